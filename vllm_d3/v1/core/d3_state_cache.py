# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A D3 prefix_bidir state cached across requests: what serving it needs, and
the scheduler's rules for a request that carries a state block size
(upstream: ``v1/core/d3_state_cache.py``, a new file).

A state block's keys, values and Gated DeltaNet states depend on the whole
state block, which its key covers (``d3_state_key.py``). Prefix caching left
unset is on for prefix_bidir (``state_cache_by_default``);
``select_state_cache`` serves it as that cache, or refuses the settings it
cannot run with (where it was the default: turns it off); the input processor
keys every request by its whole state (``key_state_block``); the scheduler
keeps a hit strictly inside the state (``bounded_hit``), reads a prompt whole
or not at all (``whole_or_waits``) and queues a request whose state is cached
ahead of those that would read theirs (``cached_states_first``).
"""

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.utils import tensor_data

from vllm_d3.entrypoints.openai.decisions.d3_state_key import state_cache_salt
from vllm_d3.model_executor.models.d3_contract import (
    STATE_CACHE_MIN_TOKENS_KEY,
    STATE_TOKENS_KEY,
    decided,
    decision_config_of,
    decisions_to_write,
    is_prefix_bidir,
    state_cache_min_tokens_of,
    state_once_decided,
    state_tokens_of,
)
from vllm_d3.model_executor.models.d3_serving import GDN_PREFILL_BACKEND_KEY

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")

#: The decision (``d3_decided``) that prefix caching is on because the user
#: left ``--enable-prefix-caching`` unset.
BY_DEFAULT_KEY = "state_cache_by_default"


def state_cache_by_default(
    engine_args: "EngineArgs", model_config: "ModelConfig"
) -> None:
    """Turn prefix caching on for a prefix_bidir checkpoint whose user left it
    unset (vLLM resolved it to off, as for any hybrid pooling model), marked
    as the default; docs/performance.md has the measurements behind it."""
    if not is_prefix_bidir(decision_config_of(model_config.hf_config)):
        return
    engine_args.enable_prefix_caching = True
    decisions_to_write(engine_args.additional_config)[BY_DEFAULT_KEY] = True


def select_state_cache(vllm_config: "VllmConfig") -> None:
    """Serve prefix caching on a prefix_bidir checkpoint as its state cache
    (after ``select_prefix_bidir_serving``), or refuse the settings it cannot
    run with: an error where the user asked for it, else it is turned off.
    The log says which."""
    if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
        return
    min_tokens = state_cache_min_tokens_of(vllm_config.additional_config)
    if not vllm_config.cache_config.enable_prefix_caching:
        logger.info(
            "D3 prefix_bidir: states are not cached across requests "
            "(--enable-prefix-caching caches them)"
        )
        return
    why_not = _state_cache_refused(vllm_config)
    by_default = decided(vllm_config.additional_config).get(BY_DEFAULT_KEY) is True
    if why_not is not None:
        if by_default:
            # Before vLLM's hybrid hook, which reads it (align mode).
            vllm_config.cache_config.enable_prefix_caching = False
            logger.info(
                "D3 prefix_bidir: states are not cached across requests (prefix "
                "caching, on by default, is off: %s)",
                why_not,
            )
            return
        raise ValueError(
            f"--enable-prefix-caching cannot serve this D3 prefix_bidir "
            f"checkpoint: {why_not}. Drop --enable-prefix-caching."
        )
    # vLLM's Mamba prefix caching asserts chunked prefill; the scheduler still
    # reads each prefix_bidir prompt whole, within a token budget that vLLM
    # sized without chunking (at least max_model_len).
    vllm_config.scheduler_config.enable_chunked_prefill = True
    logger.info(
        "D3 prefix_bidir: states cached across requests: a request whose whole "
        "state (its tokens, its media, its cache_salt) was read before computes "
        "only what follows the state's last cached block; a state longer than "
        "a block and of at least %d tokens (%s) is read alone first, in a step "
        "of its own, so that later requests find it (a shorter one is read with "
        "its questions, and is found again only where they end in the block "
        "the state ends in); prompts are still read whole (steps of up to %d "
        "tokens); %s",
        min_tokens,
        STATE_CACHE_MIN_TOKENS_KEY,
        vllm_config.scheduler_config.max_num_batched_tokens,
        "on by default (--no-enable-prefix-caching turns it off)"
        if by_default
        else "vLLM's warning that this model does not officially support prefix "
        "caching is about pooling models that read their prompt both ways; this "
        "one is served by the state cache's keys, hit bounds and scheduler",
    )


def serves_state_cache(vllm_config: "VllmConfig") -> bool:
    """Whether ``vllm_config`` serves a prefix_bidir checkpoint's state cache,
    whose scheduler reads every prompt whole."""
    model_config = vllm_config.model_config
    return (
        model_config is not None
        and vllm_config.cache_config.enable_prefix_caching
        and is_prefix_bidir(decision_config_of(model_config.hf_config))
    )


def _state_cache_refused(vllm_config: "VllmConfig") -> str | None:
    """Why the settings cannot serve the state cache, or ``None``."""
    # The layers' module, imported where it is needed: the scheduler imports
    # this one.
    from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
        STATE_CACHE_GDN_PREFILLS,
    )

    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or not state_once_decided(extra):
        return (
            "the state cache serves the state-once reads, and this engine sends "
            "one engine request per question (an earlier log line says why)"
        )
    gdn_prefill = extra.get(GDN_PREFILL_BACKEND_KEY)
    if gdn_prefill not in STATE_CACHE_GDN_PREFILLS:
        return (
            f"its Gated DeltaNet states are the checkpoints the packed scans "
            f"write on the {' or '.join(STATE_CACHE_GDN_PREFILLS)} prefill, not "
            f"on {gdn_prefill}"
        )
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector's cache hits are not bounded by the state block"
    return None


def key_state_block(vllm_config: "VllmConfig", request: "EngineCoreRequest") -> None:
    """With prefix caching, key a checked prefix_bidir request by its whole
    state block: its ``cache_salt`` becomes ``state_cache_salt`` of the user's
    salt, the state's token ids (of a prompt given as embeddings, their
    digest) and the media that start inside it, in prompt order. Every entry
    point's requests pass here (the input processor), so no two states that
    differ anywhere share a cached block."""
    params = request.pooling_params
    if params is None or not serves_state_cache(vllm_config):
        return
    s = (params.extra_kwargs or {})[STATE_TOKENS_KEY]
    features = sorted(request.mm_features or (), key=lambda f: f.mm_position.offset)
    media = [f.identifier for f in features if f.mm_position.offset < s]
    state: Sequence[int] = ()
    if request.prompt_token_ids is not None:
        state = request.prompt_token_ids[:s]
    else:
        assert request.prompt_embeds is not None
        embeds = hashlib.sha256(tensor_data(request.prompt_embeds[:s].contiguous()))
        media.insert(0, f"prompt_embeds:{embeds.hexdigest()}")
    request.cache_salt = state_cache_salt(request.cache_salt, state, media)


def state_hit_limit(state_tokens: int, num_tokens: int) -> int:
    """The longest prefix-cache hit a prefix_bidir request may take, in
    tokens: strictly inside its state block. A block past it holds question
    tokens, which read their whole question; the Gated DeltaNet states the
    plugin writes are those strictly inside a state (a packed prompt's
    checkpoint at its state's end is not), and the readout needs the last
    token computed. vLLM's manager takes whole cached blocks within it."""
    return min(state_tokens, num_tokens) - 1


def request_state_tokens(request: "Request") -> int | None:
    """The state block size a prefix_bidir request carries; ``None`` for a
    request without one (the front end refuses those on a prefix_bidir model)."""
    params = request.pooling_params
    extra = None if params is None else params.extra_kwargs
    if not extra or STATE_TOKENS_KEY not in extra:
        return None
    return state_tokens_of(extra, request.num_prompt_tokens)


def bounded_hit(request: "Request", max_cache_hit_length: int | None) -> int | None:
    """The scheduler's bound on ``request``'s prefix-cache hit: the caller's,
    within the state for a request that carries a state block size."""
    state_tokens = request_state_tokens(request)
    if state_tokens is None:
        return max_cache_hit_length
    limit = state_hit_limit(state_tokens, request.num_tokens)
    return limit if max_cache_hit_length is None else min(limit, max_cache_hit_length)


def whole_or_waits(
    request: "Request", num_computed_tokens: int, num_new_tokens: int
) -> int:
    """The tokens to schedule of ``num_new_tokens``: all, or none where they
    stop short of the prompt's end of a request that carries a state block
    size (whatever cut them: the token budget, an encoder cap)."""
    if request_state_tokens(request) is None:
        return num_new_tokens
    whole = num_computed_tokens + num_new_tokens >= request.num_tokens
    return num_new_tokens if whole else 0


def cached_states_first(
    waiting: "RequestQueue",
    request: "Request",
    kv_cache_manager: "KVCacheManager",
    step_tokens: int,
) -> None:
    """Move ``request``, just added at the end of the first-come-first-served
    queue ``waiting``, ahead of the waiting requests that would read their
    state, where its own state is cached (among those whose state is, it stays
    last). Its questions then take the cached blocks before a state read
    queued earlier allocates the blocks that evict them: where the KV cache
    holds a few states, a state's questions sent once it was read (the
    strategy's state-alone read) otherwise wait behind other states' reads
    and find their own evicted. It goes ahead only where the first of those
    reads still fits a step of ``step_tokens`` behind it and the requests
    moved ahead before it, so that hits never hold a read back for more than
    the step they share. Other policies' queues are left as they are."""
    if not isinstance(waiting, FCFSRequestQueue):
        return
    if not waiting or waiting[-1] is not request:
        return

    def share(queued: "Request") -> tuple[int | None, int]:
        """The tokens of ``queued``'s state it finds cached (``None`` for a
        request without a state block size or already begun: not a read of
        its state), and the tokens it computes."""
        left = queued.num_tokens - queued.num_computed_tokens
        state_tokens = request_state_tokens(queued)
        if queued.num_computed_tokens or state_tokens is None:
            return None, left
        limit = state_hit_limit(state_tokens, queued.num_tokens)
        hit = kv_cache_manager.get_computed_blocks(queued, limit)[1]
        return hit, left - hit

    hit, tokens = share(request)
    if not hit:
        return
    for ahead in range(len(waiting) - 1):
        queued_hit, queued_tokens = share(waiting[ahead])
        if queued_hit == 0:
            # The first waiting read: ahead of it where it still fits a step.
            if tokens + queued_tokens <= step_tokens:
                waiting.pop()
                waiting.insert(ahead, request)
            return
        tokens += queued_tokens
