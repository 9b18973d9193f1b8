# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 prefix_bidir serving decisions the config hook writes for every
process, on a machine without a CUDA or ROCm GPU (config-only checkpoints)."""

import pytest

from tests.models.language.pooling.d3_utils import write_d3_config
from vllm.engine.arg_utils import EngineArgs


@pytest.fixture(autouse=True)
def model_runner_v2(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


def engine_config(path: str, **additional_config):
    return EngineArgs(
        model=path, additional_config=additional_config
    ).create_engine_config()


def test_without_a_gpu_vllms_selection_serves_one_question_per_request(tmp_path):
    config = engine_config(write_d3_config(tmp_path))
    decided = config.additional_config["d3_decided"]
    assert decided["d3_attention_kernel"] == "ranged"
    assert decided["d3_state_once"] is False
    assert "full_attention" not in config.attention_config.backend_per_kind


@pytest.mark.parametrize(
    ("switches", "message"),
    [
        ({"d3_state_once": "yes"}, "d3_state_once must be true or false"),
        ({"d3_attention_kernel": "nope"}, "must be one of auto, fa3"),
        ({"d3_attention_kernel": "fa3"}, "not a CUDA or ROCm GPU"),
    ],
)
def test_a_switch_it_cannot_serve_stops_start_up(tmp_path, switches, message):
    with pytest.raises(ValueError, match=message):
        engine_config(write_d3_config(tmp_path), **switches)


def test_other_modes_are_left_to_vllm(tmp_path):
    config = engine_config(write_d3_config(tmp_path, "causal"))
    assert "d3_decided" not in config.additional_config
