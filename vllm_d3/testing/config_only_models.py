"""A Hugging Face cache holding only the ``config.json`` of the few small
models vLLM's CPU tests name, so that they build their configs offline
(``HF_HUB_OFFLINE=1``) with no weights and no tokenizer: ``write_cache``.

Each config gives the model's published architecture and sizes; fields a
config class defaults are left out.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

#: ``config.json`` by model id.
CONFIGS: dict[str, dict[str, Any]] = {
    # vLLM's scheduler tests build every scheduler on it by default.
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "word_embed_proj_dim": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "do_layer_norm_before": True,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # A hybrid of Gated DeltaNet and full attention, as D3's Qwen3.5 is: the
    # scheduler's and the config's hybrid tests.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
}


def write_cache(hf_home: Path) -> None:
    """Write ``CONFIGS`` as a Hugging Face cache under ``hf_home`` (the
    ``HF_HOME`` to run with): each model's ``main`` names a snapshot of its
    config alone."""
    for model, config in CONFIGS.items():
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        revision = hashlib.sha1(text.encode()).hexdigest()
        repo = hf_home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(text)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
