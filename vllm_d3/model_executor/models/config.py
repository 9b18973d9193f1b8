# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 entry of ``MODELS_CONFIG_MAP``
(upstream: ``model_executor/models/config.py``).

``D3ForSequenceClassificationConfig`` extends 0.33.0's class of the same name:
``causal`` and ``noncausal_full_attention`` go through 0.33.0's contract
unchanged; ``prefix_bidir`` goes through it as a causal checkpoint, then the
model is marked non-causal, ``validated_length`` becomes ``max_model_len``
where the user gave none, and the d3-ultra fields are checked
(``d3_contract``). At the ``VllmConfig`` level a prefix_bidir checkpoint
refuses what it cannot be served with, then ``d3_serving`` picks its
attention, reads and GDN prefill kernel, and ``d3_state_cache`` serves prefix
caching (on by default) as its state cache, with the plugin's scheduler.
"""

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.model_executor.models import config as upstream

from vllm_d3.registration import installed_hooks, owns_custom_backend
from vllm_d3.v1.core.d3_state_cache import select_state_cache

from .d3_contract import (
    apply_validated_length,
    attention_mode_of,
    check_decision_fields,
    check_prefix_bidir_serving,
    decision_config_of,
    is_prefix_bidir,
)
from .d3_serving import select_prefix_bidir_serving

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")


class D3ForSequenceClassificationConfig(upstream.D3ForSequenceClassificationConfig):
    @staticmethod
    def verify_and_update_model_config(model_config: "ModelConfig") -> None:
        """0.33.0's contract; for prefix_bidir read as causal (the text layers
        stay decoder attention, reading per-request PrefixLM ranges), the model
        then marked non-causal so that vLLM defaults chunked prefill and prefix
        caching to off (``state_cache_by_default`` turns prefix caching back
        on). Then the new fields are checked and ``validated_length`` applied."""
        decision = decision_config_of(model_config.hf_config)
        if not is_prefix_bidir(decision):
            # 0.33.0's contract, which refuses a package without decision_config.
            upstream.D3ForSequenceClassificationConfig.verify_and_update_model_config(
                model_config
            )
        else:
            # 0.33.0's contract, read as causal: format, pooling, codes, labels,
            # raw logits, and decoder attention in the text layers.
            hf_config = model_config.hf_config
            hf_config.decision_config = {**decision, "attention_mode": "causal"}
            try:
                upstream.D3ForSequenceClassificationConfig.verify_and_update_model_config(
                    model_config
                )
            finally:
                hf_config.decision_config = decision
            # The model as a whole is not causal: the state and the question read
            # themselves both ways. vLLM then defaults chunked prefill and prefix
            # caching to off (the state cache turns the latter back on); the
            # text layers keep is_causal=True.
            hf_config.is_causal = False
            if not model_config.is_mm_prefix_lm:
                raise ValueError(
                    "D3 prefix_bidir needs is_mm_prefix_lm; the vllm-d3 checkpoint "
                    "detection did not run (is the plugin loaded in this process?)"
                )
        assert decision is not None
        check_decision_fields(decision)
        # The plugin's own line may precede the process's logging set-up.
        logger.info(
            "D3 %s checkpoint; vllm-d3 hooks: %s",
            attention_mode_of(decision),
            ", ".join(installed_hooks()),
        )
        apply_validated_length(model_config, decision)

    @staticmethod
    def verify_and_update_config(vllm_config: "VllmConfig") -> None:
        """For prefix_bidir: refuse what it cannot be served with
        (``check_prefix_bidir_serving``), decide its serving
        (``select_prefix_bidir_serving``) and its state cache
        (``select_state_cache``, and the scheduler where it is on)."""
        upstream.D3ForSequenceClassificationConfig.verify_and_update_config(vllm_config)
        if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
            return
        check_prefix_bidir_serving(vllm_config)
        select_prefix_bidir_serving(
            vllm_config,
            unavailable=None
            if owns_custom_backend()
            else "the CUSTOM attention backend belongs to another plugin",
        )
        select_state_cache(vllm_config)
        if vllm_config.cache_config.enable_prefix_caching:
            _select_scheduler(vllm_config)


def _select_scheduler(vllm_config: "VllmConfig") -> None:
    """The state cache's scheduler (in-tree, vLLM's own have its edit): the D3
    one of the async kind asked for, or the user's if it subclasses it."""
    # vLLM's scheduler module, imported where the state cache is served only.
    from vllm_d3.v1.core.sched.scheduler import D3AsyncScheduler, D3Scheduler

    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.scheduler_cls is None:
        # A pooling model's async scheduling stays off unless asked for.
        scheduler_config.scheduler_cls = (
            D3AsyncScheduler if scheduler_config.async_scheduling else D3Scheduler
        )
        return
    chosen = scheduler_config.get_scheduler_cls()
    if not issubclass(chosen, D3Scheduler):
        raise ValueError(
            f"--scheduler-cls {chosen.__qualname__} cannot serve the D3 prefix_bidir "
            f"state cache: its scheduler must subclass {D3Scheduler.__module__}."
            f"{D3Scheduler.__qualname__}, which reads each prompt whole and keeps "
            "its cache hit inside its state. Drop --scheduler-cls or "
            "--enable-prefix-caching."
        )
