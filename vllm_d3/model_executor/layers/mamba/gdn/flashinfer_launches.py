# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A packed step's Gated DeltaNet in one core call on FlashInfer's prefill
(upstream: ``model_executor/layers/mamba/gdn/flashinfer_launches.py``, a new
file).

FlashInfer's chunked delta rule is one fused kernel, with no access to the
recurrence between its chunks, so the one pass (``split_recurrence``) runs it
twice inside the layer's core: the state blocks and whole rows from their
initial states, then every question block from the final state of its row's
state block, gathered on the device (no host round trip in between).
"""

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm_d3.v1.attention.backends.d3_packed_gdn import Launch, SplitRecurrence


def _run(
    launch: "Launch",
    inputs: tuple[torch.Tensor, ...],
    initial_state: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """FlashInfer's rule over ``launch``'s sequences of ``inputs`` (q, k, v,
    g, beta, each (1, tokens, ...)), its output written to those tokens of
    ``out``; returns the sequences' final states."""
    tokens = launch.tokens
    q, k, v, g, beta = (
        x[:, tokens] if isinstance(tokens, slice) else x.index_select(1, tokens)
        for x in inputs
    )
    # Imported at the call: in-tree, vLLM's layer module imports this one.
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        fi_chunk_gated_delta_rule,
    )

    o, final_state = fi_chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens=launch.cu_seqlens,
        use_qk_l2norm_in_kernel=False,
    )
    if isinstance(tokens, slice):
        out[:, tokens] = o
    else:
        out.index_copy_(1, tokens, o)
    return final_state


def two_launch_rule(
    split: "SplitRecurrence",
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's chunked delta rule in two launches: ``split``'s state
    blocks and whole rows from ``initial_state``, then its question blocks
    from their state blocks' ends. Called as 0.33.0's ``ChunkGatedDeltaRule``
    is (its gates on, without the kernel's own l2 norm); the final states it
    returns are the question blocks', which nothing reads."""
    assert output_final_state and not use_qk_l2norm_in_kernel
    inputs = (q, k, v, g, beta)
    # FlashInfer's output has max(query, value) heads of the value head dim.
    out = q.new_empty((*q.shape[:2], max(q.shape[2], v.shape[2]), v.shape[3]))
    states, questions = split.launches
    ends = _run(states, inputs, initial_state.index_select(0, states.sequences), out)
    final_state = _run(
        questions, inputs, ends.index_select(0, split.launch_sources), out
    )
    return out, final_state
