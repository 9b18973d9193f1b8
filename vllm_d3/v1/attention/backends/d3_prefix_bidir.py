# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dense-piece attention for D3 prefix_bidir checkpoints
(upstream: ``v1/attention/backends/d3_prefix_bidir.py``, a new file beside
``triton_flash_attn.py``).

A prefix_bidir row reads two PrefixLM ranges, the state ``[0, s)`` and the
question ``[s, n)``; the mask is causal OR both ways inside one range. When a
row's ranges tile its whole sequence, a query inside range ``[a, b]`` sees
exactly the keys ``[0, b]``: each range is one dense, non-causal piece. So a
batch whose every ranged row is scheduled to its end is plain non-causal
attention over virtual sequences (one per range), which FlashAttention 3 runs
at full speed, instead of the ranged Triton kernel that scans every key for
every row.

- ``dense_pieces`` turns a batch (``CommonAttentionMetadata`` with
  ``mm_req_doc_ranges``) into virtual sequences, or returns None when it cannot
  be expressed so: a ranged row that stops before its last range ends (a prompt
  split across steps), ranges that do not tile the row, or a row without ranges
  that has more than one query (plain causal attention).
- ``dense_piece_metadata`` rewrites the batch metadata for those virtual
  sequences: ``cu_seqlens_q`` per piece, ``seqused_k`` = the piece's last key + 1,
  the row's block-table row repeated for each of its pieces, ``causal=False``.
  KV writes do not read it (they run before attention, on the real slots).
- ``D3PrefixBidirAttentionBackend`` is a composite (0.33.0's
  ``create_composite_attention_backend``) of the ranged Triton backend and a
  FlashAttention 3 backend whose builder applies ``dense_pieces``.
  ``DensePieceRouting`` sends a batch to FlashAttention when ``dense_pieces``
  can express it (or it has no ranges: plain causal FlashAttention) and to
  ranged Triton otherwise, logging the first such fallback.
- The FlashAttention child declares kernel blocks of ``KEY_TILE_TOKENS`` (80)
  tokens, so vLLM sizes the hybrid KV block of d3-turbo at 800 tokens instead of
  784: whole key tiles per page, which FlashAttention 3 reads faster.

The plugin registers the backend as vLLM's ``CUSTOM`` attention backend (a
member that exists in every process, so a config that names it pickles into
spawned engine and worker processes; a member added at run time would not). The
config hook selects it for the full-attention layers of prefix_bidir checkpoints
where ``dense_attention_unavailable`` finds nothing missing: a Hopper GPU with
vLLM's FlashAttention 3.
"""

from dataclasses import dataclass

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
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import KVCacheSpec

#: The backend's name in logs; vLLM's selector knows it as ``CUSTOM``.
BACKEND_NAME = "D3_PREFIX_BIDIR"
#: FlashAttention 3's key tile at head_dim 256 on Hopper, in tokens; a multiple
#: of 16, the paged kernels' own alignment.
KEY_TILE_TOKENS = 80

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")

Ranges = dict[int, list[tuple[int, int]]]


@dataclass(frozen=True)
class DensePieces:
    """A batch as virtual sequences, each one dense non-causal piece."""

    rows: np.ndarray
    """(num_pieces,) the batch row each piece belongs to."""
    query_start_loc: np.ndarray
    """(num_pieces + 1,) int32, where each piece's queries start in the batch."""
    seq_lens: np.ndarray
    """(num_pieces,) int32, the keys each piece reads: positions [0, seq_len)."""


def _tiled_spans(spans: list[tuple[int, int]], seq_len: int) -> bool:
    """Whether the non-empty inclusive spans tile [0, seq_len) in order."""
    next_start = 0
    for start, end in spans:
        if start != next_start:
            return False
        next_start = end + 1
    return next_start == seq_len


def dense_pieces(metadata: CommonAttentionMetadata) -> DensePieces | None:
    """The batch's dense pieces, or None when it cannot be split into them."""
    ranges: Ranges = metadata.mm_req_doc_ranges or {}
    starts = metadata.query_start_loc_cpu.numpy()
    # Exact for prefill rows, the only rows that carry ranges.
    assert metadata.seq_lens_cpu_upper_bound is not None
    seq_lens = metadata.seq_lens_cpu_upper_bound.numpy()
    rows: list[int] = []
    piece_starts: list[int] = []
    piece_keys: list[int] = []
    for row in range(metadata.num_reqs):
        query_begin = int(starts[row])
        query_len = int(starts[row + 1]) - query_begin
        seq_len = int(seq_lens[row])
        first_query = seq_len - query_len
        # A range with end < start is empty (a prompt that is all state).
        spans = sorted((a, b) for a, b in ranges.get(row, ()) if a <= b)
        if not spans:
            if query_len > 1:
                return None  # causal attention over several queries
            if query_len == 1:
                # One query at the end of its sequence: causal is non-causal.
                rows.append(row)
                piece_starts.append(query_begin)
                piece_keys.append(seq_len)
            continue
        if not _tiled_spans(spans, seq_len):
            return None
        for start, end in spans:
            if end < first_query:
                continue  # computed in an earlier step
            rows.append(row)
            piece_starts.append(query_begin + max(start, first_query) - first_query)
            piece_keys.append(end + 1)
    if not rows:
        return None
    piece_starts.append(int(starts[metadata.num_reqs]))
    return DensePieces(
        rows=np.asarray(rows, dtype=np.int64),
        query_start_loc=np.asarray(piece_starts, dtype=np.int32),
        seq_lens=np.asarray(piece_keys, dtype=np.int32),
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


class D3DenseFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashAttentionMetadata:
        if common_attn_metadata.mm_req_doc_ranges:
            pieces = dense_pieces(common_attn_metadata)
            # DensePieceRouting sends only batches that split into pieces here.
            assert pieces is not None
            common_attn_metadata = dense_piece_metadata(common_attn_metadata, pieces)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


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
    # The layer looks its backend up in AttentionBackendEnum by this name.
    backend_name="CUSTOM",
    module=__name__,
    routing_policy=DensePieceRouting,
)
