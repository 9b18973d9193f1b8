# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 prefix_bidir state cache: its key covers the whole state block, its
hits stay inside the state, and prefix caching is served as it or refused with
the reason (config-only checkpoints, no GPU)."""

import pytest

from tests.models.language.pooling.d3_utils import write_d3_config
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.decisions.d3_state_key import state_cache_salt
from vllm.v1.core.d3_state_cache import state_hit_limit


def test_the_key_covers_the_state_tokens_media_and_salt():
    key = state_cache_salt(None, [1, 2, 3], ["image-a"])
    assert key == state_cache_salt(None, [1, 2, 3], ["image-a"])
    others = [
        state_cache_salt(None, [1, 2, 4], ["image-a"]),
        state_cache_salt(None, [1, 2, 3], ["image-b"]),
        state_cache_salt(None, [1, 2, 3], []),
        state_cache_salt("tenant", [1, 2, 3], ["image-a"]),
        state_cache_salt(None, [1, 2], ["image-a"]),
    ]
    assert len({key, *others}) == 1 + len(others)


@pytest.mark.parametrize(
    ("state", "prompt", "limit"), [(100, 120, 99), (120, 120, 119), (1, 5, 0)]
)
def test_a_hit_stays_strictly_inside_the_state(state, prompt, limit):
    # The last state token is computed again, and every question token.
    assert state_hit_limit(state, prompt) == limit


@pytest.fixture(autouse=True)
def model_runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


def test_without_a_dense_kernel_the_cache_is_off_by_default(tmp_path):
    # On a CPU each question is its own engine request, which the state cache
    # does not serve: the default is off.
    config = EngineArgs(model=write_d3_config(tmp_path)).create_engine_config()
    assert config.cache_config.enable_prefix_caching is False


def test_asking_for_it_where_it_cannot_serve_stops_start_up(tmp_path):
    args = EngineArgs(model=write_d3_config(tmp_path), enable_prefix_caching=True)
    with pytest.raises(ValueError, match="Drop --enable-prefix-caching"):
        args.create_engine_config()


def test_other_modes_keep_prefix_caching(tmp_path):
    args = EngineArgs(
        model=write_d3_config(tmp_path, "causal"), enable_prefix_caching=True
    )
    assert args.create_engine_config().cache_config.enable_prefix_caching is True
