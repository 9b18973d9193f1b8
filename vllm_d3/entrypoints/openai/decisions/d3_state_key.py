# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache key of a D3 prefix_bidir state block
(upstream: ``entrypoints/openai/decisions/d3_state_key.py``, a new file).

A state block reads itself both ways and never sees a question, so every key,
value and Gated DeltaNet state inside it depends on the whole state block and
on nothing else. vLLM's block hashes cover only the tokens up to each block
(and the media overlapping it), so two states that share a prefix would share
those blocks' hashes while their contents differ. ``state_cache_salt`` keys a
request by its whole state (token ids and media identifiers, which
``media_identifiers`` reads from a rendered input) under the user's own
``cache_salt``: vLLM hashes the salt into the first block and its parent chain
carries it to every later one. The input processor keys every request so
(``key_state_block``); the strategy finds the reads of one state in flight by
it. ``checkpoint_grid`` is where align mode caches a Gated DeltaNet state.
"""

import hashlib
import json
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import CacheConfig

#: Versions the key: a change of what it covers must not meet older entries.
_KEY_VERSION = "d3-state-v1"


def state_cache_salt(
    user_salt: str | None, state_token_ids: Sequence[int], media: Sequence[str]
) -> str:
    """The ``cache_salt`` of a request whose state block is ``state_token_ids``
    with the media ``media`` (vLLM's multimodal identifiers, in prompt order),
    asked under the user's ``user_salt`` (``None``: none given)."""
    head = [_KEY_VERSION, user_salt, list(media)]
    digest = hashlib.sha256(json.dumps(head, separators=(",", ":")).encode())
    # After the self-delimiting head, the ids at a fixed width: a 64K-token
    # state hashes in about a millisecond, where JSON took several.
    digest.update(array("q", state_token_ids).tobytes())
    return f"{_KEY_VERSION}:{digest.hexdigest()}"


def media_identifiers(engine_input: Any) -> list[str]:
    """The media hashes of a rendered engine input, in prompt order."""
    hashes = engine_input.get("mm_hashes") or {}
    placeholders = engine_input.get("mm_placeholders") or {}
    ordered = sorted(
        (place.offset, item)
        for modality, items in hashes.items()
        for place, item in zip(placeholders[modality], items, strict=True)
    )
    return [item for _, item in ordered]


def checkpoint_grid(cache_config: "CacheConfig") -> int:
    """The token grid on which align mode caches Gated DeltaNet states, as the
    front end can know it: ``prefix_match_unit`` where set, else the Mamba
    block. vLLM's grid is that made a multiple of the layers' checkpoint
    alignment, which the D3 layers declare as 1 token
    (``write_prefill_checkpoints``). A state has a cached state inside it
    only where it is longer than the grid."""
    grid = cache_config.prefix_match_unit or cache_config.mamba_block_size
    assert grid is not None, "align mode sets the Mamba block size"
    return grid
