"""The decision_config.json fields 0.33.0 does not read, and d3_state_tokens."""

import math

import pytest

from vllm_d3.model_executor.models.d3_contract import (
    check_decision_fields,
    state_tokens_of,
    temperature_schedule_of,
    validated_length_of,
)

ULTRA = {"max_questions": [1, 4, 16], "temperature": [1.046, 1.0, 0.9, 0.8]}


@pytest.mark.parametrize(
    ("num_questions", "expected"),
    [(1, 1.046), (2, 1.0), (4, 1.0), (5, 0.9), (16, 0.9), (17, 0.8), (64, 0.8)],
)
def test_temperature_bucket_boundaries(num_questions, expected):
    schedule = temperature_schedule_of({"temperature_by_questions": ULTRA})
    assert schedule is not None
    assert schedule.temperature_for(num_questions) == expected


def test_temperature_schedule_absent():
    assert temperature_schedule_of({}) is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        [1, 2],
        {"max_questions": [1, 4]},
        {"max_questions": [1, 4], "temperature": [1.0, 1.0, 1.0], "x": 1},
        {"max_questions": [], "temperature": [1.0]},
        {"max_questions": [4, 1], "temperature": [1.0, 1.0, 1.0]},
        {"max_questions": [1, 1], "temperature": [1.0, 1.0, 1.0]},
        {"max_questions": [0, 4], "temperature": [1.0, 1.0, 1.0]},
        {"max_questions": [True, 4], "temperature": [1.0, 1.0, 1.0]},
        {"max_questions": [1.0, 4], "temperature": [1.0, 1.0, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, 1.0, 1.0, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, 0.0, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, -1.0, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, math.inf, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, math.nan, 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, "1", 1.0]},
        {"max_questions": [1, 4], "temperature": [1.0, False, 1.0]},
    ],
)
def test_malformed_temperature_by_questions(value):
    with pytest.raises(ValueError, match="temperature_by_questions"):
        temperature_schedule_of({"temperature_by_questions": value})


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "32768"])
def test_malformed_validated_length(value):
    with pytest.raises(ValueError, match="validated_length"):
        validated_length_of({"validated_length": value})


def test_validated_length():
    assert validated_length_of({"validated_length": 32768}) == 32768
    assert validated_length_of({}) is None


@pytest.mark.parametrize("layout", ["header-v1", "", None, 1])
def test_unknown_prompt_layout_stops(layout):
    with pytest.raises(ValueError, match="prompt_layout") as excinfo:
        check_decision_fields({"prompt_layout": layout})
    assert repr(layout) in str(excinfo.value)


def test_known_fields_pass_and_are_read():
    decision = {
        "attention_mode": "prefix_bidir",
        "prompt_layout": "d3",
        "validated_length": 32768,
        "temperature_by_questions": ULTRA,
    }
    assert check_decision_fields(decision) is None  # start-up goes on
    assert validated_length_of(decision) == 32768
    schedule = temperature_schedule_of(decision)
    assert schedule is not None
    assert [schedule.temperature_for(n) for n in (1, 4, 16, 64)] == [
        1.046,
        1.0,
        0.9,
        0.8,
    ]


def test_unknown_attention_mode():
    with pytest.raises(ValueError, match="attention_mode 'sideways'"):
        check_decision_fields({"attention_mode": "sideways"})


@pytest.mark.parametrize("s", [1, 7, 10])
def test_state_tokens_valid(s):
    assert state_tokens_of({"d3_state_tokens": s}, 10) == s


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (None, "needs the state block size"),
        ({}, "needs the state block size"),
        ({"other": 3}, "needs the state block size"),
        ({"d3_state_tokens": True}, "must be an int, not bool"),
        ({"d3_state_tokens": False}, "must be an int, not bool"),
        ({"d3_state_tokens": 3.0}, "must be an int, not float"),
        ({"d3_state_tokens": "3"}, "must be an int, not str"),
        ({"d3_state_tokens": None}, "must be an int, not NoneType"),
        ({"d3_state_tokens": 0}, "outside 1..10"),
        ({"d3_state_tokens": -2}, "outside 1..10"),
        ({"d3_state_tokens": 11}, "outside 1..10"),
    ],
)
def test_state_tokens_invalid(extra, message):
    with pytest.raises(ValueError, match=message):
        state_tokens_of(extra, 10)
