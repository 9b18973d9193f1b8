"""The D3 config contract through vLLM's own EngineArgs path, with plugins loaded.

``EngineArgs.__post_init__`` loads the ``vllm.general_plugins`` entry points, as
every vLLM process does, so these tests see the installed plugin, not a direct
call of its hooks.
"""

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_d3.model_executor.models.d3_contract import check_prefix_bidir_serving

ULTRA = {
    "prompt_layout": "d3",
    "temperature_by_questions": {
        "max_questions": [1, 4, 16],
        "temperature": [1.046, 1.0, 1.0, 1.0],
    },
}


def engine_config(model: str, **kwargs):
    return EngineArgs(model=model, **kwargs).create_engine_config()


def test_prefix_bidir_contract(make_checkpoint):
    config = engine_config(make_checkpoint(weights=False))
    model = config.model_config
    assert model.architecture == "D3ForSequenceClassification"
    assert model.hf_config.decision_config["attention_mode"] == "prefix_bidir"
    # Decoder attention with a KV cache in the text layers, read with ranges ...
    assert model.hf_text_config.is_causal is True
    assert model.is_mm_prefix_lm is True
    assert model.is_hybrid is True
    # ... while the model as a whole is not causal: no chunked prefill or caching.
    assert model.hf_config.is_causal is False
    assert config.cache_config.enable_prefix_caching is False
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.use_v2_model_runner is True
    codes = model.hf_config.decision_config["codes"]
    assert model.hf_config.id2label == dict(enumerate(codes))
    assert model.pooler_config.use_activation is False


def test_prefix_bidir_text_only_keeps_ranges(make_checkpoint):
    config = engine_config(
        make_checkpoint(weights=False), limit_mm_per_prompt={"image": 0, "video": 0}
    )
    assert config.model_config.is_mm_prefix_lm is True


@pytest.mark.parametrize(
    ("mode", "causal"), [("causal", True), ("noncausal_full_attention", False)]
)
def test_other_modes_unchanged(make_checkpoint, mode, causal):
    model = engine_config(
        make_checkpoint(attention_mode=mode, weights=False)
    ).model_config
    assert model.architecture == "D3ForSequenceClassification"
    assert model.hf_config.is_causal is causal
    assert model.hf_text_config.is_causal is causal
    assert model.is_mm_prefix_lm is False
    assert model.max_model_len == model.hf_text_config.max_position_embeddings


def test_causal_checkpoint_may_still_cache(make_checkpoint):
    config = engine_config(
        make_checkpoint(attention_mode="causal", weights=False),
        enable_prefix_caching=True,
    )
    assert config.cache_config.enable_prefix_caching is True


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, 8192), (4096, 4096), (65536, 65536), (-1, "derived")],
)
def test_validated_length(make_checkpoint, given, expected):
    model = engine_config(
        make_checkpoint(validated_length=8192, weights=False), max_model_len=given
    ).model_config
    derived = model.hf_text_config.max_position_embeddings
    assert derived > 65536
    if given == -1:
        # Auto-fit searches up to the derived length, untouched by the hook.
        assert model.original_max_model_len == -1
        assert model.max_model_len == derived
    else:
        assert model.max_model_len == expected


def test_validated_length_applies_to_other_modes(make_checkpoint):
    model = engine_config(
        make_checkpoint(attention_mode="causal", validated_length=8192, weights=False)
    ).model_config
    assert model.max_model_len == 8192


def test_d3_ultra_fields_accepted(make_checkpoint):
    model = engine_config(
        make_checkpoint(decision_overrides=ULTRA, weights=False)
    ).model_config
    assert (
        model.hf_config.decision_config["temperature_by_questions"]
        == (ULTRA["temperature_by_questions"])
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt_layout": "header-v1"}, "prompt_layout 'header-v1'"),
        ({"prompt_layout": 2}, "prompt_layout 2"),
        (
            {
                "temperature_by_questions": {
                    "max_questions": [4, 1],
                    "temperature": [1, 1, 1],
                }
            },
            "strictly increasing",
        ),
        (
            {"temperature_by_questions": {"max_questions": [1], "temperature": [1.0]}},
            "one more value",
        ),
        ({"temperature_by_questions": [1.0]}, "temperature_by_questions"),
        ({"validated_length": 0}, "validated_length"),
        ({"validated_length": True}, "validated_length"),
        ({"attention_mode": "sideways"}, "attention_mode 'sideways'"),
    ],
)
@pytest.mark.parametrize("mode", ["prefix_bidir", "causal"])
def test_malformed_fields_stop_start_up(make_checkpoint, overrides, message, mode):
    path = make_checkpoint(
        attention_mode=mode, decision_overrides=overrides, weights=False
    )
    with pytest.raises(ValueError, match=message):
        engine_config(path)


def test_model_runner_v1_is_refused(make_checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="need Model Runner V2"):
        engine_config(make_checkpoint(weights=False))
    # The other modes still run on V1.
    engine_config(make_checkpoint(attention_mode="causal", weights=False))


def test_prefix_bidir_refuses_chunked_prefill(make_checkpoint):
    with pytest.raises(ValueError, match="do not support chunked prefill"):
        engine_config(make_checkpoint(weights=False), enable_chunked_prefill=True)


def test_prefix_bidir_refuses_pipeline_parallelism(make_checkpoint):
    # vLLM 0.33.0 builds no parallel config on a machine without GPUs, so the
    # hook's own check is called on a config whose parallel layout is set.
    config = engine_config(make_checkpoint(weights=False))
    check_prefix_bidir_serving(config)
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="--tensor-parallel-size or --data-parallel"):
        check_prefix_bidir_serving(config)
    # Tensor and data parallelism are served.
    config.parallel_config.pipeline_parallel_size = 1
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.data_parallel_size = 2
    check_prefix_bidir_serving(config)
