"""The soak driver on the CPU: ``benchmarks.soak`` against vLLM 0.33.0's real API
app (its routes, request parsing, ``with_cancellation`` and the plugin's body
middleware) behind uvicorn, the decision handler replaced by a stand-in.

The stand-in answers after a delay (long states take longer than any
cancellation waits), refuses what vLLM's serving would refuse (a state over
the length, a question type it does not know, an image that does not decode)
with a 400, and counts the requests
whose handler vLLM cancelled when the client went away. Its answers are a
function of the request, so repeated requests cannot drift.
"""

import asyncio
import base64
import hashlib
import io
import json
import os
import time

import pytest
import vllm.entrypoints.launchers.app as launchers_app
from fastapi import Request
from PIL import Image
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.generate.structured_decisions.protocol import (
    DecisionUsage,
    StructuredDecisionResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser

from benchmarks import soak
from vllm_d3.testing.server import app_on_loopback

MAX_WORDS = 2000
QUESTION_TYPES = ("noul", "choice", "score")
LONG_WORDS = 150
#: Longer than ``soak.CANCEL_AFTER_S``'s end: every cancelled request is cut.
LONG_ANSWER_S = soak.CANCEL_AFTER_S[1] + 0.5


class StandIn:
    def __init__(self) -> None:
        self.cancelled = 0
        self.answered = 0

    async def create_decision(self, request, raw_request: Request):
        words = len(str(request.state or "").split())
        if words > MAX_WORDS:
            return refusal(f"state of {words} words is over {MAX_WORDS}")
        for name, spec in request.questions.items():
            if spec.type not in QUESTION_TYPES:
                return refusal(f"question {name!r} has an unknown type {spec.type!r}")
        for url in request.images or []:
            try:
                Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).load()
            except Exception:
                return refusal("image does not decode")
        try:
            await asyncio.sleep(LONG_ANSWER_S if words > LONG_WORDS else 0.02)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.answered += 1
        return answer(request)


def refusal(message: str) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(message=message, type="BadRequestError", code=400)
    )


def answer(request) -> StructuredDecisionResponse:
    digest = hashlib.sha256(repr(request.state).encode()).digest()
    answers = {}
    for i, name in enumerate(request.questions):
        p = digest[i % len(digest)] / 255
        answers[name] = {
            "type": "noul",
            "noul": p,
            "probabilities": {"yes": p, "no": 1 - p},
        }
    return StructuredDecisionResponse(
        id="decision",
        model="d3",
        answers=answers,
        usage=DecisionUsage(input_tokens=1, output_tokens=len(answers)),
        diagnostics={},
    )


@pytest.fixture(scope="module")
def served():
    load_general_plugins()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = launchers_app.build_app(args, ("classify",))
    stand_in = StandIn()
    app.state.serving_structured_decisions = stand_in
    with app_on_loopback(app) as url:
        yield url, stand_in


@pytest.fixture(scope="module")
def results(served, tmp_path_factory):
    url, stand_in = served
    out = tmp_path_factory.mktemp("soak")
    argv = ["--out", str(out), "--url", url, "--minutes", "4", "--minute-seconds", "2"]
    argv += ["--clients", "8", "--seed", "3", "--server-pid", str(os.getpid())]
    argv += ["--long-tokens", "200,400", "--max-model-len", str(MAX_WORDS)]
    argv += ["--burst-minute", "1", "--burst-states", "3"]
    assert soak.main(argv) == 0
    # vLLM cancels a handler once it sees the disconnect; give it the moment.
    time.sleep(0.5)
    return json.loads((out / "soak.json").read_text()), out, stand_in


def test_the_results_have_the_issues_keys(results):
    found, out, _ = results
    keys = {"minutes", "clients", "by_outcome", "unanswered", "drift_max_dp"}
    keys |= {"gpu_memory_growth_pct", "rss_growth_pct", "aborted_in_engine"}
    assert keys | {"cancelled"} <= found.keys()
    assert set(found["by_outcome"]) == {
        "200",
        "4xx",
        "5xx",
        "cancelled",
        "client_timeout",
        "connection_error",
    }
    assert (found["minutes"], found["clients"]) == (4, 8)
    assert [m["minute"] for m in found["per_minute"]] == [1, 2, 3, 4]
    assert (out / "soak.md").read_text().startswith("# Soak: 4 minutes, 8 clients")


def test_each_minute_leaves_the_results_so_far(results):
    # Written at the end of minute 4, the last: every request that ended by
    # then is in it, counted in the minute it ended, as in the final results.
    found, out, _ = results
    partial = json.loads((out / soak.PARTIAL).read_text())
    assert partial["minutes"] == found["minutes"] == 4
    assert [m["by_outcome"] for m in partial["per_minute"]] == [
        m["by_outcome"] for m in found["per_minute"]
    ]
    assert partial["requests"] <= found["requests"]
    assert partial["aborted_in_engine"] is None


def test_every_kind_ran_and_was_counted(results):
    found, _, stand_in = results
    kinds = {"text", "media", "long", "cancel", "bad", "repeat", "burst"}
    assert set(found["by_kind"]) == kinds
    assert sum(found["by_outcome"].values()) == found["requests"]
    assert found["by_outcome"]["200"] == stand_in.answered
    failed = ("5xx", "client_timeout", "connection_error")
    assert [found["by_outcome"][name] for name in failed] == [0, 0, 0]


def test_accepted_requests_were_answered_and_bad_ones_refused(results):
    found, _, _ = results
    assert found["unanswered"] == 0
    assert found["bad_not_refused"] == 0
    assert found["by_outcome"]["4xx"] == found["by_kind"]["bad"]


def test_the_burst_sends_one_longest_state_per_burst_client_and_each_is_answered(
    results,
):
    found, _, _ = results
    # 3 of the 8 clients.
    assert found["burst"]["sent"] == found["by_kind"]["burst"] == 3
    assert found["burst"]["answered"] == 3
    # Answered together: each took the stand-in's time for a long state.
    assert LONG_ANSWER_S <= found["burst"]["slowest_s"] < 2 * LONG_ANSWER_S


def test_each_closed_connection_cancelled_its_handler(results):
    found, _, stand_in = results
    assert found["cancelled"] == found["by_kind"]["cancel"] > 0
    assert stand_in.cancelled == found["cancelled"]


def test_repeats_are_compared_and_memory_sampled(results):
    found, _, _ = results
    assert found["drift_max_dp"] == 0.0
    assert all(m["rss_mib"] > 0 for m in found["per_minute"])
    assert found["rss_growth_pct"] is not None
    # No engine behind the stand-in: no queue metrics, no GPU, no server log.
    assert {m["running"] for m in found["per_minute"]} == {None}
    assert found["gpu_memory_growth_pct"] is None and found["aborted_in_engine"] is None


def test_a_long_state_is_asked_again_beside_the_text_requests():
    # Its later asks find it in a prefix_bidir server's state cache.
    workload = soak.Workload(
        0, per_token=1.0, long_tokens=(300, 900), max_model_len=4096, media=False
    )
    words = [len(json.loads(body)["state"].split()) for body in workload.repeated]
    assert len(words) == soak.REPEATED + 1
    assert words[-1] == 300 > max(words[:-1])
    asked = {workload.next().repeat for _ in range(3000)} - {None}
    assert asked == set(range(len(words)))


def test_growth_is_the_last_ten_minutes_against_minute_ten():
    levels = [100.0] * 9 + [200.0] + [201.0] * 9 + [210.0]
    assert soak.growth_pct(levels) == pytest.approx(5.0)
    assert soak.growth_pct([100.0, 110.0, 120.0, 90.0]) == pytest.approx(1000 / 110)
    assert soak.growth_pct([100.0, None]) is None


def test_aborted_ids_are_read_from_the_log():
    text = (
        "INFO Aborted request(s) a-1,b-2.\nINFO other\nINFO Aborted request(s) c-3.\n"
    )
    assert soak.aborted_ids(text) == {"a-1", "b-2", "c-3"}
