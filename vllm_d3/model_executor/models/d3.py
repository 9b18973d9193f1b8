# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 model for prefix_bidir checkpoints, on vLLM 0.33.0
(upstream: ``model_executor/models/d3.py``, an edit: the series' model-state
commit, ``vllm_d3.export.series``).

Registered over the in-tree ``D3ForSequenceClassification`` name, so every lookup
(config map, read strategy, processor) keeps working. For a ``prefix_bidir``
checkpoint the instance gets what in-tree ``__init__`` gives it
(``serve_prefix_bidir``, ``d3_prefix_bidir.py``: the model state and the
per-question readout), and every Gated DeltaNet layer the two-phase core that
restarts each question of a packed request from the state, which in-tree is the
layer's own (``restart_questions_from_state``).

For ``causal`` and ``noncausal_full_attention`` it changes nothing, so vLLM resolves
the model state and pooler exactly as in 0.33.0.
"""

from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.models import d3 as upstream

from vllm_d3.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    restart_questions_from_state,
)

from .d3_contract import decision_config_of, is_prefix_bidir
from .d3_prefix_bidir import serve_prefix_bidir


class D3ForSequenceClassification(upstream.D3ForSequenceClassification):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
            return
        serve_prefix_bidir(self)
        for module in self.modules():
            if isinstance(module, QwenGatedDeltaNetAttention):
                restart_questions_from_state(module)
