"""The only three monkeypatches of vllm-d3; ``apply`` is idempotent. The first two
are no-ops unless the served model is a D3 ``prefix_bidir`` checkpoint.

1. ``PoolingIOProcessor.create_pooling_params``
   (vLLM 0.33.0 ``entrypoints/pooling/base/io_processor.py:77-78``): the online
   pooling endpoints (``/classify``, ``/pooling``) build ``PoolingParams`` from a
   request's typed fields only. The wrapper passes them through
   ``with_state_tokens`` (``entrypoints/pooling/d3_state_tokens.py``), which
   carries the request field ``d3_state_tokens`` into ``extra_kwargs``; for a
   list it returns one params per input, which vLLM's pooling serving takes as
   a sequence (``base/io_processor.py:307-321``) and verifies through its
   ``verify`` (``base/serving.py:157-159`` calls ``verify`` on whatever this
   returned). Upstream this is one call in ``create_pooling_params``
   (``vllm-d3 export-patches``); no hook reaches it.
2. ``InputProcessor.process_inputs``
   (vLLM 0.33.0 ``v1/engine/input_processor.py:373``, where ``_validate_params``
   at ``:138-253`` never reads ``extra_kwargs``): every request of every entry point
   (``LLM.classify``, ``/classify``, ``/pooling``, ``/v1/systemone``) passes here
   with its final prompt. The wrapper checks it with ``check_state_blocks``
   (``entrypoints/pooling/d3_state_tokens.py``): a prefix_bidir request whose
   ``d3_state_tokens`` or ``d3_question_ends`` is missing or invalid is a
   ``VLLMValidationError`` (a 400 online) naming the field, so no request ever
   runs with a silent single block and a bad request never reaches the engine
   core.
3. ``init_entrypoints_middleware`` as ``entrypoints/launchers/app.py`` names it
   (vLLM 0.33.0 ``:10`` imports it; ``build_app`` calls it by that module-level
   name at ``:54``, after the API server loaded the plugins:
   ``launchers/api_server/entry.py:52`` builds ``AsyncEngineArgs``, whose
   ``__post_init__`` loads them, ``engine/arg_utils.py:931``). ``/v1/systemone``
   (``generate/structured_decisions/api_router.py:33-56``) reads its body as a
   pydantic parameter behind ``Depends(validate_json_request)``
   (``serve/utils/api_utils.py:309-315``), which refuses every content type but
   ``application/json``; a compressed body fails to parse. The wrapper adds
   ``SystemOneBodyMiddleware`` (``entrypoints/serve/middleware/systemone_body.py``),
   which hands the route plain JSON, ahead of vLLM's own middleware, so that
   those (CORS, the API key) wrap it. ``--middleware`` is a CLI option
   (``serve/middleware/register.py:65``), not a plugin hook, and
   ``vllm.endpoint_plugins`` load only when named in ``VLLM_PLUGINS``
   (``plugins/__init__.py:122-131``).
"""

from argparse import Namespace
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import vllm.entrypoints.launchers.app as launchers_app
from fastapi import FastAPI
from vllm.entrypoints.pooling.base.io_processor import PoolingIOProcessor
from vllm.v1.engine.input_processor import InputProcessor

from .entrypoints.pooling.d3_state_tokens import (
    check_state_blocks,
    with_state_tokens,
)
from .entrypoints.serve.middleware.systemone_body import (
    add_systemone_body_middleware,
)

_MARK = "__vllm_d3_patch__"


def _wrap_create_pooling_params(original: Callable) -> Callable:
    @wraps(original)
    def create_pooling_params(self: PoolingIOProcessor, request: Any) -> Any:
        return with_state_tokens(self.model_config, request, original(self, request))

    return create_pooling_params


def _wrap_process_inputs(original: Callable) -> Callable:
    @wraps(original)
    def process_inputs(self: InputProcessor, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        check_state_blocks(self.vllm_config, request)
        return request

    return process_inputs


def _wrap_init_entrypoints_middleware(original: Callable) -> Callable:
    @wraps(original)
    def init_entrypoints_middleware(
        args: Namespace, app: FastAPI, supported_tasks: tuple[Any, ...]
    ) -> None:
        # Added first, so that the middleware vLLM adds next wraps it.
        add_systemone_body_middleware(app)
        original(args, app, supported_tasks)

    return init_entrypoints_middleware


#: (owner, attribute, wrapper factory) of each patch.
PATCHES: tuple[tuple[type | ModuleType, str, Callable[[Callable], Callable]], ...] = (
    (PoolingIOProcessor, "create_pooling_params", _wrap_create_pooling_params),
    (InputProcessor, "process_inputs", _wrap_process_inputs),
    (launchers_app, "init_entrypoints_middleware", _wrap_init_entrypoints_middleware),
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
