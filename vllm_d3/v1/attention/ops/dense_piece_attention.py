# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Non-causal variable-length attention that returns its log-sum-exp, in Triton
(upstream: ``v1/attention/ops/dense_piece_attention.py``, a new file).

``dense_piece_attention`` attends sequence ``i``'s queries
``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` to all of
``k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]``, writes ``out`` and returns the
natural-log log-sum-exp ``(heads, total_q)`` float32, so that passes over
disjoint keys merge exactly. A sequence may have no queries (the query and
key ranges advance independently); one without keys gets zeros and ``-inf``.
Query heads share key heads in groups (GQA).
"""

import math

import torch
from vllm.triton_utils import tl, triton


@triton.jit
def _attend_keys(
    q,
    acc,
    m_i,
    l_i,
    k_block,
    v_block,
    scale_log2,
    valid_keys,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over one block of keys (``k_block``: (head_size, BLOCK_N)
    pointers, ``v_block``: (BLOCK_N, head_size)); ``MASKED``: only its first
    ``valid_keys`` are the sequence's."""
    if MASKED:
        in_range = tl.arange(0, BLOCK_N) < valid_keys
        k = tl.load(k_block, mask=in_range[None, :], other=0.0)
    else:
        k = tl.load(k_block)
    scores = tl.dot(q, k) * scale_log2
    if MASKED:
        scores = tl.where(in_range[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_block, mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_block)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_all_keys(
    q,
    k_block,
    v_block,
    num_keys,
    scale_log2,
    k_block_step,
    v_block_step,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    """Online softmax of a query block over ``num_keys`` keys from the first
    key and value blocks on, ``*_block_step`` apart: the unnormalized output,
    the running maxima and the sums (base 2)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    whole_blocks_end = (num_keys // BLOCK_N) * BLOCK_N
    for _ in range(0, whole_blocks_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, k_block, v_block, scale_log2, BLOCK_N, BLOCK_N, False
        )
        k_block += k_block_step
        v_block += v_block_step
    if whole_blocks_end < num_keys:
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, k_block, v_block, scale_log2,
            num_keys - whole_blocks_end, BLOCK_N, True,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _store_rows(o_ptrs, lse_ptrs, acc, m_i, l_i, q_rows):
    """A query block's normalized output and natural-log log-sum-exp, stored
    for its ``q_rows``."""
    # No keys: l_i is 0 and the row's output 0, its log-sum-exp -inf.
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    # Natural logarithms: log2 values times ln 2.
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, m_i)
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=q_rows[:, None])
    tl.store(lse_ptrs, lse, mask=q_rows)


@triton.jit
def _dense_piece_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_o_token,
    stride_o_head,
    stride_lse_head,
    HEADS_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    num_queries = tl.load(cu_seqlens_q + seq + 1) - q_start
    if block * BLOCK_M >= num_queries:
        return
    k_start = tl.load(cu_seqlens_k + seq)
    num_keys = tl.load(cu_seqlens_k + seq + 1) - k_start
    kv_head = head // HEADS_PER_KV

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_SIZE)
    q_rows = offs_m < num_queries
    q_tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_tokens[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
        mask=q_rows[:, None],
        other=0.0,
    )
    # The first key block: keys as (head_size, key) columns, values as rows.
    k_first = k_start.to(tl.int64)
    k_block = (
        K
        + k_first * stride_k_token
        + kv_head * stride_k_head
        + offs_d[:, None]
        + offs_n[None, :] * stride_k_token
    )
    v_block = (
        V
        + k_first * stride_v_token
        + kv_head * stride_v_head
        + offs_d[None, :]
        + offs_n[:, None] * stride_v_token
    )

    acc, m_i, l_i = _attend_all_keys(
        q, k_block, v_block, num_keys, scale_log2,
        BLOCK_N * stride_k_token, BLOCK_N * stride_v_token,
        BLOCK_M, BLOCK_N, HEAD_SIZE,
    )  # fmt: skip
    _store_rows(
        Out + q_tokens[:, None] * stride_o_token + head * stride_o_head
        + offs_d[None, :],
        Lse + head * stride_lse_head + q_tokens,
        acc, m_i, l_i, q_rows,
    )  # fmt: skip


#: (BLOCK_M, BLOCK_N, num_warps, num_stages), fastest first at head_dim 256 where
#: they were timed (docs/performance.md); smaller tiles for less shared memory.
TILES = ((128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 32, 4, 1))


def _tile(head_size: int, element_size: int, device: torch.device):
    """The first of ``TILES`` whose query tile and pipelined key and value
    tiles fit the device's shared memory."""
    if device.type != "cuda":  # Triton's interpreter
        return 16, 16, 1, 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    properties = triton.runtime.driver.active.utils.get_device_properties(index)
    for block_m, block_n, warps, stages in TILES:
        tile_rows = block_m + stages * 2 * block_n
        if tile_rows * head_size * element_size <= properties["max_shared_mem"]:
            return block_m, block_n, warps, stages
    return TILES[-1]


def dense_piece_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Attention of each sequence's queries to all its keys (module docstring);
    ``q``, ``out``: (tokens, heads, head_size), ``k``, ``v``: (tokens, kv_heads,
    head_size), last dimension contiguous. Returns the log-sum-exp."""
    num_heads, head_size = q.shape[1], q.shape[2]
    if num_heads % k.shape[1] or head_size & (head_size - 1):
        raise ValueError(
            f"dense_piece_attention takes query heads in whole groups per key head "
            f"and a power-of-two head size, not {num_heads}/{k.shape[1]} heads of "
            f"{head_size}"
        )
    lse = torch.empty((num_heads, q.shape[0]), dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if max_seqlen_q == 0 or num_seqs == 0:
        return lse
    block_m, block_n, num_warps, num_stages = _tile(
        head_size, q.element_size(), q.device
    )
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _dense_piece_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        # The kernel's exponentials are in base 2.
        softmax_scale / math.log(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        HEADS_PER_KV=num_heads // k.shape[1],
        HEAD_SIZE=head_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return lse
