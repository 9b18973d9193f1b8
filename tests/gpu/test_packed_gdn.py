"""GPU: a packed request through vLLM's engine, its Gated DeltaNet in either form.

The tiny checkpoint is served by ``vllm.LLM`` in a process of its own (this file
run as a script), its engine core in that process, on each Gated DeltaNet
prefill kernel of ``GDN_KERNELS``, so that the form can be set per call
(``gdn_forms``): a small packed request in one scan of each question's
own prompt (as shipped), in two phases and in one pass (the split recurrence)
must each give every question the logits of its own prompt ``state || q``; the
same tokens read as one question block (each question reading the ones before
it) must not.
"""

import random
import sys
from typing import Any

import pytest
import torch

from vllm_d3.testing.own_process import (
    GDN_KERNELS,
    TOKEN_IDS,
    TOLERANCE,
    classify_tokens,
    flat_logits,
    logits_from_script,
    relative_error,
)

pytestmark = pytest.mark.gpu

STATE, QUESTION, QUESTIONS = 40, 12, 4


def classify_every_way(checkpoint: str, kernel: str) -> dict[str, Any]:
    """The logits of each way of sending one packed request's questions, and
    the Gated DeltaNet prefill kernel that served them."""
    from vllm import LLM

    from vllm_d3.testing.gdn_forms import gdn_form, served_gdn_prefill

    llm = LLM(model=checkpoint, gdn_prefill_backend=kernel)

    def classify(prompts, form: str = "as served") -> torch.Tensor:
        with gdn_form(form):
            return flat_logits(classify_tokens(llm, prompts))

    rng = random.Random(0)
    state = [rng.randrange(*TOKEN_IDS) for _ in range(STATE)]
    questions = [
        [rng.randrange(*TOKEN_IDS) for _ in range(QUESTION)] for _ in range(QUESTIONS)
    ]
    packed_ids = state + [t for q in questions for t in q]
    ends = [STATE + QUESTION * (i + 1) for i in range(QUESTIONS)]
    packed = [(packed_ids, {"d3_state_tokens": STATE, "d3_question_ends": ends})]
    return {
        "gdn kernel": served_gdn_prefill(llm),
        "own prompts": classify(
            [(state + q, {"d3_state_tokens": STATE}) for q in questions]
        ),
        "one scan": classify(packed),
        "two phases": classify(packed, "two phases"),
        "one pass": classify(packed, "one pass"),
        "one block": classify([(packed_ids, {"d3_state_tokens": STATE})]),
    }


@pytest.fixture(scope="module", params=GDN_KERNELS)
def logits(request, make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed-gdn") / "logits.pt"
    return logits_from_script(__file__, make_checkpoint(), out, request.param)


def test_the_gdn_kernel_served(logits, served_kernel):
    assert logits["gdn kernel"] == served_kernel


@pytest.mark.parametrize("form", ["one scan", "two phases", "one pass"])
def test_each_form_answers_every_question_as_its_own_prompt(logits, form):
    assert relative_error(logits[form], logits["own prompts"]) < TOLERANCE


def test_questions_read_as_one_block_are_clearly_wrong(logits):
    # The last question reading every one before it, against its own prompt.
    one_block = logits["one block"]
    expected = logits["own prompts"][-one_block.numel() :]
    assert relative_error(one_block, expected) > 5 * TOLERANCE


if __name__ == "__main__":
    checkpoint, out, kernel = sys.argv[1:]
    torch.save(classify_every_way(checkpoint, kernel), out)
