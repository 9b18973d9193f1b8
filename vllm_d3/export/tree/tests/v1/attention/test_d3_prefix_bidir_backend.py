# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3_PREFIX_BIDIR backend's dense pieces: two passes of non-causal
attention whose union is exactly each row's prefix_bidir mask (no GPU)."""

import random

import pytest
import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesBackend,
    D3PrefixBidirAttentionBackend,
    dense_pieces,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend


def whole_rows(rows: list[tuple[int, int]]) -> CommonAttentionMetadata:
    """One step reading each (state tokens, prompt length) row whole, with the
    state and question ranges the D3 model state gives it."""
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    starts = torch.zeros(len(rows) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(lens, 0)
    tokens = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=lens,
        seq_lens_cpu_upper_bound=lens,
        num_reqs=len(rows),
        num_actual_tokens=tokens,
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        block_table_tensor=torch.zeros((len(rows), 4), dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        mm_req_doc_ranges={
            i: [(0, s - 1), (s, n - 1)] for i, (s, n) in enumerate(rows)
        },
    )


def prefix_bidir_mask(rows: list[tuple[int, int]]) -> torch.Tensor:
    """The step's (query, key) pairs: within each row, a state query reads the
    state, a question query reads the whole prompt; no row reads another's."""
    masks = []
    for s, n in rows:
        queries, keys = torch.arange(n)[:, None], torch.arange(n)[None, :]
        masks.append((queries >= s) | (keys < s))
    return torch.block_diag(*masks)


def pieces_mask(metadata: CommonAttentionMetadata) -> torch.Tensor:
    """The pairs the two passes attend, each pair at most once."""
    pieces = dense_pieces(metadata)
    assert pieces is not None and pieces.cached is None
    tokens = metadata.num_actual_tokens
    mask = torch.zeros(tokens, tokens, dtype=torch.bool)
    own_q, own_k = pieces.own_cu_seqlens_q, pieces.own_cu_seqlens_k
    for i in range(len(own_q) - 1):
        mask[own_q[i] : own_q[i + 1], own_k[i] : own_k[i + 1]] = True
    state_q, state_k = pieces.state_cu_seqlens_q, pieces.state_cu_seqlens_k
    questions = torch.from_numpy(pieces.question_tokens)
    for i in range(len(state_q) - 1):
        rows = questions[state_q[i] : state_q[i + 1]]
        keys = slice(int(state_k[i]), int(state_k[i + 1]))
        assert not mask[rows, keys].any(), "a pair read by both passes"
        mask[rows, keys] = True
    return mask


@pytest.mark.parametrize("seed", range(10))
def test_the_pieces_are_exactly_the_prefix_bidir_mask(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 40)
        rows.append((rng.randint(1, n), n))  # s == n: a prompt all state
    assert torch.equal(pieces_mask(whole_rows(rows)), prefix_bidir_mask(rows))


def test_the_backend_is_a_registry_member():
    member = AttentionBackendEnum.D3_PREFIX_BIDIR
    assert member.get_class() is D3PrefixBidirAttentionBackend
    # The attention layer looks its backend up by this name.
    assert D3PrefixBidirAttentionBackend.get_name() == member.name
    # Both children keep Triton's cache layout and block sizes.
    assert D3PrefixBidirAttentionBackend.general_backend_cls is TritonAttentionBackend
    assert issubclass(D3DensePiecesBackend, TritonAttentionBackend)
