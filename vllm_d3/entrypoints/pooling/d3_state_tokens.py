# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``d3_state_tokens`` on every entry point of a D3 prefix_bidir checkpoint
(new upstream, beside ``entrypoints/pooling/typing.py``).

A prefix_bidir prompt's attention mask depends on its state block size ``s``,
which the prompt itself does not carry; nothing may run without it.
``with_state_tokens`` carries the request field of ``/classify`` and
``/pooling`` into the ``PoolingParams``; ``check_state_blocks`` refuses, with
a ``VLLMValidationError`` (a 400) naming the field, every request of every
entry point whose final prompt lacks a valid one, so that no request runs
with a silent single block and a bad one never reaches the engine core.
"""

from typing import Any

from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.pooling.typing import PoolingCompletionLikeRequest
from vllm.exceptions import VLLMValidationError
from vllm.pooling_params import PoolingParams
from vllm.renderers.inputs.preprocess import prompt_to_seq
from vllm.v1.engine import EngineCoreRequest

from vllm_d3.model_executor.models.d3_contract import (
    QUESTION_ENDS_KEY,
    STATE_ONCE_KEY,
    STATE_TOKENS_KEY,
    decision_config_of,
    is_prefix_bidir,
    question_ends_of,
    state_once_decided,
    state_tokens_of,
)


def _serves_prefix_bidir(model_config: ModelConfig) -> bool:
    return is_prefix_bidir(decision_config_of(model_config.hf_config))


def _sized(params: PoolingParams, value: Any) -> PoolingParams:
    params = params.clone()
    params.extra_kwargs = {**(params.extra_kwargs or {}), STATE_TOKENS_KEY: value}
    return params


class PerInputPoolingParams(list):
    """One ``PoolingParams`` per input of a pooling request."""

    def verify(self, model_config: ModelConfig) -> None:
        for params in self:
            params.verify(model_config)


def with_state_tokens(model_config: ModelConfig, request: Any, params: Any) -> Any:
    """The ``PoolingParams`` of an online pooling request with its field
    ``d3_state_tokens`` (an int, or a list with one int per input) in
    ``extra_kwargs``. For a list, ``PerInputPoolingParams``, one params per
    input, which vLLM's pooling serving takes as a sequence; a list whose
    length is not the number of inputs is a ``VLLMValidationError`` naming the
    field. A request without the field, or a model that is not prefix_bidir,
    keeps ``params``."""
    extra = getattr(request, "model_extra", None) or {}
    if STATE_TOKENS_KEY not in extra or not _serves_prefix_bidir(model_config):
        return params
    value = extra[STATE_TOKENS_KEY]
    if not isinstance(value, list):
        return _sized(params, value)
    # A chat request is one input; a completion-like one has one per prompt.
    inputs = (
        len(prompt_to_seq(request.input))
        if isinstance(request, PoolingCompletionLikeRequest)
        else 1
    )
    if len(value) != inputs:
        raise VLLMValidationError(
            f"{STATE_TOKENS_KEY} has {len(value)} values for {inputs} inputs: "
            "give one per input, or one int for all",
            parameter=STATE_TOKENS_KEY,
            value=value,
        )
    return PerInputPoolingParams(_sized(params, v) for v in value)


def check_state_blocks(vllm_config: VllmConfig, request: EngineCoreRequest) -> None:
    """Refuse a prefix_bidir request (of ``LLM.classify``, ``/classify``,
    ``/pooling`` or ``/v1/systemone``, with its final prompt as the input
    processor made it) whose ``d3_state_tokens`` is missing or invalid, or
    whose ``d3_question_ends`` (a packed request's question blocks) is invalid
    or holds several ends on a server that reads one question per request."""
    params = request.pooling_params
    if params is None or not _serves_prefix_bidir(vllm_config.model_config):
        return
    if request.prompt_token_ids is not None:
        prompt_len = len(request.prompt_token_ids)
    else:
        assert request.prompt_embeds is not None
        prompt_len = int(request.prompt_embeds.shape[0])
    extra = params.extra_kwargs or {}
    try:
        state_tokens = state_tokens_of(extra, prompt_len)
    except ValueError as e:
        raise VLLMValidationError(
            str(e), parameter=STATE_TOKENS_KEY, value=extra.get(STATE_TOKENS_KEY)
        ) from e
    try:
        ends = question_ends_of(extra, prompt_len, state_tokens)
        if len(ends) > 1 and not state_once_decided(vllm_config.additional_config):
            # Ranged attention would let each question see the ones before it.
            raise ValueError(
                f"this server reads one question per request ({STATE_ONCE_KEY} "
                f"is off): {QUESTION_ENDS_KEY} must hold one end"
            )
    except ValueError as e:
        raise VLLMValidationError(
            str(e), parameter=QUESTION_ENDS_KEY, value=extra.get(QUESTION_ENDS_KEY)
        ) from e
