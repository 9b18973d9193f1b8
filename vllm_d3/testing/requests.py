"""Seeded /v1/systemone request sets shaped like the upstream D3 validation.

``request_sets(seed, ...)`` returns ``{set name: [request body, ...]}``: text states
with 1, 4 and 16 questions, a 16-question JSON state, a 64-question request, a
40-option and a 255-option choice, the empty state, one image with 8 questions,
three images, a video with 6 questions, a video with an image, and (``long=True``)
a ~24K-token state with 4 questions and a ~64K-token state with 2 questions.
Media are generated here as data URLs (PNG images, MP4 videos), so nothing is
downloaded. The same seed gives the same requests. ``words_per_token(tokenizer)``
measures how many generated words make one token, so that a length in tokens
(the long states, the benchmark's long rows) becomes a word count.
"""

import base64
import io
import os
import random
import tempfile
from typing import Any

import numpy as np
from PIL import Image

WORDS = [
    "river",
    "stone",
    "light",
    "paper",
    "market",
    "window",
    "garden",
    "engine",
    "signal",
    "winter",
    "copper",
    "harbor",
    "letter",
    "silver",
    "orange",
    "forest",
    "castle",
    "bridge",
    "pocket",
    "thunder",
    "planet",
    "shadow",
    "candle",
    "mirror",
    "ladder",
    "valley",
    "school",
    "travel",
    "number",
    "friend",
    "morning",
    "answer",
    "circle",
    "danger",
    "island",
    "kettle",
    "lemon",
    "marble",
    "needle",
    "ocean",
    "pepper",
]
SCALE = ["none", "low", "some", "high", "extreme"]


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + rng.choice([".", "?", "!", ""])


def words_per_token(tokenizer: Any, sample_words: int = 2000) -> float:
    sample = text_state(random.Random(1), sample_words)
    return sample_words / len(tokenizer(sample)["input_ids"])


def text_state(rng: random.Random, words: int) -> str:
    sentences, left = [], words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        sentences.append(_sentence(rng, n))
        left -= n
    return rng.choice([" ", "\n", "\n\n"]).join(sentences)


def question(rng: random.Random, kind: str, options: int = 4) -> dict[str, Any]:
    if kind == "noul":
        criteria = rng.choice([None, {"true": _sentence(rng, 4), "false": "no"}])
        return {"type": "noul", "instructions": _sentence(rng, 6), "criteria": criteria}
    if kind == "score":
        levels = rng.randint(2, 5)
        return {
            "type": "score",
            "instructions": _sentence(rng, 5),
            "criteria": SCALE[:levels],
        }
    names = rng.sample(sorted({f"{w}-{i}" for i, w in enumerate(WORDS * 7)}), options)
    return {
        "type": "choice",
        "instructions": _sentence(rng, 7),
        "criteria": {
            n: (_sentence(rng, 3) if rng.random() < 0.3 else None) for n in names
        },
    }


def questions(rng: random.Random, count: int) -> dict[str, dict[str, Any]]:
    kinds = ["choice", "noul", "score"]
    return {f"q{i}": question(rng, kinds[i % 3]) for i in range(count)}


def png_data_url(rng: random.Random, width: int, height: int) -> str:
    """A smooth random picture (gradients plus blobs), as a PNG data URL."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = []
    for _ in range(3):
        a, b, c = (rng.uniform(-3, 3) for _ in range(3))
        channels.append(np.sin(a * x * 6 + b * y * 6 + c) * 0.5 + 0.5)
    pixels = (np.stack(channels, -1) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def mp4_data_url(rng: random.Random, seconds: float, fps: int = 4) -> str:
    """A moving-pattern MP4 (OpenCV's mp4v codec), as a data URL."""
    import cv2

    width, height = 256, 192
    frames = int(seconds * fps)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "clip.mp4")
        writer = cv2.VideoWriter(
            path, cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height)
        )
        phase = rng.uniform(0, 6)
        y, x = np.mgrid[0:height, 0:width] / width
        for t in range(frames):
            frame = np.stack(
                [
                    np.sin((x + t / frames) * 9 + phase + k) * 0.5 + 0.5
                    for k in range(3)
                ],
                -1,
            )
            writer.write((frame * 255).astype(np.uint8))
        writer.release()
        with open(path, "rb") as f:
            data = f.read()
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def request_sets(
    seed: int = 0,
    *,
    per_set: int = 2,
    media: bool = True,
    long: bool = True,
    words_per_token: float = 1.0,
) -> dict[str, list[dict[str, Any]]]:
    """The validation request sets. ``words_per_token`` scales the long states
    to the tokenizer at hand (words are counted, tokens targeted)."""
    rng = random.Random(seed)

    def text(count: int, words: int = 60) -> dict[str, Any]:
        return {"state": text_state(rng, words), "questions": questions(rng, count)}

    sets: dict[str, list[dict[str, Any]]] = {
        "text, 1 question": [text(1) for _ in range(per_set)],
        "text, 4 questions": [text(4) for _ in range(per_set)],
        "text, 16 questions": [text(16) for _ in range(per_set)],
        "JSON state, 16 questions": [
            {
                "state": {
                    "customer": rng.choice(WORDS),
                    "orders": [
                        {"item": rng.choice(WORDS), "qty": rng.randint(1, 9)}
                        for _ in range(5)
                    ],
                    "note": _sentence(rng, 8),
                },
                "questions": questions(rng, 16),
            }
            for _ in range(per_set)
        ],
        "text, 64 questions": [text(64)],
        "choice, 40 options": [
            {
                "state": text_state(rng, 40),
                "questions": {"pick": question(rng, "choice", 40)},
            }
            for _ in range(per_set)
        ],
        "choice, 255 options": [
            {
                "state": text_state(rng, 40),
                "questions": {"pick": question(rng, "choice", 255)},
            }
        ],
        "empty state": [
            {"state": None, "questions": questions(rng, 3)},
            {"state": "", "questions": questions(rng, 2)},
        ],
    }
    if media:
        sets["1 image, 8 questions"] = [
            {**text(8, 20), "images": [png_data_url(rng, 512, 384)]}
            for _ in range(per_set)
        ]
        sets["3 images, 6 questions"] = [
            {**text(6, 20), "images": [png_data_url(rng, 320, 256) for _ in range(3)]}
        ]
        sets["video, 6 questions"] = [
            {**text(6, 20), "videos": [mp4_data_url(rng, 11)]}
        ]
        sets["video and image, 4 questions"] = [
            {
                **text(4, 20),
                "images": [png_data_url(rng, 256, 256)],
                "videos": [mp4_data_url(rng, 4)],
            }
        ]
    if long:
        sets["24K-token state, 4 questions"] = [text(4, int(24_000 * words_per_token))]
        sets["64K-token state, 2 questions"] = [text(2, int(64_000 * words_per_token))]
    return sets
