"""The tiny D3 package's JSON files: model, tokenizer, processor and decision
configs.

Contract
--------
Each function returns one file's content as a dict, which ``write_json`` writes
(indent 2, non-ASCII kept, a final newline); none of them writes or draws
anything.

* ``model_config(shape, tokenizer)``: ``config.json``, the bare
  ``Qwen3_5Model`` (``model_type`` qwen3_5) with its text and vision configs and
  the media token ids, in ``STORAGE_DTYPES[shape]``. Shape ``"tiny"`` keeps
  Qwen3.5-27B's proportions (8 layers of 3 x Gated DeltaNet + 1 x gated full
  attention, head_dim 256, partial rotary 0.25, interleaved mrope [11, 11, 10])
  at hidden 256 and a 2-block vision tower; ``"d3-turbo"`` is exactly the
  Qwen3.5-27B text and vision shape (vocab 248320).
* ``tokenizer_config(tokenizer)``: ``tokenizer_config.json``, naming
  ``Qwen2Tokenizer`` and the added tokens.
* ``processor_configs()``: ``preprocessor_config.json`` and
  ``video_preprocessor_config.json`` (``Qwen3VLProcessor``).
* ``decision_config(codes, token_ids, ...)``: ``decision_config.json``
  (``FORMAT_ID``, one of ``ATTENTION_MODES``), with ``decision_overrides``
  merged last and unchecked.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from tokenizers import Tokenizer

ATTENTION_MODES = ("causal", "noncausal_full_attention", "prefix_bidir")
SHAPES = ("tiny", "d3-turbo")
#: The dtype each shape's weights are stored in, which vLLM then serves with no
#: ``--dtype``. d3-turbo is published in bf16. The tiny shape is float16: its
#: 10-bit mantissa keeps rounding about 8x below bf16's, so a comparison with the
#: float32 reference checks the attention mask rather than the rounding.
STORAGE_DTYPES = {"tiny": "float16", "d3-turbo": "bfloat16"}
FORMAT_ID = "d3-code-readout-v1"


def _text_config(shape: str, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    if shape == "tiny":
        dims = {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
        }
    else:
        dims = {
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
        }
        vocab_size = 248_320
    head_dim = 256
    partial_rotary_factor = 0.25
    rotary_pairs = int(head_dim * partial_rotary_factor) // 2
    mrope_section = [11, 11, 10]
    assert sum(mrope_section) == rotary_pairs
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(dims["num_hidden_layers"])
    ]
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        **dims,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "full_attention_interval": 4,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262_144,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": partial_rotary_factor,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "dtype": STORAGE_DTYPES[shape],
    }


def _vision_config(shape: str, out_hidden_size: int) -> dict[str, Any]:
    if shape == "tiny":
        dims = {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
        }
    else:
        dims = {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
        }
    return {
        "model_type": "qwen3_5_vision",
        **dims,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 2304,
        "out_hidden_size": out_hidden_size,
        "deepstack_visual_indexes": [],
        "initializer_range": 0.02,
    }


def model_config(shape: str, tokenizer: Tokenizer) -> dict[str, Any]:
    def token_id(token: str) -> int:
        found = tokenizer.token_to_id(token)
        assert found is not None, token
        return found

    text = _text_config(
        shape,
        tokenizer.get_vocab_size(with_added_tokens=True),
        token_id("<|endoftext|>"),
    )
    return {
        "architectures": ["Qwen3_5Model"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": _vision_config(shape, text["hidden_size"]),
        "image_token_id": token_id("<|image_pad|>"),
        "video_token_id": token_id("<|video_pad|>"),
        "vision_start_token_id": token_id("<|vision_start|>"),
        "vision_end_token_id": token_id("<|vision_end|>"),
        "tie_word_embeddings": False,
        "dtype": STORAGE_DTYPES[shape],
    }


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262_144,
        "added_tokens_decoder": added,
    }


def processor_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json``."""
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        **common,
        "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216},
    }
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        **common,
        "size": {"shortest_edge": 4_096, "longest_edge": 25_165_824},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    }
    return image, video


def decision_config(
    codes: list[str],
    token_ids: list[int],
    *,
    attention_mode: str,
    temperature: float,
    validated_length: int | None,
    decision_overrides: dict[str, Any] | None,
) -> dict[str, Any]:
    decision: dict[str, Any] = {
        "format_version": 1,
        "format_id": FORMAT_ID,
        "prompt": "d3",
        "base_model": "tiny-fixture",
        "revision": "0" * 40,
        "codes": codes,
        "token_ids": token_ids,
        "temperature": temperature,
        "attention_mode": attention_mode,
        "pooling": "last",
        "max_length": None,
        "readout_dtype": "float32",
    }
    if validated_length is not None:
        decision["validated_length"] = validated_length
    decision.update(decision_overrides or {})
    return decision


def write_json(path: pathlib.Path, value: Any) -> None:
    """Write ``value`` as every JSON file of the package is written."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
