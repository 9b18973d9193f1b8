"""How a packed step's Gated DeltaNet runs, chosen per call where the engine
core is in the caller's process (benchmarks and GPU tests).

``with gdn_form(name):`` sets the step rules of ``FORMS[name]``
(``d3_packed_gdn.STATE_REREAD_TOKENS_MAX`` and ``SPLIT_SEQUENCES_MAX``; None
keeps a rule as shipped) and
restores them after. ``served_gdn_prefill(llm)`` names the Gated DeltaNet
prefill kernel an engine runs.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_d3.v1.attention.backends import d3_packed_gdn

#: Form -> (states re-read at most, sequences of one pass at most).
FORMS: dict[str, tuple[int | None, int | None]] = {
    "as served": (None, None),
    "two phases": (0, 0),
    # Wherever the step's blocks fit one scan (the one pass off).
    "one scan": (1 << 30, 0),
    # Wherever the split recurrence takes the step, its bound on sequences
    # lifted (so that a step past it, 64 questions, can be timed in one pass).
    "one pass": (0, 1 << 30),
}


@contextmanager
def gdn_form(name: str) -> Iterator[None]:
    reread, sequences = FORMS[name]
    shipped = (d3_packed_gdn.STATE_REREAD_TOKENS_MAX, d3_packed_gdn.SPLIT_SEQUENCES_MAX)
    if reread is not None:
        d3_packed_gdn.STATE_REREAD_TOKENS_MAX = reread
    if sequences is not None:
        d3_packed_gdn.SPLIT_SEQUENCES_MAX = sequences
    try:
        yield
    finally:
        (
            d3_packed_gdn.STATE_REREAD_TOKENS_MAX,
            d3_packed_gdn.SPLIT_SEQUENCES_MAX,
        ) = shipped


def served_gdn_prefill(llm: Any) -> str:
    """The Gated DeltaNet prefill kernel of ``vllm.LLM`` ``llm``'s layers, as
    vLLM resolves it from the engine's config."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        _resolve_gdn_prefill_backend,
    )

    return _resolve_gdn_prefill_backend(llm.llm_engine.vllm_config)[1]
