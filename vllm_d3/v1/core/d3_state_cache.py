# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache key and hit limit of a D3 prefix_bidir state block
(upstream: ``v1/core/d3_state_cache.py``, a new file).

A state block reads itself both ways and never sees a question, so every key,
value and Gated DeltaNet state inside it depends on the whole state block and
on nothing else. vLLM's block hashes cover only the tokens up to each block
(and the media overlapping it), so two states that share a prefix would share
those blocks' hashes while their contents differ. ``state_cache_salt`` keys a
request by its whole state (token ids and media identifiers) under the user's
own ``cache_salt``: vLLM hashes the salt into the first block and its parent
chain carries it to every later one. ``state_hit_limit`` keeps a hit strictly
inside the state, where only whole matching states share blocks; the scheduler reads
a request's state size with ``request_state_tokens``.
"""

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_d3.model_executor.models.d3_contract import STATE_TOKENS_KEY, state_tokens_of

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Versions the key: a change of what it covers must not meet older entries.
_KEY_VERSION = "d3-state-v1"


def state_cache_salt(
    user_salt: str | None, state_token_ids: Sequence[int], media: Sequence[str]
) -> str:
    """The ``cache_salt`` of a request whose state block is ``state_token_ids``
    with the media ``media`` (vLLM's multimodal identifiers, in prompt order),
    asked under the user's ``user_salt`` (``None``: none given)."""
    key = [_KEY_VERSION, user_salt, [int(t) for t in state_token_ids], list(media)]
    digest = hashlib.sha256(json.dumps(key, separators=(",", ":")).encode())
    return f"{_KEY_VERSION}:{digest.hexdigest()}"


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
