# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 state for D3 prefix_bidir checkpoints
(upstream: ``v1/worker/gpu/model_states/d3_prefix_bidir.py``, a new file).

``D3PrefixBidirModelState`` derives from ``MambaHybridModelState``, the state
vLLM picks for Qwen3.5, keeping its hybrid bookkeeping. It keeps each request's
``d3_state_tokens`` and ``d3_question_ends`` (``add_request``), gives a packed
request's questions the M-RoPE positions they have in their own prompt
``state || qi``, and hands the step's PrefixLM ranges to the attention
builders (``get_mm_prefix_ranges``): per row the state range, then one range
per question block (a packed row only the dense-piece backend runs). Gated
DeltaNet groups stay causal; in a step with packed rows they get the metadata
of the scans that restart every question from the state
(``d3_packed_gdn.packed_step_metadata``: one pass on a prefill kernel that has
one, two phases, or one scan per question).
"""

from dataclasses import replace
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_states.interface import ModelSpecificAttnMetadata
from vllm.v1.worker.utils import AttentionGroup

from vllm_d3.model_executor.layers.mamba.gdn.split_recurrence import ONE_PASS_RULES
from vllm_d3.model_executor.models.d3_contract import (
    PrefixRanges,
    StateBlock,
    question_ends_of,
    state_tokens_of,
)
from vllm_d3.v1.attention.backends.d3_packed_gdn import (
    GDNGroup,
    PackedRow,
    packed_step_metadata,
    phase_a_checkpoints,
    step_checkpoint_offsets,
    step_state_slots,
)
from vllm_d3.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

logger = init_logger(f"vllm.{__name__}")

#: How vLLM 0.33.0 names the dummy requests of its kernel warm-up
#: (``v1/worker/gpu/warmup.py``: ``req_ids = [f"_warmup_{i}_" ...]``).
WARMUP_REQUEST_PREFIX = "_warmup_"


def _one_pass_window(model: torch.nn.Module) -> int | None:
    """The convolution window of ``model``'s Gated DeltaNet layers if every
    one's prefill kernel has a one pass (``ONE_PASS_RULES``), else None; logs
    the packed forms."""
    layers = [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]
    kernels = sorted({m.gdn_prefill_backend for m in layers})
    if layers and all(kernel in ONE_PASS_RULES for kernel in kernels):
        logger.info(
            "D3 prefix_bidir: a packed step's Gated DeltaNet runs in one pass on "
            "the %s prefill where the step allows it, else in two phases (or one "
            "scan of each question's own prompt, for a small step)",
            "/".join(kernels),
        )
        return layers[0].conv_kernel_size - 1
    logger.info(
        "D3 prefix_bidir: a packed step's Gated DeltaNet runs in two phases (or "
        "one scan of each question's own prompt, for a small step); the %s "
        "prefill has no one pass (%s have)",
        "/".join(kernels),
        ", ".join(ONE_PASS_RULES),
    )
    return None


class D3PrefixBidirModelState(MambaHybridModelState):
    def __init__(
        self,
        vllm_config: VllmConfig,
        model: torch.nn.Module,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(vllm_config, model, *args, **kwargs)
        self.state_blocks: dict[str, StateBlock] = {}
        # Set where a packed step may run in one pass (split_recurrence).
        self.split_window = _one_pass_window(model)

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
        block = StateBlock(
            state_tokens,
            prompt_len,
            tuple(question_ends_of(extra, prompt_len, state_tokens)),
        )
        if block.packed:
            self._add_packed_request(req_index, new_req_data, block)
        else:
            super().add_request(req_index, new_req_data)
        self.state_blocks[new_req_data.req_id] = block

    def _add_packed_request(
        self, req_index: int, new_req_data: NewRequestData, block: StateBlock
    ) -> None:
        rope = self.rope_state
        token_ids = new_req_data.prefill_token_ids
        # D3's backbone (Qwen3.5) always runs M-RoPE on Model Runner V2.
        assert rope is not None and token_ids is not None
        s = block.state_tokens
        # The state's positions (and the request's M-RoPE delta) as 0.33.0
        # computes them: the media lie inside the state.
        super().add_request(
            req_index, replace(new_req_data, prefill_token_ids=token_ids[:s])
        )
        # Every question continues after the state's last position, as in its
        # own prompt: text positions advance by one on every axis.
        after_state = s + int(rope.prefill_delta.np[req_index])
        for start, end in block.question_blocks():
            positions = list(range(after_state, after_state + end - start))
            for axis in range(rope.num_dims):
                rope.prefill_positions.stage_write(
                    rope.num_dims * req_index + axis, start, positions
                )

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.state_blocks.pop(req_id, None)

    def prefix_ranges(self, req_ids: list[str]) -> PrefixRanges:
        """Per row ``[(0, s - 1), (s, e1 - 1), (e1, e2 - 1), ...]``, the
        inclusive ends the attention backends take; for one question these are
        vLLM's PrefixLM ranges. No image ranges: they lie inside the state
        block, and ranges must not overlap."""
        ranges: PrefixRanges = {}
        for row, req_id in enumerate(req_ids):
            block = self.state_blocks.get(req_id)
            # Only the runner's dummy rows (profiling, warm-up, graph capture)
            # were never added: every real request passed add_request.
            if block is not None:
                ranges[row] = block.ranges()
        return ranges

    def get_mm_prefix_ranges(self, input_batch: InputBatch) -> PrefixRanges | None:
        return self.prefix_ranges(input_batch.req_ids) or None

    def packed_rows(self, input_batch: InputBatch) -> list[PackedRow]:
        rows = []
        starts = input_batch.query_start_loc_np
        seq_lens = input_batch.seq_lens_cpu_upper_bound
        for row, req_id in enumerate(input_batch.req_ids):
            block = self.state_blocks.get(req_id)
            if block is None or not block.packed:
                continue
            # A prompt runs to its end in one step (no scheduler of prefix_bidir
            # cuts one), after what it found in the prefix cache, which lies
            # inside its state.
            computed = block.prompt_len - int(starts[row + 1] - starts[row])
            assert int(seq_lens[row]) == block.prompt_len
            assert 0 <= computed < block.state_tokens
            rows.append(PackedRow(row, int(starts[row]) - computed, block))
        return rows

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
        attn_metadata = super().prepare_attn(
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
        if not for_capture:
            self._add_gdn_phases(attn_metadata, input_batch, attn_groups)
        return attn_metadata

    def _add_gdn_phases(
        self,
        attn_metadata: dict[str, Any],
        input_batch: InputBatch,
        attn_groups: list[list[AttentionGroup]],
    ) -> None:
        """Give every Gated DeltaNet layer the step's own scans where it has
        packed rows or prefill checkpoints that phase A must write (align mode
        caches them; 0.33.0's core writes them only on FlashInfer's prefill):
        one pass, two phases, or one scan of each question's own prompt. The
        scans run on the state slots vLLM resolved for the step's rows."""
        state_groups = [
            group
            for groups in attn_groups
            for group in groups
            if isinstance(group.kv_cache_spec, MambaSpec)
        ]
        if not state_groups:
            return
        packed = self.packed_rows(input_batch)
        first = attn_metadata[state_groups[0].layer_names[0]]
        offsets = (
            step_checkpoint_offsets(first)
            if isinstance(first, GDNAttentionMetadata)
            else []
        )
        num_reqs = input_batch.num_reqs
        query_start_loc = input_batch.query_start_loc_np[: num_reqs + 1]
        checkpoints = phase_a_checkpoints(query_start_loc, packed, offsets)
        if not packed and not checkpoints:
            return
        gdn_groups: list[GDNGroup] = []
        for group in state_groups:
            builder = group.get_metadata_builder(0)
            metadata = attn_metadata[group.layer_names[0]]
            if not isinstance(builder, GDNAttentionMetadataBuilder):
                raise NotImplementedError(
                    "a packed D3 request needs Gated DeltaNet state layers, "
                    f"not {type(builder).__name__}"
                )
            gdn_groups.append((metadata, builder, step_state_slots(metadata)))
        packed_metadata = packed_step_metadata(
            gdn_groups,
            query_start_loc,
            np.asarray(input_batch.seq_lens_cpu_upper_bound[:num_reqs]),
            packed,
            checkpoints,
            self.split_window,
        )
        for group, metadata in zip(state_groups, packed_metadata, strict=True):
            for name in group.layer_names:
                attn_metadata[name] = metadata
