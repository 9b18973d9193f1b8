# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 entry of ``MODELS_CONFIG_MAP``
(upstream: ``model_executor/models/config.py``).

``D3ForSequenceClassificationConfig`` extends 0.33.0's class of the same name:

- ``causal`` and ``noncausal_full_attention`` go through 0.33.0's contract unchanged.
- ``prefix_bidir`` goes through the same contract as a causal checkpoint (the text
  layers stay decoder attention with a KV cache, reading per-request PrefixLM
  ranges), then the *model* is marked non-causal so that chunked prefill and
  prefix caching default to off, as for the other non-causal D3 modes.
- ``validated_length`` becomes ``max_model_len`` when the user gave none.
- The d3-ultra fields are validated at start-up (``d3_contract``).
- At the ``VllmConfig`` level a prefix_bidir checkpoint refuses Model Runner V1
  (it cannot pass the ranges) and prefix caching or chunked prefill (a state block
  must be computed whole, with its own mask).
- Its full-attention layers get the dense-piece backend (``D3_PREFIX_BIDIR``,
  registered as vLLM's ``CUSTOM``) through ``attention_config.backend_per_kind``
  when the platform runs it and the user chose no attention backend; otherwise
  vLLM's own selection (ranged Triton) stays. The log says which, and why.
- Where the dense-piece backend serves, /v1/systemone reads each request's state
  once unless ``--additional-config '{"d3_state_once": false}'``; the hook
  writes the decision back into ``additional_config`` so that every process
  (front end, engine, workers) agrees, and logs it.
- The Gated DeltaNet prefill kernel is Triton/FLA (the validated one) unless
  ``--gdn-prefill-backend`` chose another.
"""

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.model_executor.models import config as upstream
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from vllm_d3 import installed_hooks, owns_custom_backend

from .d3_contract import (
    STATE_ONCE_KEY,
    apply_validated_length,
    attention_mode_of,
    check_decision_fields,
    check_prefix_bidir_serving,
    decision_config_of,
    is_prefix_bidir,
    state_once_of,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")
#: Where ``--gdn-prefill-backend`` lands (``vllm_config.additional_config``).
GDN_PREFILL_BACKEND_KEY = "gdn_prefill_backend"
#: The Gated DeltaNet prefill kernel every GPU validation of the plugin ran on
#: (Triton/FLA); vLLM's "auto" would pick FlashInfer on Hopper.
VALIDATED_GDN_PREFILL_BACKEND = "triton"


def _select_full_attention(vllm_config: "VllmConfig") -> bool:
    """Put the full-attention layers on the dense-piece backend where it runs;
    whether it does."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
        BACKEND_NAME,
        dense_attention_unavailable,
    )

    attention = vllm_config.attention_config
    kind = KVCacheSpecKind.FULL_ATTENTION.value
    chosen = attention.backend_per_kind.get(kind, attention.backend)
    reason: str | None
    if chosen is not None:
        reason = f"{chosen.name} was chosen"
    elif not owns_custom_backend():
        reason = "the CUSTOM attention backend belongs to another plugin"
    elif attention.flash_attn_version not in (None, 3):
        reason = f"FlashAttention {attention.flash_attn_version} was chosen"
    else:
        reason = dense_attention_unavailable()
    if reason is None:
        attention.backend_per_kind[kind] = AttentionBackendEnum.CUSTOM
        logger.info(
            "D3 prefix_bidir: full-attention layers on %s (FlashAttention 3 over "
            "dense state and question pieces; ranged Triton for a batch that does "
            "not split into them). --attention-backend TRITON_FLASH_ATTN selects "
            "vLLM's ranged attention instead.",
            BACKEND_NAME,
        )
        return True
    logger.info(
        "D3 prefix_bidir: full-attention layers on vLLM's own selection "
        "(ranged attention), not %s: %s",
        BACKEND_NAME,
        reason,
    )
    return False


def _select_reads(vllm_config: "VllmConfig", dense_attention: bool) -> None:
    """Decide, once for every process, whether /v1/systemone reads a request's
    state once (packed questions), and keep the Gated DeltaNet prefill on the
    kernel the packed path was validated on."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError(
            "D3 prefix_bidir needs --additional-config to be a JSON object, not "
            f"{type(extra).__name__}"
        )
    if not state_once_of(extra):
        why_not: str | None = f"{STATE_ONCE_KEY} is false"
    elif not dense_attention:
        why_not = "reading the state once needs the dense-piece attention"
    elif is_quantized_kv_cache(vllm_config.cache_config.cache_dtype):
        # Packed rows merge two FlashAttention passes over bf16/fp16 keys.
        why_not = "reading the state once needs a bf16/fp16 KV cache"
    elif vllm_config.parallel_config.decode_context_parallel_size > 1:
        why_not = "reading the state once does not run with context parallelism"
    else:
        why_not = None
    extra[STATE_ONCE_KEY] = why_not is None
    if why_not is None:
        logger.info(
            "D3 prefix_bidir: /v1/systemone reads each request's state once (the "
            "questions packed into one engine request). --additional-config "
            "'{\"%s\": false}' sends one engine request per question instead.",
            STATE_ONCE_KEY,
        )
    else:
        logger.info(
            "D3 prefix_bidir: /v1/systemone sends one engine request per question (%s)",
            why_not,
        )
    chosen = extra.get(GDN_PREFILL_BACKEND_KEY)
    if chosen is None:
        extra[GDN_PREFILL_BACKEND_KEY] = VALIDATED_GDN_PREFILL_BACKEND
        logger.info(
            "D3 prefix_bidir: Gated DeltaNet prefill on %s, the kernel its "
            "state-once path was validated on (--gdn-prefill-backend chooses "
            "another)",
            VALIDATED_GDN_PREFILL_BACKEND,
        )
    elif chosen != VALIDATED_GDN_PREFILL_BACKEND and extra[STATE_ONCE_KEY]:
        logger.warning(
            "D3 prefix_bidir: --gdn-prefill-backend %s was chosen; the state-once "
            "path restarts each question from the state on it unvalidated (it was "
            "validated on %s)",
            chosen,
            VALIDATED_GDN_PREFILL_BACKEND,
        )


class D3ForSequenceClassificationConfig(upstream.D3ForSequenceClassificationConfig):
    @staticmethod
    def verify_and_update_model_config(model_config: "ModelConfig") -> None:
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
            # themselves both ways. This keeps chunked prefill and prefix caching
            # off by default; the text layers keep is_causal=True.
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
        upstream.D3ForSequenceClassificationConfig.verify_and_update_config(vllm_config)
        if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
            return
        check_prefix_bidir_serving(vllm_config)
        _select_reads(vllm_config, _select_full_attention(vllm_config))
