"""The hybrid model state's ``get_mm_prefix_ranges`` hook, on vLLM's real classes.

In-tree this is the series' ``get_mm_prefix_ranges`` commit; with the plugin it
is ``vllm_d3/v1/worker/gpu/model_states/mamba_hybrid.py``. A subclass of the
hybrid state that only overrides the hook must get its ranges into the
attention metadata that vLLM's own Triton builder makes from them.
"""

import pytest

from vllm_d3.testing.model_runner import attention_metadata, cpu_model_state
from vllm_d3.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

pytestmark = pytest.mark.usefixtures("process_group")


class FixedRanges(MambaHybridModelState):
    """The hybrid state with a hook that returns ``ranges``."""

    ranges: dict[int, list[tuple[int, int]]] | None = None

    def get_mm_prefix_ranges(self, input_batch):
        return self.ranges


@pytest.fixture
def hybrid_state(make_checkpoint):
    path = make_checkpoint(weights=False)
    with cpu_model_state(FixedRanges, path) as state_and_config:
        yield state_and_config


def test_the_hooks_ranges_reach_the_attention_builder(hybrid_state):
    model_state, _ = hybrid_state
    model_state.ranges = {0: [(0, 3), (4, 9)], 1: [(2, 5)]}
    metadata = attention_metadata(hybrid_state, ["a", "b"], [10, 7])
    assert metadata.mm_prefix_range == {0: [(0, 3), (4, 9)], 1: [(2, 5)]}
    # The tensor the ranged kernel reads: one row per request, padded with (0, 0).
    assert metadata.mm_prefix_range_tensor.tolist() == [
        [[0, 3], [4, 9]],
        [[2, 5], [0, 0]],
    ]


def test_no_ranges_from_the_hook_is_plain_causal_attention(hybrid_state):
    metadata = attention_metadata(hybrid_state, ["a", "b"], [10, 7])
    assert not metadata.mm_prefix_range
    assert metadata.mm_prefix_range_tensor is None
