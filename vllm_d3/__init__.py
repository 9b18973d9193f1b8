"""vllm-d3: serve Decision 3.0 ``prefix_bidir`` checkpoints with vLLM 0.33.0.

``register``, the ``vllm.general_plugins`` entry point, runs in every process
vLLM starts and is idempotent. Through vLLM's registries it installs the D3
model, its config contract, the checkpoint detection (``is_mm_prefix_lm`` for
prefix_bidir), the dense-piece attention backend as ``CUSTOM`` (unless another
plugin owns it) and the patches of ``vllm_d3.patches`` (the read strategy
among them), and logs what it installed (``registration`` keeps the
record). A vLLM other than ``SUPPORTED_VLLM``.x is refused before anything is
installed: the hooks reach into that release's internals (docs/upstream.md).
"""

from .registration import DENSE_ATTENTION_BACKEND, installed, owns_custom_backend

ARCHITECTURE = "D3ForSequenceClassification"
#: The vLLM release line the plugin is written against (pyproject pins 0.33.0).
SUPPORTED_VLLM = "0.33"


def check_vllm_version(version: str) -> None:
    if not version.startswith(f"{SUPPORTED_VLLM}."):
        raise RuntimeError(
            f"vllm-d3 supports vLLM {SUPPORTED_VLLM}.x only (it patches that "
            f"release's internals); this is vLLM {version}. Install "
            f"vllm=={SUPPORTED_VLLM}.0, or uninstall vllm-d3."
        )


def register() -> None:
    if installed:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm import ModelRegistry
    from vllm.logger import init_logger
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
    )
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from . import patches
    from .model_executor.models.config import D3ForSequenceClassificationConfig
    from .transformers_utils.model_arch_config_convertor import (
        D3Qwen3_5ModelArchConfigConvertor,
    )

    ModelRegistry.register_model(
        ARCHITECTURE, "vllm_d3.model_executor.models.d3:D3ForSequenceClassification"
    )
    MODELS_CONFIG_MAP[ARCHITECTURE] = D3ForSequenceClassificationConfig
    MODEL_ARCH_CONFIG_CONVERTORS["qwen3_5"] = D3Qwen3_5ModelArchConfigConvertor
    installed.extend(
        [
            f"ModelRegistry[{ARCHITECTURE}]",
            f"MODELS_CONFIG_MAP[{ARCHITECTURE}]",
            "MODEL_ARCH_CONFIG_CONVERTORS[qwen3_5]",
            *(f"patch {name}" for name in patches.apply()),
        ]
    )
    # Under the "vllm" logger, so that it shares vLLM's handlers and level.
    logger = init_logger(f"vllm.{__name__}")
    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden() or owns_custom_backend():
        register_backend(custom, DENSE_ATTENTION_BACKEND)
        installed.append("AttentionBackendEnum.CUSTOM")
    else:
        logger.warning(
            "vllm-d3: the CUSTOM attention backend is already %s; prefix_bidir "
            "checkpoints keep vLLM's ranged attention",
            custom.get_path(),
        )
    logger.info("vllm-d3 installed its D3 hooks: %s", ", ".join(installed))
