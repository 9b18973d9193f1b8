"""Micro-benchmark: a packed request against the same tokens sent as one
question block and as one prompt per question, in process.

``python -m benchmarks.packed_step --out FILE [--layers 16]
[--shapes 280x92x4,290x80x16] [--copies 1] [--repeats 5] [--profile]
[--compilation-config JSON] [--max-model-len N] [--gdn-prefill-backend KERNEL]``

Contract:
- A weight-less d3-turbo package is written to a temporary directory and cut
  to its first ``--layers`` decoder layers (d3-turbo repeats three Gated
  DeltaNet layers and one full-attention layer, so a multiple of 4 keeps the
  mix); ``vllm.LLM`` serves it in this process (``load_format="dummy"``, the
  Gated DeltaNet prefill kernel vLLM and the plugin choose unless
  ``--gdn-prefill-backend`` names one, ``--max-model-len`` or else the package's,
  ``--compilation-config`` as vLLM takes it), its engine core in this process too
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
- Each shape ``SxQLxQ`` (state tokens, tokens per question, questions) is sent
  through ``LLM.classify`` six ways, fresh random token ids each call:
  ``packed`` (one prompt ``state || q1 || ... || qQ`` with
  ``d3_question_ends``: the state read once), ``packed, two phases``,
  ``packed, one scan`` and ``packed, one pass`` (the same with its Gated
  DeltaNet in that form where the step allows it, ``gdn_forms``), ``one
  block`` (the same prompt as a
  single question block: the same tokens through the single-phase path) and
  ``per question`` (Q prompts ``state || qi``, one step). ``--copies N``
  sends N such requests in each call, each with its own state and questions,
  as N clients' requests share a step. Two untimed calls, then the median
  wall-clock time of ``--repeats``.
- ``--profile``: one more call of each shape and way under torch's profiler:
  its GPU timeline (``gpu_timeline``) and its gzipped chrome trace beside
  ``FILE`` (``FILE.<shape>.<way>.trace.json.gz``, the way's words joined by
  ``-``); for the first shape the profiler tables (by total and self CPU
  time, and by CUDA time) of every way's call but ``per question``
  (``FILE.packed.txt``, ``FILE.packed-two-phases.txt``, ...,
  ``FILE.one-block.txt``).
- Writes ``FILE`` (JSON: the layers, the copies, the GDN prefill kernel that
  served (``gdn_prefill_backend``), a list of ``{"shape",
  "way", "median_ms", "samples_ms"}`` and, with ``--profile``, ``timelines``:
  ``{"shape", "way", ...}`` with the timeline's fields) and prints a line per
  shape and way.
  CUDA only.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_d3.model_executor.models.d3_contract import (
    QUESTION_ENDS_KEY,
    STATE_TOKENS_KEY,
)
from vllm_d3.testing.gdn_forms import gdn_form, served_gdn_prefill
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

from .gpu_timeline import timeline
from .timing import run_record
from .validation import VALIDATED_LENGTH

#: The ways that send a packed request, by the Gated DeltaNet form each asks
#: of its calls (``gdn_forms``: the engine core runs in this process).
PACKED_WAYS = {
    "packed": "as served",
    "packed, two phases": "two phases",
    "packed, one scan": "one scan",
    "packed, one pass": "one pass",
}
WAYS = (*PACKED_WAYS, "one block", "per question")
#: Token ids drawn for the prompts: ordinary text tokens of the D3 tokenizer.
TOKEN_IDS = (1000, 50000)
WARMUP_CALLS = 2
#: The profiler tables written with --profile, by what they sort on.
PROFILE_SORTS = ("cpu_time_total", "self_cpu_time_total", "cuda_time_total")
#: The host annotation around a profiled call.
CALL_SPAN = "d3_packed_step_call"


def _shape_text(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def _shape(text: str) -> tuple[int, int, int]:
    state, question, count = (int(part) for part in text.split("x"))
    return state, question, count


def write_package(directory: Path, layers: int) -> Path:
    """The weight-less d3-turbo package with its first ``layers`` layers."""
    path = write_tiny_checkpoint(
        directory / "d3-turbo",
        shape="d3-turbo",
        weights=False,
        validated_length=VALIDATED_LENGTH,
    )
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    config_file.write_text(json.dumps(config))
    return path


def prompts(
    way: str, state: list[int], questions: list[list[int]]
) -> list[tuple[list[int], dict[str, Any]]]:
    """(token ids, extra_kwargs) of the prompts that send ``way``."""
    s = len(state)
    packed = state + [t for q in questions for t in q]
    if way in PACKED_WAYS:
        ends = list(itertools.accumulate((len(q) for q in questions), initial=s))
        return [(packed, {STATE_TOKENS_KEY: s, QUESTION_ENDS_KEY: ends[1:]})]
    if way == "one block":
        return [(packed, {STATE_TOKENS_KEY: s})]
    return [(state + q, {STATE_TOKENS_KEY: s}) for q in questions]


def step_prompts(
    way: str, shape: tuple[int, int, int], copies: int, rng: random.Random
) -> list[tuple[list[int], dict[str, Any]]]:
    """The prompts of one call: ``copies`` requests of ``shape`` sent ``way``,
    each with fresh random token ids."""
    state_tokens, question_tokens, count = shape
    sent = []
    for _ in range(copies):
        state = [rng.randrange(*TOKEN_IDS) for _ in range(state_tokens)]
        questions = [
            [rng.randrange(*TOKEN_IDS) for _ in range(question_tokens)]
            for _ in range(count)
        ]
        sent += prompts(way, state, questions)
    return sent


def _slug(way: str) -> str:
    return "-".join(way.replace(",", "").split())


def profile_calls(
    call: Callable[[str, tuple[int, int, int]], float],
    shapes: list[tuple[int, int, int]],
    out: Path,
) -> list[dict[str, Any]]:
    """Profile one call of each shape and way: its GPU timeline (returned), its
    gzipped chrome trace beside ``out``, and for the first shape the tables."""
    from torch.profiler import ProfilerActivity, profile, record_function

    timelines = []
    for shape, way in itertools.product(shapes, WAYS):
        with (
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as run,
            record_function(CALL_SPAN),
        ):
            call(way, shape)
        label = f"{_shape_text(shape)}.{_slug(way)}"
        with tempfile.TemporaryDirectory() as scratch:
            trace_file = Path(scratch) / "trace.json"
            run.export_chrome_trace(str(trace_file))
            trace = trace_file.read_bytes()
        (out.parent / f"{out.name}.{label}.trace.json.gz").write_bytes(
            gzip.compress(trace)
        )
        summary = timeline(json.loads(trace)["traceEvents"], CALL_SPAN)
        timelines.append({"shape": _shape_text(shape), "way": way, **summary})
        print(f"{label}: {json.dumps(summary)[:300]}")
        if shape == shapes[0] and way != "per question":
            averages = run.key_averages()
            tables = [
                averages.table(sort_by=key, row_limit=40) for key in PROFILE_SORTS
            ]
            name = f"{out.name}.{_slug(way)}.txt"
            (out.parent / name).write_text("\n\n".join(tables))
    return timelines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shapes", default="280x92x4,290x80x16")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compilation-config", type=json.loads, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--gdn-prefill-backend",
        help="a Gated DeltaNet prefill kernel (default: vLLM's and the plugin's)",
    )
    args = parser.parse_args(argv)
    shapes = [_shape(part) for part in args.shapes.split(",") if part]
    # Before vLLM starts an engine: its core in this process, for the profiler.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        llm = LLM(
            model=str(write_package(Path(scratch), args.layers)),
            load_format="dummy",
            gdn_prefill_backend=args.gdn_prefill_backend,
            compilation_config=args.compilation_config,
            max_model_len=args.max_model_len,
        )

        def call(way: str, shape: tuple[int, int, int]) -> float:
            sent = step_prompts(way, shape, args.copies, rng)
            with gdn_form(PACKED_WAYS.get(way, "as served")):
                started = time.perf_counter()
                llm.classify(
                    [TokensPrompt(prompt_token_ids=ids) for ids, _ in sent],
                    pooling_params=[
                        PoolingParams(
                            task="classify", use_activation=False, extra_kwargs=x
                        )
                        for _, x in sent
                    ],
                    use_tqdm=False,
                )
                return (time.perf_counter() - started) * 1e3

        results = []
        for shape in shapes:
            for way in WAYS:
                for _ in range(WARMUP_CALLS):
                    call(way, shape)
                samples = [call(way, shape) for _ in range(args.repeats)]
                median = statistics.median(samples)
                results.append(
                    {
                        "shape": _shape_text(shape),
                        "way": way,
                        "median_ms": median,
                        "samples_ms": samples,
                    }
                )
                print(
                    f"{args.layers} layers, {args.copies} x {shape}: {way} "
                    f"{median:.1f} ms"
                )
        timelines = profile_calls(call, shapes, args.out) if args.profile else []
    args.out.write_text(
        json.dumps(
            {
                "run": run_record(),
                "layers": args.layers,
                "copies": args.copies,
                "gdn_prefill_backend": served_gdn_prefill(llm),
                "compilation_config": args.compilation_config,
                "max_model_len": args.max_model_len,
                "results": results,
                "timelines": timelines,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
