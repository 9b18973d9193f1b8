# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A packed step's Gated DeltaNet in one pass through the layer's core
(upstream: ``model_executor/layers/mamba/gdn/split_recurrence.py``, a new file).

In a packed row ``state || q1 || ... || qQ`` each question block continues from
the layer's state after the state block. The step runs once, every block a
sequence of its own on a scratch slot: the convolution (each question's window
seeded with its state's last inputs) and the gates once, then the prefill's
chunked rule as ``ONE_PASS_RULES`` runs it for the layer's kernel: on FLA's,
the recurrence across chunks twice, first from zero to find where each state
ends, then with each question starting there (``two_pass_rule``); on
FlashInfer's, two launches (``flashinfer_launches``). It replaces the two
phases (``packed_questions``) for the steps it takes and writes no state slot:
nothing reads the final states of a prompt that ran whole (a step with
prefill checkpoints to write runs in two phases).
"""

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.third_party.flash_linear_attention.ops.chunk_delta_h import (
    chunk_gated_delta_rule_fwd_h,
)
from vllm.third_party.flash_linear_attention.ops.chunk_o import chunk_fwd_o
from vllm.third_party.flash_linear_attention.ops.chunk_scaled_dot_kkt import (
    chunk_scaled_dot_kkt_fwd,
)
from vllm.third_party.flash_linear_attention.ops.cumsum import chunk_local_cumsum
from vllm.third_party.flash_linear_attention.ops.solve_tril import solve_tril
from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
from vllm.third_party.flash_linear_attention.ops.wy_fast import recompute_w_u_fwd

from vllm_d3.model_executor.layers.mamba.gdn.flashinfer_launches import (
    two_launch_rule,
)
from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
    FLASHINFER_GDN_PREFILL,
    TRITON_GDN_PREFILL,
    layer_step_metadata,
    zeroed_states,
)
from vllm_d3.v1.attention.backends.d3_packed_gdn import (
    SplitGDNAttentionMetadata,
    SplitRecurrence,
)

if TYPE_CHECKING:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )


class FreshStates:
    """The recurrent states of a one-pass step, as 0.33.0's prefill path uses
    them: ``states[indices]`` is zeros, one per sequence (every row is fresh;
    the questions get theirs in ``two_pass_rule``); ``states[indices] = final``
    drops ``final`` (module docstring)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.dtype = cache.dtype

    def __getitem__(self, indices: torch.Tensor) -> torch.Tensor:
        return self.cache.new_zeros((len(indices), *self.cache.shape[1:]))

    def __setitem__(self, indices: torch.Tensor, final: torch.Tensor) -> None:
        pass


def two_pass_rule(
    split: SplitRecurrence,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    core_attn_out: torch.Tensor | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's chunked delta rule with the recurrence across chunks run twice:
    from ``initial_state`` (zeros), then with each question from its state's
    end. Called as 0.33.0's ``ChunkGatedDeltaRule`` is (its gates on, without
    FLA's own l2 norm)."""
    assert output_final_state and not use_qk_l2norm_in_kernel
    g = chunk_local_cumsum(
        g, chunk_size=FLA_CHUNK_SIZE, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )
    a = chunk_scaled_dot_kkt_fwd(
        k=k,
        beta=beta,
        g=g,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        output_dtype=torch.float32,
    )
    a = solve_tril(
        A=a, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, output_dtype=k.dtype
    )
    w, u = recompute_w_u_fwd(
        k=k,
        v=v,
        beta=beta,
        A=a,
        g_cumsum=g,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    recurrence = partial(
        chunk_gated_delta_rule_fwd_h,
        k=k,
        w=w,
        u=u,
        g=g,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
    )
    # FLA annotates two results; it returns (h, new values, final states). The
    # new values are computed, and dropped with h at once, so that the kernel
    # is the variant vLLM's warm-up has autotuned (without them, the first
    # step would autotune it).
    ends = recurrence(initial_state=initial_state)[2]  # type: ignore[misc]
    initial_state.index_copy_(
        0, split.questions, ends[split.sources].to(initial_state.dtype)
    )
    h, v_new, final_state = recurrence(initial_state=initial_state)  # type: ignore[misc]
    o = chunk_fwd_o(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=g,
        scale=k.shape[-1] ** -0.5,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        core_attn_out=core_attn_out,
    )
    return o.to(q.dtype), final_state


#: The one pass's chunked rule on each prefill kernel that has one.
ONE_PASS_RULES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    TRITON_GDN_PREFILL: two_pass_rule,
    FLASHINFER_GDN_PREFILL: two_launch_rule,
}


def forward_split_recurrence(
    layer: "QwenGatedDeltaNetAttention",
    forward_core: Callable[..., Any],
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> bool:
    """Run ``layer``'s step in one pass through ``forward_core`` if the step
    has a split recurrence; returns whether it did."""
    found = layer_step_metadata(layer, SplitGDNAttentionMetadata)
    if found is None:
        return False
    all_metadata, metadata = found
    assert metadata.split is not None and metadata.one_pass is not None
    conv_cache, recurrent_cache = layer.kv_cache
    rule = layer.chunk_gated_delta_rule
    own_rule = rule._forward_method
    one_pass_rule = ONE_PASS_RULES[layer.gdn_prefill_backend]
    # FreshStates stands in for a tensor where the core only indexes it.
    layer.kv_cache = (  # type: ignore[assignment]
        _seeded_windows(conv_cache, mixed_qkv, metadata.split),
        FreshStates(recurrent_cache),
    )
    rule._forward_method = partial(one_pass_rule, metadata.split)
    all_metadata[layer.prefix] = metadata.one_pass
    try:
        forward_core(mixed_qkv, b, a, core_attn_out)
    finally:
        layer.kv_cache = (conv_cache, recurrent_cache)
        rule._forward_method = own_rule
        all_metadata[layer.prefix] = metadata
    return True


def _seeded_windows(
    conv_cache: torch.Tensor, mixed_qkv: torch.Tensor, split: SplitRecurrence
) -> torch.Tensor:
    """Scratch convolution states, one per sequence after the null slot 0: a
    question's holds its state block's last inputs, the others zeros (unread:
    their sequences start fresh)."""
    scratch = zeroed_states(conv_cache, 1 + split.metadata.num_reqs)
    # (slots, channels, width), as 0.33.0's kernels read them.
    windows = scratch if is_conv_state_dim_first() else scratch.transpose(-1, -2)
    width = windows.shape[-1]
    inputs = mixed_qkv.index_select(0, split.window_tokens)
    windows.index_copy_(
        0,
        split.question_slots,
        inputs.view(-1, width, inputs.shape[-1]).transpose(1, 2),
    )
    return scratch
