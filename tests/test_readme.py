"""The README's request examples, so that they cannot rot.

The ``curl`` body and the ``typesafe-sdk`` snippet are read out of README.md
and sent to vLLM 0.33.0's own API app (``build_app``, the plugin loaded
through its entry point), whose /v1/systemone handler is replaced by one that
records the parsed request and answers with the README's answers. The answers
shown are checked against the reference runtime on the tiny checkpoint the
README's command builds: each answer has the shape vLLM's question types give
the reference's probabilities, its numbers within the validation tolerance.
"""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm.entrypoints.launchers.app as launchers_app
from starlette.testclient import TestClient
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.generate.structured_decisions.protocol import (
    DecisionUsage,
    StructuredDecisionResponse,
)
from vllm.entrypoints.openai.decisions.question_types import build_question
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_d3.testing.compare import TOLERANCE
from vllm_d3.testing.server import app_on_loopback

README = (Path(__file__).parents[1] / "README.md").read_text()


def block(language: str, starting: str) -> str:
    """The README's fenced ``language`` block whose text starts with ``starting``."""
    found = re.findall(rf"```{language}\n({re.escape(starting)}.*?)```", README, re.S)
    assert len(found) == 1, f"one {language} block starting {starting!r}"
    return found[0]


CURL = block("bash", "curl ")
REQUEST = json.loads(re.search(r"-d '(.*?)'", CURL, re.S).group(1))
ANSWERS = json.loads(block("json", "{"))
SDK = block("python", "from typesafe_sdk")
SDK_PRINTS = re.search(r"prints `([^`]*)`", README).group(1)


class Recorder:
    """Stands in for vLLM's ServingStructuredDecisions: keeps each parsed
    request and answers with the README's answers."""

    def __init__(self) -> None:
        self.requests: list = []

    async def create_decision(self, request, raw_request):
        self.requests.append(request)
        return StructuredDecisionResponse(
            id=f"decision-{request.request_id}",
            model=request.model or "tiny-d3",
            answers=ANSWERS,
            usage=DecisionUsage(input_tokens=1, output_tokens=0),
            diagnostics={},
        )


def questions(parsed) -> dict:
    """The questions of a request as the route parsed it."""
    return {qid: q.model_dump() for qid, q in parsed.questions.items()}


def questions_asked() -> dict:
    """The curl body's questions, written out as the route's model holds them."""
    return {
        qid: {"type": q["type"], "instructions": q["instructions"]}
        | {"criteria": q.get("criteria")}
        for qid, q in REQUEST["questions"].items()
    }


@pytest.fixture(scope="module")
def app():
    load_general_plugins()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = launchers_app.build_app(args, ("classify",))
    app.state.serving_structured_decisions = Recorder()
    return app


def test_the_curl_request_is_what_the_route_reads(app):
    recorder = app.state.serving_structured_decisions
    recorder.requests.clear()
    assert "localhost:8000/v1/systemone" in CURL
    response = TestClient(app).post("/v1/systemone", json=REQUEST)
    assert response.status_code == 200, response.text
    assert response.json()["answers"] == ANSWERS
    (parsed,) = recorder.requests
    assert parsed.state == REQUEST["state"]
    assert questions(parsed) == questions_asked()


def test_the_sdk_snippet_sends_the_same_request_and_prints_what_is_shown(app):
    recorder = app.state.serving_structured_decisions
    recorder.requests.clear()
    assert 'base_url="http://localhost:8000"' in SDK
    printed = io.StringIO()
    with app_on_loopback(app) as url, contextlib.redirect_stdout(printed):
        exec(SDK.replace("http://localhost:8000", url), {})
    assert printed.getvalue() == SDK_PRINTS + "\n"
    (sent,) = recorder.requests
    assert sent.model == "tiny-d3"
    assert sent.state == REQUEST["state"]
    assert questions(sent) == questions_asked()


def test_the_answers_shown_are_the_tiny_checkpoints(tmp_path):
    from vllm_d3.reference import ReferenceRuntime

    command = re.search(
        r"python -m (vllm_d3\.testing\.tiny_checkpoint) tiny-d3(.*)\n", README
    )
    checkpoint = tmp_path / "tiny-d3"
    subprocess.run(
        [sys.executable, "-m", command.group(1), str(checkpoint)]
        + command.group(2).split(),
        check=True,
        capture_output=True,
    )
    reference = ReferenceRuntime(checkpoint).answer(REQUEST)["answers"]
    assert ANSWERS.keys() == REQUEST["questions"].keys()
    for qid, spec in REQUEST["questions"].items():
        question = build_question(
            qid, spec["type"], spec.get("instructions"), spec.get("criteria"), 255
        )
        probabilities = list(reference[qid]["probabilities"].values())
        # vLLM's answer for the reference's probabilities (a D3 read's label
        # mass is 1).
        expected = question.type.answer(question, probabilities, 1.0)
        shown = ANSWERS[qid]
        assert list(shown) == list(expected)
        for key, value in expected.items():
            if isinstance(value, float):
                assert shown[key] == pytest.approx(value, abs=TOLERANCE), (qid, key)
            elif key == "probabilities":
                assert shown[key].keys() == value.keys()
                for option, p in value.items():
                    assert shown[key][option] == pytest.approx(p, abs=TOLERANCE)
            else:
                assert shown[key] == value, (qid, key)
