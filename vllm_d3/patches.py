"""The plugin's six patches of vLLM functions (``PATCHES``); ``apply`` is
idempotent. All but the middleware's are no-ops unless the served model is a
D3 ``prefix_bidir`` checkpoint (the read strategy's also for d3-ultra's
temperature by question count): ``/classify`` and ``/pooling`` carry
``d3_state_tokens``; every request is checked (and, with prefix caching, keyed
by its whole state) in the input processor; /v1/systemone's body middleware
goes ahead of vLLM's; its reads go to the plugin's read strategy; with the
state cache, align mode's demand for chunked media input is waived and an
unset ``--enable-prefix-caching`` is on. Each wrapper says what it changes.
(Each Gated DeltaNet layer's ``_forward_core`` is also replaced, on its
instance: ``qwen_gdn_linear_attn.py``.) docs/upstream.md says why no hook
reaches them.
"""

from argparse import Namespace
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import vllm.entrypoints.launchers.app as launchers_app
import vllm.entrypoints.openai.decisions.state as decisions_state
import vllm.entrypoints.openai.decisions.strategies as vllm_strategies
from fastapi import FastAPI
from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.pooling.base.io_processor import PoolingIOProcessor
from vllm.v1.engine.input_processor import InputProcessor

from .entrypoints.openai.decisions.d3_reads import needs_state_block_reads
from .entrypoints.openai.decisions.strategies import D3Strategy
from .entrypoints.pooling.d3_state_tokens import (
    check_state_blocks,
    with_state_tokens,
)
from .entrypoints.serve.middleware.systemone_body import (
    add_systemone_body_middleware,
)
from .v1.core.d3_state_cache import (
    key_state_block,
    serves_state_cache,
    state_cache_by_default,
)

_MARK = "__vllm_d3_patch__"


def _wrap_create_pooling_params(original: Callable) -> Callable:
    """``PoolingIOProcessor.create_pooling_params``: ``/classify`` and
    ``/pooling`` carry the request field ``d3_state_tokens`` into
    ``extra_kwargs`` (``with_state_tokens``; one params per input for a list)."""

    @wraps(original)
    def create_pooling_params(self: PoolingIOProcessor, request: Any) -> Any:
        return with_state_tokens(self.model_config, request, original(self, request))

    return create_pooling_params


def _wrap_process_inputs(original: Callable) -> Callable:
    """``InputProcessor.process_inputs``: every request of every entry point is
    checked with its final prompt (``check_state_blocks``: a missing or invalid
    ``d3_state_tokens`` or ``d3_question_ends`` is a 400 naming the field); with
    prefix caching it is then keyed by its whole state (``key_state_block``)."""

    @wraps(original)
    def process_inputs(self: InputProcessor, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        check_state_blocks(self.vllm_config, request)
        key_state_block(self.vllm_config, request)
        return request

    return process_inputs


def _wrap_init_entrypoints_middleware(original: Callable) -> Callable:
    """``init_entrypoints_middleware``, as ``entrypoints/launchers/app.py``
    names it: ``SystemOneBodyMiddleware`` goes ahead of vLLM's own middleware,
    so that /v1/systemone gets plain JSON."""

    @wraps(original)
    def init_entrypoints_middleware(
        args: Namespace, app: FastAPI, supported_tasks: tuple[Any, ...]
    ) -> None:
        # Added first, so that the middleware vLLM adds next wraps it.
        add_systemone_body_middleware(app)
        original(args, app, supported_tasks)

    return init_entrypoints_middleware


def _wrap_select_read_strategy(original: Callable) -> Callable:
    """``select_read_strategy``, as ``entrypoints/openai/decisions/state.py``
    names it: where vLLM chose its ``D3Strategy`` for a checkpoint whose reads
    need state blocks, the plugin's subclass reads instead; every other model
    keeps vLLM's choice."""

    @wraps(original)
    def select_read_strategy(model_config: ModelConfig, supported_tasks: Any) -> type:
        chosen = original(model_config, supported_tasks)
        if chosen is vllm_strategies.D3Strategy and needs_state_block_reads(
            model_config.hf_config.decision_config
        ):
            return D3Strategy
        return chosen

    return select_read_strategy


def _wrap_validate_block_size(original: Callable) -> Callable:
    """``VllmConfig.validate_block_size``: with the state cache, align mode's
    demand for chunked media input (which CUDA and ROCm turn off for a
    prefix-LM model) does not apply (``serves_state_cache``)."""

    @wraps(original)
    def validate_block_size(self: VllmConfig) -> None:
        # Nothing past the fields vLLM's check reads unless it would refuse:
        # vLLM's own tests call it on stand-ins that carry only those.
        scheduler_config = self.scheduler_config
        refused = (
            self.cache_config.mamba_cache_mode == "align"
            and scheduler_config.disable_chunked_mm_input
        )
        if not refused or not serves_state_cache(self):
            return original(self)
        # Align mode asks for chunked media input so as to end a chunk on a
        # block inside a media item; the state cache's scheduler never cuts a
        # prefix_bidir prompt, so the platform's choice stands, unchecked.
        chosen = scheduler_config.disable_chunked_mm_input
        scheduler_config.disable_chunked_mm_input = False
        try:
            original(self)
        finally:
            scheduler_config.disable_chunked_mm_input = chosen

    return validate_block_size


def _wrap_set_default_prefix_caching(original: Callable) -> Callable:
    """``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args``: an
    unset ``--enable-prefix-caching`` is on (``state_cache_by_default``)."""

    @wraps(original)
    def set_defaults(self: EngineArgs, model_config: ModelConfig) -> None:
        unset = self.enable_prefix_caching is None
        original(self, model_config)
        if unset:
            state_cache_by_default(self, model_config)

    return set_defaults


#: (owner, attribute, wrapper factory) of each patch.
PATCHES: tuple[tuple[type | ModuleType, str, Callable[[Callable], Callable]], ...] = (
    (PoolingIOProcessor, "create_pooling_params", _wrap_create_pooling_params),
    (InputProcessor, "process_inputs", _wrap_process_inputs),
    (launchers_app, "init_entrypoints_middleware", _wrap_init_entrypoints_middleware),
    (decisions_state, "select_read_strategy", _wrap_select_read_strategy),
    (VllmConfig, "validate_block_size", _wrap_validate_block_size),
    (
        EngineArgs,
        "_set_default_chunked_prefill_and_prefix_caching_args",
        _wrap_set_default_prefix_caching,
    ),
)


def is_applied(owner: type | ModuleType, name: str) -> bool:
    return getattr(getattr(owner, name), _MARK, False)


def _qualified_name(owner: type | ModuleType, name: str) -> str:
    if isinstance(owner, ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def apply() -> list[str]:
    """Install every patch not yet installed; return the qualified names."""
    installed = []
    for owner, name, wrap in PATCHES:
        if is_applied(owner, name):
            continue
        patched = wrap(getattr(owner, name))
        setattr(patched, _MARK, True)
        setattr(owner, name, patched)
        installed.append(_qualified_name(owner, name))
    return installed
