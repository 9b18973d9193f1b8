"""vLLM's sides of the D3 benchmark: ``vllm serve`` on loopback, over HTTP.

Contract:
- ``serve_flags(checkpoint, extra)``: the flags after the checkpoint:
  ``--load-format dummy`` for a package without weights, then ``extra``.
- ``run_group(...)`` starts one server (``server.Server``), measures
  start-up (process start to the first HTTP 200 of ``/v1/systemone``), the
  latency rows one request at a time and the closed-loop loads, and stops it.
  While the server lives, ``nvidia-smi`` is polled: the peak of
  ``memory.used`` (summed over the GPUs) less its value before the start, and
  the GPUs it used (``gpus``: those whose own peak rose ``GPU_IN_USE_MIB``).
  A row or load that fails is recorded as failed; a server that does not come
  up fails every row of its group, with the end of its log. ``progress(result)``
  gets the server's result so far after start-up and after each row and load
  (its peak memory once the server has stopped).
- Around each latency row, the server's Prometheus ``/metrics`` are read
  (``engine_totals``) and the row gets ``engine`` (``engine_time``): per HTTP
  request of the row (warm-ups included), its mean HTTP latency, the engine's
  seconds from vLLM's per-request histograms (``ENGINE_HISTOGRAMS``: from the
  request's arrival at the engine to its end, its wait in the queue, its
  prefill) and the engine requests it became. The gap between the HTTP
  latency and the engine's is the front end's (rendering, packing, the answer).
  A server without those metrics gives no ``engine``.
- ``closed_loop(url, pool, clients, ...)``: ``clients`` threads, each sending
  the next request of ``pool`` (round robin) as soon as its previous one is
  answered, until ``max_requests`` were sent. Requests begun after
  ``warmup_s`` count. A client sends for ``duration_s`` more, and after that
  until one request of its own that counts has finished, however long a step
  takes. The requests per second are the sum over clients of each one's
  requests answered with 200 over its span, from its first counted request's
  start to its last one's end (questions per second likewise).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_d3.testing.server import Server, post, served_max_model_len

from .reference_side import has_weights
from .rows import Load, Row, question_count
from .timing import Budget, RowGate, log, measure

REQUEST_TIMEOUT_S = 1800
SERVER_START_TIMEOUT_S = 900
POLL_INTERVAL_S = 0.5
#: A GPU whose memory.used rose this much while a server lived was one it used.
GPU_IN_USE_MIB = 1024
#: Server log lines worth keeping: how vLLM split the GPU memory.
MEMORY_LOG = re.compile(
    r"model loading took|available kv cache memory|gpu kv cache size"
    r"|graph capturing finished|init engine",
    re.IGNORECASE,
)


#: vLLM's per-request histograms (``v1/metrics/loggers.py``), by what the
#: results call them.
ENGINE_HISTOGRAMS = {
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
#: A Prometheus sample line: name, labels, value.
SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{.*\})?\s+(\S+)$")


def serve_flags(checkpoint: str, extra: list[str]) -> list[str]:
    flags = [] if has_weights(checkpoint) else ["--load-format", "dummy"]
    return flags + extra


def parse_gpu_memory(text: str) -> dict[str, float]:
    """``nvidia-smi --query-gpu=index,name,memory.used`` CSV (no header, no
    units) as MiB used by GPU, named "INDEX NAME"."""
    used = {}
    for line in text.strip().splitlines():
        index, name, mib = (part.strip() for part in line.split(","))
        used[f"{index} {name}"] = float(mib)
    return used


def gpu_memory_by_gpu() -> dict[str, float] | None:
    """MiB used on each GPU, or ``None`` without nvidia-smi."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,name,memory.used",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_memory(out)


def gpu_memory_used_mib() -> float | None:
    """``memory.used`` summed over the GPUs, or ``None`` without nvidia-smi."""
    used = gpu_memory_by_gpu()
    return None if used is None else sum(used.values())


def gpus_in_use(baseline: dict[str, float], peaks: dict[str, float]) -> list[str]:
    """The GPUs whose peak rose ``GPU_IN_USE_MIB`` above their baseline."""
    return [
        gpu for gpu, peak in peaks.items() if peak - baseline[gpu] >= GPU_IN_USE_MIB
    ]


class MemoryPoller:
    """Polls ``gpu_memory_by_gpu`` in a thread and keeps the peak of the sum
    and of each GPU."""

    def __init__(self) -> None:
        self.baseline = gpu_memory_by_gpu()
        self.baseline_mib = (
            None if self.baseline is None else sum(self.baseline.values())
        )
        self.peak_mib = self.baseline_mib
        self.peaks = dict(self.baseline or {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if self.baseline is not None:
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            used = gpu_memory_by_gpu()
            if used is None:
                continue
            total = sum(used.values())
            if self.peak_mib is None or total > self.peak_mib:
                self.peak_mib = total
            for gpu, mib in used.items():
                self.peaks[gpu] = max(self.peaks.get(gpu, 0.0), mib)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.baseline_mib is None or self.peak_mib is None:
            return {"status": "not measured (no nvidia-smi)"}
        return {
            "status": "ok",
            "peak_memory_gib": (self.peak_mib - self.baseline_mib) / 1024,
            "peak_used_gib": self.peak_mib / 1024,
            "baseline_gib": self.baseline_mib / 1024,
            "gpus": gpus_in_use(self.baseline or {}, self.peaks),
        }


def systemone(url: str, request: dict[str, Any]) -> dict[str, Any]:
    """POST one request; its reply, or raise on non-200."""
    status, body = post(url + "/v1/systemone", request, timeout=REQUEST_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {json.dumps(body)[:300]}")
    return body


def metrics_text(url: str) -> str:
    """The server's Prometheus ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each metric of ``names`` the text has, summed over its label sets
    (Prometheus text format)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if (match := SAMPLE.match(line)) and (name := match.group(1)) in names:
            sums[name] = sums.get(name, 0.0) + float(match.group(2))
    return sums


def engine_totals(url: str) -> dict[str, tuple[float, float]]:
    """Each ``ENGINE_HISTOGRAMS`` sum and count over its label sets, from the
    server's ``/metrics``; those it does not export are left out."""
    try:
        text = metrics_text(url)
    except OSError:  # urllib's URLError among them
        return {}
    wanted = tuple(
        f"{name}_{part}"
        for name in ENGINE_HISTOGRAMS.values()
        for part in ("sum", "count")
    )
    samples = metric_sums(text, wanted)
    return {
        key: (samples[f"{name}_sum"], samples[f"{name}_count"])
        for key, name in ENGINE_HISTOGRAMS.items()
        if f"{name}_sum" in samples and f"{name}_count" in samples
    }


def engine_time(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    http_s: list[float],
) -> dict[str, float]:
    """Per HTTP request (``http_s``: each one's latency), the engine's seconds
    of each histogram between two ``engine_totals``, and the engine requests."""
    keys = [key for key in ENGINE_HISTOGRAMS if key in before and key in after]
    if not keys or not http_s:
        return {}
    n = len(http_s)
    engine = {"http_mean_s": sum(http_s) / n}
    engine |= {f"{key}_s": (after[key][0] - before[key][0]) / n for key in keys}
    engine["engine_requests"] = (after[keys[0]][1] - before[keys[0]][1]) / n
    return engine


def _served_max_model_len(url: str) -> int | None:
    """The server's ``max_model_len``, or ``None`` where it does not say."""
    try:
        return served_max_model_len(url, timeout=30)
    except (OSError, ValueError, LookupError):
        return None


def _log_lines(path: Path, pattern: re.Pattern[str], limit: int) -> list[str]:
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [line.strip() for line in lines if pattern.search(line)][:limit]


def _log_tail(path: Path, lines: int = 20) -> list[str]:
    if not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


def closed_loop(
    url: str,
    pool: list[dict[str, Any]],
    clients: int,
    *,
    warmup_s: float,
    duration_s: float,
    max_requests: int,
) -> dict[str, Any]:
    lock = threading.Lock()
    window_start = time.perf_counter() + warmup_s
    window_end = window_start + duration_s
    sent = 0
    capped = False
    # Per client, its finished requests begun after the warm-up:
    # (began, ended, questions), questions None where the request failed.
    finished: list[list[tuple[float, float, int | None]]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(mine: list[tuple[float, float, int | None]]) -> None:
        nonlocal sent, capped
        while True:
            with lock:
                # Past the window, a client goes on until one request of its
                # own counts: a step longer than the window is not lost.
                if time.perf_counter() >= window_end and mine:
                    return
                if sent >= max_requests:
                    capped = True
                    return
                request = pool[sent % len(pool)]
                sent += 1
            began = time.perf_counter()
            questions: int | None = question_count(request)
            try:
                systemone(url, request)
            except Exception as error:  # counted, the load goes on
                questions = None
                with lock:
                    errors.append(f"{type(error).__name__}: {str(error)[:200]}")
            if began >= window_start:
                mine.append((began, time.perf_counter(), questions))

    threads = [threading.Thread(target=client, args=(m,)) for m in finished]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A client sends back to back, so it is busy from its first counted
    # request's start to its last one's end: its rate is its answers over that
    # span, and the load's is the sum of its clients' rates.
    per_client = [
        (m[-1][1] - m[0][0], [(end - began, q) for began, end, q in m if q is not None])
        for m in finished
        if m
    ]
    latencies = sorted(latency for _, ok in per_client for latency, _ in ok)
    if not latencies:
        return {
            "status": "failed: no request begun after the warm-up was answered",
            "errors": len(errors),
            "first_errors": errors[:3],
        }
    return {
        "status": "ok",
        "requests_per_s": sum(len(ok) / span for span, ok in per_client),
        "questions_per_s": sum(sum(q for _, q in ok) / span for span, ok in per_client),
        "requests": len(latencies),
        "window_s": max(m[-1][1] for m in finished if m) - window_start,
        "p50_latency_s": latencies[len(latencies) // 2],
        "sent": sent,
        "capped": capped,
        "errors": len(errors),
        "first_errors": errors[:3],
        "distinct_requests": len(pool),
    }


def attention_kernel(server_log: str) -> str | None:
    """The full-attention path a server's log names: the dense pieces' kernel,
    ``ranged`` (vLLM's own selection), or None for a checkpoint that is not
    prefix_bidir."""
    if match := re.search(r"dense state and question pieces on (\w+)", server_log):
        return match.group(1)
    if "full-attention layers on vLLM's own selection" in server_log:
        return "ranged"
    return None


def run_group(
    checkpoint: str,
    name: str,
    extra_flags: list[str],
    rows: list[Row],
    requests: dict[str, list[dict[str, Any]]],
    loads: list[Load],
    pools: dict[str, list[dict[str, Any]]],
    startup_request: dict[str, Any],
    *,
    warmup: int,
    long_warmup: int,
    budget: Budget,
    throughput: dict[str, float],
    logs: Path,
    progress: Callable[[dict[str, Any]], object],
) -> dict[str, Any]:
    """One server: start-up, ``rows`` (``warmup`` warm-up requests first in
    ``requests[row.id]``; a long-state row sends only the last ``long_warmup``
    of them), then ``loads`` with ``pools[load.mix]``;
    ``throughput`` holds ``warmup_s``, ``duration_s`` and ``max_requests``;
    the server's log is ``logs/serve-NAME.log``."""
    flags = serve_flags(checkpoint, extra_flags)
    log_file = logs / f"serve-{name}.log"
    result: dict[str, Any] = {
        "flags": flags,
        "command": ["vllm", "serve", checkpoint, *flags],
        "log": log_file.name,
    }
    rows_out: dict[str, Any] = {}
    loads_out: dict[str, Any] = {}
    result["rows"], result["loads"] = rows_out, loads_out
    result["memory"] = {"status": "pending (server running)"}
    log(f"vLLM {name}: starting vllm serve {shlex.join(flags)}")
    poller = MemoryPoller()
    started = time.perf_counter()
    with Server(checkpoint, *flags, log_file=log_file) as server:
        try:
            server.wait(timeout=SERVER_START_TIMEOUT_S)
            systemone(server.url, startup_request)
            result["startup"] = {
                "status": "ok",
                "first_answer_s": time.perf_counter() - started,
                "max_model_len": _served_max_model_len(server.url),
                "attention_kernel": attention_kernel(log_file.read_text()),
            }
        except Exception as error:
            failure = f"failed: server start-up: {type(error).__name__}: {error}"
            result["startup"] = {"status": failure, "log_tail": _log_tail(log_file)}
            result["memory"] = poller.stop()
            rows_out.update({row.id: {"status": failure} for row in rows})
            loads_out.update({load.id: {"status": failure} for load in loads})
            log(f"vLLM {name}: {failure}; see {log_file}")
            return result
        log(f"vLLM {name}: first answer {result['startup']['first_answer_s']:.0f}s")
        progress(result)
        serving = _Serving(server.url, name, budget, lambda: progress(result))
        _run_rows(serving, rows, requests, rows_out, warmup, long_warmup)
        _run_loads(serving, loads, pools, loads_out, throughput)
        result["memory"] = poller.stop()
    result["memory_log"] = _log_lines(log_file, MEMORY_LOG, limit=12)
    return result


@dataclasses.dataclass
class _Serving:
    """A started server as its rows and loads use it."""

    url: str
    name: str
    budget: Budget
    #: Called after each row and load.
    progress: Callable[[], object]


def _run_rows(
    serving: _Serving,
    rows: list[Row],
    requests: dict[str, list[dict[str, Any]]],
    rows_out: dict[str, Any],
    warmup: int,
    long_warmup: int,
) -> None:
    """Each row's timed requests into ``rows_out``; a row that fails or does
    not fit the budget says so, and the others go on."""
    url, name, budget = serving.url, serving.name, serving.budget
    # The gate estimates long rows only, so it counts their warm-up.
    gate = RowGate(budget, long_warmup, f"vLLM {name}")
    for row in rows:
        if refusal := gate.refusal(row):
            rows_out[row.id] = {"status": refusal}
            continue
        row_warmup = long_warmup if row.long else warmup
        sent = requests[row.id][warmup - row_warmup :]
        before = engine_totals(url)
        try:
            timed = measure(
                lambda request: int(systemone(url, request)["usage"]["input_tokens"]),
                sent,
                warmup=row_warmup,
                budget=budget,
            )
        except Exception as error:  # one row failing must not end the run
            rows_out[row.id] = {
                "status": f"failed: {type(error).__name__}: {str(error)[:300]}"
            }
            log(f"vLLM {name}: {row.id} {rows_out[row.id]['status']}")
            continue
        rows_out[row.id] = {**timed.summary(), "input_tokens": timed.outputs}
        engine = engine_time(before, engine_totals(url), timed.warmup_s + timed.times_s)
        shown = ""
        if engine:
            rows_out[row.id]["engine"] = engine
        if "e2e_s" in engine:
            shown = (
                f"; per request: HTTP {engine['http_mean_s'] * 1e3:.1f} ms, "
                f"engine {engine['e2e_s'] * 1e3:.1f} ms"
            )
        gate.measured(row, timed.p50_s)
        log(f"vLLM {name}: {row.id} p50 {timed.p50_s * 1e3:.1f} ms{shown}")
        serving.progress()


def _run_loads(
    serving: _Serving,
    loads: list[Load],
    pools: dict[str, list[dict[str, Any]]],
    loads_out: dict[str, Any],
    throughput: dict[str, float],
) -> None:
    """Each closed-loop load into ``loads_out``, until the budget is spent."""
    url, name, budget = serving.url, serving.name, serving.budget
    for load in loads:
        if budget.exhausted():
            loads_out[load.id] = {"status": "skipped (time budget)"}
            log(f"vLLM {name}: {load.id} skipped (time budget)")
            continue
        loads_out[load.id] = outcome = closed_loop(
            url,
            pools[load.mix],
            load.clients,
            warmup_s=throughput["warmup_s"],
            duration_s=throughput["duration_s"],
            max_requests=int(throughput["max_requests"]),
        )
        shown = (
            f"{outcome['requests_per_s']:.2f} req/s"
            if outcome["status"] == "ok"
            else outcome["status"]
        )
        log(f"vLLM {name}: {load.id} {shown}")
        serving.progress()
