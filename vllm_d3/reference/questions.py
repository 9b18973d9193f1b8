"""Questions of a /v1/systemone request: validation, option lines and answers.

Contract:
- ``parse_questions(request, max_options)`` turns the request's ``questions``
  mapping into ``Question`` objects, in request order. Anything the D3 prompt
  cannot express raises ``ValueError`` naming the question: an unknown type, bad
  criteria, an empty option name, too many options or questions.
- ``Question.option_texts`` are the option lines' texts in the order the model
  reads them; option ``i`` is written under answer code ``codes[i]``.
  ``noul`` options are written false first, then true.
- ``Question.answer(probs)`` takes the probabilities in that model order and
  returns the answer object in exactly vLLM's /v1/systemone shape for the type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Most questions one request may ask (vLLM's limit for D3 models).
MAX_QUESTIONS = 64
#: Most levels a score question may have.
MAX_SCORE_LEVELS = 10
#: Fields a question may carry.
QUESTION_FIELDS = frozenset({"type", "instructions", "criteria"})
#: What a noul option says when the request does not describe it (false, true).
NOUL_DEFAULTS = ("No / false", "Yes / true")
QUESTION_TYPES = ("choice", "noul", "score")


@dataclass(frozen=True)
class Question:
    """One validated question.

    ``names`` are the option names in request order (choice names, score
    levels, or ``("yes", "no")`` for noul); ``option_texts`` are the option lines
    in model order.
    """

    qid: str
    type: str
    instructions: str
    names: tuple[str, ...]
    option_texts: tuple[str, ...]

    @property
    def num_options(self) -> int:
        return len(self.option_texts)

    def answer(self, probs: Sequence[float]) -> dict[str, Any]:
        """The answer object for probabilities given in model order."""
        if len(probs) != self.num_options:
            raise ValueError(
                f"question {self.qid!r}: {len(probs)} probabilities for "
                f"{self.num_options} options"
            )
        if self.type == "noul":
            p_false, p_true = probs
            return {
                "type": "noul",
                "noul": p_true,
                "probabilities": {"yes": p_true, "no": p_false},
                "confidence": max(p_true, p_false),
            }
        top = max(range(len(probs)), key=probs.__getitem__)
        if self.type == "choice":
            return {
                "type": "choice",
                "choice": self.names[top],
                "probabilities": dict(zip(self.names, probs, strict=True)),
                "confidence": probs[top],
            }
        return {
            "type": "score",
            "score": sum(level * p for level, p in enumerate(probs)),
            "legend": {str(level): name for level, name in enumerate(self.names)},
            "probabilities": {str(level): p for level, p in enumerate(probs)},
            "confidence": probs[top],
        }


def parse_questions(questions: Any, max_options: int) -> list[Question]:
    """Validate a request's ``questions`` mapping, keeping its order."""
    if not isinstance(questions, Mapping) or not questions:
        raise ValueError("questions: needs a non-empty object of question id -> spec")
    if len(questions) > MAX_QUESTIONS:
        raise ValueError(f"questions: at most {MAX_QUESTIONS} per request")
    return [_parse_question(qid, spec, max_options) for qid, spec in questions.items()]


def _parse_question(qid: Any, spec: Any, max_options: int) -> Question:
    if not isinstance(qid, str) or not qid:
        raise ValueError("question ids must be non-empty strings")
    if not isinstance(spec, Mapping):
        raise ValueError(f"question {qid!r}: must be an object")
    if unknown := set(spec) - QUESTION_FIELDS:
        raise ValueError(f"question {qid!r}: unknown field(s) {sorted(unknown)}")
    qtype = spec.get("type")
    if qtype not in QUESTION_TYPES:
        raise ValueError(
            f"question {qid!r}: unknown question type {qtype!r}; "
            f"supported: {list(QUESTION_TYPES)}"
        )
    instructions = spec.get("instructions")
    if not isinstance(instructions, str):
        instructions = "" if instructions is None else str(instructions)
    criteria = spec.get("criteria")
    if qtype == "choice":
        names, texts = _choice_options(qid, criteria)
    elif qtype == "noul":
        names, texts = _noul_options(qid, criteria)
    else:
        names, texts = _score_options(qid, criteria)
    if len(set(names)) != len(names):
        raise ValueError(f"question {qid!r}: duplicate option names")
    if len(texts) > max_options:
        raise ValueError(f"question {qid!r}: at most {max_options} options")
    return Question(qid, qtype, instructions, tuple(names), tuple(texts))


def _choice_options(qid: str, criteria: Any) -> tuple[list[str], list[str]]:
    if not isinstance(criteria, Mapping) or not criteria:
        raise ValueError(
            f"question {qid!r}: choice criteria must be a non-empty object mapping "
            "option names to a description or null"
        )
    names: list[str] = []
    texts: list[str] = []
    for raw_name, description in criteria.items():
        name = str(raw_name)
        if not name:
            raise ValueError(f"question {qid!r}: option names must be non-empty")
        names.append(name)
        texts.append(name if description is None else f"{name}: {description}")
    return names, texts


def _noul_options(qid: str, criteria: Any) -> tuple[list[str], list[str]]:
    if criteria is None:
        criteria = {}
    if not isinstance(criteria, Mapping) or not set(criteria) <= {"true", "false"}:
        raise ValueError(
            f"question {qid!r}: noul criteria must be null or an object with "
            "optional 'true' and 'false' descriptions"
        )
    texts = []
    for side, default in zip(("false", "true"), NOUL_DEFAULTS, strict=True):
        description = criteria.get(side)
        text = "" if description is None else str(description)
        texts.append(text or default)
    return ["yes", "no"], texts


def _score_options(qid: str, criteria: Any) -> tuple[list[str], list[str]]:
    if not isinstance(criteria, list) or not 2 <= len(criteria) <= MAX_SCORE_LEVELS:
        raise ValueError(
            f"question {qid!r}: score criteria must be a list of 2 to "
            f"{MAX_SCORE_LEVELS} level names"
        )
    levels = [str(level) for level in criteria]
    if not all(levels):
        raise ValueError(f"question {qid!r}: score levels must be non-empty")
    return levels, list(levels)
