"""``vllm-d3``: the package's command line (``vllm serve`` loads the plugin
itself; these commands show it, document it and export it).

``vllm-d3 demo`` shows the main job in one command. It builds (once, into a
cache directory) a tiny ``prefix_bidir`` D3 checkpoint with the factory, serves
it with ``vllm serve`` on loopback (``vllm_d3.testing.server.Server``), sends
one /v1/systemone request (a text state with a noul, a choice and a score
question), prints vLLM's answers next to the reference runtime's, shuts the
server down, and exits 1 if an answer differs by more than the tolerance.
``--model`` serves a real checkpoint (a path or hub id) the same way. On a
machine without a CUDA GPU it says so in one line and prints the reference
runtime's answers alone: vLLM never runs there.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO_REQUEST: dict[str, Any] = {
    "state": (
        "Order 1042: two lamps and a desk chair, paid by card. The customer wrote "
        "that one lamp arrived with a cracked shade and asked what happens next."
    ),
    "questions": {
        "damaged": {"type": "noul", "instructions": "Does the customer report damage?"},
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": {
                "refund": "money back",
                "replacement": "a new item",
                "information": "to know the next step",
                "cancel": None,
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this message?",
            "criteria": ["low", "medium", "high"],
        },
    },
}


def step(message: str) -> None:
    print(f"vllm-d3 demo: {message}", flush=True)


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-d3"


def tiny_checkpoint(cache: Path) -> str:
    from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

    path = cache / "tiny-prefix-bidir"
    if (path / "decision_config.json").exists():
        step(f"using the tiny prefix_bidir checkpoint in {path}")
        return str(path)
    step(f"building a tiny prefix_bidir checkpoint in {path}")
    partial = cache / f".tiny-prefix-bidir-{os.getpid()}"
    write_tiny_checkpoint(partial, attention_mode="prefix_bidir", vision=True)
    partial.rename(path)
    return str(path)


def reference_answers(model: str, device: str, dtype_name: str) -> dict[str, Any]:
    import torch

    from vllm_d3.reference import ReferenceRuntime

    dtype = getattr(torch, dtype_name)
    return ReferenceRuntime(model, device=device, dtype=dtype).answer(DEMO_REQUEST)


def serve_and_ask(model: str, serve_args: list[str]) -> dict[str, Any]:
    from vllm_d3.testing.server import Server, ServerExited, post

    log_file = Path(tempfile.gettempdir()) / f"vllm-d3-demo-{os.getpid()}.log"
    step(f"starting vllm serve {model} (log: {log_file})")
    with Server(model, *serve_args, log_file=log_file) as server:
        try:
            up = server.wait()
        except ServerExited as exited:
            raise SystemExit(str(exited)) from None
        step(f"server up in {up:.0f} s; asking /v1/systemone")
        status, body = post(server.url + "/v1/systemone", DEMO_REQUEST)
    step("server stopped")
    if status != 200:
        raise SystemExit(f"/v1/systemone answered HTTP {status}: {body}")
    return body


def _line(qid: str, answer: dict[str, Any]) -> str:
    kind = answer["type"]
    probs = ", ".join(f"{k}={v:.3f}" for k, v in answer["probabilities"].items())
    headline = {
        "noul": lambda: f"noul={answer['noul']:.3f}",
        "choice": lambda: f"choice={answer['choice']}",
        "score": lambda: f"score={answer['score']:.3f}",
    }[kind]()
    return f"  {qid:<9} {headline:<22} [{probs}]"


def show(title: str, response: dict[str, Any]) -> None:
    print(title)
    for qid, answer in response["answers"].items():
        print(_line(qid, answer))


def demo(args: argparse.Namespace) -> int:
    import torch

    from vllm_d3.testing.compare import TOLERANCE, compare, flatten, passes

    cache = Path(args.cache_dir) if args.cache_dir else default_cache()
    model = args.model or tiny_checkpoint(cache)
    print("request:", json.dumps(DEMO_REQUEST, ensure_ascii=False))
    if not torch.cuda.is_available():
        step(
            "no CUDA GPU on this machine, so vLLM cannot run here; showing the "
            "reference runtime's answers for the same request instead"
        )
        reference = reference_answers(model, "cpu", "float32")
        show("reference runtime (transformers, float32, CPU):", reference)
        return 0
    served = serve_and_ask(model, args.serve_args)
    show("vLLM + vllm-d3:", served)
    if args.no_reference:
        return 0
    step("computing the reference runtime's answers")
    # The tiny checkpoint's oracle runs in float32; a real 27B one fits in bf16.
    dtype_name = "bfloat16" if args.model else "float32"
    reference = reference_answers(model, "cuda", dtype_name)
    show(f"reference runtime (transformers, {dtype_name}, GPU):", reference)
    stats = compare(flatten([reference]), flatten([served]))
    ok = passes(stats)
    step(
        f"max |dp| {stats['max_dp']:.4f} (tolerance {TOLERANCE}), decisions changed "
        f"{stats['decisions_changed']}: {'OK' if ok else 'DIFFERENT'}"
    )
    return 0 if ok else 1


def export_patches(args: argparse.Namespace) -> int:
    """Write the upstream patch series (``vllm_d3.export``) and list it."""
    from vllm_d3.export import ExportError, export_series, installed_vllm, patched_tree

    vllm_src = Path(args.vllm_src) if args.vllm_src else None
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch, "vllm")
        try:
            files = export_series(Path(args.out), repo, vllm_src)
        except ExportError as e:
            print(f"vllm-d3 export-patches: {e}", file=sys.stderr)
            return 1
        for patch_file in files:
            print(patch_file)
        if args.patched_tree:
            tree = patched_tree(repo, installed_vllm(), Path(args.patched_tree))
            print(f"patched vLLM: PYTHONPATH={tree} VLLM_PLUGINS= python ...")
    return 0


def options() -> int:
    """Print every option of the plugin (``vllm_d3.options``)."""
    from vllm_d3.options import table

    print(table(), end="")
    return 0


DESCRIPTION = (
    "Serve Decision 3.0 prefix_bidir checkpoints with vLLM 0.33.0 on "
    "/v1/systemone. The package is a plugin that `vllm serve` loads by itself; "
    "these commands show it working, list its options and export it as an "
    "upstream patch series."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-d3", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_help = (
        "serve a D3 checkpoint (by default a tiny prefix_bidir one, built once) "
        "with vllm serve, ask /v1/systemone once and compare the answers with "
        "the reference runtime's (without a CUDA GPU: the reference's alone)"
    )
    demo_parser = sub.add_parser("demo", help=demo_help, description=demo_help)
    demo_parser.add_argument("--model", help="a D3 checkpoint (path or hub id)")
    demo_parser.add_argument("--cache-dir", help="where the tiny checkpoint is built")
    demo_parser.add_argument(
        "--serve-args",
        default="",
        help='extra "vllm serve" arguments, e.g. "--max-model-len 8192"',
    )
    demo_parser.add_argument(
        "--no-reference", action="store_true", help="skip the reference comparison"
    )
    options_help = (
        "print every option (--additional-config keys, request fields, "
        "environment variables, the vLLM defaults the plugin changes) with its "
        "default and what it does, as a Markdown table"
    )
    sub.add_parser("options", help=options_help, description=options_help)
    export_help = (
        "write the plugin's changes as an upstream patch series against vLLM "
        "0.33.0 (git format-patch, for git am)"
    )
    export_parser = sub.add_parser(
        "export-patches", help=export_help, description=export_help
    )
    export_parser.add_argument("--out", required=True, help="where the patches go")
    export_parser.add_argument(
        "--vllm-src",
        help="a vLLM 0.33.0 git checkout, or a source tree holding a vllm package "
        "such as its sdist's (default: the installed package's Python files)",
    )
    export_parser.add_argument(
        "--patched-tree",
        help="also write a runnable copy of the installed vllm package with the "
        "series applied here (its files linked, the patched ones copied)",
    )
    args = parser.parse_args(argv)
    if args.command == "export-patches":
        return export_patches(args)
    if args.command == "options":
        return options()
    args.serve_args = args.serve_args.split()
    started = time.time()
    code = demo(args)
    step(f"done in {time.time() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
