# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The rules D3StateBlockReads reads a prefix_bidir request by: the state
block's size, the packs of questions after one state, and which checkpoints
need any of it."""

import pytest

from vllm.entrypoints.openai.decisions.d3_reads import (
    needs_state_block_reads,
    pack_questions,
    state_block_size,
)

TEMPERATURE_BY_QUESTIONS = {"max_questions": [1, 4], "temperature": [1.2, 1.0, 0.9]}


@pytest.mark.parametrize(
    ("decision", "needed"),
    [
        ({"attention_mode": "prefix_bidir"}, True),
        ({"attention_mode": "causal"}, False),
        ({}, False),
        ({"attention_mode": "noncausal_full_attention"}, False),
        ({"temperature_by_questions": TEMPERATURE_BY_QUESTIONS}, True),
    ],
)
def test_which_checkpoints_read_state_blocks(decision, needed):
    assert needs_state_block_reads(decision) is needed


def test_the_state_is_the_tokens_that_end_within_its_text():
    # Token character spans of "State: a b|\n\nQuestion": the token that joins
    # the state's last character to what follows belongs to the question.
    offsets = [(0, 6), (6, 8), (8, 10), (10, 13), (13, 21)]
    assert state_block_size(offsets, 10) == 3
    assert state_block_size(offsets, 11) == 3
    assert state_block_size(offsets, 13) == 4
    assert state_block_size(offsets, 0) == 0


@pytest.mark.parametrize(
    ("state", "questions", "limit", "packs"),
    [
        (10, [5, 5, 5], 100, [[0, 1, 2]]),
        (10, [5, 5, 5], 20, [[0, 1], [2]]),
        (10, [5, 5, 5], 15, [[0], [1], [2]]),
        # A question too long for any pack goes alone, and fails as its own
        # prompt would.
        (10, [5, 50, 5], 20, [[0], [1], [2]]),
    ],
)
def test_questions_are_packed_within_the_engine_step(state, questions, limit, packs):
    assert pack_questions(state, questions, limit) == packs
    for pack in packs[:-1]:
        assert state + sum(questions[n] for n in pack) <= limit or len(pack) == 1
