"""Write a complete, deterministic Decision 3.0 (D3) package for tests and benchmarks.

Contract
--------
``write_tiny_checkpoint(out, ...)`` creates the directory ``out`` (which must be
missing or empty) and writes a D3 package that

* vLLM 0.33.0 resolves to ``D3ForSequenceClassification`` (``config.json`` names
  the bare ``Qwen3_5Model`` and ``decision_config.json`` is present), and
* transformers loads offline: ``Qwen3_5Model.from_pretrained``, ``AutoTokenizer``
  and ``AutoProcessor`` (``Qwen3VLProcessor``).

Files: ``config.json``, ``decision_config.json``, ``readout.safetensors`` (one
float32 tensor ``weight`` of shape [255, hidden]), ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``, ``preprocessor_config.json``,
``video_preprocessor_config.json``, ``MODEL_MANIFEST.json`` and, unless
``weights=False``, the backbone: ``model.safetensors``, or shards plus
``model.safetensors.index.json`` when it exceeds ``MAX_SHARD_BYTES``. Tensor names
are those of ``Qwen3_5Model.state_dict()`` (``language_model.*``, ``visual.*``),
which is what ``Qwen3_5Model.save_pretrained`` writes. ``MODEL_MANIFEST.json``
is a subset of the released ``d3-package-manifest/1``: parameter counts, the
size and sha256 of every other file, and how the fixture was built.

Shapes: ``"tiny"`` keeps Qwen3.5-27B's proportions at hidden 256 and a 2-block
vision tower; ``"d3-turbo"`` is exactly the Qwen3.5-27B text and vision shape.
A vision tower and its weights are always written, because vLLM loads D3 through
the Qwen3.5 multimodal class. ``vision=True`` only records in
``MODEL_MANIFEST.json`` that the package is meant to take media (``modalities``
gains image and video, and the vision parameters count as loaded); nothing vLLM
reads changes. The arguments are checked (``ValueError``); the same arguments
give byte-identical files.

Parts, each with its own contract:

* ``tokenizer``: the byte-level BPE trained here, its special tokens, the chat
  template and the selection of the 255 answer codes;
* ``configs``: ``config.json`` (text and vision shapes), the tokenizer,
  processor and decision configs;
* ``weights``: the seeded random backbone, its (sharded) safetensors and the
  readout;
* ``__main__``: the CLI, ``python -m vllm_d3.testing.tiny_checkpoint OUT
  [--attention-mode MODE] [--vision] [--shape tiny|d3-turbo]
  [--validated-length N] [--seed S] [--temperature T] [--no-weights]
  [--decision-field KEY=JSON ...]``.

This package re-exports the names in ``__all__`` from them (the CLI's ``main``
stays in ``__main__``, so that ``python -m`` runs it only once).
``MAX_SHARD_BYTES`` is read here, on each call, so setting it on this package
takes effect.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
from typing import Any

from safetensors.torch import save_file

from .configs import (
    ATTENTION_MODES,
    FORMAT_ID,
    SHAPES,
    STORAGE_DTYPES,
    decision_config,
    model_config,
    processor_configs,
    tokenizer_config,
    write_json,
)
from .tokenizer import (
    ASSISTANT_PREFIX,
    CHAT_TEMPLATE,
    NUM_CODES,
    PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    SYSTEM_PROMPT,
    THINK_TOKENS,
    UNMERGED_SECOND_LETTERS,
    build_tokenizer,
    code_candidates,
    select_codes,
)
from .weights import (
    ATTENTION_OUTPUT_GAIN,
    ATTENTION_QK_NORM_SCALE,
    FIRST_ATTENTION_OUTPUT_GAIN,
    READOUT_LOGIT_STD,
    SUBLAYER_OUTPUT_GAIN,
    backbone_tensors,
    parameter_counts,
    readout_weight,
    skeleton,
    write_backbone,
)

__all__ = [
    "ASSISTANT_PREFIX",
    "ATTENTION_MODES",
    "ATTENTION_OUTPUT_GAIN",
    "ATTENTION_QK_NORM_SCALE",
    "CHAT_TEMPLATE",
    "FIRST_ATTENTION_OUTPUT_GAIN",
    "FORMAT_ID",
    "MAX_SHARD_BYTES",
    "NUM_CODES",
    "PRETOKENIZE_REGEX",
    "READOUT_LOGIT_STD",
    "SHAPES",
    "SPECIAL_TOKENS",
    "STORAGE_DTYPES",
    "SUBLAYER_OUTPUT_GAIN",
    "SYSTEM_PROMPT",
    "THINK_TOKENS",
    "UNMERGED_SECOND_LETTERS",
    "build_tokenizer",
    "code_candidates",
    "select_codes",
    "write_tiny_checkpoint",
]

#: Backbone tensors are split into shards of at most this many bytes.
MAX_SHARD_BYTES = 4 * 1024**3


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(
    out: pathlib.Path,
    *,
    shape: str,
    seed: int,
    vision: bool,
    weights: bool,
    decision: dict[str, Any],
    counts: dict[str, int],
    readout_parameters: int,
) -> dict[str, Any]:
    """A subset of the released ``d3-package-manifest/1`` (no identity block),
    plus how the fixture was built."""
    files = sorted(p for p in out.iterdir() if p.is_file())
    loaded_vision = counts["vision"] if vision else 0
    return {
        "schema": "d3-package-manifest/1",
        "model_name": f"d3-{shape}-fixture",
        "format_id": decision.get("format_id"),
        "prompt": decision.get("prompt"),
        "attention_mode": decision.get("attention_mode"),
        "modalities": ["text", "image", "video"] if vision else ["text"],
        "parameters": {
            "text": counts["text"],
            "vision": counts["vision"],
            "readout": readout_parameters,
            "loaded": counts["text"] + loaded_vision + readout_parameters,
        },
        "files_bytes": {p.name: p.stat().st_size for p in files},
        "files_sha256": {p.name: _sha256(p) for p in files},
        "fixture": {"shape": shape, "seed": seed, "weights": weights},
        "licence": {"spdx": "Apache-2.0"},
    }


def _check_arguments(
    attention_mode: str,
    shape: str,
    seed: int,
    temperature: float,
    validated_length: int | None,
) -> None:
    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode must be one of {ATTENTION_MODES}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}")
    if seed < 0:
        raise ValueError("seed must be >= 0")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError("temperature must be positive and finite")
    if validated_length is not None and validated_length < 1:
        raise ValueError("validated_length must be a positive token count")


def write_tiny_checkpoint(
    out: str | os.PathLike,
    *,
    attention_mode: str = "prefix_bidir",
    vision: bool = False,
    shape: str = "tiny",
    seed: int = 0,
    temperature: float = 0.75,
    validated_length: int | None = None,
    decision_overrides: dict | None = None,
    weights: bool = True,
) -> pathlib.Path:
    """Write a D3 package into ``out`` (missing or empty) and return its path.

    ``decision_overrides`` is merged last into ``decision_config.json``, so it
    can add fields or write malformed values; the arguments themselves are
    checked. ``weights=False`` leaves out the backbone weights only.
    """
    _check_arguments(attention_mode, shape, seed, temperature, validated_length)
    path = pathlib.Path(out)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    codes, token_ids = select_codes(tokenizer)
    tokenizer.save(str(path / "tokenizer.json"))
    write_json(path / "tokenizer_config.json", tokenizer_config(tokenizer))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image_processor, video_processor = processor_configs()
    write_json(path / "preprocessor_config.json", image_processor)
    write_json(path / "video_preprocessor_config.json", video_processor)

    config = model_config(shape, tokenizer)
    write_json(path / "config.json", config)
    decision = decision_config(
        codes,
        token_ids,
        attention_mode=attention_mode,
        temperature=temperature,
        validated_length=validated_length,
        decision_overrides=decision_overrides,
    )
    write_json(path / "decision_config.json", decision)

    model = skeleton(config)
    if shape == "tiny":
        backbone = dict(backbone_tensors(model, seed, shape))
        readout = readout_weight(seed, config, tokenizer, backbone)
        if weights:
            write_backbone(path, backbone.items(), MAX_SHARD_BYTES)
    else:
        readout = readout_weight(seed, config, tokenizer, None)
        if weights:
            write_backbone(path, backbone_tensors(model, seed, shape), MAX_SHARD_BYTES)
    save_file({"weight": readout.contiguous()}, str(path / "readout.safetensors"))
    manifest = _manifest(
        path,
        shape=shape,
        seed=seed,
        vision=vision,
        weights=weights,
        decision=decision,
        counts=parameter_counts(model),
        readout_parameters=readout.numel(),
    )
    write_json(path / "MODEL_MANIFEST.json", manifest)
    return path
