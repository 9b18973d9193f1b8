# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dense-piece attention for D3 prefix_bidir checkpoints
(upstream: ``v1/attention/backends/d3_prefix_bidir.py``, a new file beside
``triton_flash_attn.py``).

A prefix_bidir row carries its ranges in ``mm_req_doc_ranges``: the state
``[0, s)`` first, then one range per question block, tiling the row. Every
question reads the state and itself both ways; the state reads itself.

- A row with one question (``[(0, s - 1), (s, n - 1)]``) is vLLM's PrefixLM
  mask (causal OR both ways inside one range): a query inside range ``[a, b]``
  sees exactly the keys ``[0, b]``, so each range is one dense, non-causal
  piece.
- A packed row (``state || q1 || ... || qQ``, ``Q >= 2``; the state read once
  for all its questions) is not a PrefixLM mask: question ``i`` must not see
  questions ``1 .. i - 1``. Its pieces are the state over the state keys, all
  its question rows over the state keys ``[0, s)``, and each question over its
  own keys, which are this step's fresh keys; the question rows' two partial
  results are merged by their log-sum-exp (vLLM's ``merge_attn_states``). The
  ranged Triton kernel cannot express it, so a packed row runs only here.

So a batch whose every ranged row is scheduled to its end is plain non-causal
attention over virtual sequences, which FlashAttention 3 runs at full speed,
instead of the ranged Triton kernel that scans every key for every row.

- ``dense_pieces`` turns a batch (``CommonAttentionMetadata`` with
  ``mm_req_doc_ranges``) into virtual sequences, or returns None when it cannot
  be expressed so: a ranged row that stops before its last range ends (a prompt
  split across steps), ranges that do not tile the row, or a row without ranges
  that has more than one query (plain causal attention). Its ``questions`` are
  the packed rows' question blocks, the own-key pieces.
- ``dense_piece_metadata`` rewrites the batch metadata for those virtual
  sequences: ``cu_seqlens_q`` per piece, ``seqused_k`` = the piece's last key + 1,
  the row's block-table row repeated for each of its pieces, ``causal=False``.
  KV writes do not read it (they run before attention, on the real slots).
  ``D3DenseFlashAttentionImpl`` runs the own-key pieces and the merge when the
  batch has packed rows (``D3FlashAttentionMetadata.questions``).
- ``D3PrefixBidirAttentionBackend`` is a composite (0.33.0's
  ``create_composite_attention_backend``) of the ranged Triton backend and a
  FlashAttention 3 backend whose builder applies ``dense_pieces``.
  ``DensePieceRouting`` sends a batch to FlashAttention when ``dense_pieces``
  can express it (or it has no ranges: plain causal FlashAttention) and to
  ranged Triton otherwise, logging the first such fallback. A batch with a
  packed row that does not split into pieces is refused (``PackedRowError``):
  no kernel here computes its mask.
- The FlashAttention child declares kernel blocks of ``KEY_TILE_TOKENS`` (80)
  tokens, so vLLM sizes the hybrid KV block of d3-turbo at 800 tokens instead of
  784: whole key tiles per page, which FlashAttention 3 reads faster.

The config hook (``model_executor/models/d3_serving.py``) selects it, as the
``AttentionBackendEnum`` member ``REGISTRY_MEMBER``, for the full-attention
layers of prefix_bidir checkpoints where ``dense_attention_unavailable`` finds
nothing missing: a Hopper GPU with vLLM's FlashAttention 3.
"""

from dataclasses import dataclass, fields

import numpy as np
import torch
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata, MultipleOf
from vllm.v1.attention.backends.composite import (
    MMPrefixAttentionRouting,
    create_composite_attention_backend,
)
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
from vllm.v1.kv_cache_interface import KVCacheSpec, is_quantized_kv_cache

from vllm_d3.model_executor.models.d3_contract import PrefixRanges

#: The backend's name in logs.
BACKEND_NAME = "D3_PREFIX_BIDIR"
#: The ``AttentionBackendEnum`` member the layers look this backend up by: the
#: plugin registers it as ``CUSTOM``, a member every process has, so that a
#: config naming it unpickles in spawned engine and worker processes (one added
#: at run time would not).
REGISTRY_MEMBER = "CUSTOM"
#: FlashAttention 3's key tile at head_dim 256 on Hopper, in tokens; a multiple
#: of 16, the paged kernels' own alignment.
KEY_TILE_TOKENS = 80

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class DensePieces:
    """A batch as virtual sequences, each one dense non-causal piece."""

    rows: np.ndarray
    """(num_pieces,) the batch row each piece belongs to."""
    query_start_loc: np.ndarray
    """(num_pieces + 1,) int32, where each piece's queries start in the batch."""
    seq_lens: np.ndarray
    """(num_pieces,) int32, the keys each piece reads: positions [0, seq_len)."""
    questions: np.ndarray
    """(num_questions, 2) int64, the packed rows' question blocks as
    ``[start, end)`` in the batch's tokens: each also reads its own keys."""


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
    rows: list[int] = []
    piece_starts: list[int] = []
    piece_keys: list[int] = []
    questions: list[tuple[int, int]] = []

    def add_piece(row: int, first_query: int, keys: int) -> None:
        rows.append(row)
        piece_starts.append(first_query)
        piece_keys.append(keys)

    for row in range(metadata.num_reqs):
        query_begin = int(starts[row])
        query_len = int(starts[row + 1]) - query_begin
        seq_len = int(seq_lens[row])
        first_query = seq_len - query_len
        spans = _spans(ranges, row)
        if not spans:
            if query_len > 1:
                return None  # causal attention over several queries
            if query_len == 1:
                # One query at the end of its sequence: causal is non-causal.
                add_piece(row, query_begin, seq_len)
            continue
        if not _tiled_spans(spans, seq_len):
            return None
        if len(spans) > 2:
            # Packed: every question reads the state and its own block, so all
            # of them must be in this step.
            state_tokens = spans[0][1] + 1
            if first_query > state_tokens:
                return None
            if first_query < state_tokens:
                add_piece(row, query_begin, state_tokens)
            # All question rows over the state keys, in one piece ...
            add_piece(row, query_begin + state_tokens - first_query, state_tokens)
            # ... and each over its own keys, merged with it.
            questions.extend(
                (query_begin + a - first_query, query_begin + b + 1 - first_query)
                for a, b in spans[1:]
            )
            continue
        for start, end in spans:
            if end < first_query:
                continue  # computed in an earlier step
            add_piece(row, query_begin + max(start, first_query) - first_query, end + 1)
    if not rows:
        return None
    piece_starts.append(int(starts[metadata.num_reqs]))
    return DensePieces(
        rows=np.asarray(rows, dtype=np.int64),
        query_start_loc=np.asarray(piece_starts, dtype=np.int32),
        seq_lens=np.asarray(piece_keys, dtype=np.int32),
        questions=np.asarray(questions, dtype=np.int64).reshape(-1, 2),
    )


def dense_piece_metadata(
    metadata: CommonAttentionMetadata, pieces: DensePieces
) -> CommonAttentionMetadata:
    """``metadata`` rewritten for the pieces: one non-causal sequence each."""
    device = metadata.query_start_loc.device
    query_start_loc_cpu = torch.from_numpy(pieces.query_start_loc)
    seq_lens_cpu = torch.from_numpy(pieces.seq_lens)
    rows = torch.from_numpy(pieces.rows).to(device, non_blocking=True)
    return metadata.replace(
        query_start_loc=query_start_loc_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        num_reqs=len(pieces.rows),
        max_query_len=int(np.diff(pieces.query_start_loc).max()),
        max_seq_len=int(pieces.seq_lens.max()),
        # FlashAttention 3 takes exactly one block-table row per sequence.
        block_table_tensor=metadata.block_table_tensor.index_select(0, rows),
        causal=False,
        # The ranges are spent: FlashAttention must not apply them again.
        mm_req_doc_ranges=None,
        # Per-row fields and caches that no longer match the rows; FlashAttention
        # reads none of them.
        is_prefilling=None,
        req_idx=None,
        dcp_local_seq_lens=None,
        dcp_local_seq_lens_cpu_upper_bound=None,
        rswa_prefix_lens=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


def dense_attention_unavailable() -> str | None:
    """Why this process's platform cannot run the dense pieces (None: it can)."""
    if not current_platform.is_cuda():
        return "not a CUDA GPU"
    capability = current_platform.get_device_capability()
    if capability is None or capability.major != 9:
        return f"compute capability {capability}, not Hopper (9.x)"
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except ImportError:
        return "vLLM's FlashAttention is not installed"
    if not is_fa_version_supported(3):
        return "FlashAttention 3 is not supported here"
    return None


@dataclass(frozen=True)
class QuestionBlocks:
    """The packed rows' question blocks, on the device, for the own-key pass."""

    token_index: torch.Tensor
    """(num_question_tokens,) int64, the blocks' tokens in the batch, in order."""
    cu_seqlens: torch.Tensor
    """(num_questions + 1,) int32, where each block starts in ``token_index``."""
    max_len: int


def question_blocks(questions: np.ndarray, device: torch.device) -> QuestionBlocks:
    lengths = questions[:, 1] - questions[:, 0]
    token_index = np.concatenate([np.arange(a, b) for a, b in questions])
    cu_seqlens = np.zeros(len(questions) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    return QuestionBlocks(
        token_index=torch.from_numpy(token_index).to(device, non_blocking=True),
        cu_seqlens=torch.from_numpy(cu_seqlens).to(device, non_blocking=True),
        max_len=int(lengths.max()),
    )


@dataclass
class D3FlashAttentionMetadata(FlashAttentionMetadata):
    questions: QuestionBlocks | None = None
    """Set when the batch has packed rows: their question blocks, which also
    read their own keys."""


class D3DenseFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashAttentionMetadata:
        if not common_attn_metadata.mm_req_doc_ranges:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        pieces = dense_pieces(common_attn_metadata)
        # DensePieceRouting sends only batches that split into pieces here.
        assert pieces is not None
        metadata = super().build(
            common_prefix_len,
            dense_piece_metadata(common_attn_metadata, pieces),
            fast_build,
        )
        if not len(pieces.questions):
            return metadata
        return D3FlashAttentionMetadata(
            **{f.name: getattr(metadata, f.name) for f in fields(metadata)},
            questions=question_blocks(
                pieces.questions, common_attn_metadata.query_start_loc.device
            ),
        )


class D3DenseFlashAttentionImpl(FlashAttentionImpl):
    """FlashAttention 3 over the dense pieces; for packed rows, also each
    question block over its own keys, merged by log-sum-exp."""

    def forward(  # type: ignore[override]  # FlashAttentionImpl narrows it
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        questions = getattr(attn_metadata, "questions", None)
        if questions is None:
            return super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        self._check_packed_rows_supported(output_scale, output_block_scale)
        # Defined only where vLLM's FlashAttention is built (not on the CPU).
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

        fa_version = self.vllm_flash_attn_version
        assert fa_version is not None
        num_tokens = attn_metadata.num_actual_tokens
        # The cache holds one page per block: (blocks, kv heads, block size,
        # key and value side by side); FlashAttention reads (blocks, block
        # size, kv heads, head size) views of each half.
        key_cache, value_cache = kv_cache.transpose(1, 2).chunk(2, dim=-1)
        # Every piece over the paged keys: the state pieces and all question
        # rows over the state, with the log-sum-exp of each query.
        _, paged_lse = flash_attn_varlen_func(
            q=query[:num_tokens],
            k=key_cache,
            v=value_cache,
            out=output[:num_tokens],
            cu_seqlens_q=attn_metadata.query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=False,
            block_table=attn_metadata.block_table,
            scheduler_metadata=attn_metadata.scheduler_metadata,
            num_splits=attn_metadata.max_num_splits,
            return_softmax_lse=True,
            fa_version=fa_version,
        )
        # Each question block over its own keys: this step's fresh keys.
        index = questions.token_index
        own_output, own_lse = flash_attn_varlen_func(
            q=query.index_select(0, index),
            k=key.index_select(0, index),
            v=value.index_select(0, index),
            cu_seqlens_q=questions.cu_seqlens,
            max_seqlen_q=questions.max_len,
            cu_seqlens_k=questions.cu_seqlens,
            max_seqlen_k=questions.max_len,
            softmax_scale=self.scale,
            causal=False,
            return_softmax_lse=True,
            fa_version=fa_version,
        )
        merged = torch.empty_like(own_output)
        merge_attn_states(
            merged,
            output.index_select(0, index),
            paged_lse.index_select(1, index).contiguous(),
            own_output,
            own_lse,
        )
        output.index_copy_(0, index, merged)
        return output

    def _check_packed_rows_supported(
        self, output_scale: torch.Tensor | None, output_block_scale: torch.Tensor | None
    ) -> None:
        """Packed rows run only the plain attention of D3's backbone: bf16/fp16
        KV, no sinks, windows, ALiBi, soft cap, context parallelism or fused
        output quantization."""
        unsupported = [
            name
            for name, present in (
                ("a quantized KV cache", is_quantized_kv_cache(self.kv_cache_dtype)),
                ("attention sinks", self.sinks is not None),
                # FlashAttentionImpl keeps (-1, -1) for "no window".
                ("a sliding window", self.sliding_window not in (None, (-1, -1))),
                ("ALiBi", self.alibi_slopes is not None),
                ("a logit soft cap", bool(self.logits_soft_cap)),
                ("decode context parallelism", self.dcp_world_size > 1),
                (
                    "fused output quantization",
                    output_scale is not None or output_block_scale is not None,
                ),
            )
            if present
        ]
        if unsupported:
            raise PackedRowError(
                "a packed D3 request (the state read once for several questions) "
                f"cannot run with {', '.join(unsupported)}; serve "
                "with one request per question instead (docs/README: the state-"
                "once switch)"
            )


class D3DenseFlashAttentionBackend(FlashAttentionBackend):
    """FlashAttention 3 on Hopper, over dense pieces."""

    @classmethod
    def get_supported_kernel_block_sizes(
        cls, kv_cache_spec: KVCacheSpec | None = None
    ) -> list[int | MultipleOf]:
        # Whole key tiles per page: FlashAttention 3 reads keys in tiles of 80
        # tokens at head_dim 256, and pages of a multiple of 80 (d3-turbo's
        # hybrid cache: 800 instead of 784 tokens) ran 8-11% faster on the H200
        # (docs/performance.md). vLLM sizes the hybrid block from this.
        return [MultipleOf(KEY_TILE_TOKENS)]

    @staticmethod
    def get_builder_cls() -> type[D3DenseFlashAttentionMetadataBuilder]:
        return D3DenseFlashAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[D3DenseFlashAttentionImpl]:
        return D3DenseFlashAttentionImpl

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major == 9 and super().supports_compute_capability(capability)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        reason = super().supports_combination(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            use_mm_prefix,
            device_capability,
        )
        if reason is not None:
            return reason
        version = get_flash_attn_version(
            head_size=head_size, has_sinks=has_sink, kv_cache_block_size=block_size
        )
        if version != 3:
            return f"dense pieces need FlashAttention 3, not {version}"
        return None


class DensePieceRouting(MMPrefixAttentionRouting):
    """Dense pieces on FlashAttention (variant 1) whenever the batch splits into
    them or has no ranges; ranged Triton (variant 0) otherwise. (The builder
    splits the batch again: one pass over the rows, once per step and group.)"""

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
    D3DenseFlashAttentionBackend,
    name="D3PrefixBidirAttentionBackend",
    backend_name=REGISTRY_MEMBER,
    module=__name__,
    routing_policy=DensePieceRouting,
)
