"""Tests of the reference's exact attention against torch's own SDPA (CPU)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from vllm_d3.reference import ReferenceRuntime, exact_attention
from vllm_d3.reference.masks import additive, allowed
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

HEADS, KV_HEADS, DIM = 4, 2, 16


def tensors(queries: int, keys: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, queries, DIM, generator=generator)
    k = torch.randn(1, KV_HEADS, keys, DIM, generator=generator)
    v = torch.randn(1, KV_HEADS, keys, DIM, generator=generator)
    return q, k, v


def sdpa(q, k, v, mask=None, is_causal=False):
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return out.transpose(1, 2)


def run(q, k, v, mask, **kwargs):
    module = types.SimpleNamespace(is_causal=False)
    out, weights = exact_attention.exact_attention(module, q, k, v, mask, **kwargs)
    assert weights is None
    return out


@pytest.fixture(params=[1024, 3], ids=["one chunk", "chunks of 3"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(exact_attention, "QUERY_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("mode", ["causal", "noncausal_full_attention", "prefix_bidir"])
def test_masks_match_sdpa(mode: str, chunk: int) -> None:
    q, k, v = tensors(10, 10)
    mask = additive(allowed(mode, 10, 4), torch.float32)
    expected = sdpa(q, k, v, mask)
    torch.testing.assert_close(run(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)


def test_question_rows_after_a_cache_and_a_broadcast_row(chunk: int) -> None:
    q, k, v = tensors(10, 10)
    full = sdpa(q, k, v, additive(allowed("prefix_bidir", 10, 4), torch.float32))
    # The question's rows alone, reading the cached state and themselves.
    rows = additive(allowed("prefix_bidir", 10, 4, first_query=4), torch.float32)
    got = run(q[:, :, 4:], k, v, rows)
    torch.testing.assert_close(got, full[:, 4:], atol=1e-5, rtol=1e-5)
    # The state block alone: one all-allowed row stands for all of its rows.
    state = additive(allowed("prefix_bidir", 4, 4, first_query=3), torch.float32)
    got = run(q[:, :, :4], k[:, :, :4], v[:, :, :4], state)
    torch.testing.assert_close(got, full[:, :4], atol=1e-5, rtol=1e-5)


def test_no_mask_is_causal_or_full(chunk: int) -> None:
    q, k, v = tensors(6, 9)
    # Six new queries after three cached keys: query i is key 3 + i.
    bottom_right = torch.ones(6, 9, dtype=torch.bool).tril(diagonal=3)
    expected = sdpa(q, k, v, bottom_right)
    torch.testing.assert_close(
        run(q, k, v, None, is_causal=True), expected, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        run(q, k, v, None, is_causal=False), sdpa(q, k, v), atol=1e-5, rtol=1e-5
    )


def test_dropout_is_refused() -> None:
    q, k, v = tensors(2, 2)
    with pytest.raises(ValueError, match="dropout"):
        run(q, k, v, None, dropout=0.1)


def test_the_exact_and_sdpa_kernels_give_the_same_answers(tmp_path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    request = {
        "state": "Order 7: the parcel came open and one cup is broken.",
        "questions": {
            "damaged": {"type": "noul", "instructions": "Is anything damaged?"},
            "mood": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        },
    }
    answers = {
        kernel: ReferenceRuntime(checkpoint, kernel=kernel).answer(request)
        for kernel in ("exact", "sdpa")
    }
    for qid, exact in answers["exact"]["answers"].items():
        for option, p in exact["probabilities"].items():
            other = answers["sdpa"]["answers"][qid]["probabilities"][option]
            assert abs(p - other) < 1e-5, (qid, option)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        ReferenceRuntime(checkpoint, kernel="flash")
