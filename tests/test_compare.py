"""The answer comparison and the validation report, on hand-made answers."""

import pytest

from benchmarks.validation import (
    HTTP_TABLE,
    STATE_ONCE_TABLE,
    report,
    verdict_of,
)
from vllm_d3.testing.compare import compare, decision, flatten, probabilities


def choice(*probs):
    return {
        "type": "choice",
        "probabilities": {f"o{i}": p for i, p in enumerate(probs)},
    }


def noul(yes):
    return {
        "type": "noul",
        "noul": yes,
        "probabilities": {"yes": yes, "no": 1 - yes},
    }


def score(*probs):
    return {"type": "score", "probabilities": {str(i): p for i, p in enumerate(probs)}}


def test_probabilities_and_decisions():
    assert probabilities(noul(0.7)) == [0.7, pytest.approx(0.3)]
    assert decision(noul(0.5)) == 1 and decision(noul(0.49)) == 0
    assert decision(choice(0.2, 0.5, 0.3)) == 1
    assert probabilities(score(0.1, 0.2, 0.7)) == [0.1, 0.2, 0.7]
    assert decision(score(0.1, 0.2, 0.7)) == 2


def test_compare_counts_changes_and_near_ties():
    reference = [choice(0.6, 0.4), choice(0.504, 0.496), noul(0.9), score(0.2, 0.8)]
    served = [choice(0.59, 0.41), choice(0.49, 0.51), noul(0.3), score(0.2, 0.8)]
    stats = compare(reference, served, tie=0.01)
    assert stats["questions"] == 4
    assert stats["decisions_changed"] == 2  # the near tie and the noul
    assert stats["changed_near_ties"] == 1
    assert stats["max_dp"] == pytest.approx(0.6)
    deltas = sorted([0.01, 0.01, 0.014, 0.014, 0.6, 0.6, 0.0, 0.0])
    assert stats["median_dp"] == pytest.approx((deltas[3] + deltas[4]) / 2)


def test_compare_refuses_misaligned_answers():
    with pytest.raises(ValueError, match="2 reference answers, 1 served"):
        compare([noul(0.5), noul(0.5)], [noul(0.5)])
    with pytest.raises(ValueError, match="option counts differ"):
        compare([choice(0.5, 0.5)], [choice(0.3, 0.3, 0.4)])
    # An empty set would meet every bound: it is an error, not a pass.
    with pytest.raises(ValueError, match="no answers to compare"):
        compare([], [])


def test_flatten_keeps_request_and_question_order():
    responses = [
        {"answers": {"b": noul(0.1), "a": noul(0.2)}},
        {"answers": {"c": noul(0.3)}},
    ]
    assert [a["noul"] for a in flatten(responses)] == [0.1, 0.2, 0.3]


def test_report_verdicts_and_missing_tables():
    good = compare([choice(0.6, 0.4)], [choice(0.6, 0.4)])
    bad = compare([choice(0.6, 0.4)], [choice(0.2, 0.8)])
    results = {
        "versions": {"gpu": "test"},
        "tables": {
            "prefix_bidir, HTTP /v1/systemone": {"text": good, "image": bad},
            "control: served vs reference causal mask": {"text": bad},
        },
    }
    text = report(results, "cmd")
    assert "| text | 1 | 0 (0) | 0.0000 | 0.0000 | 0.0000 | yes |" in text
    assert "| image | 1 | 1 (0) | 0.4000 | 0.4000 | 0.4000 | NO |" in text
    assert "| clearly wrong |" in text
    assert "- causal checkpoint, in process" in text
    assert "- --enable-chunked-prefill" in text
    assert "## Failures" not in text
    results["failures"] = {"causal checkpoint, in process": "exited with 1"}
    assert "- causal checkpoint, in process: exited with 1" in report(results, "cmd")


def test_the_two_read_paths_are_held_to_kernel_rounding():
    # 0.01 apart passes against the reference, not between the plugin's own
    # state-once and per-question answers.
    stats = compare([choice(0.6, 0.4)], [choice(0.59, 0.41)])
    results = {
        "versions": {},
        "tables": {HTTP_TABLE: {"text": stats}, STATE_ONCE_TABLE: {"text": stats}},
    }
    _, meets_reference = verdict_of(HTTP_TABLE)
    _, meets_per_question = verdict_of(STATE_ONCE_TABLE)
    assert meets_reference(stats) and not meets_per_question(stats)
    text = report(results, "cmd")
    assert text.count("| text | 1 | 0 (0) | 0.0100 | 0.0100 | 0.0100 |") == 2
    assert "0.0100 | yes |" in text and "0.0100 | NO |" in text
