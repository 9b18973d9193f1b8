"""Exact attention for the reference runtime: scores, mask and softmax written out.

Contract: ``exact_attention(module, query, key, value, attention_mask, scaling,
dropout=0.0, **kwargs)`` has the signature of transformers' attention functions
and is registered in ``AttentionInterface`` as ``EXACT`` on import.

- ``query`` is ``[batch, heads, q, d]``, ``key`` and ``value`` are
  ``[batch, kv_heads, k, d]`` (grouped-query heads are repeated).
- ``attention_mask`` is an additive ``[..., q or 1, k or more]`` tensor,
  broadcast over batch and heads (a single row broadcasts over every query); or
  ``None``: then causal when ``is_causal`` (the keyword, else the module's
  attribute) is true and ``q > 1``, with the queries the last ``q`` keys, and
  no mask otherwise.
- Scores, mask and softmax are computed in float32, ``QUERY_CHUNK`` query rows at
  a time, so memory grows with ``QUERY_CHUNK * k`` per head, not ``q * k``.
- Returns ``([batch, q, heads, d], None)`` in the query's dtype.

The same few tensor operations run on every device, so the reference's CPU and
GPU answers differ only by rounding; fused kernels (SDPA) choose different
algorithms per device, dtype and shape.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

EXACT = "d3_exact"
QUERY_CHUNK = 1024


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if dropout:
        raise ValueError(f"exact_attention runs inference only; got dropout={dropout}")
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1).float()
    values = value.repeat_interleave(groups, dim=1).float()
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    num_queries, num_keys = query.shape[2], keys.shape[2]
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
    causal = attention_mask is None and bool(is_causal) and num_queries > 1
    out = torch.empty(
        *query.shape[:3], values.shape[-1], dtype=query.dtype, device=query.device
    )
    for start in range(0, num_queries, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, num_queries)
        scores = query[:, :, start:stop].float() @ keys.transpose(-1, -2) * scale
        if attention_mask is not None:
            rows = attention_mask[..., :num_keys]
            if rows.shape[-2] != 1:
                rows = rows[..., start:stop, :]
            scores = scores + rows.float()
        elif causal:
            first_key = num_keys - num_queries
            query_positions = torch.arange(start, stop, device=query.device)
            key_positions = torch.arange(num_keys, device=query.device)
            later = key_positions[None, :] > query_positions[:, None] + first_key
            scores = scores.masked_fill(later, float("-inf"))
        out[:, :, start:stop] = (scores.softmax(-1) @ values).to(out.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT, exact_attention)
