# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hybrid model state with the ``get_mm_prefix_ranges`` hook, on vLLM 0.33.0
(upstream: ``v1/worker/gpu/model_states/mamba_hybrid.py`` and ``default.py``,
an edit: the series' ``get_mm_prefix_ranges`` commit, ``vllm_d3.export.series``).

In-tree, ``DefaultModelState.get_mm_prefix_ranges(input_batch)`` returns the
step's PrefixLM ranges per batch row (or ``None``) and both states'
``prepare_attn`` pass them to ``build_attn_metadata``. Here, without editing
vLLM, ``MambaHybridModelState`` is 0.33.0's plus the hook (``None``: 0.33.0's
hybrid state passes no ranges; a subclass overrides it) and a ``prepare_attn``
that hands the ranges to each attention group's builder
(``_RangedAttentionGroup``, since 0.33.0's has no parameter for them). A module
of the series that imports ``MambaHybridModelState`` from here imports 0.33.0's
own class in-tree.
"""

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_states import mamba_hybrid
from vllm.v1.worker.utils import AttentionGroup

from vllm_d3.model_executor.models.d3_contract import PrefixRanges


class _RangedAttentionGroup:
    """An attention group whose metadata carries this step's PrefixLM ranges:
    ``CommonAttentionMetadata.mm_req_doc_ranges``, set before its builder runs.
    Mamba groups are not wrapped: their builders never read ranges."""

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


class MambaHybridModelState(mamba_hybrid.MambaHybridModelState):
    def get_mm_prefix_ranges(self, input_batch: InputBatch) -> PrefixRanges | None:
        return None

    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        attn_groups: list[list[AttentionGroup]],
        *args: Any,
        **kwargs: Any,
    ) -> dict[str, Any]:
        ranges = self.get_mm_prefix_ranges(input_batch)
        if ranges is not None:
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
            *args,
            **kwargs,
        )
