"""Soak: one ``vllm serve`` of the d3-turbo-shaped package driven for minutes by
many clients with a mixed, seeded workload (GPU; ``--url`` drives a server
that is already up).

``python -m benchmarks.soak --out DIR [--minutes 20] [--clients 64] [--seed 0]
[--burst-minute M [--burst-states N]] [--url URL [--server-pid PID] [--server-log FILE]]
[--serve-arg=FLAG ...]``

Contract:
- Without ``--url`` a weight-less d3-turbo package is written under
  ``OUT/work`` and served with ``--max-model-len`` (131072 by default; the
  over-long bad input is twice it), the test servers' flags,
  ``--enable-log-requests --max-log-len 0`` (its log then names each request
  the engine aborts) and ``--serve-arg``; the state is read once.
- Each client sends one request after another until the time is up: the text
  and media rows' requests, a long state (``--long-tokens``) in about 1 of 20,
  a request cancelled part-way (its connection closed after a random delay)
  in about 1 of 20, a bad input in about 1 of 50 (``BAD_BODIES``, then the
  validation's bad /v1/systemone bodies, ``validation.bad_inputs``), and one of
  ``REPEATED`` fixed text requests or a fixed long state of the shortest
  ``--long-tokens`` (which a prefix_bidir server's state cache keeps between
  its asks, until evicted) in about 1 of 30, whose answers are held to their
  first. ``--burst-minute M``: at minute M ``--burst-states`` clients
  (``BURST_STATES``) each send a state of the longest ``--long-tokens`` at
  once, more than the KV cache holds, which must queue and be answered
  (``burst``).
- Per minute (``--minute-seconds``): requests by outcome (``OUTCOMES``), p50
  and p99 latency per kind, GPU memory used, the server's RSS (its process
  tree), vLLM's running and waiting requests from ``/metrics``. At the end:
  ``unanswered`` (requests neither cancelled nor bad that got no 200), bad
  inputs that got no 4xx, ``drift_max_dp``, the memory growth of the last 10
  minutes against minute 10 (``growth_pct``), and the requests the engine
  aborted (``aborted_in_engine``, from the server log).
- Writes ``OUT/soak.json``, ``OUT/soak.md`` and, with matplotlib,
  ``OUT/soak.png``; at the end of every minute ``OUT/soak.partial.json``, the
  results so far (the requests that ended; no engine aborts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_d3.testing.compare import compare, flatten
from vllm_d3.testing.requests import (
    questions,
    request_sets,
    text_state,
    words_per_token,
)
from vllm_d3.testing.server import Server

from .startup import package
from .timing import log, run_record
from .validation import LONG_MAX_MODEL_LEN, bad_inputs
from .vllm_side import gpu_memory_used_mib, metric_sums, serve_flags

ROUTE = "/v1/systemone"
#: ``connection_error``: the connection failed or closed with no reply.
OUTCOMES = ("200", "4xx", "5xx", "cancelled", "client_timeout", "connection_error")
#: Shares of the jobs (the rest are text and media rows' requests).
SHARES = {"long": 1 / 20, "cancel": 1 / 20, "bad": 1 / 50, "repeat": 1 / 30}
#: The share of the ordinary requests that carry media.
MEDIA_SHARE = 0.25
#: The fixed text requests asked again through the run (beside one long state).
REPEATED = 3
#: The long states' lengths in tokens (d3-turbo at --max-model-len 131072).
LONG_TOKENS = (24_000, 117_000)
#: The burst's longest states: 10 x 117K tokens is more than the 915K tokens a
#: 141 GB Hopper GPU's KV cache holds at d3-turbo's shape and --max-model-len
#: 131072, and about 3 minutes of its GPU.
BURST_STATES = 10
#: How long a cancelled request runs before its client closes the connection.
CANCEL_AFTER_S = (0.2, 3.0)
#: Memory growth is the last ``GROWTH_WINDOW`` minutes against this minute.
GROWTH_FROM_MINUTE = 10
GROWTH_WINDOW = 10
#: The soak's own bad bodies, beside the validation's: (what, body, headers).
BAD_BODIES: tuple[tuple[str, bytes, dict[str, str]], ...] = (
    ("malformed JSON", b'{"state": "x", "questions": {', {}),
    ("wrong types", b'{"state": "x", "questions": ["not", "a", "mapping"]}', {}),
    ("bad zstd", b"\x00 this is not a zstd frame \xff", {"content-encoding": "zstd"}),
)
ABORT_LINE = re.compile(r"Aborted request\(s\) (\S+)\.")
#: The results so far, rewritten at the end of every minute.
PARTIAL = "soak.partial.json"


@dataclass(frozen=True)
class Job:
    """One request a client sends: its kind, body and headers; ``cancel_after``
    (seconds) for a request the client gives up on; ``repeat`` for a fixed one."""

    kind: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    cancel_after: float | None = None
    repeat: int | None = None


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def bad_jobs(max_model_len: int) -> list[Job]:
    """The bodies the server must refuse with a 4xx, one job each."""
    jobs = [Job("bad", body, headers) for _, body, headers in BAD_BODIES]
    # The validation's bad /v1/systemone bodies (the prompt ids it also takes
    # are for its /classify ones).
    for _, route, body in bad_inputs([1], 1, max_model_len):
        if route == ROUTE:
            jobs.append(Job("bad", _json(body)))
    return jobs


class Workload:
    """The seeded sequence of jobs every client draws from."""

    def __init__(
        self,
        seed: int,
        *,
        per_token: float,
        long_tokens: tuple[int, int],
        max_model_len: int,
        media: bool = True,
    ) -> None:
        self.rng = random.Random(seed)
        sets = request_sets(seed, per_set=4, media=media, long=False)
        carries_media = {n: "image" in n or "video" in n for n in sets}
        self.text = [r for n, rs in sets.items() if not carries_media[n] for r in rs]
        self.media = [r for n, rs in sets.items() if carries_media[n] for r in rs]
        self.per_token = per_token
        self.long_tokens = long_tokens
        self.bad = bad_jobs(max_model_len)
        self.repeated = [
            *(_json(r) for r in self.text[:REPEATED]),
            self.long_state(long_tokens[0]),
        ]

    def long_state(self, tokens: int | None = None) -> bytes:
        tokens = tokens or self.rng.randint(*self.long_tokens)
        words = max(1, int(tokens * self.per_token))
        count = self.rng.choice((2, 4))
        return _json(
            {
                "state": text_state(self.rng, words),
                "questions": questions(self.rng, count),
            }
        )

    def burst(self) -> Job:
        """A longest state, which the burst's clients send at once."""
        return Job("burst", self.long_state(self.long_tokens[1]))

    def special_kind(self) -> str | None:
        """The kind of ``SHARES`` the next job is, or ``None`` for a row's."""
        draw = self.rng.random()
        for kind, share in SHARES.items():
            if draw < share:
                return kind
            draw -= share
        return None

    def next(self) -> Job:
        kind = self.special_kind()
        if kind is None:
            kind = "media" if self.media and self.rng.random() < MEDIA_SHARE else "text"
            return Job(
                kind,
                _json(self.rng.choice(self.media if kind == "media" else self.text)),
            )
        if kind == "long":
            return Job("long", self.long_state())
        if kind == "cancel":
            return Job(
                "cancel",
                self.long_state(),
                cancel_after=self.rng.uniform(*CANCEL_AFTER_S),
            )
        if kind == "bad":
            return self.rng.choice(self.bad)
        index = self.rng.randrange(len(self.repeated))
        return Job("repeat", self.repeated[index], repeat=index)


@dataclass
class Outcome:
    """What one job got: the minute it ended in, its outcome and latency, and
    a repeated request's answers (of a 200)."""

    minute: int
    kind: str
    outcome: str
    seconds: float
    answers: list[dict[str, Any]] | None = None
    repeat: int | None = None


def outcome_of(status: int) -> str:
    return "200" if status == 200 else f"{status // 100}xx"


async def send(
    client: httpx.AsyncClient, job: Job, timeout: float
) -> tuple[str, list[dict[str, Any]] | None]:
    """Send ``job``; its outcome and, for a 200, its answers. A cancelled job's
    connection is closed when its delay is up (the request's task cancelled)."""
    headers = {"content-type": "application/json", **job.headers}
    request = client.post(ROUTE, content=job.body, headers=headers)
    try:
        reply = await asyncio.wait_for(request, job.cancel_after or timeout)
    except (TimeoutError, httpx.TimeoutException):
        return ("cancelled" if job.cancel_after else "client_timeout"), None
    except httpx.TransportError:
        return "connection_error", None
    outcome = outcome_of(reply.status_code)
    return outcome, flatten([reply.json()]) if outcome == "200" else None


@dataclass(frozen=True)
class Schedule:
    """When the soak runs (``time.monotonic`` seconds), how long its minute and a
    request's patience are, and when the burst starts (``None``: no burst)."""

    started: float
    deadline: float
    minute_s: float
    timeout: float
    burst_at: float | None


async def client_loop(
    client: httpx.AsyncClient,
    workload: Workload,
    schedule: Schedule,
    outcomes: list[Outcome],
    in_burst: bool,
) -> None:
    burst_due = in_burst and schedule.burst_at is not None
    while (begun := time.monotonic()) < schedule.deadline:
        if burst_due and begun >= schedule.started + (schedule.burst_at or 0):
            job, burst_due = workload.burst(), False
        else:
            job = workload.next()
        outcome, answers = await send(client, job, schedule.timeout)
        ended = time.monotonic()
        minute = int((ended - schedule.started) // schedule.minute_s)
        # Only a repeated request's answers are compared: keep no others.
        kept = answers if job.repeat is not None else None
        outcomes.append(
            Outcome(minute, job.kind, outcome, ended - begun, kept, job.repeat)
        )


def tree_rss_mib(pid: int) -> float | None:
    """The resident memory of ``pid`` and its descendants (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    tree = {pid}
    while grown := {p for p, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    total = 0
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        if match := re.search(r"VmRSS:\s+(\d+) kB", status):
            total += int(match.group(1))
    return total / 1024 if total else None


async def sample(
    client: httpx.AsyncClient, server_pid: int | None
) -> dict[str, float | None]:
    """GPU memory, the server's RSS and vLLM's queue, now."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    try:
        queue = metric_sums((await client.get("/metrics")).text, names)
    except httpx.HTTPError:
        queue = {}
    return {
        "gpu_memory_mib": gpu_memory_used_mib(),
        "rss_mib": tree_rss_mib(server_pid) if server_pid else None,
        "running": queue.get(names[0]),
        "waiting": queue.get(names[1]),
    }


#: Called with the outcomes and samples so far at the end of every minute.
MinuteHook = Callable[[list[Outcome], list[dict[str, float | None]]], None]


async def sampler(
    client: httpx.AsyncClient,
    server_pid: int | None,
    schedule: Schedule,
    outcomes: list[Outcome],
    samples: list[dict[str, float | None]],
    on_minute: MinuteHook | None,
) -> None:
    """One sample at the end of every minute, then ``on_minute``."""
    while (left := schedule.deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(schedule.minute_s, left))
        samples.append(await sample(client, server_pid))
        if on_minute is not None:
            on_minute(outcomes, samples)


async def drive(
    url: str,
    workload: Workload,
    *,
    clients: int,
    server_pid: int | None,
    minutes: float,
    minute_s: float,
    timeout: float,
    burst_minute: float | None,
    burst_states: int = BURST_STATES,
    on_minute: MinuteHook | None = None,
) -> tuple[list[Outcome], list[dict[str, float | None]]]:
    """Run ``clients`` client loops and the sampler for ``minutes``; the first
    ``burst_states`` clients send the burst."""
    outcomes: list[Outcome] = []
    samples: list[dict[str, float | None]] = []
    limits = httpx.Limits(
        max_connections=clients + 1, max_keepalive_connections=clients + 1
    )
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        started = time.monotonic()
        burst_at = None if burst_minute is None else burst_minute * minute_s
        schedule = Schedule(
            started, started + minutes * minute_s, minute_s, timeout, burst_at
        )
        await asyncio.gather(
            sampler(client, server_pid, schedule, outcomes, samples, on_minute),
            *(
                client_loop(client, workload, schedule, outcomes, n < burst_states)
                for n in range(clients)
            ),
        )
    return outcomes, samples


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def per_minute(
    outcomes: list[Outcome], samples: list[dict[str, float | None]]
) -> list[dict[str, Any]]:
    """Each minute's outcomes, latency per kind (requests answered 200) and sample."""
    minutes = []
    for minute, taken in enumerate(samples):
        ended = [o for o in outcomes if o.minute == minute]
        latency = {}
        for kind in sorted({o.kind for o in ended if o.outcome == "200"}):
            times = [o.seconds for o in ended if o.kind == kind and o.outcome == "200"]
            latency[kind] = {
                "p50_s": statistics.median(times),
                "p99_s": _percentile(times, 0.99),
            }
        counts = Counter(o.outcome for o in ended)
        minutes.append(
            {
                "minute": minute + 1,
                "by_outcome": {name: counts[name] for name in OUTCOMES},
                "latency": latency,
                **taken,
            }
        )
    return minutes


def growth_pct(levels: list[float | None]) -> float | None:
    """The largest level of the last ``GROWTH_WINDOW`` minutes against minute
    ``GROWTH_FROM_MINUTE`` (of a shorter run: its middle minute, against the
    minutes after it), in percent."""
    if len(levels) < 2 or any(v is None for v in levels):
        return None
    start = min(GROWTH_FROM_MINUTE, len(levels) // 2) - 1
    base = levels[max(start, 0)]
    window = levels[max(start + 1, len(levels) - GROWTH_WINDOW) :]
    assert base is not None
    return 100 * (max(v for v in window if v is not None) - base) / base


def drift_max_dp(outcomes: list[Outcome]) -> float | None:
    """The largest |dp| of a repeated request's answers against its first."""
    first: dict[int, list[dict[str, Any]]] = {}
    worst = None
    for o in outcomes:
        if o.repeat is None or o.answers is None:
            continue
        if o.repeat not in first:
            first[o.repeat] = o.answers
            continue
        dp = compare(first[o.repeat], o.answers)["max_dp"]
        worst = dp if worst is None else max(worst, dp)
    return worst


def aborted_ids(log_text: str) -> set[str]:
    """The engine request ids a ``--enable-log-requests`` server log aborted."""
    return {i for ids in ABORT_LINE.findall(log_text) for i in ids.split(",")}


def _burst(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """The burst's requests: how many were sent and answered, the slowest."""
    burst = [o for o in outcomes if o.kind == "burst"]
    if not burst:
        return None
    return {
        "sent": len(burst),
        "answered": sum(o.outcome == "200" for o in burst),
        "slowest_s": max(o.seconds for o in burst),
    }


def summary(
    outcomes: list[Outcome],
    samples: list[dict[str, float | None]],
    *,
    clients: int,
    aborted: int | None,
) -> dict[str, Any]:
    """The soak's results (the module docstring's keys)."""
    counts = Counter(o.outcome for o in outcomes)
    accepted = [o for o in outcomes if o.kind != "bad" and o.outcome != "cancelled"]
    minutes = per_minute(outcomes, samples)
    return {
        "minutes": len(samples),
        "clients": clients,
        "requests": len(outcomes),
        "by_outcome": {name: counts[name] for name in OUTCOMES},
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "unanswered": sum(o.outcome != "200" for o in accepted),
        "bad_not_refused": sum(
            o.kind == "bad" and o.outcome != "4xx" for o in outcomes
        ),
        "drift_max_dp": drift_max_dp(outcomes),
        "gpu_memory_growth_pct": growth_pct([m["gpu_memory_mib"] for m in minutes]),
        "rss_growth_pct": growth_pct([m["rss_mib"] for m in minutes]),
        "cancelled": counts["cancelled"],
        "aborted_in_engine": aborted,
        "burst": _burst(outcomes),
        "per_minute": minutes,
    }


def _pct(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}%"


def report(results: dict[str, Any]) -> str:
    """The markdown report: the totals, then a row per minute."""
    by = results["by_outcome"]
    lines = [
        f"# Soak: {results['minutes']} minutes, {results['clients']} clients",
        "",
        f"{results['requests']} requests: "
        + ", ".join(f"{by[name]} {name}" for name in OUTCOMES)
        + f". Unanswered (neither cancelled nor bad): {results['unanswered']}; "
        f"bad inputs not refused with a 4xx: {results['bad_not_refused']}; "
        f"repeated requests' drift: max |dp| {results['drift_max_dp']}; "
        f"GPU memory growth {_pct(results['gpu_memory_growth_pct'])}, server RSS "
        f"growth {_pct(results['rss_growth_pct'])}; cancelled "
        f"{results['cancelled']}, aborted in the engine "
        f"{results['aborted_in_engine']}; burst {results['burst']}.",
        "",
        "| minute | 200 | 4xx | 5xx | cancelled | timeout | connection error "
        "| text p50 / p99 (s) | GPU MiB | RSS MiB | running | waiting |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["per_minute"]:
        text = m["latency"].get("text")
        latency = f"{text['p50_s']:.3f} / {text['p99_s']:.3f}" if text else "-"
        counts = " | ".join(str(m["by_outcome"][name]) for name in OUTCOMES)
        rss = m["rss_mib"] and round(m["rss_mib"])
        lines.append(
            f"| {m['minute']} | {counts} | {latency} | {m['gpu_memory_mib']} "
            f"| {rss} | {m['running']} | {m['waiting']} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Requests answered, text p50 and memory per minute, with matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    minutes = results["per_minute"]
    x = [m["minute"] for m in minutes]
    figure, axes = plt.subplots(3, 1, sharex=True, figsize=(7, 7))
    axes[0].plot(x, [m["by_outcome"]["200"] for m in minutes], label="200")
    axes[0].plot(x, [m["by_outcome"]["cancelled"] for m in minutes], label="cancelled")
    axes[0].legend()
    axes[0].set_ylabel("requests")
    axes[1].plot(x, [m["latency"].get("text", {}).get("p50_s") for m in minutes])
    axes[1].set_ylabel("text p50 (s)")
    for name in ("gpu_memory_mib", "rss_mib"):
        axes[2].plot(x, [m[name] for m in minutes], label=name)
    axes[2].legend()
    axes[2].set_xlabel("minute")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def serve_and_drive(args: argparse.Namespace) -> dict[str, Any]:
    """Serve the package (or drive ``--url``) and return the results."""
    if args.url:
        return run(
            args,
            args.url,
            args.server_pid,
            args.server_log,
            per_token=args.words_per_token,
        )
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = package(work, "prefix_bidir")
    from transformers import AutoTokenizer

    per_token = words_per_token(AutoTokenizer.from_pretrained(checkpoint))
    flags = serve_flags(
        str(checkpoint),
        [
            "--max-model-len",
            str(args.max_model_len),
            "--enable-log-requests",
            "--max-log-len",
            "0",
            *args.serve_arg,
        ],
    )
    log_file = args.out / "serve-soak.log"
    with Server(str(checkpoint), *flags, log_file=log_file) as server:
        log(f"server up after {server.wait(900):.0f} s")
        return run(args, server.url, server.process.pid, log_file, per_token=per_token)


def run(
    args: argparse.Namespace,
    url: str,
    server_pid: int | None,
    server_log: Path | None,
    *,
    per_token: float,
) -> dict[str, Any]:
    workload = Workload(
        args.seed,
        per_token=per_token,
        long_tokens=args.long_tokens,
        max_model_len=args.max_model_len,
    )

    def partial(
        outcomes: list[Outcome], samples: list[dict[str, float | None]]
    ) -> None:
        # The requests still running are not in it; nor are the engine's aborts.
        so_far = summary(outcomes, samples, clients=args.clients, aborted=None)
        (args.out / PARTIAL).write_text(json.dumps(so_far, indent=1))

    outcomes, samples = asyncio.run(
        drive(
            url,
            workload,
            clients=args.clients,
            server_pid=server_pid,
            minutes=args.minutes,
            minute_s=args.minute_seconds,
            timeout=args.request_timeout,
            burst_minute=args.burst_minute,
            burst_states=args.burst_states,
            on_minute=partial,
        )
    )
    aborted = len(aborted_ids(server_log.read_text())) if server_log else None
    return summary(outcomes, samples, clients=args.clients, aborted=aborted)


def _tokens(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(","))
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--minute-seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=900)
    parser.add_argument("--long-tokens", type=_tokens, default=LONG_TOKENS)
    parser.add_argument("--burst-minute", type=float)
    parser.add_argument("--burst-states", type=int, default=BURST_STATES)
    parser.add_argument("--max-model-len", type=int, default=LONG_MAX_MODEL_LEN)
    parser.add_argument("--url")
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--server-log", type=Path)
    parser.add_argument("--words-per-token", type=float, default=1.0)
    parser.add_argument("--serve-arg", action="append", default=[])
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"run": run_record(), **serve_and_drive(args)}
    (args.out / "soak.json").write_text(json.dumps(results, indent=1))
    (args.out / "soak.md").write_text(report(results))
    plot(results, args.out / "soak.png")
    log(report(results).splitlines()[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
