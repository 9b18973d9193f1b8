"""The plugin entry point and the pooling and input patches, on vLLM's real
front-end classes (the /v1/systemone body patch: ``test_systemone_body.py``).

The /classify tests run vLLM's own ``ServingClassification`` (context, renderer,
request fan-out, response) over an engine client that, as ``AsyncLLM.encode``
does, passes each prompt through the real ``InputProcessor.process_inputs`` and
then answers it without an engine.
"""

import asyncio
import json
import re
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
from vllm.entrypoints.pooling.base.io_processor import PoolingIOProcessor
from vllm.entrypoints.pooling.classify.io_processor import ClassifyIOProcessor
from vllm.entrypoints.pooling.classify.protocol import (
    ClassificationChatRequest,
    ClassificationCompletionRequest,
)
from vllm.entrypoints.pooling.classify.serving import ServingClassification
from vllm.entrypoints.pooling.pooling.protocol import PoolingCompletionRequest
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.inputs import tokens_input
from vllm.outputs import PoolingOutput, PoolingRequestOutput
from vllm.pooling_params import PoolingParams
from vllm.renderers.chat_utils import ChatTemplateConfig
from vllm.v1.engine.input_processor import InputProcessor

import vllm_d3
from vllm_d3 import patches
from vllm_d3.entrypoints.pooling.d3_state_tokens import (
    check_state_blocks,
    with_state_tokens,
)


@pytest.mark.plugin
def test_entry_point_is_declared():
    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "d3"
    ]
    assert plugin.value == "vllm_d3:register"
    assert plugin.load() is vllm_d3.register


@pytest.mark.plugin
def test_vllm_loads_the_plugin_once_per_process():
    script = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import vllm.plugins as p\n"
        "p.load_general_plugins(); p.load_general_plugins()\n"
        "import vllm_d3; vllm_d3.register()\n"
        "from vllm.model_executor.models.config import MODELS_CONFIG_MAP\n"
        "from vllm import ModelRegistry\n"
        "arch = 'D3ForSequenceClassification'\n"
        "print('config', MODELS_CONFIG_MAP[arch].__module__)\n"
        "print('model', ModelRegistry.models[arch].module_name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    logs = done.stdout + done.stderr
    assert logs.count("vllm-d3 installed its D3 hooks") == 1
    assert "patch vllm.v1.engine.input_processor.InputProcessor.process_inputs" in logs
    assert "patch vllm.entrypoints.launchers.app.init_entrypoints_middleware" in logs
    assert "patch vllm.config.vllm.VllmConfig.validate_block_size" in logs
    assert "patch vllm.entrypoints.openai.decisions.state.select_read_strategy" in logs
    assert "config vllm_d3.model_executor.models.config" in logs
    assert "model vllm_d3.model_executor.models.d3" in logs


@pytest.mark.plugin
@pytest.mark.parametrize("version", ["0.33.0", "0.33.1", "0.33.2.dev3+gabc"])
def test_supported_vllm_versions(version):
    assert vllm_d3.check_vllm_version(version) is None


@pytest.mark.plugin
def test_other_vllm_versions_are_refused():
    # register() itself, in a fresh process whose vLLM reports another release.
    script = (
        "import vllm; vllm.__version__ = '0.34.0'\nimport vllm_d3; vllm_d3.register()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "vllm-d3 supports vLLM 0.33.x only" in done.stderr
    assert "this is vLLM 0.34.0" in done.stderr
    assert "installed its D3 hooks" not in done.stdout + done.stderr


@pytest.mark.plugin
def test_patches_are_applied_once():
    vllm_d3.register()
    wrapped = [getattr(owner, name) for owner, name, _ in patches.PATCHES]
    assert all(patches.is_applied(owner, name) for owner, name, _ in patches.PATCHES)
    assert patches.apply() == []
    assert [getattr(owner, name) for owner, name, _ in patches.PATCHES] == wrapped


@pytest.fixture(scope="module")
def prefix_bidir_front_end(make_checkpoint):
    config = EngineArgs(
        model=make_checkpoint(weights=False), max_model_len=4096
    ).create_engine_config()
    processor = InputProcessor(config)
    io = ClassifyIOProcessor(config, processor.renderer, ChatTemplateConfig())
    return processor, io


def classify(processor: InputProcessor, prompt_len: int, extra):
    return processor.process_inputs(
        "req",
        tokens_input(list(range(prompt_len))),
        PoolingParams(task="classify", extra_kwargs=extra),
        supported_tasks=("classify",),
    )


def test_valid_state_tokens_pass(prefix_bidir_front_end):
    processor, _ = prefix_bidir_front_end
    request = classify(processor, 12, {"d3_state_tokens": 5})
    assert request.pooling_params.extra_kwargs == {"d3_state_tokens": 5}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (None, "needs the state block size"),
        ({"d3_state_tokens": True}, "must be an int, not bool"),
        ({"d3_state_tokens": 4.0}, "must be an int, not float"),
        ({"d3_state_tokens": -1}, "outside 1..12"),
        ({"d3_state_tokens": 13}, "outside 1..12"),
    ],
)
def test_bad_state_tokens_are_client_errors(prefix_bidir_front_end, extra, message):
    processor, _ = prefix_bidir_front_end
    with pytest.raises(VLLMClientError, match=message) as excinfo:
        classify(processor, 12, extra)
    assert "d3_state_tokens" in str(excinfo.value)


def test_a_prompt_of_embeddings_is_checked_by_its_length(prefix_bidir_front_end):
    # An embeddings prompt has no token ids: its length is its rows.
    processor, _ = prefix_bidir_front_end

    def request(extra):
        return SimpleNamespace(
            pooling_params=PoolingParams(task="classify", extra_kwargs=extra),
            prompt_token_ids=None,
            prompt_embeds=torch.zeros(12, 8),
        )

    check_state_blocks(processor.vllm_config, request({"d3_state_tokens": 12}))
    with pytest.raises(VLLMValidationError) as excinfo:
        check_state_blocks(processor.vllm_config, request({"d3_state_tokens": 13}))
    assert (
        excinfo.value.args[0]
        == "d3_state_tokens=13 is outside 1..12 (the prompt length)"
    )
    assert (excinfo.value.parameter, excinfo.value.value) == ("d3_state_tokens", 13)
    bad_ends = {"d3_state_tokens": 5, "d3_question_ends": [11]}
    with pytest.raises(VLLMValidationError) as excinfo:
        check_state_blocks(processor.vllm_config, request(bad_ends))
    assert (excinfo.value.parameter, excinfo.value.value) == ("d3_question_ends", [11])


def test_packed_requests_need_state_once(prefix_bidir_front_end):
    # On the CPU the config hook turned state once off: ranged attention would
    # let each packed question see the ones before it.
    processor, _ = prefix_bidir_front_end
    decided = processor.vllm_config.additional_config["d3_decided"]
    assert decided["d3_state_once"] is False
    packed = {"d3_state_tokens": 5, "d3_question_ends": [8, 12]}
    with pytest.raises(VLLMClientError, match="one question per request"):
        classify(processor, 12, packed)
    # One question block is what every request is anyway.
    one = {"d3_state_tokens": 5, "d3_question_ends": [12]}
    assert classify(processor, 12, one).pooling_params.extra_kwargs == one
    # Where the config hook decided state once (a GPU's dense kernel), the
    # packed request is taken.
    state_once = SimpleNamespace(
        model_config=processor.vllm_config.model_config,
        additional_config={"d3_decided": {"d3_state_once": True}},
    )
    request = SimpleNamespace(
        pooling_params=PoolingParams(task="classify", extra_kwargs=packed),
        prompt_token_ids=list(range(12)),
    )
    check_state_blocks(state_once, request)


@pytest.mark.parametrize("ends", [[8, 11], [5, 12], [13], "12"])
def test_bad_question_ends_are_client_errors(prefix_bidir_front_end, ends):
    # The contract's own error, not the one-question-per-request one (which
    # also names the field): [5, 12]'s first question block is empty.
    processor, _ = prefix_bidir_front_end
    rule = (
        "d3_question_ends must be a non-empty list of ints increasing from above "
        f"d3_state_tokens=5 to the prompt length 12, not {ends!r}"
    )
    with pytest.raises(VLLMClientError, match=re.escape(rule)):
        classify(processor, 12, {"d3_state_tokens": 5, "d3_question_ends": ends})


def test_a_list_of_state_sizes_gives_one_per_input(prefix_bidir_front_end):
    processor, _ = prefix_bidir_front_end
    model_config = processor.vllm_config.model_config
    params = PoolingParams(task="classify")
    # A chat request is one input, whatever its messages.
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    chat = ClassificationChatRequest.model_validate(
        {"messages": messages, "d3_state_tokens": [3]}
    )
    (one,) = with_state_tokens(model_config, chat, params)
    assert one.extra_kwargs == {"d3_state_tokens": 3}
    # A completion-like request has one per prompt.
    two = ClassificationCompletionRequest.model_validate(
        {"input": ["a", "b"], "d3_state_tokens": [3]}
    )
    with pytest.raises(VLLMValidationError) as excinfo:
        with_state_tokens(model_config, two, params)
    assert excinfo.value.args[0] == (
        "d3_state_tokens has 1 values for 2 inputs: give one per input, or one "
        "int for all"
    )
    assert (excinfo.value.parameter, excinfo.value.value) == ("d3_state_tokens", [3])
    # A request that carries no extra fields keeps its params.
    assert with_state_tokens(model_config, object(), params) is params


def test_other_modes_need_no_state_tokens(make_checkpoint):
    config = EngineArgs(
        model=make_checkpoint(attention_mode="causal", weights=False),
        max_model_len=4096,
    ).create_engine_config()
    request = classify(InputProcessor(config), 12, None)
    assert request.pooling_params.extra_kwargs is None


def test_classify_request_carries_state_tokens(prefix_bidir_front_end):
    _, io = prefix_bidir_front_end
    assert type(io).create_pooling_params is PoolingIOProcessor.create_pooling_params
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
    assert params[0].task == "classify"
    # Without the field nothing is invented: the input processor refuses it.
    bare = ClassificationCompletionRequest.model_validate({"input": "State: x"})
    assert io.create_pooling_params(bare).extra_kwargs is None


class EngineWithoutModel:
    """What ``ServingClassification`` uses of an engine client. ``encode`` runs
    the real input processor first, as ``AsyncLLM.encode`` does, and answers
    each admitted prompt with fixed probabilities."""

    def __init__(self, config) -> None:
        self.vllm_config = config
        self.input_processor = InputProcessor(config)
        self.renderer = self.input_processor.renderer
        self.admitted: list = []

    async def encode(self, prompt, pooling_params, request_id, **kwargs):
        request = self.input_processor.process_inputs(
            request_id, prompt, pooling_params, supported_tasks=("classify",)
        )
        self.admitted.append(request)
        yield PoolingRequestOutput(
            request_id,
            PoolingOutput(data=torch.tensor([0.25, 0.75])),
            request.prompt_token_ids,
            num_cached_tokens=0,
            finished=True,
        )


@pytest.fixture(scope="module")
def classify_server(prefix_bidir_front_end):
    processor, _ = prefix_bidir_front_end
    config = processor.vllm_config
    engine = EngineWithoutModel(config)
    models = OpenAIModelRegistry(
        config.model_config, [BaseModelPath("d3", config.model_config.model)]
    )
    serving = ServingClassification(
        engine,
        models,
        request_logger=None,
        chat_template_config=ChatTemplateConfig(),
    )

    def post(body: dict):
        engine.admitted.clear()
        request = ClassificationCompletionRequest.model_validate(body)
        return asyncio.run(serving(request)), list(engine.admitted)

    return post


def test_classify_list_form_answers_each_input(classify_server):
    response, admitted = classify_server(
        {"input": [[1, 2, 3, 4], [5, 6, 7, 8, 9]], "d3_state_tokens": [2, 4]}
    )
    assert response.status_code == 200
    data = json.loads(response.body)["data"]
    assert [item["index"] for item in data] == [0, 1]
    sizes = {
        len(r.prompt_token_ids): r.pooling_params.extra_kwargs["d3_state_tokens"]
        for r in admitted
    }
    assert sizes == {4: 2, 5: 4}


def test_classify_single_size_for_every_input(classify_server):
    response, admitted = classify_server(
        {"input": [[1, 2, 3], [4, 5, 6]], "d3_state_tokens": 2}
    )
    assert response.status_code == 200
    assert [r.pooling_params.extra_kwargs for r in admitted] == [
        {"d3_state_tokens": 2}
    ] * 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": [[1, 2, 3], [4, 5]], "d3_state_tokens": [2]}, "1 values for 2"),
        ({"input": [[1, 2, 3]], "d3_state_tokens": [2, 1]}, "2 values for 1"),
        ({"input": [[1, 2, 3], [4, 5]], "d3_state_tokens": [2, 3]}, "outside 1..2"),
        ({"input": [[1, 2, 3], [4, 5]], "d3_state_tokens": [2, True]}, "not bool"),
    ],
)
def test_classify_list_form_bad_values_are_client_errors(
    classify_server, body, message
):
    # vLLM's API server answers a VLLMClientError with a 400.
    with pytest.raises(VLLMClientError) as excinfo:
        classify_server(body)
    assert "d3_state_tokens" in str(excinfo.value)
    assert message in str(excinfo.value)
