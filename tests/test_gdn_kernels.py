"""Packed questions through vLLM's real Gated DeltaNet layer and kernels, on the CPU.

One process of its own (``vllm_d3.testing.gdn_kernels``) runs a layer of the tiny
checkpoint's model through 0.33.0's ``_forward_core``, whose Triton kernels run
in Triton's interpreter, over each case below. The oracle is 0.33.0's own path
with no packed row: each question in its own prompt ``state || q``, as the
per-question server sends it.
"""

import os
import subprocess
import sys

import pytest
import torch

from vllm_d3.testing.gdn_kernels import CACHE_SLOTS, ENVIRONMENT
from vllm_d3.testing.model_runner import STEP
from vllm_d3.v1.attention.backends.d3_packed_gdn import (
    SPLIT_SEQUENCES_MAX,
    STATE_REREAD_TOKENS_MAX,
)

# The plugin's wrapper of the layer is what runs; in-tree the series edits the
# method itself, and the process of its own does not load the tree.
pytestmark = pytest.mark.plugin


#: A plain row and a packed one whose blocks span several of FLA's 64-token
#: chunks (the state three, each question two), so that the recurrence across
#: chunks carries a state within every block.
LONG = [
    ("a", 70, {"d3_state_tokens": 70}, 3),
    ("p", 300, {"d3_state_tokens": 150, "d3_question_ends": [220, 300]}, 5),
]
#: Where each row of ``STEP``'s tokens start in the step.
STEP_STARTS = [sum(n for _, n, _, _ in STEP[:row]) for row in range(len(STEP))]
#: Align mode's prefill checkpoints in ``STEP`` (row: offset into its query,
#: slot): inside a's prompt, inside p's state, and among r's questions.
CHECKPOINTS = {0: (7, 10), 1: (3, 11), 2: (8, 12)}
#: Those the plugin writes: r's is past its state, where no hit reads it.
WRITTEN = {row: CHECKPOINTS[row] for row in (0, 1)}
#: STEP in align mode on 7-token blocks, each row with its Gated DeltaNet block
#: table. vLLM resolves each row's slot as the block of its length (STEP's own
#: slots) and places each row's checkpoint at its last whole block before its
#: end: a's at 7 (slot 10, as in CHECKPOINTS), p's at 14 and r's at 7, both
#: among their questions (slots 11 and 12: not written).
ALIGN_BLOCK = 7
#: A prefix-cache hit on p's first 3 tokens (inside its 5-token state): the
#: step's tokens, by their index in STEP.
HIT = 3
HIT_TOKENS = [t for t in range(STEP_STARTS[-1] + STEP[-1][1]) if not 10 <= t < 10 + HIT]
ALIGN_STEP = [
    (*row[:3], table)
    for row, table in zip(STEP, [[10, 3, 0], [13, 11, 5], [12, 7, 0]], strict=True)
]
#: A packed request whose first question block is one token.
ONE_TOKEN_FIRST = [("q", 12, {"d3_state_tokens": 5, "d3_question_ends": [6, 12]}, 3)]


def own_prompts(step, first_slot: int):
    """The step with each packed request's questions in their own prompts,
    ``state || q``, as rows of a step with no packed row; and, per row, the
    packed step's token indices of its tokens."""
    rows, tokens, start = [], [], 0
    for req_id, n, extra, _ in step:
        s = extra["d3_state_tokens"]
        ends = extra.get("d3_question_ends", [n])
        for i, (q_start, q_end) in enumerate(zip([s, *ends[:-1]], ends, strict=True)):
            own = [*range(start, start + s), *range(start + q_start, start + q_end)]
            slot = first_slot + len(rows)
            rows.append((f"{req_id}{i}", len(own), {"d3_state_tokens": s}, slot))
            tokens.append(own)
        start += n
    return rows, tokens


def draw_inputs(num_tokens: int, generator: torch.Generator):
    # The tiny checkpoint's layer: 2 key and 4 value heads of 128, so a
    # convolution over 2 x 256 + 512 channels.
    mixed_qkv = torch.randn(num_tokens, 1024, generator=generator)
    b = torch.randn(num_tokens, 4, generator=generator)
    a = torch.randn(num_tokens, 4, generator=generator)
    return tuple(x.half() for x in (mixed_qkv, b, a))


@pytest.fixture(scope="module")
def runs(make_checkpoint, tmp_path_factory):
    """Every case in one process: the packed step three ways, one causal scan
    over it (the negative control), each row's own prompts, and what the step
    reads of each row before its questions."""
    checkpoint = make_checkpoint(weights=False)
    generator = torch.Generator().manual_seed(0)
    inputs = draw_inputs(sum(n for _, n, _, _ in STEP), generator)
    # p alone: its tokens in the step are 10-29.
    alone = [STEP[1]]
    alone_inputs = tuple(x[10:30] for x in inputs)
    rows, tokens = own_prompts(STEP, first_slot=8)
    own = torch.tensor([t for row in tokens for t in row])
    # What the step reads of each row before its questions (a plain row's whole
    # prompt, a packed row's state) as prompts of their own, in the rows' slots.
    read_alone, read, start = [], [], 0
    for req_id, n, extra, slot in STEP:
        length = n if "d3_question_ends" not in extra else extra["d3_state_tokens"]
        read_alone.append((req_id, length, {"d3_state_tokens": length}, slot))
        read.extend(range(start, start + length))
        start += n
    read_tokens = torch.tensor(read)
    read_inputs = tuple(x[read_tokens] for x in inputs)
    # A packed row whose first question is one token: vLLM's GDN builder takes
    # such a block, with a state before it, for a decode.
    short_inputs = tuple(x[:12] for x in inputs)
    short_rows, short_tokens = own_prompts(ONE_TOKEN_FIRST, first_slot=8)
    short_own = torch.tensor([t for row in short_tokens for t in row])
    long_inputs = draw_inputs(sum(n for _, n, _, _ in LONG), generator)
    long_rows, long_tokens = own_prompts(LONG, first_slot=8)
    long_own = torch.tensor([t for row in long_tokens for t in row])
    # Each row's tokens up to its checkpoint as a prompt of its own, on the
    # checkpoint's slot.
    to_checkpoints = [
        (f"{STEP[row][0]}-{offset}", offset, {"d3_state_tokens": offset}, slot)
        for row, (offset, slot) in sorted(WRITTEN.items())
    ]
    to_checkpoint_tokens = torch.tensor(
        [
            t
            for row, (offset, _) in sorted(WRITTEN.items())
            for t in range(STEP_STARTS[row], STEP_STARTS[row] + offset)
        ]
    )
    # STEP after a hit on p's first 3 tokens: the step computes the rest.
    hit_inputs = tuple(x[HIT_TOKENS] for x in inputs)
    after_hit = (
        STEP,
        hit_inputs,
        True,
        64,
        STATE_REREAD_TOKENS_MAX,
        SPLIT_SEQUENCES_MAX,
    )
    # (step, inputs, the plugin's core, questions per scan, states re-read,
    # sequences of a split recurrence)
    cases = {
        # First, as vLLM's kernel warm-up: 0.33.0's method on fresh prompts.
        "warm-up": (read_alone, read_inputs, False, 64, 0, 0),
        # The same on packed state caches (the control's layout).
        "warm-up-packed-cache": (read_alone, read_inputs, False, 64, 0, 0),
        "gathered": (STEP, inputs, True, 64, 0, 0),
        "views": (alone, alone_inputs, True, 64, 0, 0),
        "two-per-scan": (STEP, inputs, True, 2, 0, 0),
        "split": (STEP, inputs, True, 64, 0, SPLIT_SEQUENCES_MAX),
        "split-views": (alone, alone_inputs, True, 64, 0, SPLIT_SEQUENCES_MAX),
        "states-re-read": (STEP, inputs, True, 64, STATE_REREAD_TOKENS_MAX, 0),
        "one-scan": (STEP, inputs, False, 64, 0, 0),
        "own-prompts": (rows, tuple(x[own] for x in inputs), True, 64, 0, 0),
        "read-alone": (read_alone, read_inputs, True, 64, 0, 0),
        "one-token-question": (
            ONE_TOKEN_FIRST,
            short_inputs,
            True,
            64,
            0,
            SPLIT_SEQUENCES_MAX,
        ),
        "long-split": (LONG, long_inputs, True, 64, 0, SPLIT_SEQUENCES_MAX),
        "long-two-phases": (LONG, long_inputs, True, 64, 0, 0),
        "long-own-prompts": (
            long_rows,
            tuple(x[long_own] for x in long_inputs),
            True,
            64,
            0,
            0,
        ),
        "one-token-own-prompts": (
            short_rows,
            tuple(x[short_own] for x in short_inputs),
            True,
            64,
            0,
            0,
        ),
        "checkpoints": (
            STEP,
            inputs,
            True,
            64,
            STATE_REREAD_TOKENS_MAX,
            SPLIT_SEQUENCES_MAX,
        ),
        "checkpoints-unpacked": (
            read_alone,
            read_inputs,
            True,
            64,
            0,
            SPLIT_SEQUENCES_MAX,
        ),
        "checkpoints-by-vllm": (STEP, inputs, False, 64, 0, 0),
        # p's first 3 tokens as a prompt of their own, on p's slot: the state
        # a prefix-cache hit inside p's state starts from.
        "p-prefix": (
            [("p3", 3, {"d3_state_tokens": 3}, STEP[1][3])],
            tuple(x[10:13] for x in inputs),
            False,
            64,
            0,
            0,
        ),
        # Where the one pass and the one scan were allowed.
        "hit": after_hit,
        "hit-on-other-states": after_hit,
        "align-mode": (
            ALIGN_STEP,
            inputs,
            True,
            64,
            STATE_REREAD_TOKENS_MAX,
            SPLIT_SEQUENCES_MAX,
        ),
        "to-checkpoints": (
            to_checkpoints,
            tuple(x[to_checkpoint_tokens] for x in inputs),
            False,
            64,
            0,
            0,
        ),
    }
    # Further options of some cases (gdn_kernels.Case).
    hit = {"computed": {"p": HIT}}
    options = {
        "warm-up-packed-cache": {"packed_cache": True},
        "align-mode": {"align_block": ALIGN_BLOCK},
        "hit": {**hit, "cache_from": list(cases).index("p-prefix")},
        "hit-on-other-states": hit,
    }
    folder = tmp_path_factory.mktemp("gdn-kernels")
    torch.save(
        [
            {
                "step": step,
                "inputs": case_inputs,
                "restart": restart,
                "questions_per_scan": per_scan,
                "state_reread_tokens_max": reread,
                "split_sequences_max": split,
                "checkpoints": CHECKPOINTS if name.startswith("checkpoints") else {},
                **options.get(name, {}),
            }
            for name, (step, case_inputs, restart, per_scan, reread, split) in (
                cases.items()
            )
        ],
        folder / "cases.pt",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_d3.testing.gdn_kernels",
            checkpoint,
            str(folder / "cases.pt"),
            str(folder / "out.pt"),
        ],
        env={**os.environ, **ENVIRONMENT},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = dict(zip(cases, torch.load(folder / "out.pt"), strict=True))
    return results, {
        "own-prompts": tokens,
        "one-token-own-prompts": short_tokens,
        "long-own-prompts": long_tokens,
    }


def own_outputs(runs, case: str = "own-prompts"):
    """Each packed-step token's output in its own prompt (``case``), in the
    packed step's order (a state token once, from its request's first prompt)."""
    results, tokens = runs
    out = results[case]["out"]
    by_token: dict[int, torch.Tensor] = {}
    start = 0
    for row in tokens[case]:
        for offset, token in enumerate(row):
            by_token.setdefault(token, out[start + offset])
        start += len(row)
    return torch.stack([by_token[t] for t in sorted(by_token)])


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize(
    ("case", "form"),
    [
        ("gathered", "two phases"),
        ("two-per-scan", "two phases"),
        ("views", "two phases"),
        ("states-re-read", "one scan"),
        ("split", "one pass"),
        ("split-views", "one pass"),
    ],
)
def test_packed_questions_equal_their_own_prompts_on_vllms_kernels(runs, case, form):
    assert runs[0][case]["form"] == form
    expected = own_outputs(runs)
    if case.endswith("views"):
        expected = expected[10:30]
    out = runs[0][case]["out"]
    assert not out.isnan().any()
    # float16 rounding, in the interpreter as on a GPU.
    assert max_error(out, expected) < 2e-3


@pytest.mark.parametrize(
    ("case", "form"),
    [("long-split", "one pass"), ("long-two-phases", "two phases")],
)
def test_blocks_of_several_chunks_equal_their_own_prompts(runs, case, form):
    assert runs[0][case]["form"] == form
    out = runs[0][case]["out"]
    assert max_error(out, own_outputs(runs, "long-own-prompts")) < 2e-3


def test_the_one_pass_autotunes_no_kernel_the_warm_up_did_not(runs):
    # A configuration the one pass were the first to autotune would be tuned
    # during the first packed request a server gets. "split" is the run's
    # first case in one pass.
    results, _ = runs
    tuned = results["warm-up"]["tuned"]
    assert any("chunk_gated_delta_rule_fwd" in key for key in tuned)
    assert results["split"]["form"] == "one pass"
    assert results["split"]["tuned"] == []


@pytest.mark.parametrize(
    "case",
    [
        "gathered",
        "two-per-scan",
        "split",
        "states-re-read",
        "long-split",
        "checkpoints",
    ],
)
def test_a_packed_step_convolves_on_the_layouts_the_warm_up_did(runs, case):
    # On a GPU a layout of its own would compile the convolution's kernel during
    # the first packed step a server gets. Each of these runs scratch slots.
    results, _ = runs
    warm_up = results["warm-up"]["convolution_layouts"]
    assert results[case]["convolution_layouts"] <= warm_up
    # The control: the same warm-up on state slots packed one after the other
    # (what scratch slots were) convolves on a layout of its own.
    assert not results["warm-up-packed-cache"]["convolution_layouts"] <= warm_up


def test_a_one_token_first_question_equals_its_own_prompt(runs):
    # Two phases, the split recurrence allowed: the question block is one token
    # after the state, which the builder runs through 0.33.0's decode kernel.
    out = runs[0]["one-token-question"]["out"]
    assert runs[0]["one-token-question"]["form"] == "two phases"
    assert max_error(out, own_outputs(runs, "one-token-own-prompts")) < 2e-3


def test_one_causal_scan_over_the_packed_step_is_clearly_wrong(runs):
    expected = own_outputs(runs)
    out = runs[0]["one-scan"]["out"]
    # a's prompt and p's state and first question come before anything of p's
    # other questions: the same; p's second question runs on from its first.
    assert max_error(out[:19], expected[:19]) < 2e-3
    assert max_error(out[19:22], expected[19:22]) > 0.1


@pytest.mark.parametrize("case", ["gathered", "two-per-scan"])
def test_the_packed_step_writes_only_its_rows_state_slots(runs, case):
    result = runs[0][case]
    rows = [slot for *_, slot in STEP]
    others = [slot for slot in range(CACHE_SLOTS) if slot not in rows]
    read_alone = runs[0]["read-alone"]
    for cache in ("conv", "ssm"):
        before, after = result[f"{cache}_before"], result[f"{cache}_after"]
        assert torch.equal(after[others], before[others])
        # Each row's slot holds its state after a plain row's prompt, after a
        # packed row's state: its questions write nothing back.
        expected = read_alone[f"{cache}_after"]
        assert max_error(after[rows], expected[rows]) < 2e-3


@pytest.mark.parametrize("case", ["states-re-read", "split"])
def test_a_step_on_scratch_slots_writes_no_slot(runs, case):
    # Every sequence of the one scan, or of the split recurrence, runs on
    # scratch slots: the caches are as they were, the rows' slots too (nothing
    # reads a finished prompt's state).
    result = runs[0][case]
    for cache in ("conv", "ssm"):
        assert torch.equal(result[f"{cache}_after"], result[f"{cache}_before"])


@pytest.mark.parametrize(
    ("case", "form"),
    [("checkpoints", "two phases"), ("checkpoints-unpacked", "two phases")],
)
def test_checkpoints_inside_the_states_hold_their_prefixes_states(runs, case, form):
    # In a packed step (where the one pass and the one scan were allowed) and
    # in a step of plain rows, each checkpoint slot gets the state of the
    # row's tokens up to the checkpoint; the outputs and the rows' own slots
    # are those of the step without checkpoints.
    results, _ = runs
    result = results[case]
    assert result["form"] == form
    plain = "read-alone" if case.endswith("unpacked") else "gathered"
    assert max_error(result["out"], results[plain]["out"]) < 2e-3
    written = [slot for _, slot in WRITTEN.values()]
    rows = [slot for *_, slot in STEP]
    unread = [slot for slot in range(CACHE_SLOTS) if slot not in written + rows]
    for cache in ("conv", "ssm"):
        before, after = result[f"{cache}_before"], result[f"{cache}_after"]
        expected = results["to-checkpoints"][f"{cache}_after"]
        assert max_error(after[written], expected[written]) < 2e-3
        assert max_error(after[rows], results[plain][f"{cache}_after"][rows]) < 2e-3
        # r's checkpoint, among its questions, is not written.
        assert torch.equal(after[unread], before[unread])


def test_vllms_triton_prefill_leaves_the_checkpoint_slots_unwritten(runs):
    # The control: 0.33.0's core writes checkpoints only on FlashInfer's
    # prefill, so on the Triton prefill the slots keep what they held, which is
    # clearly not the prefixes' states.
    results, _ = runs
    result = results["checkpoints-by-vllm"]
    written = [slot for _, slot in WRITTEN.values()]
    for cache in ("conv", "ssm"):
        after = result[f"{cache}_after"][written]
        assert torch.equal(after, result[f"{cache}_before"][written])
        expected = results["to-checkpoints"][f"{cache}_after"][written]
        assert max_error(after, expected) > 0.1


def test_in_align_mode_vllms_checkpoint_and_the_rows_slots_are_written(runs):
    # vLLM places the checkpoints (the layers declare them) and resolves the
    # rows' slots; the two phases write a's checkpoint with the state of its
    # first 7 tokens and each row's resolved slot with the step's final state,
    # and leave the checkpoints among the questions and every other slot.
    results, _ = runs
    result = results["align-mode"]
    assert result["form"] == "two phases"
    assert max_error(result["out"], results["gathered"]["out"]) < 2e-3
    written, rows = [10], [slot for *_, slot in STEP]
    unread = [slot for slot in range(CACHE_SLOTS) if slot not in written + rows]
    for cache in ("conv", "ssm"):
        before, after = result[f"{cache}_before"], result[f"{cache}_after"]
        expected = results["to-checkpoints"][f"{cache}_after"]
        assert max_error(after[written], expected[written]) < 2e-3
        step = results["gathered"][f"{cache}_after"]
        assert max_error(after[rows], step[rows]) < 2e-3
        assert torch.equal(after[unread], before[unread])


def test_a_packed_row_after_a_hit_continues_from_the_cached_state(runs):
    # p found its first 3 tokens in the prefix cache, their state in its slot:
    # the step computes the rest of p (and a and r) in two phases, where the
    # one pass and the one scan were allowed, and gives those tokens and
    # every row's slot what the step of whole prompts gives.
    results, _ = runs
    result = results["hit"]
    assert result["form"] == "two phases"
    whole = results["gathered"]
    assert max_error(result["out"], whole["out"][HIT_TOKENS]) < 2e-3
    rows = [slot for *_, slot in STEP]
    for cache in ("conv", "ssm"):
        after = result[f"{cache}_after"][rows]
        assert max_error(after, whole[f"{cache}_after"][rows]) < 2e-3
    # The control: on another state in p's slot, p's tokens come out wrong.
    other = results["hit-on-other-states"]["out"]
    p_tokens = slice(10, 10 + 20 - HIT)
    assert max_error(other[p_tokens], whole["out"][HIT_TOKENS][p_tokens]) > 0.1
