# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dense-piece attention for D3 prefix_bidir checkpoints
(upstream: ``v1/attention/backends/d3_prefix_bidir.py``, a new file).

A prefix_bidir row's ranges (``mm_req_doc_ranges``) are its state, then one
block per question; a row is computed to its end in one step, so its mask is
two passes of non-causal attention over the row's keys: every range over
itself, and each row's question rows over its state, merged by log-sum-exp.
The keys are the step's own, and after a prefix-cache hit inside the state,
theirs from the paged cache (``CachedKeys``, ``with_cached_keys``).
``dense_pieces`` finds the passes (None where a batch has none: a row split
across steps, a causal row); the composite ``D3PrefixBidirAttentionBackend``
runs them on the kernel the config hook chose (``d3_dense_kernels``) and
anything else on vLLM's ranged Triton, where a packed row is refused
(``PackedRowError``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.composite import (
    MMPrefixAttentionRouting,
    create_composite_attention_backend,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from vllm_d3.model_executor.models.d3_contract import (
    ATTENTION_KERNEL_KEY,
    DECIDED_KEY,
    PrefixRanges,
    StateBlock,
    decided,
)
from vllm_d3.v1.attention.backends.d3_dense_kernels import DenseKernel, dense_kernel

#: The backend's name in logs.
BACKEND_NAME = "D3_PREFIX_BIDIR"
#: The ``AttentionBackendEnum`` member the layers look this backend up by: its
#: own in-tree; the plugin registers it as ``CUSTOM``, a member every process
#: has, so that a config naming it unpickles in spawned engine and worker
#: processes (one added at run time would not).
REGISTRY_MEMBER = (
    BACKEND_NAME if BACKEND_NAME in AttentionBackendEnum.__members__ else "CUSTOM"
)

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class CachedKeys:
    """The keys of a batch's rows whose first tokens came from the prefix
    cache, on the host: each such key's row and prompt position, and the key
    layout of the passes (each row's keys in prompt order, rows in batch
    order) as indices into the step's keys followed by the cached ones."""

    rows: np.ndarray
    positions: np.ndarray
    key_tokens: np.ndarray


@dataclass(frozen=True)
class DensePieces:
    """A batch's two passes (module docstring), on the host. Keys are counted
    in the key layout: the step's tokens, or ``cached.key_tokens``."""

    own_cu_seqlens_q: np.ndarray
    """(num_ranges + 1,) int32 over the batch's tokens: every range of every
    row (what the step computes of it)."""
    own_cu_seqlens_k: np.ndarray
    """(num_ranges + 1,) int32 over the keys: every range of every row."""
    state_cu_seqlens_q: np.ndarray
    """(2 * rows + 1,) int32 over ``question_tokens``: each row's question rows,
    then none (the sequence that steps over its question keys)."""
    state_cu_seqlens_k: np.ndarray
    """(2 * rows + 1,) int32 over the keys: each row's state keys, then its
    question keys (read by no query)."""
    question_tokens: np.ndarray
    """(num_question_tokens,) int64, the batch's question tokens in order."""
    cached: CachedKeys | None = None
    """Where any row's first keys are in the paged cache."""


class PackedRowError(RuntimeError):
    """A packed row (the state read once for several questions) that the dense
    pieces cannot run; no other kernel here computes its mask."""


def _tiled_spans(spans: list[tuple[int, int]], seq_len: int) -> bool:
    """Whether the non-empty inclusive spans tile [0, seq_len) in order."""
    next_start = 0
    for start, end in spans:
        if start != next_start:
            return False
        next_start = end + 1
    return next_start == seq_len


def _spans(ranges: PrefixRanges, row: int) -> list[tuple[int, int]]:
    # A range with end < start is empty (a prompt that is all state).
    return sorted((a, b) for a, b in ranges.get(row, ()) if a <= b)


def has_packed_rows(metadata: CommonAttentionMetadata) -> bool:
    """Whether a row holds a state and two or more question blocks."""
    ranges: PrefixRanges = metadata.mm_req_doc_ranges or {}
    return any(len(_spans(ranges, row)) > 2 for row in ranges)


def dense_pieces(metadata: CommonAttentionMetadata) -> DensePieces | None:
    """The batch's dense pieces, or None when it cannot be split into them."""
    ranges: PrefixRanges = metadata.mm_req_doc_ranges or {}
    starts = metadata.query_start_loc_cpu.numpy()
    # Exact for prefill rows, the only rows that carry ranges.
    assert metadata.seq_lens_cpu_upper_bound is not None
    seq_lens = metadata.seq_lens_cpu_upper_bound.numpy()
    own_q, own_k, state_q, state_k = [0], [0], [0], [0]
    questions: list[np.ndarray] = []
    # (row, its first token in the step, its tokens in the step, its tokens
    # computed before the step)
    rows: list[tuple[int, int, int, int]] = []
    for row in range(metadata.num_reqs):
        begin = int(starts[row])
        query_len = int(starts[row + 1]) - begin
        if query_len == 0:
            continue
        seq_len = int(seq_lens[row])
        computed = seq_len - query_len
        spans = _spans(ranges, row)
        # A row that is not prefix_bidir, or one computed past its state in
        # an earlier step.
        if not _tiled_spans(spans, seq_len) or computed > spans[0][1]:
            return None
        # The row's prompt position 0 among the step's tokens and the keys.
        first_query, first_key = begin - computed, own_k[-1]
        own_q.extend(first_query + end + 1 for _, end in spans)
        own_k.extend(first_key + end + 1 for _, end in spans)
        state_end = spans[0][1] + 1
        state_q.extend((state_q[-1] + seq_len - state_end,) * 2)
        state_k.extend((first_key + state_end, first_key + seq_len))
        questions.append(np.arange(first_query + state_end, begin + query_len))
        rows.append((row, begin, query_len, computed))
    if len(own_q) == 1:
        return None
    cached = None
    if any(computed for *_, computed in rows):
        cached = _cached_keys(rows, int(starts[metadata.num_reqs]))
    return DensePieces(
        own_cu_seqlens_q=np.asarray(own_q, dtype=np.int32),
        own_cu_seqlens_k=np.asarray(own_k, dtype=np.int32),
        state_cu_seqlens_q=np.asarray(state_q, dtype=np.int32),
        state_cu_seqlens_k=np.asarray(state_k, dtype=np.int32),
        question_tokens=np.concatenate(questions).astype(np.int64),
        cached=cached,
    )


def _cached_keys(rows: list[tuple[int, int, int, int]], num_tokens: int) -> CachedKeys:
    """``CachedKeys`` of a step of ``num_tokens`` tokens over ``rows``: (row,
    its first token in the step, its tokens in the step, its tokens computed
    before the step), each row's cached keys placed after the step's."""
    computed = np.asarray([c for *_, c in rows], dtype=np.int64)
    cached_starts = num_tokens + np.cumsum(computed) - computed
    key_tokens = [
        segment
        for (_, begin, query_len, c), start in zip(rows, cached_starts, strict=True)
        for segment in (
            np.arange(start, start + c),
            np.arange(begin, begin + query_len),
        )
    ]
    return CachedKeys(
        rows=np.repeat(np.asarray([row for row, *_ in rows], dtype=np.int64), computed),
        positions=np.concatenate([np.arange(c) for c in computed]).astype(np.int64),
        key_tokens=np.concatenate(key_tokens).astype(np.int64),
    )


def _on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


@dataclass(frozen=True)
class Pass:
    """One kernel call over ``cu_seqlens``, on the device."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @classmethod
    def of(cls, cu_q: np.ndarray, cu_k: np.ndarray, device: torch.device) -> "Pass":
        return cls(
            _on_device(cu_q, device),
            _on_device(cu_k, device),
            # At least 2: PyTorch's flash attention takes a bound of 1 to mean
            # one query in every sequence and regroups the query heads so,
            # which the sequences without queries break.
            max(int(np.diff(cu_q).max()), 2),
            int(np.diff(cu_k).max()),
        )


@dataclass
class CachedKeysOnDevice:
    """``CachedKeys`` on the device, with the batch's block table."""

    rows: torch.Tensor
    positions: torch.Tensor
    key_tokens: torch.Tensor
    block_table: torch.Tensor


@dataclass
class D3DensePiecesMetadata:
    """A batch's dense pieces for ``run_dense_pieces`` (no other field: the KV
    cache writes read the forward context's slot mapping)."""

    num_actual_tokens: int
    own_keys: Pass
    state_keys: Pass
    question_tokens: torch.Tensor
    cached_keys: CachedKeysOnDevice | None = None

    @classmethod
    def of(
        cls,
        pieces: DensePieces,
        num_tokens: int,
        device: torch.device,
        block_table: torch.Tensor | None = None,
    ) -> "D3DensePiecesMetadata":
        """``pieces`` on ``device``; ``block_table``: the batch's, where
        ``pieces`` has cached keys."""
        cached_keys = None
        if pieces.cached is not None:
            assert block_table is not None, "cached keys need the block table"
            cached = pieces.cached
            cached_keys = CachedKeysOnDevice(
                rows=_on_device(cached.rows, device),
                positions=_on_device(cached.positions, device),
                key_tokens=_on_device(cached.key_tokens, device),
                block_table=block_table,
            )
        return cls(
            num_actual_tokens=num_tokens,
            own_keys=Pass.of(pieces.own_cu_seqlens_q, pieces.own_cu_seqlens_k, device),
            state_keys=Pass.of(
                pieces.state_cu_seqlens_q, pieces.state_cu_seqlens_k, device
            ),
            question_tokens=_on_device(pieces.question_tokens, device),
            cached_keys=cached_keys,
        )


def with_cached_keys(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    cached: CachedKeysOnDevice,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The passes' keys and values: the step's ``key`` and ``value`` and the
    cached ones, read from ``kv_cache`` (Triton's, logical shape (blocks, KV
    heads, block size, 2 * head size)), in the key layout."""
    block_size = kv_cache.shape[2]
    blocks = cached.block_table[cached.rows, cached.positions // block_size]
    # Indices on either side of a slice: the (cached token, KV head, 2 * head
    # size) entries.
    entries = kv_cache[blocks.long(), :, cached.positions % block_size]
    cached_key, cached_value = entries.split(head_size, dim=-1)
    tokens = cached.key_tokens
    return (
        torch.cat([key, cached_key]).index_select(0, tokens),
        torch.cat([value, cached_value]).index_select(0, tokens),
    )


def run_dense_pieces(
    kernel: DenseKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: D3DensePiecesMetadata,
    scale: float,
    output: torch.Tensor,
) -> None:
    """The two passes and the merge (module docstring), into ``output``."""
    own = metadata.own_keys
    own_lse = kernel(
        query, key, value, own.cu_seqlens_q, own.cu_seqlens_k,
        own.max_seqlen_q, own.max_seqlen_k, scale, output,
    )  # fmt: skip
    index = metadata.question_tokens
    if not index.numel():
        return
    state = metadata.state_keys
    over_state = torch.empty(
        (index.numel(), *output.shape[1:]), dtype=output.dtype, device=output.device
    )
    state_lse = kernel(
        query.index_select(0, index), key, value, state.cu_seqlens_q,
        state.cu_seqlens_k, state.max_seqlen_q, state.max_seqlen_k, scale,
        over_state,
    )  # fmt: skip
    merged = torch.empty_like(over_state)
    merge_attn_states(
        merged,
        output.index_select(0, index),
        own_lse.index_select(1, index),
        over_state,
        state_lse,
    )
    output.index_copy_(0, index, merged)


def selected_kernel_name() -> str:
    """The kernel the config hook chose for this engine."""
    extra = get_current_vllm_config().additional_config
    name = decided(extra).get(ATTENTION_KERNEL_KEY)
    if not isinstance(name, str):
        raise RuntimeError(
            f"the D3 dense-piece attention needs additional_config "
            f"{DECIDED_KEY}[{ATTENTION_KERNEL_KEY!r}], which the D3 config hook "
            "writes"
        )
    return name


class D3DensePiecesMetadataBuilder(TritonAttentionMetadataBuilder):
    def build(  # type: ignore[override]  # dense batches get their own type
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ):
        if not common_attn_metadata.mm_req_doc_ranges:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        pieces = dense_pieces(common_attn_metadata)
        # DensePieceRouting sends only batches that split into pieces here.
        assert pieces is not None
        return D3DensePiecesMetadata.of(
            pieces,
            common_attn_metadata.num_actual_tokens,
            common_attn_metadata.query_start_loc.device,
            common_attn_metadata.block_table_tensor,
        )


class D3DensePiecesImpl(TritonAttentionImpl):
    """The dense pieces on the configured kernel; plain causal Triton for a
    batch without ranges."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dense_kernel = dense_kernel(selected_kernel_name())
        # What the dense pieces do not compute, fixed with the layer: the plain
        # attention of D3's backbone has bf16/fp16 KV and none of the rest.
        self.unsupported = [
            name
            for name, present in (
                ("a quantized KV cache", is_quantized_kv_cache(self.kv_cache_dtype)),
                ("attention sinks", self.sinks is not None),
                # TritonAttentionImpl keeps (-1, -1) for "no window".
                ("a sliding window", self.sliding_window != (-1, -1)),
                ("ALiBi", self.alibi_slopes is not None),
                ("a logit soft cap", bool(self.logits_soft_cap)),
            )
            if present
        ]

    def forward(  # type: ignore[override]  # dense batches get their own type
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(attn_metadata, D3DensePiecesMetadata):
            return super().forward(
                layer,  # type: ignore[arg-type]
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        self._check_supported(output_scale, output_block_scale)
        num_tokens = attn_metadata.num_actual_tokens
        key, value = key[:num_tokens], value[:num_tokens]
        if attn_metadata.cached_keys is not None:
            key, value = with_cached_keys(
                key, value, kv_cache, attn_metadata.cached_keys, self.head_size
            )
        run_dense_pieces(
            self.dense_kernel,
            query[:num_tokens],
            key,
            value,
            attn_metadata,
            self.scale,
            output[:num_tokens],
        )
        return output

    def _check_supported(
        self, output_scale: torch.Tensor | None, output_block_scale: torch.Tensor | None
    ) -> None:
        """The dense pieces run neither ``unsupported`` nor fused output
        quantization."""
        unsupported = list(self.unsupported)
        if output_scale is not None or output_block_scale is not None:
            unsupported.append("fused output quantization")
        if unsupported:
            raise PackedRowError(
                "the D3 dense-piece attention cannot run with "
                f"{', '.join(unsupported)}; serve with --attention-backend "
                "TRITON_FLASH_ATTN (vLLM's ranged attention, one request per "
                "question) instead"
            )


class D3DensePiecesBackend(TritonAttentionBackend):
    """The dense pieces on the configured kernel, beside vLLM's Triton cache
    layout (the ranged child's)."""

    @staticmethod
    def get_builder_cls() -> type[D3DensePiecesMetadataBuilder]:  # type: ignore[override]
        return D3DensePiecesMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[D3DensePiecesImpl]:  # type: ignore[override]
        return D3DensePiecesImpl


class DensePieceRouting(MMPrefixAttentionRouting):
    """Dense pieces (variant 1) whenever the batch splits into them or has no
    ranges; ranged Triton (variant 0) otherwise. (The builder splits the batch
    again: one pass over the rows, once per step and group.)"""

    def select(self, metadata: CommonAttentionMetadata) -> int:
        if not metadata.mm_req_doc_ranges or dense_pieces(metadata) is not None:
            return 1
        if has_packed_rows(metadata):
            raise PackedRowError(
                "a packed D3 request (the state read once for several questions) "
                "was not scheduled whole in one step; it has no other kernel"
            )
        logger.info_once(
            "vllm-d3: a batch that does not split into dense pieces (a prompt "
            "split across steps, or causal rows beside ranged ones) runs on the "
            "ranged Triton attention; later ones are not logged"
        )
        return 0


D3PrefixBidirAttentionBackend = create_composite_attention_backend(
    TritonAttentionBackend,
    D3DensePiecesBackend,
    name="D3PrefixBidirAttentionBackend",
    backend_name=REGISTRY_MEMBER,
    module=__name__,
    routing_policy=DensePieceRouting,
)


def step_metadata(
    rows: Sequence[StateBlock], device: torch.device
) -> CommonAttentionMetadata:
    """One step that computes each of ``rows`` whole, with its ranges, as the
    prefix_bidir model state describes it to the attention builders."""
    lengths = [row.prompt_len for row in rows]
    starts = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        block_table_tensor=torch.zeros((len(rows), 1), dtype=torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        mm_req_doc_ranges={index: row.ranges() for index, row in enumerate(rows)},
    )
