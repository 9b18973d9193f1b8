# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A packed step's Gated DeltaNet in one pass through the layer's core
(upstream: ``model_executor/layers/mamba/gdn/split_recurrence.py``, a new file).

In a packed row ``state || q1 || ... || qQ`` each question block continues from
the layer's state after the state block. Where the layer's chunked delta rule
is FLA's (the Triton prefill), the step runs once, every block a sequence of its
own on a scratch slot: the convolution (each question's window seeded with its
state's last inputs) and the gates once, FLA's chunk-local kernels once, and
the recurrence across chunks twice, first from zero to find where each state
ends, then with each question starting there (``split_recurrence``). It
replaces the two phases (``packed_questions``) for the steps it takes, and, as
their one-scan form, writes no state slot: nothing reads the final states of a
prompt that ran whole (no prefix-cache hit reaches a packed prompt's
questions; a step with prefill checkpoints to write runs in two phases).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
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
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
    QUESTIONS_PER_SCAN,
    GDNGroup,
    PackedRow,
    build_on_slots,
    common_metadata,
    layer_step_metadata,
    scratch_slots,
    zeroed_states,
)

if TYPE_CHECKING:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

#: The prefill backend whose chunked delta rule the split recurrence calls.
FLA_PREFILL_BACKEND = "triton"
#: Most sequences (states, whole rows and question blocks) a step may have to
#: run in one pass; each holds three recurrent states in the layer's core (its
#: initial one, where its first recurrence ends, its final one: 3.1 MB each at
#: d3-turbo's shape), which vLLM's memory profile does not see. A larger step
#: runs in two phases, ``QUESTIONS_PER_SCAN`` blocks a scan.
SPLIT_SEQUENCES_MAX = QUESTIONS_PER_SCAN


@dataclass(frozen=True)
class SplitRecurrence:
    """A step's sequences in batch order, sequence ``i`` on scratch slot
    ``1 + i``: each packed row's state block then its question blocks, each
    other row whole."""

    metadata: CommonAttentionMetadata
    questions: torch.Tensor
    """(questions,) int64: the sequences that are question blocks."""
    question_slots: torch.Tensor
    """(questions,) int64: their scratch slots."""
    sources: torch.Tensor
    """(questions,) int64: the sequence of each one's state block."""
    window_tokens: torch.Tensor
    """(questions * width,) int64: the batch tokens of each question's
    convolution window, its state's last ``width`` tokens."""


def split_recurrence(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    packed: list[PackedRow],
    width: int,
    device: torch.device,
) -> SplitRecurrence | None:
    """The plan of a step of fresh prefill rows, whose packed rows are
    scheduled whole; None where a row continues a sequence, a state block is
    shorter than the convolution's window ``width``, a block is one token
    (0.33.0's builder takes it for a decode), or the step has more than
    ``SPLIT_SEQUENCES_MAX`` sequences."""
    if not np.array_equal(np.diff(query_start_loc), seq_lens):
        return None
    if any(p.block.state_tokens < width for p in packed):
        return None
    by_row = {p.row: p.block for p in packed}
    starts: list[int] = []
    lens: list[int] = []
    restarts: list[int] = []
    sources: list[int] = []
    for row, (start, end) in enumerate(pairwise(query_start_loc.tolist())):
        block = by_row.get(row)
        starts.append(start)
        lens.append(end - start if block is None else block.state_tokens)
        restarts.append(0)
        if block is None:
            continue
        state = len(starts) - 1
        for q_start, q_end in block.question_blocks():
            sources.append(state)
            starts.append(start + q_start)
            lens.append(q_end - q_start)
            restarts.append(block.state_tokens)
    if len(starts) > SPLIT_SEQUENCES_MAX or min(lens) == 1:
        return None
    return _plan(
        np.asarray(starts),
        np.asarray(lens),
        np.asarray(restarts),
        sources,
        width,
        device,
    )


def _plan(
    starts: np.ndarray,
    lens: np.ndarray,
    restarts: np.ndarray,
    sources: list[int],
    width: int,
    device: torch.device,
) -> SplitRecurrence:
    questions = np.flatnonzero(restarts)
    # A question block's window is its state block's last ``width`` tokens.
    state_ends = starts[sources] + restarts[questions]
    window = (state_ends[:, None] + np.arange(-width, 0)).reshape(-1)

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(device)

    return SplitRecurrence(
        metadata=common_metadata(
            lens, restarts + lens, scratch_slots(len(starts), device), device
        ),
        questions=on_device(questions),
        question_slots=on_device(questions + 1),
        sources=on_device(np.asarray(sources)),
        window_tokens=on_device(window),
    )


@dataclass
class SplitGDNAttentionMetadata(GDNAttentionMetadata):
    """A step's GDN metadata (the fields, as built) plus its one pass: the
    metadata it runs with (sequence ``i`` on scratch slot ``1 + i``) and the
    plan."""

    one_pass: GDNAttentionMetadata | None = None
    split: SplitRecurrence | None = None


def split_gdn_metadata(
    groups: Sequence[GDNGroup], split: SplitRecurrence
) -> list[SplitGDNAttentionMetadata]:
    """Each KV-cache group's step metadata with the one pass, which is the same
    for every group (it runs on scratch slots): built once, by the first
    group's builder. Its initial-state mask stays the builder's, on the device:
    the masked fill over the gathered states (zeros, ``FreshStates``) is one
    kernel a layer, where a host mask would copy to the device from pageable
    memory and so wait for the GPU, every layer."""
    _, builder, _ = groups[0]
    one_pass = build_on_slots(builder, split.metadata)
    return [
        SplitGDNAttentionMetadata(
            **{f.name: getattr(metadata, f.name) for f in fields(GDNAttentionMetadata)},
            one_pass=one_pass,
            split=split,
        )
        for metadata, _, _ in groups
    ]


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
    # FreshStates stands in for a tensor where the core only indexes it.
    layer.kv_cache = (  # type: ignore[assignment]
        _seeded_windows(conv_cache, mixed_qkv, metadata.split),
        FreshStates(recurrent_cache),
    )
    rule._forward_method = partial(two_pass_rule, metadata.split)
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
