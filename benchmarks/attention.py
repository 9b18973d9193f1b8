"""Micro-benchmark: one prefix_bidir full-attention layer, the dense pieces on
each kernel vs ranged Triton, at d3-turbo's head shape.

``python -m benchmarks.attention --out FILE [--states 8192,...] [--question 150]
[--prompts 1,4] [--kernels fa3,...] [--ranged-states 8192,...] [--repeats 5]``

Contract:
- A weight-less d3-turbo package is written to a temporary directory, and for
  each of ``--kernels`` (default: every dense-piece kernel this GPU runs) a
  ``FullAttentionLayer`` (``vllm_d3.testing.attention_layer``) is built by
  vLLM with the plugin's config hook and ``d3_attention_kernel`` set to it: 24
  query / 4 KV heads, head_dim 256, bf16, a paged KV cache of random keys and
  values, blocks of 784 tokens.
- For each state size s, a prompt of n = s + ``--question`` tokens, and each
  batch of ``--prompts`` such prompts (c = 0), the layer's metadata is built by
  the plugin's builder (``path``: the kernel's name, the dense pieces on it) or
  by vLLM's Triton builder with the two PrefixLM ranges per prompt
  ("ranged_triton", at ``--ranged-states`` only), and the layer's forward over
  the step's own keys and values is timed with CUDA events: one untimed call,
  then the median of ``--repeats`` calls (one call when a call takes over 2 s).
- TFLOP/s counts the pairs the mask allows, s^2 + (n - s) n per prompt, times
  4 x 24 x 256 FLOP (QK^T and PV): the useful work, whatever a path computes.
- Writes ``FILE`` (JSON): a list of ``{"path", "state_tokens", "prompts", "ms",
  "tflops", "build_ms"}`` (``build_ms``: the metadata build the runner does
  once per step), and prints a table. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from vllm.utils.math_utils import cdiv

from vllm_d3.testing.attention_layer import (
    FullAttentionLayer,
    Prompt,
    attention_pairs,
)
from vllm_d3.v1.attention.backends.d3_dense_kernels import (
    KERNEL_NAMES,
    kernel_unavailable,
)

DEFAULT_STATES = (8192, 24576, 65536, 119808)
DEFAULT_RANGED_STATES = (8192, 24576)
BLOCK_SIZE = 784
SLOW_CALL_MS = 2000.0


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _timed(call: Any) -> tuple[Any, float]:
    """``call()``'s result and its CUDA time in ms."""
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    result = call()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end)


def time_path(
    layer: FullAttentionLayer, prompts: list[Prompt], path: str, repeats: int
) -> dict[str, Any]:
    query = layer.random_query(prompts)
    output = torch.empty_like(query)
    keys_values = layer.fresh_keys_values(prompts)
    metadata, build_ms = _timed(lambda: layer.metadata(prompts, path))

    def attention() -> None:
        layer.forward(query, metadata, keys_values, output)

    _, first = _timed(attention)
    count = 1 if first > SLOW_CALL_MS else repeats
    ms = statistics.median(_timed(attention)[1] for _ in range(count))
    flop = sum(attention_pairs(p) for p in prompts) * 4 * layer.num_heads
    flop *= layer.head_size
    return {
        "path": layer.kernel if path == "dense" else "ranged_triton",
        "state_tokens": prompts[0].state_tokens,
        "prompts": len(prompts),
        "ms": round(ms, 3),
        "tflops": round(flop / ms / 1e9, 1),
        "build_ms": round(build_ms, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--states", type=_ints, default=list(DEFAULT_STATES))
    parser.add_argument("--question", type=int, default=150)
    parser.add_argument("--prompts", type=_ints, default=[1, 4])
    parser.add_argument("--kernels", type=lambda t: t.split(","), default=None)
    parser.add_argument(
        "--ranged-states", type=_ints, default=list(DEFAULT_RANGED_STATES)
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

    longest = max(args.states) + args.question
    batch_tokens = max(args.prompts) * longest
    results = []
    with tempfile.TemporaryDirectory() as work:
        checkpoint = str(
            write_tiny_checkpoint(Path(work) / "turbo", shape="d3-turbo", weights=False)
        )
        kernels = args.kernels or [
            k for k in KERNEL_NAMES if kernel_unavailable(k) is None
        ]
        for index, kernel in enumerate(kernels):
            layer = FullAttentionLayer(
                checkpoint,
                BLOCK_SIZE,
                max_prompt_len=longest,
                max_batch_tokens=batch_tokens,
                num_blocks=max(args.prompts) * cdiv(longest, BLOCK_SIZE),
                kernel=kernel,
            )
            for state_tokens in args.states:
                # Ranged Triton once, beside the first kernel.
                ranged = index == 0 and state_tokens in args.ranged_states
                for count in args.prompts:
                    prompts = [Prompt(state_tokens, state_tokens + args.question)]
                    prompts *= count
                    for path in ["dense", "ranged"] if ranged else ["dense"]:
                        row = time_path(layer, prompts, path, args.repeats)
                        results.append(row)
                        print(json.dumps(row), flush=True)
            del layer
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'path':14} {'state':>7} {'prompts':>7} {'ms':>10} TFLOP/s")
    for row in results:
        print(
            f"{row['path']:14} {row['state_tokens']:>7} "
            f"{row['prompts']:>7} {row['ms']:>10.1f} {row['tflops']:>7.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
