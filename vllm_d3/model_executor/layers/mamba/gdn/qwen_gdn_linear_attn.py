# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gated DeltaNet layers that restart packed questions from the state, on vLLM
0.33.0 (upstream: ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``, an
edit: the series' model-state commit, ``vllm_d3.export.series``).

In-tree, ``QwenGatedDeltaNetAttention._forward_core`` first hands a step with
packed rows to ``forward_packed_questions`` (``packed_questions.py``), which runs
the method once per phase. ``restart_questions_from_state(layer)`` gives one
layer of vLLM 0.33.0 the same: its ``_forward_core`` becomes an instance
attribute that does that, then runs 0.33.0's own method when the step holds no
packed rows. The custom op ``qwen_gdn_attention_core`` looks the layer up and
calls ``self._forward_core``, so the attribute is what runs.
"""

from types import MethodType
from typing import Any

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)

from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
    forward_packed_questions,
)
from vllm_d3.model_executor.layers.mamba.gdn.split_recurrence import (
    forward_split_recurrence,
)


def restart_questions_from_state(layer: QwenGatedDeltaNetAttention) -> None:
    """Give ``layer`` the two-phase ``_forward_core`` for packed steps."""
    original = layer._forward_core

    def forward_core(
        self: QwenGatedDeltaNetAttention,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ) -> Any:
        if forward_split_recurrence(
            self, original, mixed_qkv, b, a, core_attn_out
        ) or forward_packed_questions(self, original, mixed_qkv, b, a, core_attn_out):
            return None
        return original(mixed_qkv, b, a, core_attn_out)

    layer._forward_core = MethodType(forward_core, layer)  # type: ignore[method-assign]
