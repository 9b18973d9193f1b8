# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a D3 model serving a prefix_bidir checkpoint adds to itself
(upstream: ``model_executor/models/d3_prefix_bidir.py``, a new file).

``serve_prefix_bidir(model)``, which ``D3ForSequenceClassification.__init__``
calls for a ``prefix_bidir`` checkpoint, gives the instance
``get_model_state_cls`` (the Model Runner V2 hook, returning
``D3PrefixBidirModelState``) and a classify pooler (``PackedReadoutPooler``)
that reads a packed request (``state || q1 || ... || qQ``) out at the last
token of every question block, ``Q * num_codes`` logits flat; every other
request gets 0.33.0's readout at its last token. Its Gated DeltaNet layers
restart each question from the state on their own
(``layers/mamba/gdn/packed_questions.py``); in align mode on the Triton or
FlashInfer prefill, ``serve_prefix_bidir`` has each declare the prefill
checkpoints the two phases write (``write_prefill_checkpoints``).
"""

from collections.abc import Set
from dataclasses import replace

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.pooler.abstract import Pooler
from vllm.model_executor.layers.pooler.seqwise.poolers import SequencePooler
from vllm.model_executor.layers.pooler.special import DispatchPooler
from vllm.pooling_params import PoolingParams
from vllm.tasks import PoolingTask
from vllm.v1.pool.metadata import PoolingMetadata

from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
    write_prefill_checkpoints,
)
from vllm_d3.model_executor.models.d3_contract import QUESTION_ENDS_KEY


def _prefix_bidir_model_state_cls() -> type:
    # Imported on use: the registry inspects this module in a subprocess that
    # must not pull in the GPU worker.
    from vllm_d3.v1.worker.gpu.model_states.d3_prefix_bidir import (
        D3PrefixBidirModelState,
    )

    return D3PrefixBidirModelState


def _readout_offsets(params: PoolingParams, prompt_len: int) -> list[int]:
    """The prompt offsets a request is read out at: its last token, or the last
    token of each question block of a packed request (validated at the front
    end)."""
    ends = (params.extra_kwargs or {}).get(QUESTION_ENDS_KEY, [prompt_len])
    return [end - 1 for end in ends]


class PackedReadoutPooler(Pooler):
    """The classify pooler, read out once per question of a packed request."""

    def __init__(self, classify: SequencePooler) -> None:
        super().__init__()
        self.classify = classify

    def get_supported_tasks(self) -> Set[PoolingTask]:
        return self.classify.get_supported_tasks()

    def get_pooling_updates(self, task: PoolingTask):  # type: ignore[no-untyped-def]
        return self.classify.get_pooling_updates(task)

    def forward(
        self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata
    ) -> list[torch.Tensor]:
        params = pooling_metadata.pooling_params
        if not any(QUESTION_ENDS_KEY in (p.extra_kwargs or {}) for p in params):
            return self.classify(hidden_states, pooling_metadata)
        cursor = pooling_metadata.get_pooling_cursor()
        scheduled = cursor.num_scheduled_tokens_cpu.tolist()
        # Prompt offset -> batch row: where the request's tokens start in the
        # batch, less the offset of its first token in this step.
        batch_start = 0
        rows: list[int] = []
        counts: list[int] = []
        for p, prompt_len, seq_len, num_scheduled in zip(
            params,
            cursor.prompt_lens_cpu.tolist(),
            cursor.seq_lens_cpu.tolist(),
            scheduled,
            strict=True,
        ):
            offsets = _readout_offsets(p, prompt_len)
            first = seq_len - num_scheduled
            rows.extend(batch_start + offset - first for offset in offsets)
            counts.append(len(offsets))
            batch_start += num_scheduled
        readouts = hidden_states[torch.tensor(rows, device=hidden_states.device)]
        # One pooling params per readout row, for the head's per-row activation.
        per_row = replace(
            pooling_metadata,
            pooling_params=[
                p for p, n in zip(params, counts, strict=True) for _ in range(n)
            ],
        )
        logits = self.classify.head(readouts, per_row)
        if isinstance(logits, list):
            logits = torch.stack(logits)
        return [chunk.reshape(-1) for chunk in logits.split(counts)]


def serve_prefix_bidir(model: torch.nn.Module) -> None:
    """Give ``model`` (a D3 model of a prefix_bidir checkpoint) its model
    state and its per-question readout, and its Gated DeltaNet layers the
    prefill checkpoints of align mode (``write_prefill_checkpoints``)."""
    # An instance attribute: only prefix_bidir instances have the hook, so
    # vLLM resolves the other modes' model state as before.
    model.get_model_state_cls = _prefix_bidir_model_state_cls  # type: ignore[assignment]
    # as_seq_cls_model's DispatchPooler: one pooler per task, in a dict.
    dispatch = getattr(model, "pooler")  # noqa: B009  (typed by the mixin)
    assert isinstance(dispatch, DispatchPooler)
    classify = dispatch.poolers_by_task["classify"]
    assert isinstance(classify, SequencePooler)
    model.pooler = DispatchPooler(
        {**dispatch.poolers_by_task, "classify": PackedReadoutPooler(classify)}
    )
    for module in model.modules():
        if isinstance(module, QwenGatedDeltaNetAttention):
            write_prefill_checkpoints(module)
