"""The one pass on FlashInfer's prefill (two launches in one core call)
against a float32 gated delta rule.

Each question block must get the outputs of its own prompt ``state || q`` run
from a zero state, and each plain row those of itself; the same tokens with
every packed row read as one sequence (no restart) must not. The oracle is a
token-by-token recurrence in float32 (``testing.gated_delta_rule``), sharing no
code with FlashInfer or vLLM. On a GPU the launches run FlashInfer's kernel
through vLLM's wrapper; on the CPU, where FlashInfer does not run, the
wrapper's contract is met by that recurrence per sequence, which checks what
the plugin adds: each launch's tokens, boundaries and initial states.
"""

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_gdn

from vllm_d3.model_executor.layers.mamba.gdn import flashinfer_launches
from vllm_d3.model_executor.models.d3_contract import StateBlock
from vllm_d3.testing.gated_delta_rule import reference_rule, varlen_rule
from vllm_d3.testing.own_process import TOLERANCE, relative_error
from vllm_d3.v1.attention.backends.d3_packed_gdn import PackedRow, split_recurrence

#: The tiny checkpoint's Gated DeltaNet heads: 2 key heads, 4 value heads of 128.
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2, 4, 128
#: The convolution window (the split plan seeds each question's with it).
WINDOW = 3

#: Rows of a step: (prompt length, state tokens, question ends or None).
MIXED = [(100, 100, None), (300, 150, (220, 300)), (460, 300, (340, 380, 420, 460))]
ONE_ROW = [(410, 200, (270, 340, 410))]


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def device(request, monkeypatch) -> torch.device:
    """FlashInfer's kernel on a GPU; on the CPU the float32 recurrence in
    place of vLLM's FlashInfer wrapper."""
    if request.param == "cpu":
        monkeypatch.setattr(vllm_gdn, "fi_chunk_gated_delta_rule", varlen_rule)
    return torch.device(request.param)


def draw(num_tokens: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    q, k = (
        torch.nn.functional.normalize(randn(num_tokens, KEY_HEADS, HEAD_DIM), dim=-1)
        for _ in range(2)
    )
    v = randn(num_tokens, VALUE_HEADS, HEAD_DIM)
    g = -0.1 * rand(num_tokens, VALUE_HEADS)
    beta = torch.sigmoid(randn(num_tokens, VALUE_HEADS))
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta


def plan(rows, device: torch.device):
    lens = np.asarray([n for n, _, _ in rows])
    starts = np.concatenate([[0], np.cumsum(lens)])
    packed = [
        PackedRow(row, int(starts[row]), StateBlock(s, n, ends))
        for row, (n, s, ends) in enumerate(rows)
        if ends is not None
    ]
    split = split_recurrence(starts, lens, packed, WINDOW, device)
    assert split is not None
    return starts, split


def expected_outputs(rows, starts, inputs) -> torch.Tensor:
    """Each plain row's outputs over itself, each question block's over its
    own prompt ``state || q``, in batch order."""
    device = inputs[0].device
    out = torch.empty(int(starts[-1]), VALUE_HEADS, HEAD_DIM, device=device)
    for row, (n, s, ends) in enumerate(rows):
        start = int(starts[row])
        blocks = [(0, n)]
        if ends is not None:
            blocks = [(0, s), *zip((s, *ends[:-1]), ends, strict=True)]
        for i, (b_start, b_end) in enumerate(blocks):
            # A question block's own prompt starts with its state.
            state = [] if i == 0 else list(range(start, start + s))
            own = state + list(range(start + b_start, start + b_end))
            index = torch.tensor(own, device=device)
            result, _ = reference_rule(*(x[index] for x in inputs))
            out[start + b_start : start + b_end] = result[-(b_end - b_start) :]
    return out


def zero_states(num_sequences: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(num_sequences, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device=device)


@pytest.mark.parametrize("rows", [MIXED, ONE_ROW], ids=["mixed", "one row"])
def test_two_launches_answer_every_question_as_its_own_prompt(device, rows):
    starts, split = plan(rows, device)
    inputs = draw(int(starts[-1]), device)
    out, _ = flashinfer_launches.two_launch_rule(
        split,
        *(x[None] for x in inputs),
        initial_state=zero_states(split.metadata.num_reqs, device),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    expected = expected_outputs(rows, starts, inputs)
    assert relative_error(out[0].float(), expected) < TOLERANCE


def test_packed_rows_read_as_one_sequence_are_clearly_wrong(device):
    starts, _ = plan(MIXED, device)
    inputs = draw(int(starts[-1]), device)
    out, _ = vllm_gdn.fi_chunk_gated_delta_rule(
        *(x[None] for x in inputs),
        initial_state=zero_states(len(MIXED), device),
        output_final_state=True,
        cu_seqlens=torch.from_numpy(starts).to(device),
        use_qk_l2norm_in_kernel=False,
    )
    expected = expected_outputs(MIXED, starts, inputs)
    assert relative_error(out[0].float(), expected) > 5 * TOLERANCE
