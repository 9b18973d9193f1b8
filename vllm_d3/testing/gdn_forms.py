"""How a packed step's Gated DeltaNet runs, chosen per call where the engine
core is in the caller's process (benchmarks and GPU tests).

``with gdn_form(name):`` sets the step rules of ``FORMS[name]``
(``packed_questions.STATE_REREAD_TOKENS_MAX``,
``split_recurrence.SPLIT_SEQUENCES_MAX``; None keeps a rule as shipped) and
restores them after.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from vllm_d3.model_executor.layers.mamba.gdn import packed_questions, split_recurrence

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
    shipped = (
        packed_questions.STATE_REREAD_TOKENS_MAX,
        split_recurrence.SPLIT_SEQUENCES_MAX,
    )
    if reread is not None:
        packed_questions.STATE_REREAD_TOKENS_MAX = reread
    if sequences is not None:
        split_recurrence.SPLIT_SEQUENCES_MAX = sequences
    try:
        yield
    finally:
        (
            packed_questions.STATE_REREAD_TOKENS_MAX,
            split_recurrence.SPLIT_SEQUENCES_MAX,
        ) = shipped
