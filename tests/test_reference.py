"""Tests of the reference runtime (``vllm_d3.reference``) on the tiny D3 fixture.

CPU only. One fixture checkpoint is written per session; a second one, which
differs only in ``decision_config.json``, links to the first one's files.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_d3.reference import ReferenceRuntime, RenderedQuestion
from vllm_d3.reference.masks import allowed
from vllm_d3.reference.prompt import SYSTEM_PROMPT
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {"billing": "money matters", "shipping": None, "support": None},
    },
    "urgency": {"type": "score", "criteria": ["low", "medium", "high", "critical"]},
}
PATH_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's matrices are too small to share between threads, and
    on a busy machine waiting threads slow it down tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("d3") / "tiny")


@pytest.fixture(scope="session")
def runtime(checkpoint: Path) -> ReferenceRuntime:
    return ReferenceRuntime(checkpoint)


def png_url(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_url(tmp_path: Path, frames: int = 10, fps: float = 4.0) -> str:
    import cv2

    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (64, 48))
    rng = np.random.default_rng(0)
    for _ in range(frames):
        writer.write(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    writer.release()
    return "data:video/x-msvideo;base64," + base64.b64encode(path.read_bytes()).decode()


def probabilities(answer: dict[str, Any]) -> list[float]:
    return list(answer["probabilities"].values())


def max_dp(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(
        abs(p - q)
        for qid in a["answers"]
        for p, q in zip(
            probabilities(a["answers"][qid]),
            probabilities(b["answers"][qid]),
            strict=True,
        )
    )


def requests(tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    yield (
        "text",
        {
            "state": "The customer says the parcel arrived torn open.",
            "questions": QUESTIONS,
        },
    )
    yield (
        "json",
        {
            "state": {"ticket": 311, "text": "charged twice", "tags": ["é", "日本"]},
            "questions": QUESTIONS,
        },
    )
    yield (
        "one_image",
        {"state": "A photo.", "images": [png_url(40, 30, 0)], "questions": QUESTIONS},
    )
    yield (
        "several_images",
        {
            "state": "Photos.",
            "images": [png_url(40, 30, 1), png_url(300, 200, 2), png_url(64, 64, 3)],
            "questions": QUESTIONS,
        },
    )
    yield (
        "video",
        {"state": None, "videos": [video_url(tmp_path)], "questions": QUESTIONS},
    )


def test_paths_agree(runtime: ReferenceRuntime, tmp_path: Path) -> None:
    measured = {}
    for name, request in requests(tmp_path):
        per_question = runtime.answer(request, path="per_question")
        state_once = runtime.answer(request, path="state_once")
        measured[name] = max_dp(per_question, state_once)
        assert per_question["usage"] == state_once["usage"]
    print("max |dp| per_question vs state_once:", measured)
    assert all(dp <= PATH_TOLERANCE for dp in measured.values()), measured


def test_media_expansion(runtime: ReferenceRuntime, tmp_path: Path) -> None:
    request = {
        "state": "x",
        "images": [png_url(40, 30, 0), png_url(300, 200, 1)],
        "videos": [video_url(tmp_path)],
        "questions": {"q": {"type": "noul"}},
    }
    (rendered,) = runtime.render(request)
    config = runtime.model.config
    media = rendered.media
    assert media.image_grid_thw is not None and media.video_grid_thw is not None
    ids = rendered.token_ids
    assert (
        ids.count(config.image_token_id)
        == int(media.image_grid_thw.prod(-1).sum()) // 4
    )
    assert (
        ids.count(config.video_token_id)
        == int(media.video_grid_thw.prod(-1).sum()) // 4
    )
    # 10 frames at 4 fps: 2.5 s at 2 fps is 5 frames, padded to 3 temporal patches.
    assert media.video_grid_thw[0, 0].item() == 3
    # Images reach at least 65,536 pixels: a 40x30 image becomes 224x320.
    assert media.image_grid_thw[0].tolist() == [1, 14, 20]
    text = runtime.tokenizer.decode(ids)
    assert text.count("seconds>") == 3
    last_media = max(i for i, t in enumerate(ids) if t == config.vision_end_token_id)
    assert last_media < rendered.state_tokens


def test_prompt_text_and_tokens(runtime: ReferenceRuntime) -> None:
    request = {
        "state": "hello",
        "questions": {
            "q": {
                "type": "choice",
                "instructions": "",
                "criteria": {"a": None, "b": "bee"},
            }
        },
    }
    (rendered,) = runtime.render(request)
    expected = (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
        "State:\nhello\n\nQuestion:\nChoose the best matching option.\n\n"
        "Options:\nA: a\nB: b: bee\n\nReply with only the code of the best option."
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered.text == expected
    assert rendered.token_ids == runtime.tokenizer.encode(
        expected, add_special_tokens=False
    )


@pytest.mark.parametrize("media", [0, 2])
def test_prompt_matches_chat_template(runtime: ReferenceRuntime, media: int) -> None:
    """The hand-written prompt equals what the fixture's chat template renders."""
    images = [png_url(40, 30, i) for i in range(media)]
    request = {"state": {"k": 1}, "images": images, "questions": QUESTIONS}
    for rendered in runtime.render(request):
        user = rendered.text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        body = user.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
        content: Any = [{"type": "image"}] * media + [{"type": "text", "text": body}]
        templated = runtime.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": content if media else body},
            ],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert templated == rendered.text


# (state, how many of its last characters the tokenizer joins to the question)
STATE_BLOCK_CASES = [
    ("hello", 0),
    ("word  ", 0),
    ("here.  \n", 1),
    ("line\n", 1),
    ("a\n\n", 2),
    ("今天天气很好", 0),
    ("今天天气很好。", 1),
    ("日本語のテキスト", 0),
    ("thumbs 👍", 0),
    ("x 👍👍", 0),
    ("end?", 1),
    ({"k": "v"}, 2),
    ({"k": "v", "n": 1}, 0),
    (None, 1),
    ("", 1),
]


@pytest.mark.parametrize(("state", "moved"), STATE_BLOCK_CASES)
def test_state_block_count(runtime: ReferenceRuntime, state: Any, moved: int) -> None:
    (rendered,) = runtime.render({"state": state, "questions": {"q": {"type": "noul"}}})
    written = "(empty)" if state in (None, "") else state
    if not isinstance(written, str):
        written = json.dumps(written, ensure_ascii=False)
    state_end = rendered.text.index("State:\n") + len("State:\n") + len(written)
    split = state_end - moved
    ids, s = rendered.token_ids, rendered.state_tokens
    decode = runtime.tokenizer.decode
    assert decode(ids[:s]) == rendered.text[:split]
    assert decode(ids[s:]) == rendered.text[split:]
    # An independent count from the tokenizer's own character offsets.
    offsets = runtime.tokenizer(
        rendered.text, add_special_tokens=False, return_offsets_mapping=True
    )["offset_mapping"]
    leading = next(i for i, (_, end) in enumerate(offsets) if end > state_end)
    assert s == leading


def test_state_block_count_with_images(runtime: ReferenceRuntime) -> None:
    request = {
        "state": "end?",
        "images": [png_url(40, 30, 0)],
        "questions": {"q": {"type": "noul"}},
    }
    (with_image,) = runtime.render(request)
    (without,) = runtime.render({**request, "images": []})
    grown = len(with_image.token_ids) - len(without.token_ids)
    assert grown == 70 + 2  # 14 x 20 patches merged 2 x 2, and the start/end markers
    assert with_image.state_tokens == without.state_tokens + grown


def layer_outputs(
    runtime: ReferenceRuntime, rendered: RenderedQuestion, attention: str
) -> dict[str, torch.Tensor]:
    """Token-mixer outputs of the first Gated DeltaNet and first full-attention
    layer, and the final hidden states."""
    layers = runtime.model.language_model.layers
    full = (runtime.text_config.layer_types or []).index("full_attention")
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            mixed = output[0] if isinstance(output, tuple) else output
            captured[name] = mixed[0].clone()

        return hook

    handles = [
        layers[0].linear_attn.register_forward_hook(keep("linear")),
        layers[full].self_attn.register_forward_hook(keep("full")),
    ]
    try:
        captured["final"] = runtime.final_hidden(rendered, attention=attention)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def with_token(
    rendered: RenderedQuestion, position: int, token_id: int
) -> RenderedQuestion:
    ids = list(rendered.token_ids)
    assert ids[position] != token_id
    ids[position] = token_id
    return dataclasses.replace(rendered, token_ids=ids)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def two_questions(
    runtime: ReferenceRuntime,
) -> tuple[RenderedQuestion, RenderedQuestion]:
    state = "The customer says the parcel arrived torn open and wants a refund."
    first, second = runtime.render(
        {
            "state": state,
            "questions": {
                "a": {"type": "noul", "instructions": "Is this about a refund?"},
                "b": {
                    "type": "choice",
                    "criteria": {"billing": None, "shipping": "parcels"},
                },
            },
        }
    )
    assert first.state_tokens == second.state_tokens
    return first, second


def test_state_never_sees_question(
    runtime: ReferenceRuntime, two_questions: Any
) -> None:
    first, second = two_questions
    s = first.state_tokens
    bidir = [
        runtime.final_hidden(r, attention="prefix_bidir")[:s] for r in two_questions
    ]
    assert diff(*bidir) <= 1e-5
    full = [
        runtime.final_hidden(r, attention="noncausal_full_attention")[:s]
        for r in two_questions
    ]
    assert diff(*full) > 1e-3


def test_state_reads_itself_both_ways(
    runtime: ReferenceRuntime, two_questions: Any
) -> None:
    rendered = two_questions[0]
    late, early = rendered.state_tokens - 2, 0
    changed = with_token(rendered, late, rendered.token_ids[late + 1])
    for mode, full_changes in (("prefix_bidir", True), ("causal", False)):
        before = layer_outputs(runtime, rendered, mode)
        after = layer_outputs(runtime, changed, mode)
        # Gated DeltaNet stays causal: earlier tokens never see the change.
        assert diff(before["linear"][:late], after["linear"][:late]) == 0.0
        assert diff(before["linear"][late], after["linear"][late]) > 1e-3
        full_diff = diff(before["full"][early], after["full"][early])
        assert (full_diff > 1e-3) if full_changes else (full_diff == 0.0), (
            mode,
            full_diff,
        )


def test_question_reads_itself_both_ways(
    runtime: ReferenceRuntime, two_questions: Any
) -> None:
    rendered = two_questions[0]
    s, n = rendered.state_tokens, len(rendered.token_ids)
    late = n - 8
    changed = with_token(rendered, late, rendered.token_ids[late + 1])
    for mode, earlier_changes in (("prefix_bidir", True), ("causal", False)):
        before = runtime.final_hidden(rendered, attention=mode)
        after = runtime.final_hidden(changed, attention=mode)
        question_diff = diff(before[s + 1], after[s + 1])
        assert (question_diff > 1e-3) if earlier_changes else (question_diff == 0.0)
        if mode == "prefix_bidir":
            assert diff(before[:s], after[:s]) == 0.0


def test_masks() -> None:
    causal = allowed("causal", 4, 2)
    assert torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).tril())
    assert allowed("noncausal_full_attention", 4, 2).all()
    expected = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(allowed("prefix_bidir", 4, 2), expected)
    for mode in ("causal", "noncausal_full_attention", "prefix_bidir"):
        for first in range(4):
            rows = allowed(mode, 4, 2, first_query=first)
            assert torch.equal(rows, allowed(mode, 4, 2)[first:]), (mode, first)
    with pytest.raises(ValueError, match="unknown attention mode"):
        allowed("sliding", 4, 2)


def test_answer_shapes(runtime: ReferenceRuntime) -> None:
    request = {"state": "Refund please.", "questions": QUESTIONS}
    result = runtime.answer(request)
    lengths = [len(r.token_ids) for r in runtime.render(request)]
    assert result["usage"] == {"input_tokens": sum(lengths), "output_tokens": 0}
    answers = result["answers"]
    assert list(answers) == list(QUESTIONS)

    noul = answers["spam"]
    assert set(noul) == {"type", "noul", "probabilities", "confidence"}
    assert noul["type"] == "noul" and list(noul["probabilities"]) == ["yes", "no"]
    assert noul["noul"] == noul["probabilities"]["yes"]
    assert noul["confidence"] == max(noul["probabilities"].values())

    choice = answers["team"]
    assert set(choice) == {"type", "choice", "probabilities", "confidence"}
    assert list(choice["probabilities"]) == ["billing", "shipping", "support"]
    top = max(choice["probabilities"], key=choice["probabilities"].get)
    assert choice["choice"] == top
    assert choice["confidence"] == choice["probabilities"][top]

    score = answers["urgency"]
    assert set(score) == {"type", "score", "legend", "probabilities", "confidence"}
    assert score["legend"] == {"0": "low", "1": "medium", "2": "high", "3": "critical"}
    probs = score["probabilities"]
    assert list(probs) == ["0", "1", "2", "3"]
    assert score["score"] == pytest.approx(sum(int(k) * p for k, p in probs.items()))
    assert score["confidence"] == max(probs.values())
    for answer in answers.values():
        assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-12)


def test_noul_options_false_then_true(runtime: ReferenceRuntime) -> None:
    (rendered,) = runtime.render(
        {
            "state": "x",
            "questions": {"q": {"type": "noul", "criteria": {"true": "spam"}}},
        }
    )
    assert "Options:\nA: No / false\nB: spam\n" in rendered.text


def with_decision(base: Path, out: Path, **fields: Any) -> Path:
    """A copy of ``base`` (files linked) whose decision_config.json has
    ``fields`` set."""
    out.mkdir()
    for item in base.iterdir():
        if item.name != "decision_config.json":
            (out / item.name).symlink_to(item)
    decision = json.loads((base / "decision_config.json").read_text())
    decision.update(fields)
    (out / "decision_config.json").write_text(json.dumps(decision))
    return out


@pytest.fixture(scope="module")
def bucketed(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> ReferenceRuntime:
    buckets = {"max_questions": [1, 4], "temperature": [2.0, 0.5, 1.5]}
    out = tmp_path_factory.mktemp("bucketed") / "ckpt"
    return ReferenceRuntime(
        with_decision(checkpoint, out, temperature_by_questions=buckets)
    )


def test_temperature_by_questions(
    runtime: ReferenceRuntime, bucketed: ReferenceRuntime
) -> None:
    assert [bucketed.temperature_for(n) for n in (1, 2, 4, 5, 64)] == [
        2.0,
        0.5,
        0.5,
        1.5,
        1.5,
    ]
    assert runtime.temperature_for(7) == 0.75
    many = {
        f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(5)
    }
    for count, temperature in ((1, 2.0), (2, 0.5), (5, 1.5)):
        request = {"state": "s", "questions": dict(list(many.items())[:count])}
        base = runtime.answer(request)["answers"]["q0"]["probabilities"]
        tempered = bucketed.answer(request)["answers"]["q0"]["probabilities"]
        # Undo the base temperature 0.75 and apply the bucket's.
        log_odds = math.log(base["yes"] / base["no"]) * 0.75 / temperature
        assert tempered["yes"] == pytest.approx(1 / (1 + math.exp(-log_odds)), abs=1e-9)


BAD_QUESTIONS = [
    ({"type": "ranking"}, "unknown question type"),
    ({"type": "choice", "criteria": ["a", "b"]}, "choice criteria"),
    ({"type": "choice", "criteria": {}}, "choice criteria"),
    ({"type": "choice", "criteria": {"": None}}, "non-empty"),
    (
        {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}},
        "at most 255",
    ),
    ({"type": "noul", "criteria": {"maybe": "x"}}, "noul criteria"),
    ({"type": "noul", "criteria": "yes"}, "noul criteria"),
    ({"type": "score", "criteria": ["only"]}, "score criteria"),
    ({"type": "score", "criteria": [str(i) for i in range(11)]}, "score criteria"),
    ({"type": "score", "criteria": {"low": 0}}, "score criteria"),
    ({"type": "score", "criteria": ["a", "a"]}, "duplicate"),
    ({"type": "noul", "labels": []}, "unknown field"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_QUESTIONS)
def test_bad_questions(
    runtime: ReferenceRuntime, spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        runtime.answer({"state": "x", "questions": {"q": spec}})


def test_bad_requests(runtime: ReferenceRuntime) -> None:
    ok = {"state": "x", "questions": {"q": {"type": "noul"}}}
    with pytest.raises(ValueError, match="questions"):
        runtime.answer({"state": "x", "questions": {}})
    with pytest.raises(ValueError, match="state_once path needs prefix_bidir"):
        runtime.answer(ok, path="state_once", attention="causal")
    with pytest.raises(ValueError, match="unknown attention"):
        runtime.answer(ok, attention="bidirectional")
    with pytest.raises(ValueError, match="unknown path"):
        runtime.answer(ok, path="batched")
    with pytest.raises(ValueError, match="data: URLs"):
        runtime.answer({**ok, "images": ["https://example.com/cat.png"]})


BAD_DECISIONS = [
    ({"prompt_layout": "header-v1"}, "prompt_layout"),
    ({"attention_mode": "sliding"}, "attention_mode"),
    ({"pooling": "mean"}, "pooling"),
    ({"temperature": 0}, "positive"),
    ({"codes": ["A", "A"]}, "codes"),
    (
        {
            "temperature_by_questions": {
                "max_questions": [4, 1],
                "temperature": [1, 1, 1],
            }
        },
        "temperature_by_questions",
    ),
    (
        {"temperature_by_questions": {"max_questions": [1], "temperature": [1.0]}},
        "temperature_by_questions",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD_DECISIONS)
def test_bad_decision_configs(
    checkpoint: Path, tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ReferenceRuntime(with_decision(checkpoint, tmp_path / "ckpt", **fields))


def test_reference_imports_neither_vllm_nor_the_plugin() -> None:
    import ast

    import vllm_d3.reference

    package = Path(vllm_d3.reference.__file__).parent
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root not in ("vllm", "vllm_d3"), f"{source.name} imports {name}"
