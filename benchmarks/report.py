"""``results.md`` and ``latency_vs_state.png`` from the benchmark's results.

Contract:
- ``markdown(results)`` renders the results dictionary written by
  ``benchmarks.d3`` as markdown: latency rows with the p50 of each side
  (``rows.SIDES``: vLLM state once, on the portable kernel, on two GPUs, per
  question, the reference), the ratios of the p50s, the tokens each side
  computes per request and how many times it reads the state; where a vLLM
  side has them, each row's HTTP latency against the engine's time per
  request (``vllm_side.engine_time``); throughput with each side's requests
  and questions per second and their ratios; start-up and peak GPU memory of
  each server, skipped rows and the environment. A side that did not run
  shows its status instead of a number.
- ``plot(results, path)`` draws p50 latency against the state block size for
  the rows without media, every side measured, log-log. It returns a note: the
  file written, or why it was skipped (matplotlib missing, nothing measured).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .rows import SIDES

#: How the tables and the plot name each side.
LABELS = {
    "vllm": "vLLM state once",
    "vllm_triton_gdn": "vLLM state once, Triton GDN",
    "vllm_portable": "vLLM state once, portable kernel",
    "vllm_dp2": "vLLM state once, 2 GPUs (DP=2)",
    "vllm_per_question": "vLLM per question",
    "reference": "reference",
}
#: What a cell holding one value per side, "a / b / c", lists.
PER_SIDE = "state once / Triton GDN / portable / DP=2 / per question / reference"


def _ok(side: dict[str, Any] | None) -> bool:
    return side is not None and side.get("status") == "ok"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def _status(side: dict[str, Any] | None) -> str:
    return "not run" if not side else str(side.get("status"))


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _side_cells(
    entry: dict[str, Any],
    render: Callable[[dict[str, Any]], list[str]],
    width: int = 1,
) -> list[str]:
    """Each side's ``width`` cells, in ``SIDES`` order: ``render(side)`` where
    the side was measured, else its status and blanks."""
    cells: list[str] = []
    for side in (entry[name] for name in SIDES):
        cells += render(side) if _ok(side) else [_status(side)] + [""] * (width - 1)
    return cells


def _header(columns: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def _ratio_cells(entry: dict[str, Any]) -> str:
    keys = (
        "ratio",
        "ratio_per_question",
        "speedup_state_once",
        "default_over_triton_gdn",
        "portable_over_default",
        "dp2_over_default",
    )
    return " | ".join(_ratio(entry[key]) for key in keys)


def _tokens(row: dict[str, Any], side: str) -> str:
    """The tokens ``side`` computes, with its ``usage.input_tokens`` where
    they differ."""
    shown = f"{row[f'tokens_{side}']:,}"
    if _ok(row[side]) and row[side].get("usage_matches_render") is False:
        shown += f" (usage.input_tokens {row[side]['input_tokens']})"
    return shown


def _latency_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = _header(
        [
            "row",
            "questions",
            "state tokens",
            *(f"{LABELS[side]} p50 (ms)" for side in SIDES),
            "state once / reference",
            "per question / reference",
            "per question / state once",
            "state once / Triton GDN",
            "portable / state once",
            "DP=2 / state once",
            f"tokens computed: {PER_SIDE}",
            f"state reads: {PER_SIDE}",
        ]
    )
    for row in rows:
        cells = _side_cells(row, lambda side: [_ms(side["p50_s"])])
        tokens = " / ".join(_tokens(row, side) for side in SIDES)
        reads = " / ".join(str(row[f"state_reads_{side}"]) for side in SIDES)
        lines.append(
            f"| {row['label']} | {row['questions']} | {row['state_tokens']:,} "
            f"| {' | '.join(cells)} | {_ratio_cells(row)} | {tokens} | {reads} |"
        )
    return lines


def _engine_table(rows: list[dict[str, Any]]) -> list[str]:
    """HTTP against engine time per request, for every vLLM side that has it."""
    entries = [
        (row, side, row[side]["engine"])
        for row in rows
        for side in SIDES
        if _ok(row[side]) and "e2e_s" in row[side].get("engine", {})
    ]
    if not entries:
        return []
    lines = [
        "### vLLM: HTTP and engine time per request",
        "",
        "Means over each row's requests, warm-ups included, from vLLM's "
        "per-request histograms (`/metrics`): *engine* from a request's arrival "
        "at the engine to its end (summed over the engine requests of one HTTP "
        "request, which overlap), of it the wait in the queue and the prefill; "
        "*front end* the rest of the HTTP latency, where one HTTP request is one "
        "engine request.",
        "",
        *_header(
            [
                "row",
                "side",
                "HTTP (ms)",
                "engine (ms)",
                "queue (ms)",
                "prefill (ms)",
                "front end (ms)",
                "engine requests",
            ]
        ),
    ]
    for row, side, engine in entries:
        parts = [engine["http_mean_s"], engine["e2e_s"]]
        parts += [engine.get(f"{key}_s") for key in ("queue", "prefill")]
        cells = ["" if part is None else _ms(part) for part in parts]
        front = engine["http_mean_s"] - engine["e2e_s"]
        one = engine["engine_requests"] == 1
        lines.append(
            f"| {row['label']} | {LABELS[side]} | {' | '.join(cells)} "
            f"| {_ms(front) if one else ''} | {engine['engine_requests']:g} |"
        )
    return [*lines, ""]


def _throughput_table(loads: list[dict[str, Any]]) -> list[str]:
    lines = _header(
        [
            "mix",
            "clients",
            *(
                f"{LABELS[side]} {unit}"
                for side in SIDES
                for unit in ("req/s", "questions/s")
            ),
            "state once / reference (req/s)",
            "per question / reference",
            "state once / per question",
            "portable / state once",
            "DP=2 / state once",
        ]
    )
    for load in loads:
        cells = _side_cells(
            load,
            lambda side: [
                f"{side['requests_per_s']:.2f}",
                f"{side['questions_per_s']:.1f}",
            ],
            width=2,
        )
        lines.append(
            f"| {load['mix']} | {load['clients']} | {' | '.join(cells)} "
            f"| {_ratio_cells(load)} |"
        )
    return lines


def _startup_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| | start-up to first answer (s) | peak GPU memory (GiB) | GPUs used "
        "| max_model_len | full attention |",
        "|---|---|---|---|---|---|",
    ]
    for name, group in results["vllm_servers"].items():
        startup, memory = group.get("startup", {}), group.get("memory", {})
        first = f"{startup['first_answer_s']:.1f}" if _ok(startup) else _status(startup)
        peak = _gib(memory["peak_memory_gib"]) if _ok(memory) else memory.get("status")
        gpus = ", ".join(memory.get("gpus", []))
        lines.append(
            f"| vLLM, {name} server (`{shlex.join(group['command'][3:])}`) | {first} "
            f"| {peak} | {gpus} | {startup.get('max_model_len', '')} "
            f"| {startup.get('attention_kernel') or ''} |"
        )
    reference = results["reference"]
    if reference.get("startup"):
        startup = reference["startup"]
        lines.append(
            f"| reference ({startup['weights']}, {results['settings']['reference']}) "
            f"| {startup['first_answer_s']:.1f} "
            f"| {_gib(reference.get('peak_memory_gib')) or 'n/a (CPU)'} | | | |"
        )
    else:
        lines.append(f"| reference | {_status(reference)} | | | | |")
    return lines


def _vllm_long_warmup(settings: dict[str, Any]) -> str:
    if settings["vllm_long_warmup"] == settings["warmup"]:
        return ""
    return (
        f" ({settings['vllm_long_warmup']} for vLLM's long states: "
        "it times the same requests)"
    )


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [
        f"# D3 benchmark: vLLM + vllm-d3 vs the reference runtime ({results['mode']})",
        "",
        "Generated by `benchmarks.d3` from one run; do not edit by hand.",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Checkpoint: {settings['shape']} shape, {settings['weights']}. "
        f"Latency: p50 of up to {settings['repeats']} timed requests "
        f"({settings['long_repeats']} for the long states) after "
        f"{settings['warmup']} warm-up{_vllm_long_warmup(settings)}, one "
        "request at a time, each request distinct. vLLM is timed over HTTP "
        "(`/v1/systemone`): *state once* is the plugin's default, all questions "
        "of a request in one engine request (state || q1 || ... || qQ); *per "
        "question* a server with `--additional-config "
        "'{\"d3_state_once\": false}'`, one engine request per question. The "
        "reference is timed in process (`answer(path='state_once')`, the state "
        "read once).",
        "",
        "## Latency",
        "",
        *(
            [
                f"Long states scaled by {settings['state_scale']:g} for this run: "
                "the state tokens column shows what was sent.",
                "",
            ]
            if settings["state_scale"] != 1
            else []
        ),
        "Ratios of the p50s: below 1 means the first named is faster. Tokens "
        "computed per request (s state tokens, n_i each question's prompt "
        "length): state once and the reference read the state once, "
        "s + sum(n_i - s); per question reads it for every question, sum(n_i). "
        "A vLLM count whose `usage.input_tokens` differ shows them beside it.",
        "",
        *_latency_table(results["latency"]),
        "",
        *_engine_table(results["latency"]),
        "## Throughput (closed loop over HTTP)",
        "",
        f"Each run: {settings['throughput']['warmup_s']:g} s warm-up; the requests "
        "begun after it count. Each client sends for "
        f"{settings['throughput']['duration_s']:g} s more, then until one request "
        "of its own that counts has finished; req/s is the sum over clients of "
        "each one's answers over its own span, from its first counted request's "
        "start to its last one's end. The reference "
        "serves one request at a time: its figures are the mix's requests over "
        "the sum of their latency-row p50s. Ratios of the requests per second: "
        "above 1 means the first named serves more.",
        "",
        *_throughput_table(results["throughput"]),
        "",
        "## Start-up and memory",
        "",
        "vLLM: server process start to the first HTTP 200 of `/v1/systemone`; "
        "peak of nvidia-smi `memory.used` while the server lives, less its "
        "value before (vLLM reserves its KV cache up front, so this is mostly "
        "`--gpu-memory-utilization`). Reference: runtime construction to its "
        "first answer; peak of `torch.cuda.max_memory_allocated`.",
        "",
        *_startup_table(results),
        "",
    ]
    for name, group in results["vllm_servers"].items():
        if group.get("memory_log"):
            lines += [f"vLLM {name} server log (memory):", ""]
            lines += [f"    {line}" for line in group["memory_log"]]
            lines += [""]
    lines += ["## Skipped", ""]
    lines += [f"- {item}" for item in results["skipped"]] or ["- nothing"]
    lines += ["", "## Environment", ""]
    lines += [f"- {key}: {value}" for key, value in results["environment"].items()]
    lines += ["", f"Plot: {results['plot']}", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    rows = [r for r in results["latency"] if not r["media"]]
    series = {}
    for side, marker in zip(SIDES, ("o", "x", "D", "v", "^", "s"), strict=True):
        points = sorted(
            (r["state_tokens"], r[side]["p50_s"], r["id"]) for r in rows if _ok(r[side])
        )
        if points:
            series[side] = (points, marker)
    if not series:
        return "skipped: no text row was measured"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for side, (points, marker) in series.items():
        xs, ys, _ = zip(*points, strict=True)
        axes.plot(xs, ys, marker, label=LABELS[side])
        for x, y, row_id in points:
            axes.annotate(row_id, (x, y), textcoords="offset points", xytext=(4, 4))
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("state block size (tokens)")
    axes.set_ylabel("p50 latency per request (s)")
    axes.set_title(f"D3 latency vs state length ({results['mode']})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path.name
