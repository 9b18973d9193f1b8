# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Config-only Decision 3.0 (D3) checkpoints for the D3 tests: a tiny Qwen3.5
backbone's ``config.json`` (text and vision, no weights) and a
``decision_config.json``, enough for vLLM to resolve and configure
``D3ForSequenceClassification`` without a GPU or a download."""

import json
from pathlib import Path
from typing import Any

#: One answer code per readout row, each with its token id.
CODES = [f"C{n}" for n in range(8)]

TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "attn_output_gate": True,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "mamba_ssm_dtype": "float32",
    "eos_token_id": 500,
    "dtype": "float16",
}

VISION_CONFIG = {
    "model_type": "qwen3_5_vision",
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
    "out_hidden_size": 256,
    "deepstack_visual_indexes": [],
}


def write_d3_config(
    path: Path, attention_mode: str = "prefix_bidir", **decision: Any
) -> str:
    """Write a config-only D3 checkpoint under ``path`` (the decision fields
    ``decision`` added or replaced) and return its path."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3_5Model"],
        "model_type": "qwen3_5",
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "image_token_id": 504,
        "video_token_id": 505,
        "vision_start_token_id": 502,
        "vision_end_token_id": 503,
        "tie_word_embeddings": False,
        "dtype": "float16",
    }
    decision_config = {
        "format_version": 1,
        "prompt": "d3",
        "codes": CODES,
        "token_ids": list(range(32, 32 + len(CODES))),
        "attention_mode": attention_mode,
        "pooling": "last",
        **decision,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "decision_config.json").write_text(json.dumps(decision_config))
    return str(path)
