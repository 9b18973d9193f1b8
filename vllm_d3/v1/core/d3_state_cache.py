# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache hit limit of a D3 prefix_bidir state block
(upstream: ``v1/core/d3_state_cache.py``, a new file).

A state block's keys, values and Gated DeltaNet states depend on the whole
state block, which the front end's key covers (``d3_state_key.py``); a block
past the state holds question tokens, which read their whole question.
``state_hit_limit`` keeps a hit strictly inside the state; the scheduler reads
a request's state size with ``request_state_tokens``.
"""

from typing import TYPE_CHECKING

from vllm_d3.model_executor.models.d3_contract import STATE_TOKENS_KEY, state_tokens_of

if TYPE_CHECKING:
    from vllm.v1.request import Request


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
