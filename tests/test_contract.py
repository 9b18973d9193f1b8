"""The decision_config.json fields 0.33.0 does not read, d3_state_tokens and
d3_question_ends."""

import math
from types import SimpleNamespace

import pytest

from vllm_d3.model_executor.models.d3_contract import (
    StateBlock,
    apply_validated_length,
    attention_kernel_of,
    attention_mode_of,
    check_decision_fields,
    check_prefix_bidir_serving,
    decided,
    decision_config_of,
    decisions_to_write,
    is_prefix_bidir,
    question_ends_of,
    state_cache_min_tokens_of,
    state_once_decided,
    state_once_of,
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


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([1, 2], "it must be an object with exactly max_questions, temperature"),
        (
            {"max_questions": [], "temperature": [1.0]},
            "max_questions must be a non-empty list",
        ),
        (
            {"max_questions": [0], "temperature": [1.0, 1.0]},
            "max_questions must hold positive integers",
        ),
        (
            {"max_questions": [2, 2], "temperature": [1.0] * 3},
            "max_questions must be strictly increasing",
        ),
        (
            {"max_questions": [2], "temperature": [1.0]},
            "temperature must hold one more value than max_questions",
        ),
        (
            {"max_questions": [2], "temperature": [1.0, 0.0]},
            "temperatures must be finite positive numbers",
        ),
    ],
)
def test_a_malformed_temperature_schedule_says_why(value, why):
    decision = {"temperature_by_questions": value}
    assert refusal(temperature_schedule_of, decision) == (
        f"decision_config.json temperature_by_questions {value!r} is malformed: {why}"
    )


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "32768"])
def test_malformed_validated_length(value):
    with pytest.raises(ValueError, match="validated_length"):
        validated_length_of({"validated_length": value})


def test_validated_length():
    assert validated_length_of({"validated_length": 32768}) == 32768
    assert validated_length_of({"validated_length": 1}) == 1
    assert validated_length_of({}) is None
    assert refusal(validated_length_of, {"validated_length": 0}) == (
        "decision_config.json validated_length must be a positive integer, not 0"
    )


@pytest.mark.parametrize("layout", ["header-v1", "", None, 1])
def test_unknown_prompt_layout_stops(layout):
    assert refusal(check_decision_fields, {"prompt_layout": layout}) == (
        f"decision_config.json prompt_layout {layout!r} is not supported: vllm-d3 "
        "renders only ['d3'], and serving another layout with the d3 prompt would "
        "give wrong answers"
    )


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


def ends_refused(ends, prompt_len: int, state_tokens: int) -> str:
    """The error ``question_ends_of`` gives for ``ends``, checked to be the
    one that states the rule."""
    with pytest.raises(ValueError) as excinfo:
        question_ends_of({"d3_question_ends": ends}, prompt_len, state_tokens)
    assert str(excinfo.value) == (
        "d3_question_ends must be a non-empty list of ints increasing from above "
        f"d3_state_tokens={state_tokens} to the prompt length {prompt_len}, "
        f"not {ends!r}"
    )
    return str(excinfo.value)


@pytest.mark.parametrize(
    "ends",
    [
        [7, 7, 12],  # the second question block, [7, 7), is empty
        [5, 12],  # the first one, [s, 5), is empty
        [7, 12, 12],  # the last one, [12, 12), is empty
    ],
)
def test_a_question_block_is_never_empty(ends):
    # Block i is [e(i-1), ei) with e0 = s: an end that repeats the one before
    # it (or s) is a question of no tokens, with nothing to read out.
    ends_refused(ends, 12, 5)


@pytest.mark.parametrize(
    "ends",
    [
        pytest.param([], id="no question"),
        pytest.param([4, 12], id="a block starting inside the state"),
        pytest.param([9, 8, 12], id="ends going back"),
        pytest.param([9, 11], id="the last end short of the prompt"),
        pytest.param([9, 12, 13], id="an end past the prompt"),
        pytest.param([True, 12], id="a bool for an end"),
        pytest.param([9.0, 12], id="a float for an end"),
        pytest.param("12", id="not a list"),
        pytest.param((9, 12), id="a tuple"),
    ],
)
def test_malformed_question_ends_are_refused(ends):
    ends_refused(ends, 12, 5)


@pytest.mark.parametrize(
    ("ends", "state_tokens"),
    [([12], 5), ([6, 7, 12], 5), ([6, 12], 5), ([12], 11), ([2, 3, 4, 12], 1)],
)
def test_one_token_question_blocks_are_valid(ends, state_tokens):
    # The shortest question block is one token: each end one past the last.
    assert question_ends_of({"d3_question_ends": ends}, 12, state_tokens) == ends


def test_without_ends_the_prompt_is_one_question():
    assert question_ends_of(None, 12, 5) == [12]
    assert question_ends_of({}, 12, 5) == [12]
    assert question_ends_of({"d3_state_tokens": 5}, 12, 11) == [12]
    # A prompt that is all state has no question block.
    assert question_ends_of(None, 12, 12) == []


def test_a_state_blocks_question_blocks_and_ranges():
    packed = StateBlock(state_tokens=5, prompt_len=12, question_ends=(7, 9, 12))
    assert packed.packed
    assert packed.question_blocks() == [(5, 7), (7, 9), (9, 12)]
    # The ranges attention reads: the state, then each question, ends inclusive.
    assert packed.ranges() == [(0, 4), (5, 6), (7, 8), (9, 11)]
    one = StateBlock(state_tokens=5, prompt_len=12, question_ends=(12,))
    assert not one.packed
    assert one.question_blocks() == [(5, 12)]
    assert one.ranges() == [(0, 4), (5, 11)]
    all_state = StateBlock(state_tokens=12, prompt_len=12, question_ends=())
    assert not all_state.packed
    assert all_state.question_blocks() == []
    assert all_state.ranges() == [(0, 11)]


def refusal(call, *args) -> str:
    """The message of the ``ValueError`` ``call(*args)`` raises."""
    with pytest.raises(ValueError) as excinfo:
        call(*args)
    return str(excinfo.value)


def test_the_decision_config_and_its_attention_mode():
    decision = {"attention_mode": "prefix_bidir"}
    assert decision_config_of(SimpleNamespace(decision_config=decision)) is decision
    # Only a mapping vLLM's D3 detection attached is a decision config.
    assert decision_config_of(SimpleNamespace()) is None
    assert decision_config_of(SimpleNamespace(decision_config=["x"])) is None
    assert attention_mode_of({}) == "causal"
    assert attention_mode_of(decision) == "prefix_bidir"
    assert is_prefix_bidir(decision)
    assert not is_prefix_bidir({})
    assert not is_prefix_bidir({"attention_mode": "causal"})
    assert not is_prefix_bidir(None)
    assert not is_prefix_bidir("prefix_bidir")


@pytest.mark.parametrize(
    ("given", "derived", "validated", "expected"),
    [
        (None, 4096, 2048, 2048),  # applied
        (None, 4096, 4096, 4096),
        (None, 4096, 8192, 4096),  # past the model's positions: not applied
        (1000, 1000, 2048, 1000),  # the user chose one
        (1000, 1000, 512, 1000),
        (None, 4096, None, 4096),  # none declared
    ],
)
def test_validated_length_becomes_max_model_len(given, derived, validated, expected):
    model_config = SimpleNamespace(original_max_model_len=given, max_model_len=derived)
    decision = {} if validated is None else {"validated_length": validated}
    apply_validated_length(model_config, decision)
    assert model_config.max_model_len == expected


def serving(mode="prefix_bidir", v2=True, chunked=False, pipeline=1):
    """A stand-in of the ``VllmConfig`` fields the serving check reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(decision_config={"attention_mode": mode})
        ),
        use_v2_model_runner=v2,
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline),
    )


def test_prefix_bidir_serving_refuses_what_would_give_the_wrong_mask():
    check_prefix_bidir_serving(serving())
    assert refusal(check_prefix_bidir_serving, serving(v2=False)) == (
        "D3 prefix_bidir checkpoints need Model Runner V2: Model Runner V1 does not "
        "pass the state/question ranges to attention and would answer with the "
        "wrong mask. V1 was selected (an earlier log line says why, e.g. "
        "VLLM_USE_V2_MODEL_RUNNER=0 or no Triton)."
    )
    assert refusal(check_prefix_bidir_serving, serving(chunked=True)) == (
        "D3 prefix_bidir checkpoints do not support chunked prefill: a state or "
        "question block must be read whole. Drop --enable-chunked-prefill "
        "(--enable-prefix-caching alone sets what it needs)."
    )
    assert refusal(check_prefix_bidir_serving, serving(pipeline=2)) == (
        "D3 prefix_bidir checkpoints are served on several GPUs with "
        "--tensor-parallel-size or --data-parallel-size; pipeline parallelism has "
        "not been validated with their state/question ranges and packed reads. "
        "Drop --pipeline-parallel-size."
    )
    # Other modes have no state block: nothing of this is refused.
    check_prefix_bidir_serving(serving("causal", v2=False, chunked=True, pipeline=2))


def test_state_once_switch():
    assert state_once_of(None) is True
    assert state_once_of({}) is True
    assert state_once_of({"d3_state_once": False}) is False
    assert state_once_of({"d3_state_once": True}) is True
    for value in ("false", 0, None):
        assert refusal(state_once_of, {"d3_state_once": value}) == (
            f"--additional-config d3_state_once must be true or false, not {value!r}"
        )


def test_state_cache_min_tokens_switch():
    assert state_cache_min_tokens_of(None) == 8192
    assert state_cache_min_tokens_of({}) == 8192
    assert state_cache_min_tokens_of({"d3_state_cache_min_tokens": 0}) == 0
    assert state_cache_min_tokens_of({"d3_state_cache_min_tokens": 100}) == 100
    for value in (-1, True, 1.5, "0"):
        config = {"d3_state_cache_min_tokens": value}
        assert refusal(state_cache_min_tokens_of, config) == (
            "--additional-config d3_state_cache_min_tokens must be an int of at "
            f"least 0 (tokens), not {value!r}"
        )


def test_attention_kernel_switch():
    kernels = ("fa3", "triton")
    assert attention_kernel_of(None, kernels) == "auto"
    assert attention_kernel_of({}, kernels) == "auto"
    for value in ("auto", "fa3", "triton", "ranged"):
        assert attention_kernel_of({"d3_attention_kernel": value}, kernels) == value
    config = {"d3_attention_kernel": "fa2"}
    assert refusal(attention_kernel_of, config, kernels) == (
        "--additional-config d3_attention_kernel must be one of "
        "auto, fa3, triton, ranged, not 'fa2'"
    )


def test_what_the_config_hook_decided():
    assert decided(None) == {}
    assert decided({}) == {}
    assert decided({"d3_decided": 3}) == {}
    record = {"d3_state_once": True}
    config = {"d3_decided": record}
    assert decided(config) == record
    decided(config)["d3_state_once"] = False  # a copy
    assert record == {"d3_state_once": True}
    assert state_once_decided(config)
    assert not state_once_decided({"d3_decided": {"d3_state_once": "yes"}})
    assert not state_once_decided({})
    assert not state_once_decided(None)
    # The hook writes into the record there is, or a fresh one.
    assert decisions_to_write(config) is record
    fresh: dict = {"d3_decided": 3}
    written = decisions_to_write(fresh)
    assert written == {} and fresh["d3_decided"] is written
