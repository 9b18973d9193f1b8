"""The state cache's reads through ``vllm.LLM``, run as a script in a process
of its own (``own_process.logits_from_script``): ``python -m
vllm_d3.testing.state_cache_reads CHECKPOINT OUT KERNEL``.

``cached_and_uncached(checkpoint, kernel)`` serves a prefix_bidir checkpoint
with prefix caching on the Gated DeltaNet prefill ``kernel`` (``auto``: vLLM's
and the plugin's choice) and returns the kernel that served
(``"gdn kernel"``), and each read's logits and the tokens it found cached
(``"<read> cached"``): a packed request with nothing cached, then after its
state was read alone, then each question's own prompt; the control reads the
state alone with the key left out (``key_state_block`` not called), then a
state that differs from it in every token after its whole blocks, whose hit
takes the first state's blocks (``"other, unkeyed"``, against ``"other, uncached"``).
"""

import random
import sys
from typing import Any

import torch

from vllm_d3.testing.own_process import TOKEN_IDS, classify_tokens, flat_logits

STATE, QUESTION, QUESTIONS = 700, 12, 4


def cached_and_uncached(checkpoint: str, kernel: str) -> dict[str, Any]:
    """Each read's logits, and the tokens it found cached (``... cached``)."""
    from vllm import LLM

    import vllm_d3.patches
    from vllm_d3.testing.gdn_forms import served_gdn_prefill

    llm = LLM(model=checkpoint, gdn_prefill_backend=kernel, enable_prefix_caching=True)
    found: dict[str, Any] = {"gdn kernel": served_gdn_prefill(llm)}

    def classify(name: str, prompts) -> None:
        outputs = classify_tokens(llm, prompts)
        found[name] = flat_logits(outputs)
        found[f"{name} cached"] = torch.tensor([o.num_cached_tokens for o in outputs])

    config = llm.llm_engine.vllm_config.cache_config
    rng = random.Random(0)
    state = [rng.randrange(*TOKEN_IDS) for _ in range(STATE)]
    # The other state shares the first's whole blocks and differs in every
    # token after them: what an unkeyed hit would reuse was read beside them.
    shared = STATE // config.block_size * config.block_size
    other = state[:shared] + [another_token(t) for t in state[shared:]]
    questions = [
        [rng.randrange(*TOKEN_IDS) for _ in range(QUESTION)] for _ in range(QUESTIONS)
    ]
    ends = [STATE + QUESTION * (i + 1) for i in range(QUESTIONS)]
    sized = {"d3_state_tokens": STATE}

    def packed(s: list[int]):
        ids = s + [t for q in questions for t in q]
        return [(ids, {**sized, "d3_question_ends": ends})]

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


def another_token(token: int) -> int:
    """An ordinary token id other than ``token``."""
    low, high = TOKEN_IDS
    return low + (token + 1 - low) % (high - low)


if __name__ == "__main__":
    checkpoint, out, kernel = sys.argv[1:]
    torch.save(cached_and_uncached(checkpoint, kernel), out)
