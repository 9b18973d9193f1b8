"""GPU: the state cache through vLLM's engine, against the same requests uncached.

The tiny checkpoint is served by ``vllm.LLM`` with prefix caching in a process
of its own (``vllm_d3.testing.state_cache_reads``), on each Gated DeltaNet
prefill kernel of ``GDN_KERNELS``. A packed request computed
with nothing cached, then again after its state was read alone, must give the
same logits, the second having taken tokens from the cache; so must each
question's own prompt, read after it. The control reads a state alone with the
key left out, then a state that differs from it in every token after its
whole blocks: its hit takes the first state's blocks, and its logits must move
clearly.
"""

import pytest

from vllm_d3.testing import state_cache_reads
from vllm_d3.testing.own_process import (
    GDN_KERNELS,
    TOLERANCE,
    logits_from_script,
    relative_error,
)
from vllm_d3.testing.state_cache_reads import STATE

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=GDN_KERNELS)
def logits(request, make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("state-cache") / "logits.pt"
    return logits_from_script(
        state_cache_reads.__file__, make_checkpoint(), out, request.param
    )


def test_the_gdn_kernel_served(logits, served_kernel):
    assert logits["gdn kernel"] == served_kernel


@pytest.mark.parametrize("read", ["packed", "own prompts"])
def test_a_cached_state_answers_as_uncached(logits, read):
    assert (logits["uncached cached"] == 0).all()
    # Each request found the state's blocks cached, within the state.
    hits = logits[f"{read}, cached cached"]
    assert (hits > 0).all() and (hits < STATE).all(), logits["block sizes"]
    assert relative_error(logits[f"{read}, cached"], logits["uncached"]) < TOLERANCE


def test_a_hit_keyed_on_a_shared_prefix_only_is_clearly_wrong(logits):
    assert (logits["other, uncached cached"] == 0).all()
    assert (logits["other, unkeyed cached"] > 0).all()
    wrong = relative_error(logits["other, unkeyed"], logits["other, uncached"])
    assert wrong > 5 * TOLERANCE
