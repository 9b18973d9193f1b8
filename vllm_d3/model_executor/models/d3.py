# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 model for prefix_bidir checkpoints
(upstream: ``model_executor/models/d3.py``).

Registered over the in-tree ``D3ForSequenceClassification`` name, so every lookup
(config map, read strategy, processor) keeps working. For a ``prefix_bidir``
checkpoint the instance supplies ``get_model_state_cls`` (the Model Runner V2 hook),
returning ``D3PrefixBidirModelState``; for ``causal`` and
``noncausal_full_attention`` it has no such attribute, so vLLM resolves the model
state exactly as in 0.33.0.
"""

from vllm.config import VllmConfig
from vllm.model_executor.models import d3 as upstream

from .d3_contract import decision_config_of, is_prefix_bidir


def _prefix_bidir_model_state_cls() -> type:
    # Imported on use: the registry inspects this module in a subprocess that
    # must not pull in the GPU worker.
    from vllm_d3.v1.worker.gpu.model_states.d3_prefix_bidir import (
        D3PrefixBidirModelState,
    )

    return D3PrefixBidirModelState


class D3ForSequenceClassification(upstream.D3ForSequenceClassification):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
            self.get_model_state_cls = _prefix_bidir_model_state_cls
