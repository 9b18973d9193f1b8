"""Every setting of vllm-d3 in one table (``vllm-d3 options``; docs/usage.md).

The plugin's own switches, request fields and environment variables are each
declared once, as an ``Option`` beside the code that reads it; the vLLM
defaults the plugin changes for a prefix_bidir checkpoint are declared here.
"""

import json

from vllm_d3.entrypoints.serve.middleware.systemone_body import (
    MAX_BODY_BYTES_OPTION,
)
from vllm_d3.model_executor.models.d3_contract import (
    ATTENTION_KERNEL_OPTION,
    QUESTION_ENDS_OPTION,
    STATE_CACHE_MIN_TOKENS_OPTION,
    STATE_ONCE_OPTION,
    STATE_TOKENS_OPTION,
    Option,
)

#: ``Option.where`` of a vLLM (or PyTorch) setting whose default the plugin
#: changes for prefix_bidir; its ``default`` is then written out in words.
CHANGED_DEFAULT = "changed default"

VLLM_DEFAULTS = (
    Option(
        "--max-model-len",
        CHANGED_DEFAULT,
        "the checkpoint's `validated_length`",
        "A checkpoint that declares `validated_length` (d3-turbo: 32768) serves "
        "that many tokens per question. An explicit value, `-1` or `auto` "
        "included, wins; the log says which applied.",
    ),
    Option(
        "--attention-backend",
        CHANGED_DEFAULT,
        "`D3_PREFIX_BIDIR` for the full-attention layers",
        "The plugin's dense-piece backend (registered as `CUSTOM`) serves "
        "where a kernel runs. A backend of your choosing, a quantized KV cache, "
        "context parallelism or FlashAttention 4 keep vLLM's ranged selection, "
        "one engine request per question; the log says why.",
    ),
    Option(
        "--enable-prefix-caching",
        CHANGED_DEFAULT,
        "on for prefix_bidir",
        "Served as the state cache: a request whose whole state (tokens, media, "
        "`cache_salt`) was read before computes only what follows it. Where it "
        "cannot serve (one engine request per question, a KV connector, a Gated "
        "DeltaNet prefill other than Triton/FLA or FlashInfer) the default is "
        "off and the log says why, and asking for it stops start-up. "
        "`--no-enable-prefix-caching` turns it off.",
    ),
    Option(
        "--enable-chunked-prefill",
        CHANGED_DEFAULT,
        "off for prefix_bidir",
        "A state or question block is read whole: asking for it stops "
        "start-up. With prefix caching the plugin turns it on inside the "
        "engine, as vLLM's Mamba cache requires, and its scheduler "
        "(`--scheduler-cls`) still reads each prompt whole.",
    ),
    Option(
        "--gdn-prefill-backend",
        CHANGED_DEFAULT,
        "vLLM's choice",
        "The Gated DeltaNet prefill kernel: FlashInfer on Hopper (sm90) and "
        "Blackwell (sm100/sm120) where the checkpoint's GDN head dim is 128, "
        "AITER FlyDSL on ROCm gfx942 (CDNA 3), Triton/FLA elsewhere. The flag "
        "overrides it; the log names the kernel that serves.",
    ),
    Option(
        "--enable-flashinfer-autotune",
        CHANGED_DEFAULT,
        "off for an unquantized prefix_bidir checkpoint",
        "Nothing in such a model is FlashInfer's to tune, and the pass is a "
        "dummy step of `max_model_len` tokens. The flag runs it; a quantized "
        "checkpoint keeps vLLM's default.",
    ),
    Option(
        "PYTORCH_CUDA_ALLOC_CONF",
        CHANGED_DEFAULT,
        "`expandable_segments:True` added",
        "For the engine's CUDA caching allocator, added to whichever of "
        "PyTorch's allocator variables is set: prompts are read whole, so steps "
        "vary widely in size. Settings that name `expandable_segments`, or a KV "
        "connector, keep it as it is; the log says which.",
    ),
)

OPTIONS = (
    ATTENTION_KERNEL_OPTION,
    STATE_ONCE_OPTION,
    STATE_CACHE_MIN_TOKENS_OPTION,
    STATE_TOKENS_OPTION,
    QUESTION_ENDS_OPTION,
    MAX_BODY_BYTES_OPTION,
    *VLLM_DEFAULTS,
)


def shown_default(option: Option) -> str:
    """An option's default as the table writes it."""
    if option.where == CHANGED_DEFAULT:
        return option.default
    if option.default is None:
        return "none"
    return f"`{json.dumps(option.default)}`"


def table() -> str:
    """The Markdown table of ``OPTIONS``."""
    lines = ["| option | where | default | what it does |", "|---|---|---|---|"]
    for option in OPTIONS:
        cells = (f"`{option.name}`", option.where, shown_default(option))
        lines.append(f"| {' | '.join(cells)} | {option.effect} |")
    return "\n".join(lines) + "\n"
