"""Compare /v1/systemone answers with the reference's.

``probabilities(answer)`` reads one answer's option probabilities in request order
(noul: yes, no; score: level 0..k-1; choice: criteria order) and ``decision``
its decision (top choice, noul >= 0.5, most likely level). ``compare`` gives, over
aligned questions: the count, decisions changed, the changes that are near ties of
the reference (top two within ``tie``), and the median, p90 and max of |dp| over
every option probability.

The verdicts on those statistics live here too: ``passes`` (max |dp| within
``TOLERANCE``, or ``STATE_ONCE_TOLERANCE`` between the plugin's two read paths,
and a decision changes only where the reference's top two are within ``TIE``)
and, for negative controls, ``clearly_wrong`` (max |dp| above
``CONTROL_MARGIN`` x ``TOLERANCE``).
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

TOLERANCE = 0.02
#: The same engine with the state read once vs one request per question: only
#: kernel rounding may differ.
STATE_ONCE_TOLERANCE = 0.005
TIE = 0.01
CONTROL_MARGIN = 2.5  # a negative control must exceed the tolerance by this factor


def probabilities(answer: dict[str, Any]) -> list[float]:
    probs = answer["probabilities"]
    if answer["type"] == "noul":
        return [probs["yes"], probs["no"]]
    if answer["type"] == "score":
        return [probs[str(i)] for i in range(len(probs))]
    return list(probs.values())


def decision(answer: dict[str, Any]) -> int:
    if answer["type"] == "noul":
        return int(answer["noul"] >= 0.5)
    probs = probabilities(answer)
    return max(range(len(probs)), key=probs.__getitem__)


def top_two_margin(answer: dict[str, Any]) -> float:
    probs = sorted(probabilities(answer), reverse=True)
    return probs[0] - probs[1] if len(probs) > 1 else 1.0


def compare(
    reference: Sequence[dict[str, Any]],
    served: Sequence[dict[str, Any]],
    *,
    tie: float = TIE,
) -> dict[str, Any]:
    """``reference`` and ``served``: answers of the same questions, in order;
    at least one, since an empty set would pass any bound."""
    if len(reference) != len(served):
        raise ValueError(f"{len(reference)} reference answers, {len(served)} served")
    if not reference:
        raise ValueError("no answers to compare")
    deltas: list[float] = []
    changed = near_ties = 0
    for ref, got in zip(reference, served, strict=True):
        a, b = probabilities(ref), probabilities(got)
        if len(a) != len(b):
            raise ValueError(f"option counts differ: {len(a)} vs {len(b)}")
        deltas.extend(abs(x - y) for x, y in zip(a, b, strict=True))
        if decision(ref) != decision(got):
            changed += 1
            near_ties += top_two_margin(ref) <= tie
    values = np.asarray(deltas)
    return {
        "questions": len(reference),
        "decisions_changed": changed,
        "changed_near_ties": near_ties,
        "median_dp": float(np.median(values)),
        "p90_dp": float(np.percentile(values, 90)),
        "max_dp": float(values.max()),
    }


def flatten(responses: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers of several responses, in request and question order."""
    return [answer for r in responses for answer in r["answers"].values()]


def passes(stats: dict, tolerance: float = TOLERANCE) -> bool:
    return (
        stats["max_dp"] <= tolerance
        and stats["decisions_changed"] == stats["changed_near_ties"]
    )


def clearly_wrong(stats: dict) -> bool:
    return stats["max_dp"] > CONTROL_MARGIN * TOLERANCE
