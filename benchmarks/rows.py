"""What the D3 benchmark measures, and the seeded requests it sends.

Contract:
- ``SIDES``: what is timed, by its key in the results: ``vllm`` (the plugin's
  default, each request's state read once), ``vllm_triton_gdn`` (the same with
  the Gated DeltaNet prefill forced to Triton/FLA), ``vllm_portable`` (the
  same with the dense pieces on ``PORTABLE_KERNEL``, the kernel ROCm gets),
  ``vllm_dp2`` (the same on two GPUs, ``--data-parallel-size 2``),
  ``vllm_per_question`` (one engine request per question, the state read
  again for each) and ``reference``; ``DEFAULT_SIDES`` leaves out
  ``vllm_triton_gdn``, ``vllm_portable`` and ``vllm_dp2``.
- ``LATENCY_ROWS``: one ``Row`` per latency row (id, label, question count, and
  the state: words of text, a target length in tokens for the long rows,
  photos or a video). ``THROUGHPUT_ROWS``: one ``Load`` per closed-loop run
  (a mix of latency rows and a number of clients).
- ``select(ids, patterns)`` keeps the ids matching any ``fnmatch`` pattern.
- ``row_requests(row, count, seed=..., words_per_token=..., state_scale=...)``
  returns ``count`` distinct requests of the row's shape; the same arguments
  give the same requests. Distinct requests keep vLLM's multimodal processor
  cache from answering a repeat from memory. ``state_scale`` shrinks the long
  states (the CPU smoke run uses 1/64).
- The long rows' word counts come from ``requests.words_per_token(tokenizer)``.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_d3.testing.requests import (
    mp4_data_url,
    png_data_url,
    question,
    questions,
    text_state,
)
from vllm_d3.v1.attention.backends.d3_dense_kernels import DEFAULT_KERNELS

#: Words of the short text states (one paragraph), and beside media.
SHORT_STATE_WORDS = 60
MEDIA_STATE_WORDS = 20
PHOTO_SIZE = (1024, 768)
PHOTOS_SIZE = (640, 480)
VIDEO_SECONDS = 11.0

SIDES = (
    "vllm",
    "vllm_triton_gdn",
    "vllm_portable",
    "vllm_dp2",
    "vllm_per_question",
    "reference",
)
#: The sides that read each request's state once.
STATE_ONCE_SIDES = ("vllm", "vllm_triton_gdn", "vllm_portable", "vllm_dp2", "reference")
DEFAULT_SIDES = ("vllm", "vllm_per_question", "reference")
#: The dense-piece kernel of the ``vllm_portable`` side: ROCm's first choice,
#: which also runs on CUDA.
PORTABLE_KERNEL = DEFAULT_KERNELS["ROCm"][0]


@dataclass(frozen=True)
class Row:
    """One latency row: the shape shared by all of its requests."""

    id: str
    label: str
    questions: int
    state_words: int = SHORT_STATE_WORDS
    state_tokens: int | None = None
    photos: int = 0
    photo_size: tuple[int, int] = PHOTO_SIZE
    video_seconds: float = 0.0
    choice_options: int | None = None

    @property
    def long(self) -> bool:
        """A long-state row (served with ``--max-model-len 131072``)."""
        return self.state_tokens is not None

    @property
    def media(self) -> bool:
        return self.photos > 0 or self.video_seconds > 0


@dataclass(frozen=True)
class Load:
    """One closed-loop throughput run: a mix of rows and a client count."""

    id: str
    mix: str
    clients: int


LATENCY_ROWS = (
    Row("text-1", "1 text question", 1),
    Row("text-4", "4 text questions", 4),
    Row("text-16", "16 text questions", 16),
    Row("text-64", "64 text questions", 64),
    Row("choice-255", "255-option choice", 1, state_words=40, choice_options=255),
    Row("photo-1", "1 photo, 1 question", 1, MEDIA_STATE_WORDS, photos=1),
    Row("photo-8", "1 photo, 8 questions", 8, MEDIA_STATE_WORDS, photos=1),
    Row(
        "photos-3",
        "3 photos, 6 questions",
        6,
        MEDIA_STATE_WORDS,
        photos=3,
        photo_size=PHOTOS_SIZE,
    ),
    Row(
        "video-6",
        "11 s video, 6 questions",
        6,
        MEDIA_STATE_WORDS,
        video_seconds=VIDEO_SECONDS,
    ),
    Row("state-24k", "24K-token state, 4 questions", 4, state_tokens=24_000),
    Row("state-64k", "64K-token state, 2 questions", 2, state_tokens=64_000),
    Row("state-117k", "117K-token state, 2 questions", 2, state_tokens=117_000),
)
ROWS_BY_ID = {row.id: row for row in LATENCY_ROWS}

#: The rows whose requests make up each throughput mix, sent round robin.
MIXES = {
    "text": ("text-1", "text-4", "text-16", "text-64", "choice-255"),
    "media": ("photo-1", "photo-8", "photos-3", "video-6"),
}
THROUGHPUT_ROWS = (
    Load("tput-text-1", "text", 1),
    Load("tput-text-8", "text", 8),
    Load("tput-text-64", "text", 64),
    Load("tput-media-1", "media", 1),
    Load("tput-media-8", "media", 8),
)

#: Request index of the pools used by the throughput runs (latency rows use
#: indices from 0), so no throughput request repeats a latency request.
POOL_OFFSET = 1000
#: The request that measures start-up time (server start to the first answer).
STARTUP_ROW = Row("startup", "start-up request", 1)


def select(ids: Iterable[str], patterns: list[str] | None) -> list[str]:
    """The ids matching any of the ``fnmatch`` patterns (all when ``None``)."""
    if patterns is None:
        return list(ids)
    return [i for i in ids if any(fnmatch.fnmatchcase(i, p) for p in patterns)]


def state_words(row: Row, words_per_token: float, state_scale: float) -> int:
    """How many words of generated text give the row's state."""
    if row.state_tokens is None:
        return row.state_words
    return max(1, round(row.state_tokens * state_scale * words_per_token))


def row_requests(
    row: Row,
    count: int,
    *,
    seed: int,
    words_per_token: float,
    state_scale: float = 1.0,
    first_index: int = 0,
) -> list[dict[str, Any]]:
    """``count`` distinct /v1/systemone bodies of the row's shape."""
    words = state_words(row, words_per_token, state_scale)
    out = []
    for index in range(first_index, first_index + count):
        rng = random.Random(f"{seed}/{row.id}/{index}")
        body: dict[str, Any] = {"state": text_state(rng, words)}
        if row.choice_options is not None:
            body["questions"] = {
                "pick": question(rng, "choice", options=row.choice_options)
            }
        else:
            body["questions"] = questions(rng, row.questions)
        if row.photos:
            width, height = row.photo_size
            body["images"] = [
                png_data_url(rng, width, height) for _ in range(row.photos)
            ]
        if row.video_seconds:
            body["videos"] = [mp4_data_url(rng, row.video_seconds)]
        out.append(body)
    return out


def question_count(request: dict[str, Any]) -> int:
    return len(request["questions"])
