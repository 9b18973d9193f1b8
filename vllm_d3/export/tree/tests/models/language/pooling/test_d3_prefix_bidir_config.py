# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 config contract for prefix_bidir checkpoints, through EngineArgs on
config-only checkpoints (no GPU, no weights)."""

import pytest

from tests.models.language.pooling.d3_utils import write_d3_config
from vllm.engine.arg_utils import EngineArgs

TEMPERATURE_BY_QUESTIONS = {
    "max_questions": [1, 4, 16],
    "temperature": [1.046, 1.0, 1.0, 1.0],
}


@pytest.fixture(autouse=True)
def model_runner_v2(monkeypatch):
    # The contract is stated for Model Runner V2, which CUDA and ROCm select.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")


def engine_config(path: str, **kwargs):
    return EngineArgs(model=path, **kwargs).create_engine_config()


def test_prefix_bidir_is_served_with_ranges(tmp_path):
    config = engine_config(write_d3_config(tmp_path))
    model = config.model_config
    assert model.architecture == "D3ForSequenceClassification"
    # Decoder attention with a KV cache in the text layers, read with ranges,
    # while the model as a whole is not causal.
    assert model.hf_text_config.is_causal is True
    assert model.hf_config.is_causal is False
    assert model.is_mm_prefix_lm is True
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.use_v2_model_runner is True
    assert model.hf_config.id2label[0] == "C0"
    assert model.pooler_config.use_activation is False


@pytest.mark.parametrize(
    ("mode", "causal"), [("causal", True), ("noncausal_full_attention", False)]
)
def test_other_modes_are_unchanged(tmp_path, mode, causal):
    model = engine_config(write_d3_config(tmp_path, mode)).model_config
    assert model.hf_config.is_causal is causal
    assert model.is_mm_prefix_lm is False


@pytest.mark.parametrize(
    ("given", "expected"), [(None, 8192), (4096, 4096), (65536, 65536)]
)
@pytest.mark.parametrize("mode", ["prefix_bidir", "causal"])
def test_validated_length_is_the_default_max_model_len(tmp_path, mode, given, expected):
    path = write_d3_config(tmp_path, mode, validated_length=8192)
    model = engine_config(path, max_model_len=given).model_config
    assert model.max_model_len == expected


def test_d3_ultra_fields_are_accepted(tmp_path):
    path = write_d3_config(
        tmp_path,
        prompt_layout="d3",
        temperature_by_questions=TEMPERATURE_BY_QUESTIONS,
    )
    decision = engine_config(path).model_config.hf_config.decision_config
    assert decision["temperature_by_questions"] == TEMPERATURE_BY_QUESTIONS


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_layout": "header-v1"}, "prompt_layout 'header-v1'"),
        (
            {"temperature_by_questions": {"max_questions": [4, 1],
                                          "temperature": [1, 1, 1]}},
            "strictly increasing",
        ),
        (
            {"temperature_by_questions": {"max_questions": [1],
                                          "temperature": [1.0]}},
            "one more value",
        ),
        ({"validated_length": 0}, "validated_length"),
        ({"attention_mode": "sideways"}, "attention_mode 'sideways'"),
    ],
)  # fmt: skip
def test_a_malformed_field_stops_start_up_naming_it(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        engine_config(write_d3_config(tmp_path, **fields))


def test_model_runner_v1_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="need Model Runner V2"):
        engine_config(write_d3_config(tmp_path))


def test_chunked_prefill_is_refused(tmp_path):
    with pytest.raises(ValueError, match="do not support chunked prefill"):
        engine_config(write_d3_config(tmp_path), enable_chunked_prefill=True)
