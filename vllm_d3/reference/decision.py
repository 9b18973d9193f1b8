"""The parts of ``decision_config.json`` that change a D3 answer.

Contract: ``DecisionConfig.load(checkpoint_dir)`` reads the file and refuses,
with ``ValueError``, anything the reference runtime would otherwise answer
wrongly: a prompt other than ``d3``, any ``prompt_layout`` (none is known
here), pooling other than ``last``, an unknown ``attention_mode``, bad codes or
temperatures. ``temperature_for(n)`` is the temperature of a request with
``n`` questions: ``temperature`` (default 1.0), or, when
``temperature_by_questions = {"max_questions": [m0 < m1 < ...],
"temperature": [t0, t1, ..., t_last]}`` is present, ``t_i`` for the first ``i``
with ``n <= m_i`` and ``t_last`` beyond the last threshold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .masks import ATTENTION_MODES


@dataclass(frozen=True)
class DecisionConfig:
    codes: tuple[str, ...]
    attention_mode: str
    temperature: float
    #: ``(max_questions, temperatures)`` from ``temperature_by_questions``.
    buckets: tuple[tuple[int, ...], tuple[float, ...]] | None

    @classmethod
    def load(cls, checkpoint: Path) -> DecisionConfig:
        decision = json.loads((checkpoint / "decision_config.json").read_text())
        if decision.get("prompt", "d3") != "d3":
            raise ValueError(f"unknown decision prompt {decision['prompt']!r}")
        if "prompt_layout" in decision:
            raise ValueError(
                f"unsupported prompt_layout {decision['prompt_layout']!r}: the "
                "reference runtime only writes the plain d3 prompt"
            )
        if decision.get("pooling", "last") != "last":
            raise ValueError(f"unsupported pooling {decision['pooling']!r}")
        codes = decision.get("codes")
        if (
            not isinstance(codes, list)
            or not codes
            or not all(isinstance(c, str) and c for c in codes)
            or len(set(codes)) != len(codes)
        ):
            raise ValueError("decision codes must be distinct non-empty strings")
        mode = decision.get("attention_mode", "causal")
        if mode not in ATTENTION_MODES:
            raise ValueError(f"unknown attention_mode {mode!r}")
        temperature = _temperature(decision.get("temperature", 1.0))
        buckets = decision.get("temperature_by_questions")
        return cls(
            tuple(codes),
            mode,
            temperature,
            None if buckets is None else _buckets(buckets),
        )

    def temperature_for(self, num_questions: int) -> float:
        if self.buckets is None:
            return self.temperature
        limits, temperatures = self.buckets
        for limit, temperature in zip(limits, temperatures, strict=False):
            if num_questions <= limit:
                return temperature
        return temperatures[-1]


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a temperature must be a number, not {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a temperature must be positive and finite, not {value}")
    return float(value)


def _buckets(value: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
    problem = (
        "temperature_by_questions must be {'max_questions': [ascending positive "
        "ints], 'temperature': [one more temperature than thresholds]}"
    )
    if not isinstance(value, dict) or set(value) != {"max_questions", "temperature"}:
        raise ValueError(problem)
    limits, temperatures = value["max_questions"], value["temperature"]
    if (
        not isinstance(limits, list)
        or not isinstance(temperatures, list)
        or not limits
        or not all(isinstance(m, int) and not isinstance(m, bool) for m in limits)
        or limits[0] < 1
        or any(a >= b for a, b in zip(limits, limits[1:], strict=False))
        or len(temperatures) != len(limits) + 1
    ):
        raise ValueError(problem)
    return tuple(limits), tuple(_temperature(t) for t in temperatures)
