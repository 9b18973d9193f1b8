# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 state for D3 prefix_bidir checkpoints
(upstream: ``v1/worker/gpu/model_states/d3_prefix_bidir.py``, a new file).

``D3PrefixBidirModelState`` derives from ``MambaHybridModelState``, the state vLLM
picks for Qwen3.5, so the hybrid bookkeeping (Mamba "align" seeding and pre-copy,
spec-decode counters) is kept as it is. On top of it:

- ``add_request`` reads the request's ``PoolingParams.extra_kwargs["d3_state_tokens"]``
  (``s``, validated by ``state_tokens_of``: an int, ``1 <= s <= n``) and keeps
  ``(s, n)`` per request id until ``remove_request``. vLLM's own warm-up requests
  carry no size; they are split in the middle, which compiles the ranged kernels.
- ``prefix_ranges`` gives, per batch row, the request's two PrefixLM ranges
  ``[0, s)`` and ``[s, n)`` with the inclusive ends the attention backends take:
  ``[(0, s - 1), (s, n - 1)]``. Attention is then causal OR both ways inside one
  range: the state reads itself both ways, the question reads the state and itself
  both ways, the state never sees the question. No image ranges are added: they lie
  inside the state block and ranges must not overlap.
- ``prepare_attn`` hands those ranges to the attention (non-Mamba) groups' metadata
  builders. 0.33.0's hybrid ``prepare_attn`` passes no ranges at all, and has no
  parameter for them, so the groups it builds are wrapped (``_RangedAttentionGroup``)
  to set ``CommonAttentionMetadata.mm_req_doc_ranges`` before their builder runs.
  Gated DeltaNet groups never read ranges and stay causal.
"""

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_states.interface import ModelSpecificAttnMetadata
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
from vllm.v1.worker.utils import AttentionGroup

from vllm_d3.model_executor.models.d3_contract import state_tokens_of

PrefixRanges = dict[int, list[tuple[int, int]]]
#: How vLLM 0.33.0 names the dummy requests of its kernel warm-up
#: (``v1/worker/gpu/warmup.py``: ``req_ids = [f"_warmup_{i}_" ...]``).
WARMUP_REQUEST_PREFIX = "_warmup_"


class _RangedAttentionGroup:
    """An attention group whose metadata carries this step's PrefixLM ranges."""

    def __init__(self, group: AttentionGroup, ranges: PrefixRanges) -> None:
        self._group = group
        self._ranges = ranges

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def build_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, *args: Any, **kwargs: Any
    ) -> Any:
        common_attn_metadata.mm_req_doc_ranges = self._ranges
        return self._group.build_metadata(common_attn_metadata, *args, **kwargs)


class D3PrefixBidirModelState(MambaHybridModelState):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: req_id -> (state block size s, prompt length n)
        self.state_blocks: dict[str, tuple[int, int]] = {}

    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        params = new_req_data.pooling_params
        extra = None if params is None else params.extra_kwargs
        prompt_len = new_req_data.prompt_len
        if new_req_data.req_id.startswith(WARMUP_REQUEST_PREFIX) and not extra:
            # vLLM's own kernel warm-up: split its dummy prompt in two so the
            # ranged attention kernels are compiled before the first request.
            state_tokens = max(1, prompt_len // 2)
        else:
            # The front end (vllm_d3.patches) already refused a request without
            # a valid size, so a failure here means a caller bypassed it.
            state_tokens = state_tokens_of(extra, prompt_len)
        super().add_request(req_index, new_req_data)
        self.state_blocks[new_req_data.req_id] = (state_tokens, prompt_len)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.state_blocks.pop(req_id, None)

    def prefix_ranges(self, req_ids: list[str]) -> PrefixRanges:
        ranges: PrefixRanges = {}
        for row, req_id in enumerate(req_ids):
            block = self.state_blocks.get(req_id)
            if block is None:
                # Only the runner's dummy rows (profiling, warm-up, graph capture)
                # were never added: every real request passed add_request.
                continue
            state_tokens, prompt_len = block
            ranges[row] = [(0, state_tokens - 1), (state_tokens, prompt_len - 1)]
        return ranges

    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        attn_groups: list[list[AttentionGroup]],
        kv_cache_config: KVCacheConfig,
        for_capture: bool = False,
        ubatch_idx: int = 0,
        model_specific_attn_metadata: ModelSpecificAttnMetadata | None = None,
    ) -> dict[str, Any]:
        ranges = self.prefix_ranges(input_batch.req_ids)
        if ranges and not for_capture:
            attn_groups = [
                [
                    group
                    if isinstance(group.kv_cache_spec, MambaSpec)
                    else _RangedAttentionGroup(group, ranges)  # type: ignore[misc]
                    for group in groups
                ]
                for groups in attn_groups
            ]
        return super().prepare_attn(
            input_batch,
            cudagraph_mode,
            block_tables,
            slot_mappings,
            attn_groups,
            kv_cache_config,
            for_capture=for_capture,
            ubatch_idx=ubatch_idx,
            model_specific_attn_metadata=model_specific_attn_metadata,
        )
