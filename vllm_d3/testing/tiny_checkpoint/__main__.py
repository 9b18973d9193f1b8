"""The tiny D3 package's command line.

Contract
--------
``python -m vllm_d3.testing.tiny_checkpoint OUT [--attention-mode MODE]
[--vision] [--shape tiny|d3-turbo] [--validated-length N] [--seed S]
[--temperature T] [--no-weights] [--decision-field KEY=JSON ...]`` calls
``write_tiny_checkpoint`` with those arguments (``--decision-field`` sets one
``decision_config.json`` field, repeatable, applied last), prints the package's
path and exits 0. A bad argument, a rejected value or a non-empty ``OUT`` is an
argparse usage error (exit 2). ``main(argv)`` is the same, in process.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import ATTENTION_MODES, SHAPES, write_tiny_checkpoint


def _decision_field(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: not JSON: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_d3.testing.tiny_checkpoint",
        description="Write a deterministic D3 package for tests and benchmarks.",
    )
    parser.add_argument("out", help="directory to create (must be missing or empty)")
    parser.add_argument(
        "--attention-mode", choices=ATTENTION_MODES, default="prefix_bidir"
    )
    parser.add_argument(
        "--vision", action="store_true", help="record that it takes media"
    )
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--validated-length", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.75)
    parser.add_argument(
        "--no-weights",
        dest="weights",
        action="store_false",
        help="leave out the backbone weights (for load_format=dummy)",
    )
    parser.add_argument(
        "--decision-field",
        type=_decision_field,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set a decision_config.json field (repeatable, applied last)",
    )
    args = parser.parse_args(argv)
    try:
        path = write_tiny_checkpoint(
            args.out,
            attention_mode=args.attention_mode,
            vision=args.vision,
            shape=args.shape,
            seed=args.seed,
            temperature=args.temperature,
            validated_length=args.validated_length,
            decision_overrides=dict(args.decision_field),
            weights=args.weights,
        )
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
