"""Benchmark vLLM + vllm-d3 (state once and per question) against the reference.

``python -m benchmarks.d3 --out DIR [--smoke] [--rows PATTERNS] [--sides SIDES]
[--repeats N] [--long-repeats N] [--warmup N] [--vllm-long-warmup N]
[--time-budget SECONDS] [--one-server] [--serve-arg=FLAG ...] ...``

Contract:
- Default (GPU) mode: a weight-less d3-turbo package (the exact Qwen3.5-27B
  shape) is written into ``WORK`` (default ``OUT/work``) unless ``--checkpoint``
  names a package. The reference runtime, random-initialised in bf16 on CUDA,
  runs first (in this process, at most ``--reference-share`` of the time
  budget); then ``vllm serve`` with ``--load-format dummy`` (default flags
  otherwise: the declared ``validated_length``) serves the short rows and the
  throughput loads, and a second server with ``--max-model-len 131072`` the
  long-state rows. A package with weights is loaded by both instead.
- ``--sides`` (default ``vllm,vllm_per_question,reference``): ``vllm`` is the
  servers above, reading each request's state once (servers ``default`` and
  ``long``); ``vllm_per_question`` the same servers with ``--additional-config
  '{"d3_state_once": false}'``, one engine request per question (servers
  ``default-per-question`` and ``long-per-question``). Each of these starts
  right after its state-once twin (``server_groups``), so a time budget cuts
  the long rows of both sides rather than one whole side. ``vllm_portable``
  (asked for by name) is the ``vllm`` servers with ``--additional-config
  '{"d3_attention_kernel": "torch_flash"}'`` (``rows.PORTABLE_KERNEL``, the
  kernel ROCm gets), servers ``default-portable`` and ``long-portable``;
  ``vllm_dp2`` (by name too) the ``vllm`` servers with ``--data-parallel-size
  2`` (two GPUs of one host), servers ``default-dp2`` and ``long-dp2``;
  ``vllm_triton_gdn`` (by name too) the ``vllm`` servers with
  ``--gdn-prefill-backend triton`` (``server.TRITON_GDN_FLAGS``), servers
  ``default-triton-gdn`` and ``long-triton-gdn``. Each
  server's ``memory`` names the GPUs it used (``vllm_side.MemoryPoller``).
- Each latency row and load has an entry per side (``rows.SIDES``) and the
  ratios of their p50s (of their requests per second for a load), ``None``
  where a side was not measured: ``ratio`` (vllm / reference),
  ``ratio_per_question`` (vllm_per_question / reference) and
  ``speedup_state_once`` (above 1 where vllm is the faster: vllm_per_question
  p50 / vllm p50, or vllm req/s / vllm_per_question req/s),
  ``default_over_triton_gdn`` (vllm / vllm_triton_gdn, p50s or req/s), and
  ``portable_over_default`` (vllm_portable / vllm, p50s or req/s) and
  ``dp2_over_default`` (vllm_dp2 / vllm, likewise).
- ``--smoke``: a tiny package, one request per row and no warm-up (the
  start-up request warms up), long states scaled by ``SMOKE_STATE_SCALE``, 5 s
  throughput loads. Without CUDA the reference runs in float32 on the CPU and
  the vLLM rows read "not run (no CUDA)"; with CUDA every side runs there (a
  quick end-to-end check of the harness).
- Latency rows: ``rows.LATENCY_ROWS``; throughput loads:
  ``rows.THROUGHPUT_ROWS``. ``--rows`` keeps the ids matching any of its
  comma-separated ``fnmatch`` patterns (``text-*,tput-*``).
- ``--vllm-long-warmup N`` (at most ``--warmup``): both vLLM sides leave out
  the first ``warmup - N`` warm-up requests of each long-state row, so every
  side still times the same requests. The reference always sends ``--warmup``.
- ``--time-budget``: no row or load starts once it is spent, nor a long row
  whose estimated time is longer than what is left (``timing.RowGate``), and
  a row stops repeating when the time left is shorter than its last request;
  what was skipped is listed in the results.
- Writes ``OUT/results.json``, ``OUT/results.md``, ``OUT/serve-NAME.log`` (one
  per server) and, when matplotlib is installed, ``OUT/latency_vs_state.png``;
  the results are rewritten after the reference and after each vLLM row, load
  and server (rows still to come read "pending"), so a run cut short keeps
  what it measured. ``usage_matches_render`` in a vLLM side's row says whether
  its ``usage.input_tokens`` are that side's token count
  (``reference_side.token_accounting``).
  Progress lines carry timestamps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_d3.model_executor.models.d3_contract import (
    ATTENTION_KERNEL_KEY,
    STATE_ONCE_KEY,
)
from vllm_d3.testing.requests import words_per_token
from vllm_d3.testing.server import ADDITIONAL_CONFIG_FLAG, TRITON_GDN_FLAGS
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

from . import report
from .reference_side import (
    RandomInitRuntime,
    has_weights,
    run_reference,
    token_accounting,
)
from .rows import (
    DEFAULT_SIDES,
    MIXES,
    POOL_OFFSET,
    PORTABLE_KERNEL,
    ROWS_BY_ID,
    SIDES,
    STARTUP_ROW,
    THROUGHPUT_ROWS,
    Load,
    Row,
    row_requests,
    select,
)
from .timing import Budget, log
from .validation import LONG_MAX_MODEL_LEN, VALIDATED_LENGTH, versions

SMOKE_STATE_SCALE = 1 / 64
NOT_RUN_NO_CUDA = "not run (no CUDA)"
#: Each vLLM side: the suffix of its servers' names and its extra serve flags.
VLLM_SIDES = {
    "vllm": ("", []),
    "vllm_portable": (
        "-portable",
        [ADDITIONAL_CONFIG_FLAG, json.dumps({ATTENTION_KERNEL_KEY: PORTABLE_KERNEL})],
    ),
    "vllm_dp2": ("-dp2", ["--data-parallel-size", "2"]),
    "vllm_per_question": (
        "-per-question",
        [ADDITIONAL_CONFIG_FLAG, json.dumps({STATE_ONCE_KEY: False})],
    ),
    "vllm_triton_gdn": ("-triton-gdn", TRITON_GDN_FLAGS),
}
#: The token count each vLLM side's ``usage.input_tokens`` should report.
USAGE_TOKENS = {side: f"tokens_{side}" for side in VLLM_SIDES}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.d3", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="generated packages (OUT/work)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny package, few requests"
    )
    parser.add_argument("--checkpoint", type=Path, help="use this D3 package")
    parser.add_argument(
        "--rows", help="comma-separated fnmatch patterns of row ids (default: all)"
    )
    default_sides = ",".join(DEFAULT_SIDES)
    parser.add_argument(
        "--sides",
        default=",".join(DEFAULT_SIDES),
        help=f"comma-separated: {', '.join(SIDES)} (default: {default_sides})",
    )
    parser.add_argument("--repeats", type=int, help="timed requests per row (3)")
    parser.add_argument(
        "--long-repeats", type=int, help="for the long states (--repeats)"
    )
    parser.add_argument(
        "--warmup", type=int, help="untimed requests per row (1; smoke: 0)"
    )
    parser.add_argument(
        "--vllm-long-warmup",
        type=int,
        help="vLLM's untimed requests per long-state row, at most --warmup "
        "(--warmup); the timed requests stay the reference's",
    )
    parser.add_argument("--time-budget", type=float, help="seconds (unlimited)")
    parser.add_argument(
        "--reference-share",
        type=float,
        default=0.4,
        help="most of the budget the reference may use when vLLM runs too (0.4)",
    )
    _load_arguments(parser)
    args = parser.parse_args(argv)
    _complete(parser, args)
    return args


def _load_arguments(parser: argparse.ArgumentParser) -> None:
    """The throughput loads', the reference's and the servers' options."""
    parser.add_argument(
        "--throughput-seconds", type=float, help="measured per load (30; smoke: 5)"
    )
    parser.add_argument(
        "--throughput-warmup", type=float, help="unmeasured per load (5; smoke: 2)"
    )
    parser.add_argument(
        "--max-requests", type=int, default=5000, help="cap per throughput load"
    )
    parser.add_argument(
        "--pool", type=int, default=16, help="distinct requests per mix row"
    )
    parser.add_argument(
        "--reference-device",
        choices=["cuda", "cpu"],
        help="where the reference runs (cuda when there is CUDA, else cpu)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--one-server",
        action="store_true",
        help=f"one server per side, --max-model-len {LONG_MAX_MODEL_LEN}, for "
        "every row and load",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="a flag for every vllm serve, as one argument "
        "(--serve-arg=--tensor-parallel-size=2)",
    )


def _complete(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check ``args`` and fill in the defaults that depend on others (the smoke
    run's, the long rows' from the short ones')."""
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown or not args.sides:
        parser.error(f"--sides takes {', '.join(SIDES)}; got {args.sides}")
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.warmup is None:
        # The start-up request warms the smoke run's tiny model up already.
        args.warmup = 0 if args.smoke else 1
    if args.throughput_seconds is None:
        args.throughput_seconds = 5.0 if args.smoke else 30.0
    if args.throughput_warmup is None:
        args.throughput_warmup = 2.0 if args.smoke else 5.0
    if args.long_repeats is None:
        args.long_repeats = args.repeats
    if args.vllm_long_warmup is None:
        args.vllm_long_warmup = args.warmup
    if min(args.repeats, args.long_repeats) < 1 or args.warmup < 0:
        parser.error("--repeats and --long-repeats need >= 1, --warmup >= 0")
    if not 0 <= args.vllm_long_warmup <= args.warmup:
        parser.error(
            f"--vllm-long-warmup needs 0 to --warmup ({args.warmup}); "
            f"got {args.vllm_long_warmup}"
        )
    args.patterns = None if args.rows is None else args.rows.split(",")


def prepare_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    if args.checkpoint is not None:
        return args.checkpoint
    shape = "tiny" if args.smoke else "d3-turbo"
    path = work / f"checkpoint-{shape}"
    if not (path / "MODEL_MANIFEST.json").exists():
        log(f"writing a weight-less {shape} D3 package")
        write_tiny_checkpoint(
            path,
            vision=True,
            shape=shape,
            weights=False,
            validated_length=None if args.smoke else VALIDATED_LENGTH,
        )
    return path


def interleave(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One request of each group in turn: the round-robin order of a mix."""
    return [request for batch in zip(*groups, strict=True) for request in batch]


def _environment() -> dict[str, Any]:
    return {**versions(), "cpu_cores": os.cpu_count()}


def _reference_throughput(
    mix: str, latency: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One request at a time: the mix's requests over their summed p50s."""
    rows = [latency.get(row_id) for row_id in MIXES[mix]]
    if not all(r and r["reference"].get("status") == "ok" for r in rows):
        return {"status": "not run (its latency rows were not all measured)"}
    seconds = sum(r["reference"]["p50_s"] for r in rows if r)
    return {
        "status": "ok",
        "requests_per_s": len(rows) / seconds,
        "questions_per_s": sum(r["questions"] for r in rows if r) / seconds,
        "one_at_a_time": True,
    }


def server_groups(
    smoke: bool,
    sides: list[str],
    rows: list[Row],
    loads: list[Load],
    serve_args: list[str] | None = None,
    one_server: bool = False,
) -> list[tuple[str, str, list[str], list[Row], list[Load]]]:
    """(side, server name, extra flags, rows, loads) of each vLLM server to
    start, in order: the default server of each side, then the long ones (with
    ``one_server``, a single long server of each side for everything);
    ``serve_args`` end every server's flags."""
    long_flags = ["--max-model-len", str(LONG_MAX_MODEL_LEN)]
    # The smoke run's scaled long states fit the default server.
    separate_long = not smoke
    groups = (
        [("one", long_flags, rows, loads)]
        if one_server
        else [
            ("default", [], [r for r in rows if not (separate_long and r.long)], loads),
            ("long", long_flags, [r for r in rows if separate_long and r.long], []),
        ]
    )
    return [
        (
            side,
            name + suffix,
            flags + side_flags + list(serve_args or []),
            group_rows,
            group_loads,
        )
        for name, flags, group_rows, group_loads in groups
        if group_rows or group_loads
        for side in sides
        for suffix, side_flags in [VLLM_SIDES[side]]
    ]


def _run_vllm(
    args: argparse.Namespace,
    plan: Plan,
    budget: Budget,
    progress: Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], object],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The servers of the plan's vLLM sides (by name), their row results and
    load results (by side, then id); ``progress`` gets the three so far after
    each row, load and server."""
    sides, loads = plan.vllm_sides, plan.loads
    servers: dict[str, Any] = {}
    row_results: dict[str, dict[str, Any]] = {side: {} for side in sides}
    load_results: dict[str, dict[str, Any]] = {side: {} for side in sides}

    def server_progress(side: str, name: str, server: dict[str, Any]) -> None:
        progress(
            {**servers, name: server},
            {**row_results, side: {**row_results[side], **server["rows"]}},
            {**load_results, side: {**load_results[side], **server["loads"]}},
        )

    from .vllm_side import run_group

    pools = {
        mix: interleave(
            [
                row_requests(
                    ROWS_BY_ID[row_id],
                    args.pool,
                    seed=args.seed,
                    words_per_token=plan.word_ratio,
                    state_scale=plan.state_scale,
                    first_index=POOL_OFFSET,
                )
                for row_id in MIXES[mix]
            ]
        )
        for mix in sorted({load.mix for load in loads})
    }
    groups = server_groups(
        args.smoke, sides, plan.rows, loads, args.serve_arg, args.one_server
    )
    for side, name, flags, group_rows, group_loads in groups:
        if budget.exhausted():
            for row in group_rows:
                row_results[side][row.id] = {"status": "skipped (time budget)"}
            for load in group_loads:
                load_results[side][load.id] = {"status": "skipped (time budget)"}
            continue
        servers[name] = run_group(
            str(plan.checkpoint),
            name,
            flags,
            group_rows,
            plan.requests,
            group_loads,
            pools,
            plan.startup_request,
            warmup=args.warmup,
            long_warmup=args.vllm_long_warmup,
            budget=budget,
            throughput={
                "warmup_s": args.throughput_warmup,
                "duration_s": args.throughput_seconds,
                "max_requests": args.max_requests,
            },
            logs=args.out,
            progress=functools.partial(server_progress, side, name),
        )
        row_results[side].update(servers[name]["rows"])
        load_results[side].update(servers[name]["loads"])
        progress(servers, row_results, load_results)
    return servers, row_results, load_results


def _quotient(top: dict[str, Any], bottom: dict[str, Any], key: str) -> float | None:
    """``top[key] / bottom[key]`` where both sides were measured, else None."""
    if top.get("status") == "ok" and bottom.get("status") == "ok":
        return top[key] / bottom[key]
    return None


def _latency_entry(
    row: Row,
    accounting: list[dict[str, Any]],
    warmup: int,
    sides: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """One latency row of the results, ``sides`` its result on each side (in
    ``SIDES`` order); its token counts are those of the first timed request,
    ``requests`` has every request's."""
    for side, key in USAGE_TOKENS.items():
        if sides[side].get("status") == "ok":
            expected = [a[key] for a in accounting[warmup:]]
            got = sides[side]["input_tokens"]
            sides[side]["usage_matches_render"] = got == expected[: len(got)]
    timed = accounting[warmup]
    return {
        "id": row.id,
        "label": row.label,
        "questions": row.questions,
        "media": row.media,
        "long": row.long,
        **{k: v for k, v in timed.items() if k != "prompt_lengths"},
        "requests": accounting,
        **sides,
        "ratio": _quotient(sides["vllm"], sides["reference"], "p50_s"),
        "ratio_per_question": _quotient(
            sides["vllm_per_question"], sides["reference"], "p50_s"
        ),
        "speedup_state_once": _quotient(
            sides["vllm_per_question"], sides["vllm"], "p50_s"
        ),
        "default_over_triton_gdn": _quotient(
            sides["vllm"], sides["vllm_triton_gdn"], "p50_s"
        ),
        "portable_over_default": _quotient(
            sides["vllm_portable"], sides["vllm"], "p50_s"
        ),
        "dp2_over_default": _quotient(sides["vllm_dp2"], sides["vllm"], "p50_s"),
    }


def _throughput_entry(
    load: Load, vllm: dict[str, dict[str, Any]], latency: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One load of the results, ``vllm`` its result on each vLLM side."""
    sides = {**vllm, "reference": _reference_throughput(load.mix, latency)}
    return {
        "id": load.id,
        "mix": load.mix,
        "mix_rows": list(MIXES[load.mix]),
        "clients": load.clients,
        **sides,
        "ratio": _quotient(sides["vllm"], sides["reference"], "requests_per_s"),
        "ratio_per_question": _quotient(
            sides["vllm_per_question"], sides["reference"], "requests_per_s"
        ),
        "speedup_state_once": _quotient(
            sides["vllm"], sides["vllm_per_question"], "requests_per_s"
        ),
        "default_over_triton_gdn": _quotient(
            sides["vllm"], sides["vllm_triton_gdn"], "requests_per_s"
        ),
        "portable_over_default": _quotient(
            sides["vllm_portable"], sides["vllm"], "requests_per_s"
        ),
        "dp2_over_default": _quotient(
            sides["vllm_dp2"], sides["vllm"], "requests_per_s"
        ),
    }


@dataclasses.dataclass
class Plan:
    """What a run sends and to whom, worked out before anything is timed."""

    checkpoint: Path
    weights: str
    state_scale: float
    word_ratio: float
    rows: list[Row]
    loads: list[Load]
    requests: dict[str, list[dict[str, Any]]]
    startup_request: dict[str, Any]
    #: Per row, each request's token counts (``token_accounting``).
    accounting: dict[str, list[dict[str, Any]]]
    vllm_sides: list[str]
    ref_device: str
    ref_dtype: torch.dtype


def make_plan(args: argparse.Namespace, work: Path) -> Plan:
    checkpoint = prepare_checkpoint(args, work)
    renderer = RandomInitRuntime(checkpoint, device="meta")
    scale = SMOKE_STATE_SCALE if args.smoke else 1.0
    word_ratio = words_per_token(renderer.tokenizer)
    rows = [ROWS_BY_ID[i] for i in select(ROWS_BY_ID, args.patterns)]
    load_ids = select([load.id for load in THROUGHPUT_ROWS], args.patterns)
    log(f"building requests for {len(rows)} rows")
    requests = {
        row.id: row_requests(
            row,
            args.warmup + (args.long_repeats if row.long else args.repeats),
            seed=args.seed,
            words_per_token=word_ratio,
            state_scale=scale,
        )
        for row in rows
    }
    accounting = {
        row_id: [token_accounting(renderer.render(r)) for r in batch]
        for row_id, batch in requests.items()
    }
    log("requests rendered (tokens per request counted)")
    cuda = torch.cuda.is_available()
    # transformers binds flash-linear-attention's CUDA kernels wherever it is
    # installed, so with CUDA the reference runs there, smoke runs included.
    ref_device = args.reference_device or ("cuda" if cuda else "cpu")
    return Plan(
        checkpoint=checkpoint,
        weights="weights loaded" if has_weights(checkpoint) else "random weights",
        state_scale=scale,
        word_ratio=word_ratio,
        rows=rows,
        loads=[load for load in THROUGHPUT_ROWS if load.id in load_ids],
        requests=requests,
        startup_request=row_requests(
            STARTUP_ROW, 1, seed=args.seed, words_per_token=word_ratio
        )[0],
        accounting=accounting,
        vllm_sides=[s for s in VLLM_SIDES if s in args.sides] if cuda else [],
        ref_device=ref_device,
        ref_dtype=torch.bfloat16 if ref_device == "cuda" else torch.float32,
    )


def reference_results(args: argparse.Namespace, plan: Plan, budget: Budget) -> dict:
    """The reference side's rows, or why it did not run."""
    if "reference" not in args.sides:
        return {"status": "not run (--sides)", "rows": {}}
    log(f"reference on {plan.ref_device} ({plan.ref_dtype}), {plan.weights}")
    threads = torch.get_num_threads()
    if args.smoke:
        # The tiny model's matrices are too small to gain from threads.
        torch.set_num_threads(1)
    try:
        return run_reference(
            plan.checkpoint,
            plan.rows,
            plan.requests,
            plan.startup_request,
            device=plan.ref_device,
            dtype=plan.ref_dtype,
            warmup=args.warmup,
            budget=budget.share(args.reference_share) if plan.vllm_sides else budget,
            seed=args.seed,
        )
    finally:
        torch.set_num_threads(threads)


def run_settings(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    return {
        "shape": "tiny" if args.smoke else "d3-turbo",
        "checkpoint": str(plan.checkpoint),
        "weights": plan.weights,
        "repeats": args.repeats,
        "long_repeats": args.long_repeats,
        "warmup": args.warmup,
        "vllm_long_warmup": args.vllm_long_warmup,
        "time_budget_s": args.time_budget,
        "reference_share": args.reference_share,
        "reference": f"{plan.ref_device}, {str(plan.ref_dtype).removeprefix('torch.')}",
        "state_scale": plan.state_scale,
        "words_per_token": plan.word_ratio,
        "seed": args.seed,
        "sides": args.sides,
        "throughput": {
            "warmup_s": args.throughput_warmup,
            "duration_s": args.throughput_seconds,
            "max_requests": args.max_requests,
            "distinct_requests_per_row": args.pool,
        },
    }


@dataclasses.dataclass
class ResultsWriter:
    """Writes the results so far (``results.json``, ``results.md``, the plot):
    a run cut short still leaves its rows."""

    out: Path
    mode: str
    command: str
    settings: dict[str, Any]
    plan: Plan
    warmup: int
    reference: dict[str, Any]
    #: What a side that does not run shows.
    not_run: dict[str, Any]

    def write(
        self,
        servers: dict[str, Any],
        vllm_rows: dict[str, dict[str, Any]],
        vllm_loads: dict[str, dict[str, Any]],
        missing: dict[str, Any],
    ) -> dict[str, Any]:
        """``missing`` stands for a result a side that runs does not have."""
        reference = self.reference
        latency = [
            _latency_entry(
                row,
                self.plan.accounting[row.id],
                self.warmup,
                {
                    **self._vllm_results(vllm_rows, row.id, missing),
                    "reference": reference["rows"].get(
                        row.id, {"status": reference.get("status")}
                    ),
                },
            )
            for row in self.plan.rows
        ]
        by_id = {entry["id"]: entry for entry in latency}
        throughput = [
            _throughput_entry(
                load, self._vllm_results(vllm_loads, load.id, missing), by_id
            )
            for load in self.plan.loads
        ]
        results = {
            "mode": self.mode,
            "command": self.command,
            "environment": {
                **_environment(),
                "reference_gdn_kernels": reference.get("gdn_kernels"),
            },
            "settings": self.settings,
            "latency": latency,
            "throughput": throughput,
            "vllm_servers": servers,
            "reference": {k: v for k, v in reference.items() if k != "rows"},
            "skipped": [
                f"{entry['id']} ({side}): {entry[side]['status']}"
                for entry in latency + throughput
                for side in SIDES
                if str(entry[side].get("status", "")).startswith("skipped")
            ],
        }
        results["plot"] = report.plot(results, self.out / "latency_vs_state.png")
        (self.out / "results.json").write_text(json.dumps(results, indent=1))
        (self.out / "results.md").write_text(report.markdown(results))
        return results

    def _vllm_results(
        self, results: dict[str, dict[str, Any]], item: str, missing: dict[str, Any]
    ) -> dict[str, dict[str, Any]]:
        """Each vLLM side's result for ``item`` (a row or load id)."""
        return {
            side: results.get(side, {}).get(
                item, dict(missing if side in self.plan.vllm_sides else self.not_run)
            )
            for side in VLLM_SIDES
        }


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    out: Path = args.out
    work: Path = args.work or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.time_budget)
    plan = make_plan(args, work)
    cuda = torch.cuda.is_available()
    writer = ResultsWriter(
        out,
        "smoke" if args.smoke else "full",
        command,
        run_settings(args, plan),
        plan,
        args.warmup,
        reference_results(args, plan, budget),
        {"status": "not run (--sides)" if cuda else NOT_RUN_NO_CUDA},
    )
    if not plan.vllm_sides:
        results = writer.write({}, {}, {}, writer.not_run)
    else:
        pending = {"status": "pending (vLLM has not run yet)"}
        writer.write({}, {}, {}, pending)
        log(f"reference written to {out / 'results.json'}")
        servers, vllm_rows, vllm_loads = _run_vllm(
            args,
            plan,
            budget,
            lambda done_servers, done_rows, done_loads: writer.write(
                done_servers, done_rows, done_loads, pending
            ),
        )
        results = writer.write(servers, vllm_rows, vllm_loads, writer.not_run)
    if results["skipped"]:
        log(f"skipped: {'; '.join(results['skipped'])}")
    log(f"plot: {results['plot']}")
    log(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    run(args, shlex.join(["python", "-m", "benchmarks.d3", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
