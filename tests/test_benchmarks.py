"""Tests of the D3 benchmark harness (``benchmarks``), CPU only.

The smoke mode runs for real once per module (a tiny weight-less package, the
reference runtime random-initialised on the CPU); the vLLM side's HTTP code
runs against a stub ``/v1/systemone`` server standing in for ``vllm serve``.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import d3, report, state_cache, vllm_side
from benchmarks.reference_side import RandomInitRuntime, token_accounting
from benchmarks.rows import (
    LATENCY_ROWS,
    ROWS_BY_ID,
    THROUGHPUT_ROWS,
    Load,
    row_requests,
    select,
)
from benchmarks.timing import Budget, RowGate, run_record
from vllm_d3.testing.server import merge_additional_config

CUDA = torch.cuda.is_available()
PER_QUESTION_FLAGS = ("--additional-config", '{"d3_state_once": false}')


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "smoke"
    assert d3.main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_measures_every_row_on_the_reference(smoke):
    _, results = smoke
    assert results["mode"] == "smoke"
    assert [r["id"] for r in results["latency"]] == [r.id for r in LATENCY_ROWS]
    for row in results["latency"]:
        assert row["reference"]["status"] == "ok", row["id"]
        assert row["reference"]["p50_s"] > 0
        assert row["reference"]["repeats"] == 1
    assert results["reference"]["startup"]["first_answer_s"] > 0
    assert [t["id"] for t in results["throughput"]] == [t.id for t in THROUGHPUT_ROWS]
    for load in results["throughput"]:
        assert load["reference"]["status"] == "ok"
        assert load["reference"]["one_at_a_time"] is True
        assert load["reference"]["requests_per_s"] > 0
    assert results["skipped"] == []


@pytest.mark.skipif(CUDA, reason="vLLM runs where CUDA is available")
def test_smoke_marks_vllm_not_run_without_cuda(smoke):
    _, results = smoke
    for entry in results["latency"] + results["throughput"]:
        assert entry["vllm"] == {"status": "not run (no CUDA)"}
        assert entry["vllm_per_question"] == {"status": "not run (no CUDA)"}
        assert entry["ratio"] is None
        assert entry["ratio_per_question"] is None
        assert entry["speedup_state_once"] is None
    assert results["vllm_servers"] == {}


def test_smoke_writes_the_markdown_table_and_plot(smoke):
    out, results = smoke
    text = (out / "results.md").read_text()
    assert (
        "| row | questions | state tokens | vLLM state once p50 (ms) "
        "| vLLM state once, Triton GDN p50 (ms) "
        "| vLLM state once, portable kernel p50 (ms) "
        "| vLLM state once, 2 GPUs (DP=2) p50 (ms) "
        "| vLLM per question p50 (ms) | reference p50 (ms) "
        "| state once / reference | per question / reference "
        "| per question / state once | state once / Triton GDN "
        "| portable / state once | DP=2 / state once |"
    ) in text
    assert "| vLLM per question req/s | vLLM per question questions/s |" in text
    for row in LATENCY_ROWS:
        assert f"| {row.label} |" in text
    if not CUDA:
        assert "not run (no CUDA)" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert results["plot"].startswith("skipped")
    else:
        assert results["plot"] == "latency_vs_state.png"
        assert (out / "latency_vs_state.png").stat().st_size > 0


def test_smoke_counts_tokens_per_request(smoke):
    """vLLM state once and the reference's state_once path read the state once:
    s + sum(n_i - s); vLLM per question reads it once per question: the sum of
    the prompt lengths."""
    out, results = smoke
    settings = results["settings"]
    renderer = RandomInitRuntime(settings["checkpoint"], device="meta")
    for row in results["latency"]:
        requests = row_requests(
            ROWS_BY_ID[row["id"]],
            len(row["requests"]),
            seed=settings["seed"],
            words_per_token=settings["words_per_token"],
            state_scale=settings["state_scale"],
        )
        for request, counted in zip(requests, row["requests"], strict=True):
            rendered = renderer.render(request)
            s = rendered[0].state_tokens
            lengths = [len(r.token_ids) for r in rendered]
            once = s + sum(n - s for n in lengths)
            assert counted["state_tokens"] == s
            assert counted["tokens_vllm"] == once
            assert counted["tokens_vllm_per_question"] == sum(lengths)
            assert counted["tokens_reference"] == once
            assert counted["state_reads_vllm"] == 1
            assert counted["state_reads_vllm_per_question"] == len(rendered)
            assert counted["state_reads_reference"] == 1
        if row["questions"] > 1:
            assert row["tokens_vllm_per_question"] > row["tokens_vllm"]
        else:
            assert row["tokens_vllm_per_question"] == row["tokens_vllm"]


def test_smoke_scales_the_long_states(smoke):
    _, results = smoke
    long = {r["id"]: r["state_tokens"] for r in results["latency"] if r["long"]}
    scale = results["settings"]["state_scale"]
    for row_id, tokens in long.items():
        target = ROWS_BY_ID[row_id].state_tokens * scale
        assert 0.8 * target < tokens < 1.3 * target + 200, (row_id, tokens)


def test_time_budget_skips_rows_and_says_so(smoke, tmp_path):
    out, _ = smoke
    argv = ["--smoke", "--out", str(tmp_path), "--work", str(out / "work")]
    argv += ["--rows", "text-1,tput-text-8", "--time-budget", "0"]
    argv += ["--sides", "reference"]
    d3.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["id"] for r in results["latency"]] == ["text-1"]
    assert results["latency"][0]["reference"] == {"status": "skipped (time budget)"}
    assert results["skipped"] == ["text-1 (reference): skipped (time budget)"]
    assert (
        "text-1 (reference): skipped (time budget)"
        in (tmp_path / "results.md").read_text()
    )


def test_row_gate_skips_a_long_row_that_cannot_finish():
    state_24k, state_64k, state_117k = (
        ROWS_BY_ID[i] for i in ("state-24k", "state-64k", "state-117k")
    )
    gate = RowGate(Budget(100), warmup=1, side="test")
    # Nothing measured yet, and short rows: only a spent budget stops them.
    assert gate.refusal(state_24k) is None
    gate.measured(state_24k, 10.0)
    assert gate.refusal(ROWS_BY_ID["text-64"]) is None
    # 2 requests x 10 s x 2/4 questions x (64/24)^2 = 71 s: it fits.
    assert gate.estimate_s(state_64k) == pytest.approx(2 * 10 * 0.5 * (64 / 24) ** 2)
    assert gate.refusal(state_64k) is None
    gate.measured(state_64k, 40.0)
    # 2 x 40 s x (117/64)^2 = 267 s: more than the 100 s left.
    refusal = gate.refusal(state_117k)
    assert refusal is not None and refusal.startswith(
        "skipped (time budget: about 267 s"
    )
    assert RowGate(Budget(0), warmup=1, side="test").refusal(ROWS_BY_ID["text-1"]) == (
        "skipped (time budget)"
    )


def test_select_matches_patterns():
    ids = [r.id for r in LATENCY_ROWS]
    assert select(ids, None) == ids
    assert select(ids, ["state-*"]) == ["state-24k", "state-64k", "state-117k"]
    assert select(ids, ["text-1", "photo-8"]) == ["text-1", "photo-8"]


def test_requests_are_distinct_and_reproducible():
    row = ROWS_BY_ID["text-4"]
    first = row_requests(row, 3, seed=0, words_per_token=1.0)
    assert first == row_requests(row, 3, seed=0, words_per_token=1.0)
    assert len({json.dumps(r) for r in first}) == 3
    assert all(len(r["questions"]) == 4 for r in first)


def _rendered(state_tokens: int, lengths: list[int]) -> list[SimpleNamespace]:
    """Stands in for ``RenderedQuestion``: what ``token_accounting`` reads."""
    return [
        SimpleNamespace(state_tokens=state_tokens, token_ids=[0] * n) for n in lengths
    ]


def test_token_accounting_counts_each_side():
    counted = token_accounting(_rendered(10, [15, 12, 20]))  # type: ignore[arg-type]
    assert counted == {
        "state_tokens": 10,
        "prompt_lengths": [15, 12, 20],
        "tokens_vllm": 10 + 5 + 2 + 10,
        "tokens_vllm_triton_gdn": 10 + 5 + 2 + 10,
        "tokens_vllm_portable": 10 + 5 + 2 + 10,
        "tokens_vllm_dp2": 10 + 5 + 2 + 10,
        "tokens_vllm_per_question": 15 + 12 + 20,
        "tokens_reference": 10 + 5 + 2 + 10,
        "state_reads_vllm": 1,
        "state_reads_vllm_triton_gdn": 1,
        "state_reads_vllm_portable": 1,
        "state_reads_vllm_dp2": 1,
        "state_reads_vllm_per_question": 3,
        "state_reads_reference": 1,
    }


def test_usage_is_judged_against_each_vllm_sides_own_count():
    # One warm-up request, then one timed: 27 tokens state once, 47 per question.
    accounting = [
        token_accounting(_rendered(8, [9, 9])),  # type: ignore[arg-type]
        token_accounting(_rendered(10, [15, 12, 20])),  # type: ignore[arg-type]
    ]

    def entry(state_once_usage: int, per_question_usage: int) -> dict[str, Any]:
        return d3._latency_entry(
            ROWS_BY_ID["text-4"],
            accounting,
            1,
            {
                "vllm": {
                    "status": "ok",
                    "p50_s": 1.0,
                    "input_tokens": [state_once_usage],
                },
                "vllm_per_question": {
                    "status": "ok",
                    "p50_s": 3.0,
                    "input_tokens": [per_question_usage],
                },
                "vllm_triton_gdn": {"status": "not run (--sides)"},
                "vllm_portable": {"status": "not run (--sides)"},
                "vllm_dp2": {"status": "not run (--sides)"},
                "reference": {"status": "ok", "p50_s": 2.0},
            },
        )

    right = entry(27, 47)
    assert right["vllm"]["usage_matches_render"] is True
    assert right["vllm_per_question"]["usage_matches_render"] is True
    assert "usage_matches_render" not in right["reference"]
    assert (right["tokens_vllm"], right["tokens_vllm_per_question"]) == (27, 47)
    assert (right["state_reads_vllm"], right["state_reads_vllm_per_question"]) == (1, 3)
    assert right["ratio"] == pytest.approx(0.5)
    assert right["ratio_per_question"] == pytest.approx(1.5)
    assert right["speedup_state_once"] == pytest.approx(3.0)
    swapped = entry(47, 27)
    assert swapped["vllm"]["usage_matches_render"] is False
    assert swapped["vllm_per_question"]["usage_matches_render"] is False
    one_wrong = entry(27, 27)
    assert one_wrong["vllm"]["usage_matches_render"] is True
    assert one_wrong["vllm_per_question"]["usage_matches_render"] is False


def test_each_vllm_server_has_a_per_question_twin():
    rows = [ROWS_BY_ID["text-1"], ROWS_BY_ID["state-24k"]]
    loads = [Load("tput-text-8", "text", 8)]
    sides = ["vllm", "vllm_per_question"]
    groups = d3.server_groups(False, sides, rows, loads)
    long_flags = ["--max-model-len", "131072"]
    assert [(side, name, flags) for side, name, flags, _, _ in groups] == [
        ("vllm", "default", []),
        ("vllm_per_question", "default-per-question", [*PER_QUESTION_FLAGS]),
        ("vllm", "long", long_flags),
        ("vllm_per_question", "long-per-question", [*long_flags, *PER_QUESTION_FLAGS]),
    ]
    for _, name, _, group_rows, group_loads in groups:
        long = name.startswith("long")
        assert [r.id for r in group_rows] == (["state-24k"] if long else ["text-1"])
        assert group_loads == ([] if long else loads)
    # The smoke run's long states fit the default server: no long servers.
    smoke = d3.server_groups(True, ["vllm_per_question"], rows, loads)
    assert [(name, rows) for _, name, _, rows, _ in smoke] == [
        ("default-per-question", rows)
    ]


def test_the_dp2_side_serves_on_two_gpus_beside_one():
    loads = [Load("tput-text-64", "text", 64)]
    groups = d3.server_groups(False, ["vllm", "vllm_dp2"], [], loads, one_server=True)
    long_flags = ["--max-model-len", "131072"]
    assert [(side, name, flags) for side, name, flags, _, _ in groups] == [
        ("vllm", "one", long_flags),
        ("vllm_dp2", "one-dp2", [*long_flags, "--data-parallel-size", "2"]),
    ]


def test_a_server_names_the_gpus_whose_memory_it_took():
    from benchmarks import vllm_side

    smi = "0, NVIDIA H200, 1.0\n1, NVIDIA H200, 600.0\n"
    baseline = vllm_side.parse_gpu_memory(smi)
    assert baseline == {"0 NVIDIA H200": 1.0, "1 NVIDIA H200": 600.0}
    one = {"0 NVIDIA H200": 90_000.0, "1 NVIDIA H200": 900.0}
    assert vllm_side.gpus_in_use(baseline, one) == ["0 NVIDIA H200"]
    two = {"0 NVIDIA H200": 90_000.0, "1 NVIDIA H200": 91_000.0}
    assert vllm_side.gpus_in_use(baseline, two) == ["0 NVIDIA H200", "1 NVIDIA H200"]


def test_one_server_per_side_serves_everything_at_the_long_length():
    rows = [ROWS_BY_ID["text-1"], ROWS_BY_ID["state-24k"]]
    loads = [Load("tput-text-8", "text", 8)]
    sides = ["vllm", "vllm_per_question"]
    groups = d3.server_groups(False, sides, rows, loads, ["--x=1"], one_server=True)
    long_flags = ["--max-model-len", "131072"]
    assert [(side, name, flags) for side, name, flags, _, _ in groups] == [
        ("vllm", "one", [*long_flags, "--x=1"]),
        (
            "vllm_per_question",
            "one-per-question",
            [*long_flags, *PER_QUESTION_FLAGS, "--x=1"],
        ),
    ]
    assert all(group_rows == rows for _, _, _, group_rows, _ in groups)
    assert all(group_loads == loads for *_, group_loads in groups)
    assert d3.parse_args(["--out", "x", "--one-server"]).one_server is True
    assert d3.parse_args(["--out", "x"]).one_server is False


def test_sides_default_to_all_three():
    assert d3.parse_args(["--out", "x"]).sides == [
        "vllm",
        "vllm_per_question",
        "reference",
    ]
    assert d3.parse_args(["--out", "x", "--sides", "vllm_per_question"]).sides == [
        "vllm_per_question"
    ]
    with pytest.raises(SystemExit):
        d3.parse_args(["--out", "x", "--sides", "vllm,per_question"])


# -------------------------------------------------------- vLLM side, stubbed


#: The stub's engine time per question, as its /metrics report it.
STUB_ENGINE_S = 0.01


class _StubHandler(BaseHTTPRequestHandler):
    """Answers like /v1/systemone: 100 input tokens per question. Its
    /metrics count one engine request of ``STUB_ENGINE_S`` per question, in
    Prometheus' text format, split over two label sets as vLLM's engines are."""

    #: Where set, each answer waits for the end of the step under way: steps of
    #: this many seconds, back to back from the server's start.
    step_s = 0.0

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self._reply({"data": [{"max_model_len": 4096}]})
            return
        questions = sum(len(b["questions"]) for b in self.server.bodies)  # type: ignore[attr-defined]
        lines = ["# TYPE vllm:e2e_request_latency_seconds histogram"]
        for engine, share in (("0", 0.25), ("1", 0.75)):
            labels = f'{{engine="{engine}",model_name="/a b"}}'
            name = "vllm:e2e_request_latency_seconds"
            lines += [
                f'{name}_bucket{{engine="{engine}",le="+Inf"}} {questions * share}',
                f"{name}_sum{labels} {questions * share * STUB_ENGINE_S}",
                f"{name}_count{labels} {questions * share}",
            ]
        data = "\n".join(lines).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        if self.step_s:  # answer at the end of the step under way, as an engine
            since = time.perf_counter() - self.server.started  # type: ignore[attr-defined]
            time.sleep(self.step_s - since % self.step_s)
        tokens = 100 * len(body["questions"])
        self._reply({"answers": [], "usage": {"input_tokens": tokens}})


class _StubServer:
    """Stands in for ``validation.Server``: the stub on loopback. ``started``
    lists every one started, in order (tests reset it); each keeps its
    ``flags`` and ``log_file``, and its ``httpd.bodies`` are the requests it
    got."""

    started: list[_StubServer] = []

    def __init__(self, checkpoint: str, *flags: str, log_file: Path):
        log_file.write_text("INFO Model loading took 1.0 GiB\n")
        self.flags, self.log_file = flags, log_file
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
        self.httpd.bodies = []  # type: ignore[attr-defined]
        self.httpd.started = time.perf_counter()  # type: ignore[attr-defined]
        _StubServer.started.append(self)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait(self, timeout: float) -> float:
        return 0.0

    def __enter__(self) -> _StubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_vllm_group_over_http(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_side, "Server", _StubServer)
    rows = [ROWS_BY_ID["text-1"], ROWS_BY_ID["text-4"]]
    requests = {
        row.id: row_requests(row, 3, seed=0, words_per_token=1.0) for row in rows
    }
    pool = requests["text-1"] + requests["text-4"]
    snapshots: list[dict[str, Any]] = []
    result = vllm_side.run_group(
        str(tmp_path),
        "default",
        [],
        rows,
        requests,
        [Load("tput-text-8", "text", 8)],
        {"text": pool},
        requests["text-1"][0],
        warmup=1,
        long_warmup=1,
        budget=Budget(None),
        throughput={"warmup_s": 0.2, "duration_s": 0.5, "max_requests": 10_000},
        logs=tmp_path,
        progress=lambda so_far: snapshots.append(json.loads(json.dumps(so_far))),
    )
    # Saved after start-up, after each row and after the load.
    assert [(list(s["rows"]), list(s["loads"])) for s in snapshots] == [
        ([], []),
        (["text-1"], []),
        (["text-1", "text-4"], []),
        (["text-1", "text-4"], ["tput-text-8"]),
    ]
    assert snapshots[-1]["memory"]["status"].startswith("pending")
    assert result["flags"][:2] == ["--load-format", "dummy"]  # no weights here
    assert result["startup"]["status"] == "ok"
    assert result["startup"]["max_model_len"] == 4096
    assert result["rows"]["text-1"]["input_tokens"] == [100, 100]
    assert result["rows"]["text-4"]["input_tokens"] == [400, 400]
    assert result["rows"]["text-4"]["repeats"] == 2
    # Per HTTP request (warm-up included): the engine requests and seconds the
    # stub's /metrics counted over the row; no queue or prefill histograms.
    for row_id, questions in (("text-1", 1), ("text-4", 4)):
        engine = result["rows"][row_id]["engine"]
        assert engine["engine_requests"] == questions
        assert engine["e2e_s"] == pytest.approx(questions * STUB_ENGINE_S)
        times = result["rows"][row_id]["warmup_s"] + result["rows"][row_id]["times_s"]
        assert engine["http_mean_s"] == pytest.approx(sum(times) / len(times))
        assert "queue_s" not in engine and "prefill_s" not in engine
    load = result["loads"]["tput-text-8"]
    assert load["status"] == "ok" and load["errors"] == 0
    assert load["requests_per_s"] > 0
    assert load["requests_per_s"] <= load["questions_per_s"]
    assert load["questions_per_s"] <= 4 * load["requests_per_s"]
    assert result["memory_log"] == ["INFO Model loading took 1.0 GiB"]


def test_vllm_long_rows_leave_out_warmups_but_time_the_same_requests(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(vllm_side, "Server", _StubServer)
    monkeypatch.setattr(_StubServer, "started", [])
    short, long = ROWS_BY_ID["text-1"], ROWS_BY_ID["state-24k"]
    requests = {
        row.id: row_requests(
            row, 4, seed=0, words_per_token=1.0, state_scale=d3.SMOKE_STATE_SCALE
        )
        for row in (short, long)
    }
    startup = row_requests(ROWS_BY_ID["text-4"], 1, seed=9, words_per_token=1.0)[0]
    result = vllm_side.run_group(
        str(tmp_path),
        "long",
        [],
        [short, long],
        requests,
        [],
        {},
        startup,
        warmup=2,
        long_warmup=0,
        budget=Budget(None),
        throughput={"warmup_s": 0.0, "duration_s": 0.0, "max_requests": 0},
        logs=tmp_path,
        progress=lambda so_far: None,
    )
    (server,) = _StubServer.started
    sent = server.httpd.bodies  # type: ignore[attr-defined]
    # Start-up, every short request, then only the long row's timed ones.
    assert sent == [startup, *requests[short.id], *requests[long.id][2:]]
    assert len(result["rows"][short.id]["warmup_s"]) == 2
    assert result["rows"][long.id]["warmup_s"] == []
    assert result["rows"][long.id]["repeats"] == 2


def test_vllm_long_warmup_cannot_exceed_warmup():
    args = d3.parse_args(["--out", "x", "--warmup", "2", "--vllm-long-warmup", "0"])
    assert (args.warmup, args.vllm_long_warmup) == (2, 0)
    assert d3.parse_args(["--out", "x", "--warmup", "2"]).vllm_long_warmup == 2
    with pytest.raises(SystemExit):
        d3.parse_args(["--out", "x", "--warmup", "1", "--vllm-long-warmup", "2"])


def test_closed_loop_stops_at_the_request_cap(monkeypatch, tmp_path):
    with _StubServer("", log_file=tmp_path / "log") as server:
        pool = row_requests(ROWS_BY_ID["text-1"], 2, seed=0, words_per_token=1.0)
        load = vllm_side.closed_loop(
            server.url, pool, 4, warmup_s=0.0, duration_s=30.0, max_requests=20
        )
    assert load["status"] == "ok"
    assert load["capped"] is True
    assert load["sent"] == 20
    assert load["requests"] <= 20


def test_closed_loop_counts_steps_longer_than_its_window(monkeypatch, tmp_path):
    """Every answer comes at the end of a 0.4 s step, long after the 0.1 s
    window: each client finishes the request it began in the window, and the
    load serves its clients once per step."""
    monkeypatch.setattr(_StubHandler, "step_s", 0.4)
    with _StubServer("", log_file=tmp_path / "log") as server:
        pool = row_requests(ROWS_BY_ID["text-4"], 2, seed=0, words_per_token=1.0)
        load = vllm_side.closed_loop(
            server.url, pool, 4, warmup_s=0.05, duration_s=0.1, max_requests=100
        )
    assert load["status"] == "ok"
    assert load["requests"] == 4  # one per client, each begun in the window
    assert load["window_s"] > 0.3  # it ended a step after the window's end
    assert load["requests_per_s"] == pytest.approx(4 / 0.4, rel=0.1)
    assert load["questions_per_s"] == pytest.approx(4 * 4 / 0.4, rel=0.1)


def _pretend_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA machine as far as ``benchmarks.d3`` can tell, with the stub
    standing in for ``vllm serve``."""
    monkeypatch.setattr(vllm_side, "Server", _StubServer)
    monkeypatch.setattr(_StubServer, "started", [])
    monkeypatch.setattr(d3.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(d3, "_environment", lambda: {"gpu": "stub"})


def test_smoke_with_vllm_side_stubbed(smoke, monkeypatch, tmp_path):
    """The orchestration as on a CUDA machine: both vLLM sides' rows, loads,
    ratios and the report, with the stub standing in for ``vllm serve``."""
    out, _ = smoke
    _pretend_cuda(monkeypatch)
    argv = ["--smoke", "--out", str(tmp_path), "--work", str(out / "work")]
    argv += ["--rows", "text-1,text-4,state-24k,tput-text-8"]
    argv += ["--reference-device", "cpu"]
    argv += ["--throughput-seconds", "0.5", "--throughput-warmup", "0.1"]
    argv += ["--warmup", "1", "--vllm-long-warmup", "0"]
    d3.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    # The default sides: the per-question server after its state-once twin,
    # the one with the state-once switch off.
    assert results["settings"]["sides"] == ["vllm", "vllm_per_question", "reference"]
    assert list(results["vllm_servers"]) == ["default", "default-per-question"]
    state_once, per_question = _StubServer.started
    assert state_once.log_file == tmp_path / "serve-default.log"
    assert per_question.log_file == tmp_path / "serve-default-per-question.log"
    assert not set(PER_QUESTION_FLAGS) & set(state_once.flags)
    assert per_question.flags[-2:] == PER_QUESTION_FLAGS
    assert json.loads(per_question.flags[-1]) == {"d3_state_once": False}
    for row in results["latency"]:
        for side in ("vllm", "vllm_per_question"):
            assert row[side]["status"] == "ok"
            assert len(row[side]["warmup_s"]) == (0 if row["long"] else 1)
            # The stub's usage (100 tokens a question) is neither side's count.
            assert row[side]["usage_matches_render"] is False
        assert len(row["reference"]["warmup_s"]) == 1
        p50 = {side: row[side]["p50_s"] for side in d3.DEFAULT_SIDES}
        assert row["ratio"] == pytest.approx(p50["vllm"] / p50["reference"])
        assert row["ratio_per_question"] == pytest.approx(
            p50["vllm_per_question"] / p50["reference"]
        )
        assert row["speedup_state_once"] == pytest.approx(
            p50["vllm_per_question"] / p50["vllm"]
        )
    (load,) = results["throughput"]
    for side in ("vllm", "vllm_per_question"):
        assert load[side]["status"] == "ok" and load[side]["requests_per_s"] > 0
    assert load["speedup_state_once"] == pytest.approx(
        load["vllm"]["requests_per_s"] / load["vllm_per_question"]["requests_per_s"]
    )
    # Three of the text mix's five rows were left out by --rows.
    assert load["reference"]["status"].startswith("not run")
    assert load["ratio"] is None and load["ratio_per_question"] is None
    text = (tmp_path / "results.md").read_text()
    assert "1 warm-up (0 for vLLM's long states: it times the same" in text
    four = next(row for row in results["latency"] if row["id"] == "text-4")
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| row |"))
    line = next(line for line in lines if line.startswith(f"| {four['label']} |"))
    cells = [cell.strip() for cell in line.split("|")[1:-1]]
    assert len(cells) == header.count("|") - 1
    # The p50 of state once, the Triton GDN, portable and DP=2 sides (not
    # run), per question and the reference, then the ratios (the last three
    # not measured).
    p50s = [report._ms(four[side]["p50_s"]) for side in d3.DEFAULT_SIDES]
    not_run = "not run (--sides)"
    assert cells[3:9] == [p50s[0], not_run, not_run, not_run, *p50s[1:]]
    ratios = ("ratio", "ratio_per_question", "speedup_state_once")
    assert cells[9:15] == [*(f"{four[key]:.3g}" for key in ratios), "", "", ""]
    # Tokens and state reads of state once / Triton GDN / portable / DP=2 /
    # per question / the reference.
    assert (
        f"| {four['tokens_vllm']:,} (usage.input_tokens [400]) "
        f"/ {four['tokens_vllm_triton_gdn']:,} "
        f"/ {four['tokens_vllm_portable']:,} / {four['tokens_vllm_dp2']:,} "
        f"/ {four['tokens_vllm_per_question']:,} (usage.input_tokens [400]) "
        f"/ {four['tokens_reference']:,} | 1 / 1 / 1 / 1 / 4 / 1 |"
    ) in text
    # No GDN kernel forced: the default server's flags start with the package's.
    assert "default server (`--load-format" in text
    # HTTP against engine time, with the front end's share where one HTTP
    # request is one engine request (the stub's 1-question row).
    engine = {row["id"]: row["vllm"]["engine"] for row in results["latency"]}
    one = next(row for row in results["latency"] if row["id"] == "text-1")
    front = engine["text-1"]["http_mean_s"] - engine["text-1"]["e2e_s"]
    http = report._ms(engine["text-1"]["http_mean_s"])
    assert (
        f"| {one['label']} | vLLM state once | {http} "
        f"| {report._ms(STUB_ENGINE_S)} |  |  | {report._ms(front)} | 1 |"
    ) in text
    assert f"| {four['label']} | vLLM state once |" in text
    assert (f"| {report._ms(4 * STUB_ENGINE_S)} |  |  |  | 4 |") in text
    assert (
        "default-per-question server (`--load-format "
        "dummy --additional-config '{\"d3_state_once\": false}'`)"
    ) in text


def test_a_run_with_the_per_question_side_alone(smoke, monkeypatch, tmp_path):
    out, _ = smoke
    _pretend_cuda(monkeypatch)
    argv = ["--smoke", "--out", str(tmp_path), "--work", str(out / "work")]
    argv += ["--rows", "text-4", "--sides", "vllm_per_question"]
    d3.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["vllm_servers"]) == ["default-per-question"]
    (server,) = _StubServer.started
    assert server.flags[-2:] == PER_QUESTION_FLAGS
    (row,) = results["latency"]
    assert row["vllm"] == {"status": "not run (--sides)"}
    assert row["reference"] == {"status": "not run (--sides)"}
    assert row["vllm_per_question"]["input_tokens"] == [400]
    assert row["ratio"] is row["ratio_per_question"] is row["speedup_state_once"]
    assert row["ratio"] is None
    assert results["skipped"] == []


def test_packed_step_sends_the_same_questions_three_ways(tmp_path):
    from benchmarks import packed_step
    from vllm_d3.model_executor.models.d3_contract import question_ends_of

    state, questions = [5, 6, 7], [[8, 9], [10, 11, 12], [13]]
    ((packed, extra),) = packed_step.prompts("packed", state, questions)
    ends = question_ends_of(extra, len(packed), extra["d3_state_tokens"])
    starts = [len(state), *ends[:-1]]
    # Each question block of the pack, after the state, is that question's prompt.
    per_question = packed_step.prompts("per question", state, questions)
    assert [state + packed[a:b] for a, b in zip(starts, ends, strict=True)] == [
        ids for ids, _ in per_question
    ]
    assert packed_step.prompts("one block", state, questions) == [
        (packed, {"d3_state_tokens": 3})
    ]
    # The ways of each Gated DeltaNet form send the packed request itself (only
    # the rules differ).
    for way in ("packed, two phases", "packed, one scan", "packed, one pass"):
        assert packed_step.prompts(way, state, questions) == [(packed, extra)]
    # Copies: one request each, with its own state and questions.
    rng = random.Random(0)
    copies = packed_step.step_prompts("packed", (3, 2, 4), 3, rng)
    assert [(len(ids), extra["d3_question_ends"]) for ids, extra in copies] == [
        (11, [5, 7, 9, 11])
    ] * 3
    assert len({tuple(ids) for ids, _ in copies}) == 3
    per_question = packed_step.step_prompts("per question", (3, 2, 4), 3, rng)
    assert [len(ids) for ids, _ in per_question] == [5] * 12
    package = packed_step.write_package(tmp_path, 8)
    text = json.loads((package / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 8
    assert text["layer_types"].count("full_attention") == 2


def test_gpu_timeline_finds_where_the_gpu_waits():
    from benchmarks.gpu_timeline import timeline

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "call", "ts": 1000, "dur": 9000},
        # The profiler's copy of the annotation on the GPU's timeline.
        {"ph": "X", "cat": "gpu_user_annotation", "name": "call", "ts": 3000, "dur": 5},
        kernel("before the call", 0, 1500),  # clipped to [1000, 1500)
        kernel("a", 3000, 1000),
        kernel("b", 3500, 1000),  # overlaps a: busy until 4500
        kernel("copy", 6500, 500, cat="gpu_memcpy"),
        kernel("c", 7000, 1000),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 4500, "dur": 2000},
    ]
    summary = timeline(events, "call")
    # GPU busy 1000-1500, 3000-4500, 6500-8000; the call ends at 10000.
    assert summary["call_ms"] == 9.0
    assert summary["gpu_busy_ms"] == 0.5 + 1.5 + 1.5
    assert summary["before_first_kernel_ms"] == 0.0
    assert summary["after_last_kernel_ms"] == 2.0
    assert summary["idle_between_ms"] == 1.5 + 2.0
    assert summary["largest_gaps"] == [
        {"at_ms": 3.5, "ms": 2.0, "after": "b", "before": "copy"},
        {"at_ms": 0.5, "ms": 1.5, "after": "before the call", "before": "a"},
    ]
    with pytest.raises(ValueError, match="no GPU work"):
        timeline(events[:1], "call")


def test_serve_args_end_every_servers_flags():
    # --serve-arg=--tensor-parallel-size=2, as the two-GPU runs pass it.
    tp = "--tensor-parallel-size=2"
    args = d3.parse_args(["--out", "x", f"--serve-arg={tp}"])
    rows = [ROWS_BY_ID["text-1"], ROWS_BY_ID["state-24k"]]
    groups = d3.server_groups(False, ["vllm", "vllm_per_question"], rows, [], [tp])
    assert args.serve_arg == [tp]
    assert [flags[-1] for _, _, flags, _, _ in groups] == [tp] * 4
    assert groups[3][2] == ["--max-model-len", "131072", *PER_QUESTION_FLAGS, tp]


def test_the_validation_passes_serve_args_after_its_own_flags():
    from benchmarks import validation

    flags = validation.server_flags(
        True, {"gpu_memory_utilization": 0.15}, ["--data-parallel-size=2"]
    )
    assert flags == [
        "--max-model-len",
        "131072",
        "--gpu-memory-utilization",
        "0.15",
        "--data-parallel-size=2",
    ]


def test_serve_flags_merge_every_additional_config():
    # A side's d3_state_once and a forced kernel from --serve-arg both hold, the
    # later kernel winning (vLLM itself keeps only the last --additional-config).
    flags = merge_additional_config(
        [
            "--max-model-len",
            "131072",
            "--additional-config",
            '{"d3_state_once": false, "d3_attention_kernel": "fa3"}',
            '--additional-config={"d3_attention_kernel": "triton"}',
        ]
    )
    assert flags[:2] == ["--max-model-len", "131072"]
    assert flags[2] == "--additional-config"
    assert json.loads(flags[3]) == {
        "d3_state_once": False,
        "d3_attention_kernel": "triton",
    }
    assert len(flags) == 4
    assert merge_additional_config(["--enforce-eager"]) == ["--enforce-eager"]


#: d3-turbo-shaped servers' logs from the H200, and their phases read by hand.
STARTUP_LOGS = [
    pytest.param(
        "h200-paths-serve-one.log",
        {
            "model loading": 9.269471,
            "torch.compile": 72.36,
            "profiling/warmup run": 134.85,
            "CUDA graph capture": 23.0,
            "engine init": 256.43,
            # 13:26:25, the first line, to 13:28:32, the engine's first.
            "before the engine": 127.0,
            # FlashInfer's own stamps: 13:32:27,869 to 13:32:29,804.
            "FlashInfer autotune": 1.935,
            # 13:32:29,804 to 13:32:41, the capture's end (13:33:04) less its 23 s.
            "autotune end to serving capture": 11.196,
        },
        id="autotuned",
    ),
    pytest.param(
        "archive/h200-startup-131072-serve-prefix_bidir-cold.log",
        {
            "model loading": 5.214287,
            "torch.compile": 42.13,
            "profiling/warmup run": 103.83,
            # vLLM's memory profile captures graphs too: 17 s, then 7 s, summed.
            "CUDA graph capture": 24.0,
            "engine init": 195.87,
            # 14:44:57, the first line, to 14:45:38, the engine's first.
            "before the engine": 41.0,
            # FlashInfer's own stamps: 14:48:43,201 to 14:48:43,552.
            "FlashInfer autotune": 0.351,
            # 14:48:43,552 to 14:48:55: the serving capture ends 14:49:02 after 7 s.
            "autotune end to serving capture": 11.448,
        },
        id="cold, graphs captured twice",
    ),
    pytest.param(
        "archive/h200-one-scan-serve-default.log",
        {
            "model loading": 7.288321,
            "torch.compile": 52.6,
            "profiling/warmup run": 102.22,
            # 21 s, then 9 s.
            "CUDA graph capture": 30.0,
            "engine init": 204.01,
            # 16:45:53, the first line, to 16:46:55, the engine's first.
            "before the engine": 62.0,
            # 16:50:17, the skip, to 16:50:21: the serving capture ends 16:50:30
            # after 9 s.
            "autotune end to serving capture": 4.0,
        },
        id="autotune skipped (the config hook's choice for prefix_bidir)",
    ),
]


@pytest.mark.parametrize(("log_name", "expected"), STARTUP_LOGS)
def test_startup_phases_read_a_real_server_log(log_name, expected):
    from benchmarks.startup import startup_phases

    log = Path(__file__).parents[1] / "docs/benchmarks" / log_name
    assert startup_phases(log.read_text()) == expected


def test_startup_phases_of_a_log_without_them():
    from benchmarks.startup import startup_phases

    assert startup_phases("no such lines") == {}


def test_the_file_cache_is_primed_with_every_file_of_the_packages(
    tmp_path, monkeypatch
):
    from benchmarks.startup import prime_file_cache

    package = tmp_path / "primed_package"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "lib" / "kernel.so").write_bytes(b"x" * 1000)
    (package / "lib" / "table.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    # A package that is not installed is left out.
    assert prime_file_cache(("primed_package", "not_installed_package")) == 1002


def test_startup_caches_all_live_under_the_modes_home(tmp_path):
    from benchmarks.startup import cache_environment, main

    home = tmp_path / "home-causal"
    for name, value in cache_environment(home).items():
        assert Path(value) == home or home in Path(value).parents, name
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "f"), "--work", str(tmp_path), "--caches", "hot"])


def test_startup_steps_names_steps_vllm_has():
    """Every start-up step the in-process timer wraps is where it looks for it
    in vLLM 0.33.0 (resolved only: wrapping would change vLLM's classes for the
    other tests)."""
    import importlib

    from benchmarks.startup_steps import STEPS

    for module_name, path in STEPS:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner), path


# ------------------------------------------------------------- the state cache


def test_metrics_are_summed_over_label_sets():
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
        'vllm:num_requests_running{engine="1"} 3.0\n'
        "vllm:num_requests_waiting_x 9.0\n"
    )
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert vllm_side.metric_sums(text, names) == {"vllm:num_requests_running": 5.0}


def test_the_state_cache_benchmark_reads_the_kv_cache_size():
    # As vLLM 0.33.0 logs it (``kv_cache_utils``), and without it.
    line = (
        "(EngineCore pid=7) INFO 12-05 02:43:18 [kv_cache_utils.py:1148] GPU KV "
        "cache size: 915,328 tokens, Maximum concurrency for 131,072 tokens per "
        "request: 6.98x"
    )
    assert state_cache.kv_cache_tokens(f"start\n{line}\nmore") == 915_328
    with pytest.raises(ValueError, match="no KV cache size"):
        state_cache.kv_cache_tokens("INFO Model loading took 1.0 GiB")


@contextmanager
def _served(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` on loopback, threaded; its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # Requests a client gave up on break their connections: not an error.
    httpd.handle_error = lambda *args: None  # type: ignore[method-assign]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _MetricsHandler(BaseHTTPRequestHandler):
    """``/metrics`` as vLLM serves it: prometheus_client's default registry."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        import prometheus_client

        data = prometheus_client.generate_latest()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_the_state_cache_benchmark_reads_vllms_prompt_token_counters(
    make_checkpoint,
):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    model = make_checkpoint(attention_mode="causal", weights=False)
    # vLLM's own metrics of two engines, as a data-parallel server has them.
    metrics = PrometheusStatLogger(
        EngineArgs(model=model).create_engine_config(), [0, 1]
    )
    try:
        with _served(_MetricsHandler) as url:
            before = state_cache.prompt_tokens(url)
            metrics.counter_prompt_tokens_cached[0].inc(40)
            metrics.counter_prompt_tokens_cached[1].inc(2)
            metrics.counter_prompt_tokens[0].inc(1000)
            metrics.counter_prompt_tokens[1].inc(100)
            after = state_cache.prompt_tokens(url)
            assert after["cached"] - before["cached"] == 42
            assert after["prompt"] - before["prompt"] == 1100
    finally:
        unregister_vllm_metrics()  # later tests' servers export none of them


def test_a_page_asks_its_questions_once_over_its_requests():
    rng = random.Random(0)
    (page,) = state_cache.make_pages(rng, 1, per_token=0.01)
    assert len(page) == state_cache.PAGE_REQUESTS == 4
    assert len({request["state"] for request in page}) == 1
    sizes = [len(request["questions"]) for request in page]
    assert sizes == [7, 7, 6, 6]
    asked = [name for request in page for name in request["questions"]]
    assert asked == [f"q{i}" for i in range(state_cache.PAGE_QUESTIONS)]


class _SlowAnswers(BaseHTTPRequestHandler):
    """Answers each POST after ``delay_s``, echoing its state."""

    delay_s = 0.2

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay_s)
        data = json.dumps({"state": body["state"]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_pages_per_second_count_the_requests_answered_in_the_window():
    pages = [
        [{"state": f"page {p}, request {r}"} for r in range(state_cache.PAGE_REQUESTS)]
        for p in range(100)
    ]
    with _served(_SlowAnswers) as url:
        started = time.monotonic()
        rate, replies = asyncio.run(
            state_cache._pages_per_s(url, pages, clients=2, seconds=1.5)
        )
        took = time.monotonic() - started
    # Two clients, a page every 0.2 s each and the round trips: at most 10
    # pages a second.
    assert 4 < rate <= 10.5
    assert took < 1.5 + 0.5  # the requests under way at the end are given up
    assert replies and all(
        reply["state"] == pages[page][part]["state"]
        for (page, part), reply in replies.items()
    )


def test_the_state_cache_benchmark_names_an_unknown_part(tmp_path, capsys):
    with pytest.raises(SystemExit):
        state_cache.main(["--out", str(tmp_path / "out"), "--parts", "speed,speeds"])
    assert "--parts: no part speeds" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _state_cache_table(max_dp: float, changed: int) -> dict:
    return {
        "questions": 4,
        "decisions_changed": changed,
        "changed_near_ties": changed,
        "max_dp": max_dp,
    }


#: The state cache benchmark's parts as a run would write them.
STATE_CACHE_ANSWERS = {
    "passes": {
        "cold": {"cached_tokens": 0, "sets": {"a": _state_cache_table(0.001, 0)}},
        "cached": {"cached_tokens": 96, "sets": {"a": _state_cache_table(0.003, 1)}},
        "after eviction": {
            "cached_tokens": 0,
            "sets": {
                "a": _state_cache_table(0.002, 0),
                "b": _state_cache_table(0.004, 1),
            },
        },
    }
}
STATE_CACHE_SPEED = {
    side: {
        "repeat_first_s": first,
        "repeat_second_s": 0.3,
        "text-16_p50_s": 0.16,
        "photo-8_p50_s": 0.24,
        "pages_per_s": rate,
    }
    for side, first, rate in (("uncached", 7.6, 0.2), ("cached", 7.7, 0.7))
}


def test_the_state_cache_summary_takes_every_pass_and_set():
    answers, speed = STATE_CACHE_ANSWERS, STATE_CACHE_SPEED
    summary = state_cache.summary(answers, {"control_max_dp": 0.3}, speed)
    assert summary == {
        "repeat_64k_first_s": 7.7,
        "repeat_64k_second_s": 0.3,
        "repeat_64k_uncached_s": 7.6,
        "pages_per_s_cached": 0.7,
        "pages_per_s_uncached": 0.2,
        "validation_max_dp": 0.004,
        "decisions_changed": 2,
        "control_max_dp": 0.3,
    }
    text = state_cache.report({"summary": summary, "answers": answers, "speed": speed})
    assert "| validation_max_dp | 0.004 |" in text
    assert "| cached | 7.700 | 0.300 | 0.160 | 0.240 | 0.700 |" in text
    assert "|---|---|---|---|---|---|\n" in text
    assert "## cached (96 tokens from the cache)" in text


def test_the_state_cache_summary_takes_the_parts_earlier_runs_wrote(tmp_path):
    done = {"control": {"control_max_dp": 0.3}}
    (tmp_path / "answers.json").write_text(json.dumps(STATE_CACHE_ANSWERS))
    assert not state_cache.write_summary(tmp_path, done)  # speed missing
    assert not (tmp_path / "state-cache.json").exists()
    (tmp_path / "speed.json").write_text(json.dumps(STATE_CACHE_SPEED))
    assert state_cache.write_summary(tmp_path, done)
    written = json.loads((tmp_path / "state-cache.json").read_text())
    assert written["summary"]["validation_max_dp"] == 0.004
    assert written["summary"]["pages_per_s_cached"] == 0.7
    assert written["control"] == {"control_max_dp": 0.3}
    assert "| control_max_dp | 0.3 |" in (tmp_path / "state-cache.md").read_text()


def test_every_run_records_its_date_commit_and_gpu():
    record = run_record()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    )
    assert record["commit"] == head.stdout.strip()
    when = datetime.fromisoformat(record["date"])
    assert abs(datetime.now(timezone.utc) - when) < timedelta(minutes=1)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    assert record["gpu"] == gpu
