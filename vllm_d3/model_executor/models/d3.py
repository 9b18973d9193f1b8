# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 model for prefix_bidir checkpoints
(upstream: ``model_executor/models/d3.py``).

Registered over the in-tree ``D3ForSequenceClassification`` name, so every lookup
(config map, read strategy, processor) keeps working. For a ``prefix_bidir``
checkpoint the instance:

- supplies ``get_model_state_cls`` (the Model Runner V2 hook), returning
  ``D3PrefixBidirModelState``;
- reads a packed request (``state || q1 || ... || qQ``, the state read once for
  several questions, ``d3_question_ends`` in its ``PoolingParams.extra_kwargs``)
  out once per question: its classify pooler (``PackedReadoutPooler``) applies the
  answer-code readout at the last token of every question block and returns the
  ``Q * num_codes`` logits flat, question by question; every other request gets
  0.33.0's readout at its last token;
- gives every Gated DeltaNet layer the two-phase core that restarts each question
  of a packed request from the state (``restart_questions_from_state``).

For ``causal`` and ``noncausal_full_attention`` it changes nothing, so vLLM resolves
the model state and pooler exactly as in 0.33.0.
"""

from collections.abc import Set
from dataclasses import replace

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.pooler.abstract import Pooler
from vllm.model_executor.layers.pooler.seqwise.poolers import SequencePooler
from vllm.model_executor.layers.pooler.special import DispatchPooler
from vllm.model_executor.models import d3 as upstream
from vllm.pooling_params import PoolingParams
from vllm.tasks import PoolingTask
from vllm.v1.pool.metadata import PoolingMetadata

from vllm_d3.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    restart_questions_from_state,
)

from .d3_contract import QUESTION_ENDS_KEY, decision_config_of, is_prefix_bidir


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


class D3ForSequenceClassification(upstream.D3ForSequenceClassification):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
            return
        self.get_model_state_cls = _prefix_bidir_model_state_cls
        # as_seq_cls_model's DispatchPooler: one pooler per task, in a dict.
        dispatch = getattr(self, "pooler")  # noqa: B009  (typed by the mixin)
        assert isinstance(dispatch, DispatchPooler)
        classify = dispatch.poolers_by_task["classify"]
        assert isinstance(classify, SequencePooler)
        self.pooler = DispatchPooler(
            {**dispatch.poolers_by_task, "classify": PackedReadoutPooler(classify)}
        )
        for module in self.modules():
            if isinstance(module, QwenGatedDeltaNetAttention):
                restart_questions_from_state(module)
