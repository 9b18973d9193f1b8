# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""/v1/systemone bodies as existing clients send them (new upstream, beside
``entrypoints/serve/middleware/authenticate.py``).

``SystemOneBodyMiddleware``, a pure ASGI middleware, acts on
``POST /v1/systemone`` only and hands vLLM's route the plain JSON body it reads:
a ``zstd`` or ``gzip`` body decompressed as it arrives (``_Decompressor``), a
``multipart/form-data`` body turned into its JSON request with the image
assets it references (``json_of_form``), both capped at ``max_body_bytes``
(413 past it). Any other content encoding but ``identity`` is a 415; a body
that cannot be read as the checkpoint runtime would is a 400 that names what
is wrong, never a guess. Any other request passes through untouched.
Refusals are vLLM's JSON error bodies (``create_error_response``), logged at
INFO.
"""

import asyncio
import base64
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from http import HTTPStatus
from io import BytesIO
from typing import Any

from fastapi import FastAPI
from PIL import Image
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm.entrypoints.serve.exception_handling.error_response import (
    create_error_response,
)
from vllm.logger import init_logger
from vllm.multimodal.image import open_image
from vllm.multimodal.media.image import ImageMediaIO

from vllm_d3.model_executor.models.d3_contract import ENVIRONMENT, Option

# The one home of the choice: clients of this module (the validation, the
# tests) compress with the same zstd.
if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

logger = init_logger(f"vllm.{__name__}")

ROUTE = "/v1/systemone"
#: The cap on a decoded body; its default is that of
#: VLLM_HTTP_MAX_REQUEST_BODY_SIZE, which only vLLM's Rust front end enforces.
MAX_BODY_BYTES_OPTION = Option(
    "VLLM_D3_MAX_BODY_BYTES",
    ENVIRONMENT,
    32 * 1024 * 1024,
    "The largest `/v1/systemone` body once decoded (zstd, gzip or a multipart "
    "form), in bytes (32 MiB by default). A body past it is a 413, refused "
    "before the rest is decompressed.",
)
MAX_BODY_BYTES_ENV = MAX_BODY_BYTES_OPTION.name
DEFAULT_MAX_BODY_BYTES: int = MAX_BODY_BYTES_OPTION.default
IDENTITY = "identity"
#: Content-Encoding -> (a new incremental decompressor, the error it raises).
DECOMPRESSORS: dict[str, tuple[Callable[[], Any], type[Exception]]] = {
    "zstd": (zstd.ZstdDecompressor, zstd.ZstdError),
    "gzip": (partial(zlib.decompressobj, wbits=16 + zlib.MAX_WBITS), zlib.error),
}
FORM = "multipart/form-data"
REQUEST_PART = "request"


class BodyRefused(Exception):
    """A /v1/systemone body that the middleware answers itself."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        # The route's own 400s are BadRequestError; 413 and 415 are named by
        # their status, as vLLM's handler names an HTTPException's.
        err_type = (
            "BadRequestError"
            if self.status == HTTPStatus.BAD_REQUEST
            else self.status.phrase
        )
        error = create_error_response(str(self), err_type, self.status)
        return JSONResponse(error.model_dump(), status_code=self.status)


def max_body_bytes() -> int:
    """The cap on a decoded body: ``VLLM_D3_MAX_BODY_BYTES``, or the default."""
    value = os.environ.get(MAX_BODY_BYTES_ENV)
    if value is None:
        return DEFAULT_MAX_BODY_BYTES
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(
            f"{MAX_BODY_BYTES_ENV} must be a positive number of bytes, not {value!r}"
        )
    return int(value)


def add_systemone_body_middleware(app: FastAPI) -> None:
    limit = max_body_bytes()
    app.add_middleware(SystemOneBodyMiddleware, max_body_bytes=limit)
    logger.info(
        "%s also takes zstd and gzip bodies and multipart forms with "
        "image assets, up to %d bytes decoded (%s)",
        ROUTE,
        limit,
        MAX_BODY_BYTES_ENV,
    )


class _Decompressor:
    """A Content-Encoding's incremental decompressor over all of a body's
    frames (zstd) or members (gzip), which are one body; its output is capped
    by the caller before more is decompressed, and a corrupt or truncated
    stream is a 400."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self.new_stream, self.error = DECOMPRESSORS[encoding]
        self.stream = self.new_stream()

    def decompress(self, data: bytes, max_length: int) -> bytes:
        """At most ``max_length`` bytes of output; the rest is never made."""
        out = bytearray()
        try:
            while data and len(out) < max_length:
                if self.stream.eof:  # another frame or member follows
                    self.stream = self.new_stream()
                out += self.stream.decompress(data, max_length - len(out))
                # Input past the end of a frame; short of it, all was consumed.
                data = self.stream.unused_data if self.stream.eof else b""
        except self.error as e:
            raise BodyRefused(f"the body is not valid {self.encoding} data: {e}") from e
        return bytes(out)

    def check_end(self) -> None:
        if not self.stream.eof:
            raise BodyRefused(f"the {self.encoding} body ends before its stream does")


class _FormParts:
    """The parts of a multipart/form-data body by name, as bytes."""

    def __init__(self) -> None:
        self.parts: dict[str, bytes] = {}
        self.ended = False
        self._header = bytearray()
        self._value = bytearray()
        self._name: str | None = None
        self._data = bytearray()

    def read(self, body: bytes, content_type: str) -> dict[str, bytes]:
        boundary = parse_options_header(content_type)[1].get(b"boundary")
        if not boundary:
            raise BodyRefused(f"the {FORM} Content-Type names no boundary")
        parser = MultipartParser(boundary, self.callbacks())
        try:
            parser.write(body)
        except FormParserError as e:
            raise BodyRefused(f"the body is not valid {FORM}: {e}") from e
        if not self.ended:
            raise BodyRefused(f"the {FORM} body ends before its closing boundary")
        return self.parts

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self._name = None
        self._data = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            name = parse_options_header(bytes(self._value))[1].get(b"name")
            self._name = None if name is None else name.decode("utf-8", "replace")
        self._header, self._value = bytearray(), bytearray()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._data += data[start:end]

    def on_part_end(self) -> None:
        if self._name is None:
            raise BodyRefused(f"a part of the {FORM} body has no name")
        if self._name in self.parts:
            raise BodyRefused(f"the {FORM} body has two parts named {self._name!r}")
        self.parts[self._name] = bytes(self._data)

    def on_end(self) -> None:
        self.ended = True


def _references(assets: Any, parts: Mapping[str, bytes]) -> dict[str, str]:
    """Each way of writing an asset's reference -> the asset's key.

    The key itself is a reference (the SDK writes an image it was given a name
    for as that name, and one it was not as its ``<image:ID>`` key); a key not
    written ``<...>`` may also be written ``{key}``."""
    if not isinstance(assets, dict):
        raise BodyRefused('"assets" must be an object: {KEY: {"type", "part"}}')
    references = {}
    claimed: dict[str, str] = {}
    for key, asset in assets.items():
        if not (
            isinstance(asset, dict)
            and asset.get("type") == "image"
            and isinstance(asset.get("part"), str)
            and len(asset) == 2
        ):
            raise BodyRefused(
                f'asset {key!r} must be {{"type": "image", "part": PART}} (images '
                f"are the only assets taken), not {json.dumps(asset)}"
            )
        part = asset["part"]
        if part not in parts:
            raise BodyRefused(
                f"asset {key!r} names the part {part!r}, which the body does not have"
            )
        if part in claimed:
            raise BodyRefused(
                f"assets {claimed[part]!r} and {key!r} name the same part {part!r}: "
                "each part is one asset's"
            )
        claimed[part] = key
        references[key] = key
        if not _delimited(key):
            references[f"{{{key}}}"] = key
    if orphans := sorted(parts.keys() - claimed.keys()):
        raise BodyRefused(f"no asset names the part(s) {orphans}")
    return references


def _delimited(reference: str) -> bool:
    """A reference written ``<...>`` or ``{...}``: found inside text too. A
    bare name is a reference only as a whole string (it may be a word)."""
    return (reference[:1], reference[-1:]) in (("<", ">"), ("{", "}"))


def _uses(
    value: Any, references: Mapping[str, str], path: str
) -> Iterator[tuple[str, str]]:
    """(path, reference) for every string in ``value`` that holds a reference."""
    if isinstance(value, str):
        yield from (
            (path, ref)
            for ref in references
            if value == ref or (_delimited(ref) and ref in value)
        )
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _uses(item, references, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            yield from _uses(key, references, child)
            yield from _uses(item, references, child)


def _state_images(request: dict[str, Any], references: Mapping[str, str]) -> list[str]:
    """The keys of the state's images in order; the state becomes its text."""
    state = request.get("state")
    # Where an image goes: the whole state, or whole elements of a state array.
    placed: dict[str, str]
    if isinstance(state, str) and state in references:
        placed = {"state": state}
    elif isinstance(state, list):
        placed = {
            f"state[{i}]": element
            for i, element in enumerate(state)
            if isinstance(element, str) and element in references
        }
    else:
        placed = {}
    for path, ref in _uses(request, references, ""):
        if placed.get(path) != ref:
            raise BodyRefused(
                f"{path} uses the asset reference {ref!r}: a reference can only be "
                "the whole state or a whole element of the state array"
            )
    keys = [references[ref] for ref in placed.values()]
    if unused := sorted(set(references.values()) - set(keys)):
        raise BodyRefused(
            f"the asset(s) {unused} stand nowhere in the state: an asset is the "
            "whole state or a whole element of the state array"
        )
    if isinstance(state, list) and placed:
        text = []
        for i, element in enumerate(state):
            if f"state[{i}]" in placed:
                continue
            if not isinstance(element, str):
                raise BodyRefused(
                    f"state[{i}] is not text: a state array with assets holds text "
                    "and asset references only"
                )
            text.append(element)
        request["state"] = "".join(text)
    elif placed:
        request["state"] = ""
    return keys


def _image_data_url(part: str, data: bytes) -> str:
    try:
        # What the route's image loader will do with it.
        ImageMediaIO().load_bytes(data)
    except ValueError as e:
        raise BodyRefused(f"the part {part!r} is not an image vLLM reads: {e}") from e
    with open_image(BytesIO(data)) as image:
        image_format = image.format or ""
    # vLLM's loader reads the bytes whatever the media type says.
    media_type = Image.MIME.get(image_format, f"image/{image_format.lower()}")
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def json_of_form(body: bytes, content_type: str) -> bytes:
    """The JSON request of a multipart/form-data /v1/systemone body.

    The part ``request`` is the JSON request. Its ``assets`` map each asset to
    a part, ``{KEY: {"type": "image", "part": PART}}``, each part one asset's.
    An asset is referenced by its key (the SDK writes an image given a name as
    that name, any other as its ``<image:ID>`` key) or, for a key not written
    ``<...>``, by ``{KEY}``; a bare name is a reference only as a whole string,
    since it may also be a word. A reference that is the whole state, or a
    whole element of a state array, becomes the request's next image (a data
    URL in ``images``, in order of reference), and the state becomes the
    array's other elements, text only, concatenated ("" for none). Every other
    use is a 400 that names it: a reference anywhere else (inside a longer
    string, in instructions, in criteria), an asset never referenced, an asset
    whose part is missing, a part no asset names, a part vLLM's image loader
    does not read, a request that also carries ``images``, a body without a
    ``request`` part. The checkpoint runtime's placement of other uses is not
    public, and a guess would give wrong answers silently."""
    parts = _FormParts().read(body, content_type)
    if REQUEST_PART not in parts:
        raise BodyRefused(f"the {FORM} body has no {REQUEST_PART!r} part")
    try:
        request = json.loads(parts.pop(REQUEST_PART))
    except ValueError as e:
        raise BodyRefused(f"the {REQUEST_PART!r} part is not JSON: {e}") from e
    if not isinstance(request, dict):
        raise BodyRefused(f"the {REQUEST_PART!r} part is not a JSON object")
    assets = request.pop("assets", {})
    if keys := _state_images(request, _references(assets, parts)):
        if request.get("images"):
            raise BodyRefused(
                '"images" and image assets in one request: send the images one way'
            )
        request["images"] = [
            _image_data_url(assets[key]["part"], parts[assets[key]["part"]])
            for key in keys
        ]
    return json.dumps(request).encode()


class SystemOneBodyMiddleware:
    """Turns a compressed or multipart /v1/systemone body into plain JSON."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The route's path under root_path, as vLLM's AuthenticationMiddleware
        # reads it.
        if not (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"].removeprefix(scope.get("root_path", "")) == ROUTE
        ):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        encoding = headers.get("content-encoding", "").strip().lower() or IDENTITY
        content_type = headers.get("content-type", "")
        is_form = content_type.partition(";")[0].strip().lower() == FORM
        if encoding == IDENTITY and not is_form:
            return await self.app(scope, receive, send)
        try:
            body = await self.read(Request(scope, receive), encoding)
            if is_form:
                body = await asyncio.to_thread(json_of_form, body, content_type)
                content_type = "application/json"
        except ClientDisconnect:
            return
        except BodyRefused as e:
            logger.info("%s refused (%d): %s", ROUTE, e.status, e)
            return await e.response()(scope, receive, send)
        logger.debug(
            "%s: a %s body (%s) became %d bytes of JSON",
            ROUTE,
            FORM if is_form else "JSON",
            encoding,
            len(body),
        )
        scope = {**scope, "headers": list(scope["headers"])}
        rewritten = MutableHeaders(scope=scope)
        del rewritten["content-encoding"]
        rewritten["content-type"] = content_type
        rewritten["content-length"] = str(len(body))
        await self.app(scope, _replay(body, receive), send)

    async def read(self, request: Request, encoding: str) -> bytes:
        """The body, decoded, refused past ``max_body_bytes``."""
        if encoding != IDENTITY and encoding not in DECOMPRESSORS:
            raise BodyRefused(
                f"Content-Encoding {encoding!r} is not supported on {ROUTE}: send "
                f"{', '.join(DECOMPRESSORS)} or an unencoded body",
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            )
        decompressor = None if encoding == IDENTITY else _Decompressor(encoding)
        body = bytearray()
        async for chunk in request.stream():
            # One byte past the cap tells a body over it from one at it.
            room = self.max_body_bytes + 1 - len(body)
            body += decompressor.decompress(chunk, room) if decompressor else chunk
            if len(body) > self.max_body_bytes:
                raise BodyRefused(
                    f"the decoded body is over {self.max_body_bytes} bytes "
                    f"({MAX_BODY_BYTES_ENV})",
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                )
        if decompressor:
            decompressor.check_end()
        return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body`` as the request's one message."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            # What comes after the body: the client's disconnect.
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
