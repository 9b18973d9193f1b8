"""GPU: the state cache through vLLM's engine, against the same requests uncached.

The tiny checkpoint is served by ``vllm.LLM`` with prefix caching in a process of
its own (this file run as a script), its input processor and engine core in that
process. A packed request computed with nothing cached, then again after its
state was read alone, must give the same logits, the second having taken tokens
from the cache; so must each question's own prompt, read after it. The control
reads a state alone with the key left out (``key_state_block`` not called),
then a state that differs from it in its last token: its hit takes the first
state's blocks, and its logits must move clearly.
"""

import random
import sys

import pytest
import torch

from vllm_d3.testing.own_process import (
    TOKEN_IDS,
    TOLERANCE,
    classify_tokens,
    flat_logits,
    logits_from_script,
    relative_error,
)

pytestmark = pytest.mark.gpu

STATE, QUESTION, QUESTIONS = 700, 12, 4


def cached_and_uncached(checkpoint: str) -> dict[str, torch.Tensor]:
    """Each read's logits, and the tokens it found cached (``... cached``)."""
    from vllm import LLM

    import vllm_d3.patches
    from vllm_d3.testing.server import GDN_PREFILL_BACKEND

    llm = LLM(
        model=checkpoint,
        gdn_prefill_backend=GDN_PREFILL_BACKEND,
        enable_prefix_caching=True,
    )
    found: dict[str, torch.Tensor] = {}

    def classify(name: str, prompts) -> None:
        outputs = classify_tokens(llm, prompts)
        found[name] = flat_logits(outputs)
        found[f"{name} cached"] = torch.tensor([o.num_cached_tokens for o in outputs])

    rng = random.Random(0)
    state = [rng.randrange(*TOKEN_IDS) for _ in range(STATE)]
    other = state[:-1] + [TOKEN_IDS[0] + (state[-1] + 1 - TOKEN_IDS[0]) % 900]
    questions = [
        [rng.randrange(*TOKEN_IDS) for _ in range(QUESTION)] for _ in range(QUESTIONS)
    ]
    ends = [STATE + QUESTION * (i + 1) for i in range(QUESTIONS)]
    sized = {"d3_state_tokens": STATE}

    def packed(s: list[int]):
        ids = s + [t for q in questions for t in q]
        return [(ids, {**sized, "d3_question_ends": ends})]

    config = llm.llm_engine.vllm_config.cache_config
    found["block sizes"] = torch.tensor([config.block_size, config.mamba_block_size])
    classify("uncached", packed(state))
    classify("state alone", [(state, sized)])
    classify("packed, cached", packed(state))
    classify("own prompts, cached", [(state + q, sized) for q in questions])
    # The control: the other state is read first with its own key (nothing of
    # it cached), then, the key left out, after the first state read alone.
    classify("other, uncached", packed(other))
    vllm_d3.patches.key_state_block = lambda *args: None
    classify("state alone, unkeyed", [(state, sized)])
    classify("other, unkeyed", packed(other))
    return found


@pytest.fixture(scope="module")
def logits(make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("state-cache") / "logits.pt"
    return logits_from_script(__file__, make_checkpoint(), out)


@pytest.mark.parametrize("read", ["packed", "own prompts"])
def test_a_cached_state_answers_as_uncached(logits, read):
    assert (logits["uncached cached"] == 0).all()
    # Each request found the state's blocks cached, within the state.
    hits = logits[f"{read}, cached cached"]
    assert (hits > 0).all() and (hits < STATE).all(), logits["block sizes"]
    assert relative_error(logits[f"{read}, cached"], logits["uncached"]) < TOLERANCE


def test_a_hit_keyed_on_a_shared_prefix_only_is_clearly_wrong(logits):
    assert (logits["other, uncached cached"] == 0).all()
    assert (logits["other, unkeyed cached"] > 0).all()
    wrong = relative_error(logits["other, unkeyed"], logits["other, uncached"])
    assert wrong > 5 * TOLERANCE


if __name__ == "__main__":
    checkpoint, out = sys.argv[1:]
    torch.save(cached_and_uncached(checkpoint), out)
