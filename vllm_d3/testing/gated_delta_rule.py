"""The gated delta rule in float32, token by token: the oracle of the packed
forms' tests, sharing no code with vLLM's, FLA's or FlashInfer's kernels.

``reference_rule(q, k, v, g, beta, state)`` runs one sequence: q and k are
(tokens, key heads, dim), v is (tokens, value heads, dim), g (the log decay)
and beta are (tokens, value heads); each value head reads key head
``head // (value heads / key heads)``. ``state`` is (value heads, value dim,
key dim) or None for zeros. It returns the outputs, (tokens, value heads,
dim), and the final state. ``varlen_rule`` runs FlashInfer's wrapper's
contract (``fi_chunk_gated_delta_rule``) over ``cu_seqlens`` with it.
"""

import torch


def reference_rule(q, k, v, g, beta, state=None):
    group = v.shape[1] // k.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1) for x in (q, k))
    v, g, beta = v.float(), g.float(), beta.float()
    if state is None:
        state = v.new_zeros(v.shape[1], v.shape[2], k.shape[2])
    state = state.float()
    out = []
    for t in range(len(q)):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        out.append(torch.einsum("hvk,hk->hv", state, q[t]) * q.shape[-1] ** -0.5)
    return torch.stack(out), state


def varlen_rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, **_):
    """``reference_rule`` over each sequence of ``cu_seqlens``, with the
    shapes of FlashInfer's wrapper: inputs (1, tokens, ...), the output (1,
    tokens, value heads, dim) in q's dtype and the final states."""
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        inputs = (x[0, start:end] for x in (q, k, v, g, beta))
        out, final = reference_rule(*inputs, initial_state[i])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs)[None].to(q.dtype), torch.stack(finals)
