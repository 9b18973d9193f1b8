"""/v1/systemone bodies as existing clients send them, through vLLM's real API app.

Each test builds vLLM 0.33.0's own app (``build_app``, its routers, exception
handlers and middleware) with the plugin loaded through its entry point, and
replaces one object: ``app.state.serving_structured_decisions``, the handler the
route calls, with a recorder that keeps the request the route parsed and the
headers it saw, and answers a canned decision. Expected requests are built here
with upstream's ``StructuredDecisionRequest``; images are small PIL images whose
data URLs are written out here from their bytes.
"""

import asyncio
import base64
import gzip
import inspect
import io
import json
import tracemalloc
import zlib

import httpx
import httpx2
import pytest
import vllm.entrypoints.launchers.app as launchers_app
from fastapi import Request
from PIL import Image
from starlette.testclient import TestClient
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.generate.structured_decisions.protocol import (
    DecisionUsage,
    StructuredDecisionRequest,
    StructuredDecisionResponse,
)
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser

import vllm_d3
from vllm_d3 import patches
from vllm_d3.entrypoints.serve.middleware.systemone_body import (
    BodyRefused,
    SystemOneBodyMiddleware,
    json_of_form,
    max_body_bytes,
    zstd,
)
from vllm_d3.testing.server import app_on_loopback

ROUTE = "/v1/systemone"
REQUEST = {
    "state": "The parcel arrived with a dent.",
    "questions": {
        "damaged": {"type": "noul", "instructions": "Is the item damaged?"},
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": ["refund", "replacement"],
        },
    },
    "request_id": "req-1",
}
ANSWER = StructuredDecisionResponse(
    id="decision-req-1",
    model="d3",
    answers={
        "damaged": {
            "type": "noul",
            "noul": 0.25,
            "probabilities": {"yes": 0.25, "no": 0.75},
        }
    },
    usage=DecisionUsage(input_tokens=12, output_tokens=2),
    diagnostics={},
)


class RecordingDecisions:
    """Stands in for vLLM's ServingStructuredDecisions."""

    def __init__(self) -> None:
        self.requests: list[StructuredDecisionRequest] = []
        self.headers: list[dict[str, str]] = []

    async def create_decision(self, request, raw_request: Request):
        self.requests.append(request)
        self.headers.append(dict(raw_request.headers))
        return ANSWER


def serve(*cli_args: str) -> tuple[TestClient, RecordingDecisions]:
    load_general_plugins()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(cli_args))
    app = launchers_app.build_app(args, ("classify",))
    recorder = RecordingDecisions()
    app.state.serving_structured_decisions = recorder

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {"body": base64.b64encode(body).decode(), **dict(request.headers)}

    return TestClient(app), recorder


@pytest.fixture(scope="module")
def server():
    return serve()


@pytest.fixture
def client(server):
    client, recorder = server
    recorder.requests.clear()
    recorder.headers.clear()
    return client


@pytest.fixture
def recorder(server):
    return server[1]


def image(fmt: str, color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), color).save(out, fmt)
    return out.getvalue()


def animated_gif() -> bytes:
    out = io.BytesIO()
    first, second = Image.new("P", (8, 8), 1), Image.new("P", (8, 8), 2)
    first.save(out, "GIF", save_all=True, append_images=[second])
    return out.getvalue()


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def expected(**changes) -> StructuredDecisionRequest:
    return StructuredDecisionRequest(**{**REQUEST, **changes})


def with_image(state: str, media_type: str, data: bytes) -> StructuredDecisionRequest:
    return expected(state=state, images=[data_url(media_type, data)])


def post_json(client: TestClient, body: bytes, encoding: str | None = None):
    headers = {"content-type": "application/json"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    return client.post(ROUTE, content=body, headers=headers)


def multipart(request: dict | None, parts: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body as httpx encodes one, and its Content-Type."""
    files: dict = {name: (f"{name}.bin", data) for name, data in parts.items()}
    if request is not None:
        files = {"request": (None, json.dumps(request), "application/json"), **files}
    encoded = httpx.Request("POST", "http://server", files=files)
    return encoded.read(), encoded.headers["content-type"]


def post_form(client, request, parts, encoding: str | None = None):
    body, content_type = multipart(request, parts)
    headers = {"content-type": content_type}
    if encoding == "zstd":
        body = zstd.compress(body)
        headers["content-encoding"] = encoding
    return client.post(ROUTE, content=body, headers=headers)


def assert_refused(response, status: int, *named: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert (
        error["type"]
        == {
            400: "BadRequestError",
            413: "Request Entity Too Large",
            415: "Unsupported Media Type",
        }[status]
    )
    for name in named:
        assert name in error["message"]


# Plain JSON, other routes and the seam.


@pytest.mark.plugin
def test_the_plugin_builds_the_middleware_into_vllms_app():
    load_general_plugins()
    assert patches.is_applied(launchers_app, "init_entrypoints_middleware")
    assert (
        "patch vllm.entrypoints.launchers.app.init_entrypoints_middleware"
        in vllm_d3.registration.installed_hooks()
    )
    # build_app calls it by its module-level name, so the patched one runs.
    source = inspect.getsource(launchers_app.build_app)
    assert "init_entrypoints_middleware(args, app, supported_tasks)" in source


def test_plain_json_reaches_the_route_unchanged(client, recorder):
    body = json.dumps(REQUEST).encode()
    response = post_json(client, body)
    assert response.status_code == 200
    assert response.json() == ANSWER.model_dump()
    assert recorder.requests == [expected()]
    assert recorder.headers[0]["content-length"] == str(len(body))
    assert post_json(client, body, "identity").status_code == 200
    assert recorder.requests[1] == expected()


def test_bodies_vllm_refused_are_still_its_refusals(client, recorder):
    response = post_json(client, b'{"state": ')
    assert response.status_code == 400
    assert "JSON decode error" in response.json()["error"]["message"]
    # Compressed bytes without a Content-Encoding.
    response = post_json(client, zstd.compress(json.dumps(REQUEST).encode()))
    assert response.status_code == 400
    assert response.json() == {"detail": "There was an error parsing the body"}
    response = client.post(ROUTE, content=b"{}", headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert "Only 'application/json' is allowed" in response.json()["error"]["message"]
    assert recorder.requests == []


def test_other_routes_are_untouched(client):
    body = gzip.compress(b'{"x": 1}')
    response = client.post(
        "/echo", content=body, headers={"content-encoding": "gzip", "x-test": "1"}
    )
    assert base64.b64decode(response.json()["body"]) == body
    assert response.json()["content-encoding"] == "gzip"
    form, content_type = multipart(REQUEST, {"asset-0": b"bytes"})
    response = client.post(
        "/echo", content=form, headers={"content-type": content_type}
    )
    assert base64.b64decode(response.json()["body"]) == form
    # Another method on the route itself: upstream's 405, not a 415.
    response = client.put(ROUTE, content=b"{}", headers={"content-encoding": "br"})
    assert response.status_code == 405


def test_the_api_key_is_checked_first():
    client, recorder = serve("--api-key", "secret")
    bad_image = {**REQUEST, "state": "{photo}"}
    bad_image["assets"] = {"photo": {"type": "image", "part": "asset-0"}}
    assert post_form(client, bad_image, {"asset-0": b"x"}).status_code == 401
    client.headers["authorization"] = "Bearer secret"
    assert_refused(post_form(client, bad_image, {"asset-0": b"x"}), 400, "asset-0")
    assert recorder.requests == []


# Compressed bodies.


def gzip_members(data: bytes) -> bytes:
    return gzip.compress(data[:20]) + gzip.compress(data[20:])


def zstd_frames(data: bytes) -> bytes:
    return zstd.compress(data[:20]) + zstd.compress(data[20:])


@pytest.mark.parametrize(
    "encoding, compress",
    [
        ("zstd", zstd.compress),
        ("gzip", gzip.compress),
        ("ZSTD", zstd.compress),
        ("zstd", zstd_frames),
        ("gzip", gzip_members),
    ],
)
def test_compressed_bodies(client, recorder, encoding, compress):
    body = json.dumps(REQUEST).encode()
    response = post_json(client, compress(body), encoding)
    assert response.status_code == 200, response.text
    assert response.json() == ANSWER.model_dump()
    assert recorder.requests == [expected()]
    headers = recorder.headers[0]
    assert "content-encoding" not in headers
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))


@pytest.mark.parametrize("encoding", ["br", "deflate", "gzip, zstd"])
def test_other_encodings_are_415_naming_them(client, recorder, encoding):
    body = gzip.compress(json.dumps(REQUEST).encode())
    assert_refused(post_json(client, body, encoding), 415, repr(encoding))
    assert recorder.requests == []


@pytest.mark.parametrize(
    "encoding, body, named",
    [
        ("zstd", zstd.compress(b'{"state": "x"}')[:-3], "ends before its stream"),
        ("gzip", gzip.compress(b'{"state": "x"}')[:-3], "ends before its stream"),
        ("zstd", b'{"state": "x"}', "not valid zstd data"),
        ("gzip", b'{"state": "x"}', "not valid gzip data"),
        ("gzip", gzip.compress(b"{}") + b"trailing", "not valid gzip data"),
        ("zstd", b"", "ends before its stream"),
    ],
    # gzip writes the time into its header: ids from the bytes would differ
    # from one collection to the next.
    ids=["zstd-cut", "gzip-cut", "zstd-plain", "gzip-plain", "gzip-trailing", "empty"],
)
def test_corrupt_or_truncated_streams_are_400(client, recorder, encoding, body, named):
    assert_refused(post_json(client, body, encoding), 400, named)
    assert recorder.requests == []


def zeros(encoding: str, mib: int) -> bytes:
    """``mib`` MiB of zero bytes, compressed a MiB at a time."""
    compressor = (
        zstd.ZstdCompressor() if encoding == "zstd" else zlib.compressobj(wbits=31)
    )
    chunks = [compressor.compress(bytes(1 << 20)) for _ in range(mib)]
    return b"".join(chunks) + compressor.flush()


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_a_body_over_the_limit_is_413_before_it_is_decompressed(monkeypatch, encoding):
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", str(1 << 20))
    client, recorder = serve()
    bomb = zeros(encoding, 512)
    tracemalloc.start()
    try:
        response = post_json(client, bomb, encoding)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_refused(response, 413, "over 1048576 bytes", "VLLM_D3_MAX_BODY_BYTES")
    assert recorder.requests == []
    # 512 MiB decompressed would need 512 MiB; the cap keeps it near 1 MiB.
    assert peak < 32 << 20


def test_the_limit_is_the_decoded_size(monkeypatch):
    body = json.dumps(REQUEST).encode()
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", str(len(body)))
    client, recorder = serve()
    assert post_json(client, zstd.compress(body), "zstd").status_code == 200
    assert recorder.requests == [expected()]
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", str(len(body) - 1))
    client, recorder = serve()
    assert_refused(post_json(client, gzip.compress(body), "gzip"), 413)
    assert_refused(post_form(client, REQUEST, {}), 413)
    # A plain JSON body is vLLM's to read, as before.
    assert post_json(client, body).status_code == 200


@pytest.mark.parametrize(
    ("value", "limit"), [(None, 32 << 20), ("1", 1), (" 4096\n", 4096)]
)
def test_the_limit_is_read_from_the_environment(monkeypatch, value, limit):
    if value is None:
        monkeypatch.delenv("VLLM_D3_MAX_BODY_BYTES", raising=False)
    else:
        monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", value)
    assert max_body_bytes() == limit


@pytest.mark.parametrize("value", ["0", "-5", "32MiB", "", " "])
def test_a_limit_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", value)
    with pytest.raises(ValueError) as excinfo:
        max_body_bytes()
    assert str(excinfo.value) == (
        f"VLLM_D3_MAX_BODY_BYTES must be a positive number of bytes, not {value!r}"
    )


@pytest.mark.parametrize("value", ["0", "-5", "32MiB", ""])
def test_the_limit_must_be_a_positive_number_of_bytes(monkeypatch, value):
    monkeypatch.setenv("VLLM_D3_MAX_BODY_BYTES", value)
    with pytest.raises(ValueError, match="VLLM_D3_MAX_BODY_BYTES must be a positive"):
        serve()


# Multipart forms.


def with_assets(state, assets: dict[str, str], **changes) -> dict:
    """REQUEST with ``state`` and image assets ``{key: part}``."""
    request = {**REQUEST, "state": state, **changes}
    request["assets"] = {
        key: {"type": "image", "part": part} for key, part in assets.items()
    }
    return request


def test_an_image_that_is_the_whole_state(client, recorder):
    png = image("PNG")
    request = with_assets("<image:7f3a>", {"<image:7f3a>": "asset-0"})
    response = post_form(client, request, {"asset-0": png})
    assert response.status_code == 200, response.text
    assert response.json() == ANSWER.model_dump()
    assert recorder.requests == [with_image("", "image/png", png)]
    assert recorder.headers[0]["content-type"] == "application/json"


def test_an_image_element_of_a_state_array(client, recorder):
    jpeg = image("JPEG")
    request = with_assets(["Look at ", "{photo}", " please"], {"photo": "asset-0"})
    assert post_form(client, request, {"asset-0": jpeg}).status_code == 200
    assert recorder.requests == [with_image("Look at  please", "image/jpeg", jpeg)]


def test_a_name_is_a_reference_as_a_whole_element_only(client, recorder):
    # The SDK writes an image it was given a name for as that name.
    jpeg = image("JPEG")
    state = ["A photo: ", "photo", " of the photo."]
    request = with_assets(state, {"photo": "asset-0"})
    assert post_form(client, request, {"asset-0": jpeg}).status_code == 200
    expected_state = "A photo:  of the photo."
    assert recorder.requests == [with_image(expected_state, "image/jpeg", jpeg)]


def test_assets_become_images_in_order_of_reference(client, recorder):
    webp, gif, png = image("WEBP", "blue"), animated_gif(), image("PNG", "green")
    state = ["{a}", "First, ", "<image:1>", "then ", "{b}", "last."]
    # Assets and parts in other orders than the state's.
    request = with_assets(state, {"b": "asset-0", "<image:1>": "asset-2", "a": "p1"})
    response = post_form(client, request, {"asset-2": png, "asset-0": webp, "p1": gif})
    assert response.status_code == 200, response.text
    images = [
        data_url("image/gif", gif),
        data_url("image/png", png),
        data_url("image/webp", webp),
    ]
    assert recorder.requests == [expected(state="First, then last.", images=images)]


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("PNG", "image/png"), ("ICO", "image/x-icon"), ("QOI", "image/qoi")],
)
def test_an_images_media_type_is_its_formats(client, recorder, fmt, media_type):
    # PIL's media type where it has one (an icon's is not image/ico), else
    # image/ and the format's name.
    data = image(fmt)
    request = with_assets("{photo}", {"photo": "asset-0"})
    assert post_form(client, request, {"asset-0": data}).status_code == 200
    assert recorder.requests == [with_image("", media_type, data)]


def test_a_compressed_form(client, recorder):
    png = image("PNG")
    request = with_assets(["{photo}"], {"photo": "asset-0"})
    response = post_form(client, request, {"asset-0": png}, encoding="zstd")
    assert response.status_code == 200, response.text
    assert recorder.requests == [with_image("", "image/png", png)]


def test_a_form_without_assets_is_its_request(client, recorder):
    url = data_url("image/png", image("PNG"))
    assert post_form(client, {**REQUEST, "images": [url]}, {}).status_code == 200
    assert recorder.requests == [expected(images=[url])]


def test_asset_parts_without_a_file_name(client, recorder):
    png = image("PNG")
    request = with_assets("{photo}", {"photo": "asset-0"})
    files = {"request": (None, json.dumps(request)), "asset-0": (None, png)}
    encoded = httpx.Request("POST", "http://server", files=files)
    assert b"filename" not in encoded.read()
    response = client.post(ROUTE, content=encoded.read(), headers=encoded.headers)
    assert response.status_code == 200, response.text
    assert recorder.requests == [with_image("", "image/png", png)]


PNG = image("PNG")


@pytest.mark.parametrize(
    "request_json, parts, named",
    [
        (
            with_assets("Look at {photo}", {"photo": "asset-0"}),
            {"asset-0": PNG},
            "state uses the asset reference '{photo}'",
        ),
        (
            with_assets(["Look at {photo}", "{photo}"], {"photo": "asset-0"}),
            {"asset-0": PNG},
            "state[0] uses the asset reference '{photo}'",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-0"}, instructions="{photo}"),
            {"asset-0": PNG},
            "instructions uses the asset reference '{photo}'",
        ),
        (
            with_assets(
                ["{photo}"],
                {"photo": "asset-0"},
                questions={"q": {"type": "noul", "instructions": "Is {photo} ok?"}},
            ),
            {"asset-0": PNG},
            "questions.q.instructions uses the asset reference '{photo}'",
        ),
        (
            with_assets(
                "<image:1>",
                {"<image:1>": "asset-0"},
                questions={"q": {"type": "choice", "criteria": ["a <image:1>", "b"]}},
            ),
            {"asset-0": PNG},
            "questions.q.criteria[0] uses the asset reference '<image:1>'",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-0", "other": "asset-1"}),
            {"asset-0": PNG, "asset-1": PNG},
            "['other'] stand nowhere in the state",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-9"}),
            {"asset-0": PNG},
            "asset 'photo' names the part 'asset-9', which the body does not have",
        ),
        (
            {**REQUEST, "state": "{photo}", "assets": {"photo": {"type": "image"}}},
            {"asset-0": PNG},
            "asset 'photo' must be",
        ),
        (
            {
                **REQUEST,
                "state": "{clip}",
                "assets": {"clip": {"type": "audio", "part": "asset-0"}},
            },
            {"asset-0": PNG},
            "asset 'clip' must be",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-0"}),
            {"asset-0": b"not an image"},
            "the part 'asset-0' is not an image vLLM reads",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-0"}),
            {"asset-0": PNG[: len(PNG) // 2]},
            "the part 'asset-0' is not an image vLLM reads",
        ),
        (
            with_assets(["{photo}"], {"photo": "asset-0"}),
            {"asset-0": PNG, "asset-1": PNG},
            "no asset names the part(s) ['asset-1']",
        ),
        (
            with_assets(["{photo}", {"note": 1}], {"photo": "asset-0"}),
            {"asset-0": PNG},
            "state[1] is not text",
        ),
        (
            with_assets("{photo}", {"photo": "asset-0"}, images=["data:image/png,"]),
            {"asset-0": PNG},
            '"images" and image assets in one request',
        ),
        (
            with_assets(["{a}", "{b}"], {"a": "asset-0", "b": "asset-0"}),
            {"asset-0": PNG},
            "assets 'a' and 'b' name the same part 'asset-0'",
        ),
        (
            with_assets(["photo"], {"photo": "asset-0"}, instructions="photo"),
            {"asset-0": PNG},
            "instructions uses the asset reference 'photo'",
        ),
        (None, {"asset-0": PNG}, "has no 'request' part"),
    ],
)
def test_form_refusals_name_what_they_refuse(
    client, recorder, request_json, parts, named
):
    assert_refused(post_form(client, request_json, parts), 400, named)
    assert recorder.requests == []


def form_refusal(body: bytes, content_type: str) -> str:
    """The message of the 400 ``json_of_form`` answers a form with."""
    with pytest.raises(BodyRefused) as excinfo:
        json_of_form(body, content_type)
    assert excinfo.value.status == 400
    return str(excinfo.value)


def raw_form(*parts: tuple[bytes, bytes]) -> tuple[bytes, str]:
    """A form of ``(Content-Disposition, data)`` parts, written out here."""
    body = b"".join(
        b"--B\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + data + b"\r\n"
        for disposition, data in parts
    )
    return body + b"--B--\r\n", "multipart/form-data; boundary=B"


def test_a_forms_parts_need_a_boundary_and_one_name_each():
    assert (
        form_refusal(b"", "multipart/form-data")
        == "the multipart/form-data Content-Type names no boundary"
    )
    garbled = form_refusal(b"--B\r\nno header end", "multipart/form-data; boundary=B")
    assert garbled.startswith("the body is not valid multipart/form-data: ")
    request = json.dumps(REQUEST).encode()
    body, content_type = raw_form((b'form-data; name="request"', request))
    assert form_refusal(body.removesuffix(b"--B--\r\n"), content_type) == (
        "the multipart/form-data body ends before its closing boundary"
    )
    assert form_refusal(*raw_form((b"form-data", request))) == (
        "a part of the multipart/form-data body has no name"
    )
    unnamed = (b'form-data; filename="a.png"', PNG)
    assert form_refusal(
        *raw_form((b'form-data; name="request"', request), unnamed)
    ) == ("a part of the multipart/form-data body has no name")
    # A part with no Content-Disposition at all has no name either.
    body, content_type = raw_form((b'form-data; name="request"', request))
    headless = b"--B\r\nContent-Type: image/png\r\n\r\n" + PNG + b"\r\n"
    assert form_refusal(body.replace(b"--B--", headless + b"--B--"), content_type) == (
        "a part of the multipart/form-data body has no name"
    )
    twice = (b'form-data; name="request"', request)
    assert form_refusal(*raw_form(twice, twice)) == (
        "the multipart/form-data body has two parts named 'request'"
    )
    # A name that is not UTF-8 is read with replacement characters.
    stray = (b'form-data; name="p\xff"', PNG)
    assert form_refusal(*raw_form(twice, stray)) == (
        "no asset names the part(s) ['p\ufffd']"
    )


@pytest.mark.parametrize(
    ("request_json", "message"),
    [
        (
            {**REQUEST, "assets": []},
            '"assets" must be an object: {KEY: {"type", "part"}}',
        ),
        (
            {**REQUEST, "assets": {"a": {"type": "video", "part": "p"}}},
            'asset \'a\' must be {"type": "image", "part": PART} (images are the '
            'only assets taken), not {"type": "video", "part": "p"}',
        ),
        (
            with_assets(["{a}", "{b}"], {"a": "p", "b": "p"}),
            "assets 'a' and 'b' name the same part 'p': each part is one asset's",
        ),
        (
            with_assets("{a}", {"a": "p"}, questions={"{a}": {"type": "noul"}}),
            "questions.{a} uses the asset reference '{a}': a reference can only be "
            "the whole state or a whole element of the state array",
        ),
        (
            with_assets("x", {"a": "p"}),
            "the asset(s) ['a'] stand nowhere in the state: an asset is the whole "
            "state or a whole element of the state array",
        ),
        (
            with_assets("{a}", {"a": "p"}, images=[data_url("image/png", PNG)]),
            '"images" and image assets in one request: send the images one way',
        ),
        (
            with_assets(["{a}", 3], {"a": "p"}),
            "state[1] is not text: a state array with assets holds text and asset "
            "references only",
        ),
    ],
)
def test_a_forms_assets_are_refused_saying_why(request_json, message):
    body, content_type = multipart(request_json, {"p": PNG})
    assert form_refusal(body, content_type) == message


@pytest.mark.parametrize(
    ("path", "root_path"),
    [("/api/v1/systemone", "/api"), ("/v1/systemone", ""), ("/v1/systemone", None)],
)
def test_the_route_is_found_under_its_root_path(path, root_path):
    # Behind a proxy the path holds the root path, as vLLM's own
    # authentication middleware reads it; a scope may also have none.
    seen = []

    async def route(scope, receive, send):
        seen.append(dict(scope["headers"]))
        seen.append(await receive())
        seen.append(await receive())  # what follows the body

    body = json.dumps(REQUEST).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-encoding", b"gzip")],
    }
    if root_path is not None:
        scope["root_path"] = root_path
    messages = [
        {"type": "http.request", "body": gzip.compress(body)},
        {"type": "http.disconnect"},
    ]

    async def receive():
        return messages.pop(0)

    middleware = SystemOneBodyMiddleware(route, max_body_bytes=1 << 20)
    asyncio.run(middleware(scope, receive, None))
    headers, request, after = seen
    # A body sent with no Content-Type goes on with none named.
    assert headers == {b"content-type": b"", b"content-length": str(len(body)).encode()}
    assert request == {"type": "http.request", "body": body, "more_body": False}
    assert after == {"type": "http.disconnect"}


def test_a_form_content_type_with_more_parameters(client, recorder):
    png = image("PNG")
    body, content_type = multipart(with_assets("{a}", {"a": "p"}), {"p": png})
    headers = {"content-type": f"{content_type}; charset=utf-8"}
    assert client.post(ROUTE, content=body, headers=headers).status_code == 200
    assert recorder.requests == [with_image("", "image/png", png)]


def test_a_request_part_that_is_not_a_json_object(client, recorder):
    for text in ("{not json", "[1, 2]"):
        files = {"request": (None, text)}
        encoded = httpx.Request("POST", "http://server", files=files)
        response = client.post(ROUTE, content=encoded.read(), headers=encoded.headers)
        assert_refused(response, 400, "the 'request' part is not")
    truncated, content_type = multipart(REQUEST, {})
    response = client.post(
        ROUTE, content=truncated[:-10], headers={"content-type": content_type}
    )
    assert_refused(response, 400, "ends before its closing boundary")
    assert recorder.requests == []


class SeenTransport(httpx2.ASGITransport):
    """The app in process; keeps each request's encoding and content type."""

    def __init__(self, app) -> None:
        super().__init__(app=app)
        self.seen: list[tuple[str | None, str]] = []

    async def handle_async_request(self, request):
        encoding = request.headers.get("content-encoding")
        self.seen.append((encoding, request.headers["content-type"].split(";")[0]))
        return await super().handle_async_request(request)


def test_the_typesafe_sdk_as_it_sends_by_default(client, recorder):
    # The client as published: zstd above 1 KiB, images as multipart assets.
    from typesafe_sdk import AsyncTypeSafeClient, Noul, RetryPolicy
    from typesafe_sdk import Image as Asset

    # Noise, so that the form too is over the SDK's 1 KiB compression floor.
    out = io.BytesIO()
    Image.effect_noise((64, 64), 64).convert("RGB").save(out, "PNG")
    png = out.getvalue()
    photo = Asset(png)
    questions = {"damaged": Noul(instructions="Is the item damaged?")}
    long_state = "The parcel arrived with a dent in its left side. " * 40
    transport = SeenTransport(client.app)

    async def ask() -> None:
        async with AsyncTypeSafeClient(
            api_key="key",
            base_url="http://server",
            transport=transport,
            retry=RetryPolicy(max_retries=0),
        ) as sdk:
            await sdk.system_one(state=long_state, questions=questions)
            await sdk.system_one(state=photo, questions=questions)
            await sdk.system_one(
                state=["Look at ", photo, " please"],
                questions=questions,
                assets={"photo": photo},
            )

    asyncio.run(ask())
    assert transport.seen == [
        ("zstd", "application/json"),
        ("zstd", "multipart/form-data"),
        ("zstd", "multipart/form-data"),
    ]
    assert [(r.state, r.images) for r in recorder.requests] == [
        (long_state, None),
        ("", [data_url("image/png", png)]),
        ("Look at  please", [data_url("image/png", png)]),
    ]


@pytest.fixture(scope="module")
def served_url(server):
    """The app of ``server`` behind uvicorn on loopback, for real HTTP clients."""
    with app_on_loopback(server[0].app) as url:
        yield url


def test_the_validation_sends_json_requests_through_the_sdk(
    client, recorder, served_url
):
    # benchmarks.validation's SDK side, as it runs on the GPU against vllm serve.
    from benchmarks.validation import sdk_answers

    png = image("PNG")
    request = {**REQUEST, "images": [data_url("image/png", png)]}
    assert sdk_answers(served_url, "d3", [request]) == [{"answers": ANSWER.answers}]
    # What the answers depend on, and the served model vLLM checks the name
    # against (the SDK's own default is a name vLLM answers 404); the SDK sends
    # its own request id.
    sent = expected(images=[data_url("image/png", png)])
    assert [(r.model, r.state, r.questions, r.images) for r in recorder.requests] == [
        ("d3", sent.state, sent.questions, sent.images)
    ]


def test_the_validations_decompression_bomb_is_413(client, recorder, served_url):
    from benchmarks.validation import decompression_bomb_status

    assert decompression_bomb_status(served_url) == 413
    assert recorder.requests == []
