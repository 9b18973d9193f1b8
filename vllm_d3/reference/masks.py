"""Full-attention masks of the D3 attention modes.

Contract: ``allowed(mode, n, s)[i, j]`` says whether query token ``i`` may read
key token ``j`` in a full-attention layer, for a prompt of ``n`` tokens whose
state block is ``[0, s)``; ``allowed(mode, n, s, first_query=q)`` is the same
mask's rows ``[q, n)`` alone (row 0 is query ``q``):

- ``causal``: ``j <= i``;
- ``noncausal_full_attention``: always (the whole prompt both ways);
- ``prefix_bidir``: ``j <= i``, or ``i`` and ``j`` in the same block, ``[0, s)``
  or ``[s, n)``. The state never reads the question; the question reads the
  state and itself both ways.

Gated DeltaNet (linear-attention) layers take no mask and stay causal.
``additive(allowed, dtype)`` turns a boolean mask into the ``[1, 1, q, k]``
additive form that transformers' eager and SDPA attention both accept.
"""

from __future__ import annotations

import torch

ATTENTION_MODES = ("causal", "noncausal_full_attention", "prefix_bidir")


def allowed(
    mode: str,
    n: int,
    s: int,
    device: torch.device | None = None,
    first_query: int = 0,
) -> torch.Tensor:
    if mode not in ATTENTION_MODES:
        raise ValueError(
            f"unknown attention mode {mode!r}; expected one of {list(ATTENTION_MODES)}"
        )
    query = torch.arange(first_query, n, device=device)[:, None]
    key = torch.arange(n, device=device)[None, :]
    if mode == "noncausal_full_attention":
        return torch.ones(n - first_query, n, dtype=torch.bool, device=device)
    causal = key <= query
    if mode == "causal":
        return causal
    return causal | ((query < s) == (key < s))


def additive(allowed_pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocked = torch.zeros(allowed_pairs.shape, dtype=dtype, device=allowed_pairs.device)
    blocked.masked_fill_(~allowed_pairs, torch.finfo(dtype).min)
    return blocked[None, None]
