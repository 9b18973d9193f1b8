# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a D3 prefix_bidir checkpoint is served with, decided once by the config
hook (upstream: ``model_executor/models/d3_serving.py``, a new file).

``select_prefix_bidir_serving(vllm_config)`` writes each decision into the
config (``additional_config["d3_decided"]``, beside the user's switches), so
that every process agrees, and logs it with its reason: the full-attention
layers on the dense-piece backend and its kernel (``d3_attention_kernel``);
whether /v1/systemone reads each state once (``d3_state_once``); the Gated
DeltaNet prefill kernel, vLLM's own choice where it runs the checkpoint
(``gdn_prefill_backend``); FlashInfer's autotune off unless asked for, where
the model has nothing it tunes; expandable segments for the engine's CUDA
caching allocator unless the user's settings name them or a KV connector is
on. Other checkpoints are left as they are.
"""

import os
from typing import TYPE_CHECKING, Any

from vllm.device_allocator.alloc_conf import (
    ALLOC_CONF_ENV_VARS,
    EXPANDABLE_SEGMENTS,
    alloc_conf_from_env,
    with_conf_flag,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from vllm_d3.model_executor.models.d3_contract import (
    ATTENTION_KERNEL_KEY,
    AUTO_KERNEL,
    RANGED_KERNEL,
    STATE_ONCE_KEY,
    attention_kernel_of,
    decision_config_of,
    decisions_to_write,
    is_prefix_bidir,
    state_once_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")
#: Where ``--gdn-prefill-backend`` lands (``vllm_config.additional_config``).
GDN_PREFILL_BACKEND_KEY = "gdn_prefill_backend"
#: The only GDN head dim FlashInfer's Gated DeltaNet prefill takes.
FLASHINFER_HEAD_DIM = 128


def select_prefix_bidir_serving(
    vllm_config: "VllmConfig", unavailable: str | None = None
) -> None:
    """Decide the attention backend and kernel, the state-once reads and the GDN
    prefill kernel of a prefix_bidir checkpoint (``unavailable``: why the
    dense-piece backend cannot be used, where the caller knows)."""
    if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
        return
    dense_attention = _select_full_attention(vllm_config, unavailable)
    _select_reads(vllm_config, dense_attention)
    _select_gdn_prefill(vllm_config)
    _select_autotune(vllm_config)
    _select_allocator(vllm_config)


def _additional_config(vllm_config: "VllmConfig") -> dict[str, Any]:
    """``--additional-config``: the user's switches, and where the decisions
    are written."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise ValueError(
            "D3 prefix_bidir needs --additional-config to be a JSON object, not "
            f"{type(extra).__name__}"
        )
    return extra


def _decisions(vllm_config: "VllmConfig") -> dict[str, Any]:
    """The config hook's decisions (``DECIDED_KEY``), apart from the switches."""
    return decisions_to_write(_additional_config(vllm_config))


def _select_full_attention(vllm_config: "VllmConfig", unavailable: str | None) -> bool:
    """Put the full-attention layers on the dense-piece backend where a kernel
    runs them, writing the kernel into ``additional_config``; whether it does."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    from vllm_d3.v1.attention.backends import d3_dense_kernels, d3_prefix_bidir

    attention = vllm_config.attention_config
    extra = _additional_config(vllm_config)
    forced = attention_kernel_of(extra, d3_dense_kernels.KERNEL_NAMES)
    # Who chose the kernel, in the log and in an error.
    chooser = f"--additional-config {ATTENTION_KERNEL_KEY}"
    kind = KVCacheSpecKind.FULL_ATTENTION.value
    chosen = attention.backend_per_kind.get(kind, attention.backend)
    kernel: str | None = None
    if chosen is not None:
        reason: str | None = f"{chosen.name} was chosen"
    else:
        reason = unavailable or _dense_pieces_refused(vllm_config, forced)
    if reason is None:
        if forced == AUTO_KERNEL and attention.flash_attn_version is not None:
            forced = f"fa{attention.flash_attn_version}"
            chooser = "--attention-config flash_attn_version"
        kernel, reason = _choose_kernel(forced, chooser)
    if kernel is None and forced not in (AUTO_KERNEL, RANGED_KERNEL):
        raise ValueError(
            f"{chooser} {forced!r} cannot serve the D3 prefix_bidir attention: {reason}"
        )
    _decisions(vllm_config)[ATTENTION_KERNEL_KEY] = kernel or RANGED_KERNEL
    if kernel is None:
        logger.info(
            "D3 prefix_bidir: full-attention layers on vLLM's own selection "
            "(ranged attention), not %s: %s",
            d3_prefix_bidir.BACKEND_NAME,
            reason,
        )
        return False
    attention.backend_per_kind[kind] = AttentionBackendEnum[
        d3_prefix_bidir.REGISTRY_MEMBER
    ]
    logger.info(
        "D3 prefix_bidir: full-attention layers on %s, dense state and question "
        "pieces on %s (%s; ranged Triton for a batch that does not split into "
        'them). --additional-config \'{"%s": "..."}\' forces one of %s.',
        d3_prefix_bidir.BACKEND_NAME,
        kernel,
        reason,
        ATTENTION_KERNEL_KEY,
        ", ".join((*d3_dense_kernels.KERNEL_NAMES, RANGED_KERNEL)),
    )
    return True


def _dense_pieces_refused(vllm_config: "VllmConfig", forced: str) -> str | None:
    """Why the settings keep the dense pieces off (``forced``: the kernel
    switch), or ``None``."""
    flash_attn_version = vllm_config.attention_config.flash_attn_version
    if forced == RANGED_KERNEL:
        return f"{ATTENTION_KERNEL_KEY} is {RANGED_KERNEL}"
    if flash_attn_version not in (None, 2, 3):
        # FlashAttention 4 applies vLLM's ranges itself.
        return f"FlashAttention {flash_attn_version} was chosen"
    if is_quantized_kv_cache(vllm_config.cache_config.cache_dtype):
        return "the dense pieces read a bf16/fp16 KV cache"
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        return "the dense pieces do not run with context parallelism"
    return None


def _choose_kernel(forced: str, chooser: str) -> tuple[str | None, str]:
    """The dense-piece kernel for this GPU (``forced``, or the platform's first
    one present, checked at start-up where it was not validated), with why."""
    from vllm_d3.v1.attention.backends import d3_dense_kernels as kernels
    from vllm_d3.v1.attention.backends import d3_kernel_check

    family, present, none_present = kernels.platform_kernels()
    if family is None or (forced == AUTO_KERNEL and not present):
        return None, none_present or ""
    if forced == AUTO_KERNEL:
        candidates, how = present, f"the default on {family}"
    else:
        why_not = kernels.kernel_unavailable(forced)
        if why_not is not None:
            return None, f"{why_not} (present on this {family} GPU: {present})"
        candidates, how = [forced], f"{chooser} chose it"
    if family == kernels.VALIDATED_FAMILY:
        return candidates[0], f"{how}, validated on {family}"
    passed, failures = d3_kernel_check.check_kernels(candidates)
    for failure in failures:
        logger.warning("D3 prefix_bidir: dense-piece kernel check failed: %s", failure)
    if passed is None:
        return None, (
            f"no dense-piece kernel of {candidates} passed its start-up check on "
            f"this {family} GPU"
        )
    return passed, f"{how}, passed its start-up check on this {family} GPU"


def _select_reads(vllm_config: "VllmConfig", dense_attention: bool) -> None:
    """Decide, once for every process, whether /v1/systemone reads a request's
    state once (packed questions)."""
    extra = _additional_config(vllm_config)
    if not state_once_of(extra):
        why_not: str | None = f"{STATE_ONCE_KEY} is false"
    elif not dense_attention:
        why_not = "reading the state once needs the dense-piece attention"
    else:
        why_not = None
    state_once = _decisions(vllm_config)[STATE_ONCE_KEY] = why_not is None
    if state_once:
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


def _select_gdn_prefill(vllm_config: "VllmConfig") -> None:
    """Write the Gated DeltaNet prefill kernel every process runs: the user's
    ``--gdn-prefill-backend``, else vLLM's own choice for this GPU, except
    that FlashInfer's, which takes GDN heads of ``FLASHINFER_HEAD_DIM`` only,
    gives way to Triton for other heads (vLLM picks it on Hopper for any)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        _resolve_gdn_prefill_backend,
    )

    from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
        FLASHINFER_GDN_PREFILL,
        TRITON_GDN_PREFILL,
    )

    extra = _additional_config(vllm_config)
    requested, resolved = _resolve_gdn_prefill_backend(vllm_config)
    kernel: str = resolved
    text_config = vllm_config.model_config.hf_text_config
    head_dims = [
        getattr(text_config, "linear_key_head_dim", None),
        getattr(text_config, "linear_value_head_dim", None),
    ]
    if kernel == FLASHINFER_GDN_PREFILL and head_dims != [FLASHINFER_HEAD_DIM] * 2:
        if requested != "auto":
            raise ValueError(
                f"--gdn-prefill-backend {requested} cannot serve this checkpoint: "
                f"FlashInfer's Gated DeltaNet prefill takes head dim "
                f"{FLASHINFER_HEAD_DIM}, this checkpoint's are {head_dims} "
                f"(linear_key_head_dim, linear_value_head_dim)"
            )
        kernel = TRITON_GDN_PREFILL
        why = (
            f"vLLM's choice on this GPU, FlashInfer, takes head dim "
            f"{FLASHINFER_HEAD_DIM} only, and this checkpoint's are "
            f"{head_dims}"
        )
    elif requested != "auto":
        why = f"--gdn-prefill-backend {requested} was chosen"
        if kernel != requested:
            why += f", which vLLM runs as {kernel} on this GPU"
    else:
        why = "vLLM's choice on this GPU"
    extra[GDN_PREFILL_BACKEND_KEY] = kernel
    logger.info(
        "D3 prefix_bidir: Gated DeltaNet prefill on %s (%s; --gdn-prefill-backend "
        "chooses another)",
        kernel,
        why,
    )


def _select_autotune(vllm_config: "VllmConfig") -> None:
    """Skip FlashInfer's autotune where nothing in the model is FlashInfer's to
    tune, unless the user's settings turn it on or off.

    Its warm-up is a dummy step of ``max_num_batched_tokens`` tokens, here
    ``max_model_len`` or more (no chunked prefill), for kernels an unquantized
    D3 model does not run: its matrix multiplies are PyTorch's, its attention
    the D3 backends' or vLLM's, its Gated DeltaNet prefill Triton/FLA or
    FlashInfer's, which does not use FlashInfer's autotuner.
    """
    kernel_config = vllm_config.kernel_config
    if kernel_config.enable_flashinfer_autotune is not None:
        return
    if vllm_config.model_config.quantization is not None:
        return
    kernel_config.enable_flashinfer_autotune = False
    logger.info(
        "D3 prefix_bidir: FlashInfer autotune off: no kernel of this unquantized "
        "model is FlashInfer's, and its warm-up step would hold %d tokens "
        "(--enable-flashinfer-autotune runs it)",
        vllm_config.scheduler_config.max_num_batched_tokens,
    )


def _select_allocator(vllm_config: "VllmConfig") -> None:
    """Turn on the caching allocator's expandable segments for the engine
    processes, unless the user's settings name them or a KV connector is on.

    Prompts are read whole (never chunked, whatever vLLM's chunked-prefill flag
    says), so a step holds up to ``max_num_batched_tokens`` (``max_model_len``
    or more) tokens, and consecutive steps differ widely in size: a step's
    activations (4.25 GiB for one MLP buffer of a full 131,072-token step at
    d3-turbo's shape) may not fit the fixed segments the steps before left: a
    64-client text mix once stopped the engine with 12-13 GiB reserved but
    unallocated.
    """
    conf = alloc_conf_from_env()
    if any(f.partition(":")[0].strip() == EXPANDABLE_SEGMENTS for f in conf.split(",")):
        logger.info("D3 prefix_bidir: CUDA caching allocator as configured (%s)", conf)
        return
    if vllm_config.kv_transfer_config is not None:
        logger.info(
            "D3 prefix_bidir: CUDA caching allocator without expandable segments: a "
            "KV connector is configured"
        )
        return
    # Where the user's settings are, else the variable vLLM's own checks read.
    name = next(
        (n for n in ALLOC_CONF_ENV_VARS if os.environ.get(n)), "PYTORCH_CUDA_ALLOC_CONF"
    )
    os.environ[name] = with_conf_flag(conf, EXPANDABLE_SEGMENTS, True)
    logger.info(
        "D3 prefix_bidir: %s=%s for the engine: prompts are read whole, so its "
        "steps hold up to %d tokens and vary in size, which fragments the caching "
        "allocator (%s=%s:False keeps its segments fixed)",
        name,
        os.environ[name],
        vllm_config.scheduler_config.max_num_batched_tokens,
        name,
        EXPANDABLE_SEGMENTS,
    )
