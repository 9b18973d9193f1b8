# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""D3 checkpoint detection
(upstream: ``transformers_utils/model_arch_config_convertor.py``).

0.33.0's Qwen3.5 convertor recognises a D3 package by its ``decision_config.json``
and attaches the file to ``hf_config``. This subclass, registered for ``qwen3_5``,
also turns ``is_mm_prefix_lm`` on for a ``prefix_bidir`` checkpoint, even when the
deployment serves text only: its per-request state/question ranges must reach
attention, so only the backends that apply such ranges may be selected.
"""

from vllm.transformers_utils.model_arch_config_convertor import (
    Qwen3_5ModelArchConfigConvertor,
)

from ..model_executor.models.d3_contract import (
    decision_config_of,
    is_prefix_bidir,
)


class D3Qwen3_5ModelArchConfigConvertor(Qwen3_5ModelArchConfigConvertor):
    def is_mm_prefix_lm(self, supports_multimodal: bool = True) -> bool:
        if is_prefix_bidir(decision_config_of(self.hf_config)):
            return True
        return super().is_mm_prefix_lm(supports_multimodal)
