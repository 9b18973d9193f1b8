# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""d3_state_tokens on every entry point of a D3 prefix_bidir model: carried by
the /classify and /pooling requests, and checked by the input processor, on
config-only checkpoints read as text (no GPU, no tokenizer)."""

import pytest

from tests.models.language.pooling.d3_utils import write_d3_config
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.pooling.classify.io_processor import ClassifyIOProcessor
from vllm.entrypoints.pooling.classify.protocol import (
    ClassificationCompletionRequest,
)
from vllm.entrypoints.pooling.pooling.protocol import PoolingCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.inputs import tokens_input
from vllm.pooling_params import PoolingParams
from vllm.renderers.chat_utils import ChatTemplateConfig
from vllm.v1.engine.input_processor import InputProcessor


def input_processor(path: str) -> InputProcessor:
    config = EngineArgs(
        model=path,
        max_model_len=4096,
        skip_tokenizer_init=True,
        limit_mm_per_prompt={"image": 0, "video": 0},
    ).create_engine_config()
    return InputProcessor(config)


@pytest.fixture(scope="module")
def prefix_bidir(tmp_path_factory) -> InputProcessor:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        return input_processor(write_d3_config(tmp_path_factory.mktemp("d3")))


def classify(processor: InputProcessor, prompt_len: int, extra):
    return processor.process_inputs(
        "req",
        tokens_input(list(range(prompt_len))),
        PoolingParams(task="classify", extra_kwargs=extra),
        supported_tasks=("classify",),
    )


def test_a_valid_state_size_passes(prefix_bidir):
    request = classify(prefix_bidir, 12, {"d3_state_tokens": 5})
    assert request.pooling_params.extra_kwargs == {"d3_state_tokens": 5}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (None, "needs the state block size"),
        ({"d3_state_tokens": True}, "must be an int, not bool"),
        ({"d3_state_tokens": 0}, "outside 1..12"),
        ({"d3_state_tokens": 13}, "outside 1..12"),
        ({"d3_state_tokens": 5, "d3_question_ends": [8, 11]}, "d3_question_ends"),
    ],
)
def test_a_bad_state_size_is_a_client_error_naming_it(prefix_bidir, extra, message):
    with pytest.raises(VLLMValidationError, match=message):
        classify(prefix_bidir, 12, extra)


def test_other_modes_need_no_state_size(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    processor = input_processor(write_d3_config(tmp_path, "causal"))
    assert classify(processor, 12, None).pooling_params.extra_kwargs is None


def test_classify_and_pooling_requests_carry_it(prefix_bidir):
    io = ClassifyIOProcessor(
        prefix_bidir.vllm_config, prefix_bidir.renderer, ChatTemplateConfig()
    )
    one = ClassificationCompletionRequest.model_validate(
        {"input": "State: x", "d3_state_tokens": 3}
    )
    assert io.create_pooling_params(one).extra_kwargs == {"d3_state_tokens": 3}
    several = PoolingCompletionRequest.model_validate(
        {"input": ["a", "b"], "task": "classify", "d3_state_tokens": [2, 4]}
    )
    params = io.create_pooling_params(several)
    assert [p.extra_kwargs for p in params] == [
        {"d3_state_tokens": 2},
        {"d3_state_tokens": 4},
    ]
    wrong = PoolingCompletionRequest.model_validate(
        {"input": ["a", "b"], "task": "classify", "d3_state_tokens": [2]}
    )
    with pytest.raises(VLLMValidationError, match="1 values for 2 inputs"):
        io.create_pooling_params(wrong)
