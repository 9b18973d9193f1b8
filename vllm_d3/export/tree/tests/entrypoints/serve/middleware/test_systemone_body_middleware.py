# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""POST /v1/systemone bodies as the typesafe-sdk sends them (zstd or gzip,
multipart with image assets), through vLLM's own app with the route's handler
replaced by one that records the request it parsed."""

import base64
import gzip
import io
import json

import httpx
import pytest
from fastapi import Request
from PIL import Image
from starlette.testclient import TestClient

import vllm.entrypoints.launchers.app as launchers_app
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.generate.structured_decisions.protocol import (
    DecisionUsage,
    StructuredDecisionRequest,
    StructuredDecisionResponse,
)
from vllm.entrypoints.serve.middleware.systemone_body import zstd
from vllm.utils.argparse_utils import FlexibleArgumentParser

ROUTE = "/v1/systemone"
REQUEST = {
    "state": "The parcel arrived with a dent.",
    "questions": {"damaged": {"type": "noul", "instructions": "Is it damaged?"}},
    "request_id": "req-1",
}
ANSWER = StructuredDecisionResponse(
    id="decision-1",
    model="d3",
    answers={},
    usage=DecisionUsage(input_tokens=12, output_tokens=2),
    diagnostics={},
)


class RecordingDecisions:
    """Stands in for ServingStructuredDecisions."""

    def __init__(self) -> None:
        self.requests: list[StructuredDecisionRequest] = []

    async def create_decision(self, request, raw_request: Request):
        self.requests.append(request)
        return ANSWER


def serve() -> tuple[TestClient, RecordingDecisions]:
    """vLLM's app, its /v1/systemone handler recording, and an /echo route."""
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = launchers_app.build_app(args, ("classify",))
    recorder = RecordingDecisions()
    app.state.serving_structured_decisions = recorder

    @app.post("/echo")
    async def echo(request: Request):
        return {"length": len(await request.body())}

    return TestClient(app), recorder


@pytest.fixture
def server() -> tuple[TestClient, RecordingDecisions]:
    return serve()


def post(client: TestClient, body: bytes, **headers: str):
    headers = {"content-type": "application/json", **headers}
    return client.post(ROUTE, content=body, headers=headers)


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), "red").save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("encoding", [None, "zstd", "gzip"])
def test_a_body_reaches_the_route_as_plain_json(server, encoding):
    client, recorder = server
    body = json.dumps(REQUEST).encode()
    compress = {None: bytes, "zstd": zstd.compress, "gzip": gzip.compress}
    headers = {"content-encoding": encoding} if encoding else {}
    response = post(client, compress[encoding](body), **headers)
    assert response.status_code == 200, response.text
    assert recorder.requests == [StructuredDecisionRequest(**REQUEST)]


def test_another_encoding_is_415_naming_it(server):
    client, recorder = server
    response = post(client, b"{}", **{"content-encoding": "br"})
    assert response.status_code == 415
    assert "'br'" in response.json()["error"]["message"]
    assert recorder.requests == []


def test_a_body_over_the_limit_is_413(monkeypatch):
    # The limit is read when the app is built.
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", "64")
    client, recorder = serve()
    body = json.dumps({**REQUEST, "state": "x" * 1000}).encode()
    response = post(client, zstd.compress(body), **{"content-encoding": "zstd"})
    assert response.status_code == 413
    assert recorder.requests == []


def post_form(client: TestClient, state: str, image: bytes):
    """A multipart form as the typesafe-sdk sends it: the request, whose
    ``state`` names the image asset ``<image:1>``, and the image's part."""
    request = {
        **REQUEST,
        "state": state,
        "assets": {"<image:1>": {"type": "image", "part": "asset-0"}},
    }
    files: dict = {
        "request": (None, json.dumps(request), "application/json"),
        "asset-0": ("asset-0.png", image),
    }
    encoded = httpx.Request("POST", "http://server", files=files)
    return client.post(ROUTE, content=encoded.read(), headers=encoded.headers)


def test_an_image_asset_that_is_the_whole_state(server):
    client, recorder = server
    image = png()
    response = post_form(client, "<image:1>", image)
    assert response.status_code == 200, response.text
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    expected = StructuredDecisionRequest(**{**REQUEST, "state": "", "images": [url]})
    assert recorder.requests == [expected]


def test_a_reference_inside_a_text_is_refused_naming_it(server):
    client, recorder = server
    response = post_form(client, "See <image:1> here", png())
    assert response.status_code == 400
    assert "<image:1>" in response.json()["error"]["message"]
    assert recorder.requests == []


def test_other_routes_are_untouched(server):
    client, _ = server
    body = zstd.compress(b"{}")
    response = client.post("/echo", content=body, headers={"content-encoding": "zstd"})
    assert response.json() == {"length": len(body)}
