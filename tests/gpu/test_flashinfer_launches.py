"""GPU: the one pass on FlashInfer's prefill (two launches in one core call)
against a float32 gated delta rule written here.

Each question block must get the outputs of its own prompt ``state || q`` run
from a zero state, and each plain row those of itself; the same tokens with
every packed row read as one sequence (no restart) must not. The oracle is a
token-by-token recurrence in float32, sharing no code with FlashInfer or vLLM.
"""

import numpy as np
import pytest
import torch

from vllm_d3.model_executor.models.d3_contract import StateBlock
from vllm_d3.testing.own_process import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

#: The tiny checkpoint's Gated DeltaNet heads: 2 key heads, 4 value heads of 128.
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2, 4, 128
#: The convolution window (the split plan seeds each question's with it).
WINDOW = 3

#: Rows of a step: (prompt length, state tokens, question ends or None).
MIXED = [(100, 100, None), (300, 150, (220, 300)), (460, 300, (340, 380, 420, 460))]
ONE_ROW = [(410, 200, (270, 340, 410))]


def reference_rule(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule over one sequence from a zero state, token by token
    in float32; q, k (tokens, key heads, dim), v (tokens, value heads, dim),
    g (log decay) and beta (tokens, value heads)."""
    group = VALUE_HEADS // KEY_HEADS
    q, k = (x.float().repeat_interleave(group, dim=1) for x in (q, k))
    v, g, beta = v.float(), g.float(), beta.float()
    state = torch.zeros(VALUE_HEADS, HEAD_DIM, HEAD_DIM, device=q.device)  # [H, V, K]
    out = []
    for t in range(len(q)):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        out.append(torch.einsum("hvk,hk->hv", state, q[t]) * HEAD_DIM**-0.5)
    return torch.stack(out)


def draw(num_tokens: int, generator: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q, k = (
        torch.nn.functional.normalize(randn(num_tokens, KEY_HEADS, HEAD_DIM), dim=-1)
        for _ in range(2)
    )
    v = randn(num_tokens, VALUE_HEADS, HEAD_DIM)
    g = -0.1 * torch.rand(num_tokens, VALUE_HEADS, generator=generator, device="cuda")
    beta = torch.sigmoid(randn(num_tokens, VALUE_HEADS))
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta


def plan(rows):
    from vllm_d3.v1.attention.backends.d3_packed_gdn import (
        PackedRow,
        split_recurrence,
    )

    lens = np.asarray([n for n, _, _ in rows])
    starts = np.concatenate([[0], np.cumsum(lens)])
    packed = [
        PackedRow(row, int(starts[row]), StateBlock(s, n, ends))
        for row, (n, s, ends) in enumerate(rows)
        if ends is not None
    ]
    split = split_recurrence(starts, lens, packed, WINDOW, torch.device("cuda"))
    assert split is not None
    return starts, split


def expected_outputs(rows, starts, inputs) -> torch.Tensor:
    """Each plain row's outputs over itself, each question block's over its
    own prompt ``state || q``, in batch order."""
    out = torch.empty(int(starts[-1]), VALUE_HEADS, HEAD_DIM, device="cuda")
    for row, (n, s, ends) in enumerate(rows):
        start = int(starts[row])
        blocks = [(0, n)]
        if ends is not None:
            blocks = [(0, s), *zip((s, *ends[:-1]), ends, strict=True)]
        for i, (b_start, b_end) in enumerate(blocks):
            # A question block's own prompt starts with its state.
            state = [] if i == 0 else list(range(start, start + s))
            own = state + list(range(start + b_start, start + b_end))
            index = torch.tensor(own, device="cuda")
            result = reference_rule(*(x[index] for x in inputs))
            out[start + b_start : start + b_end] = result[-(b_end - b_start) :]
    return out


@pytest.mark.parametrize("rows", [MIXED, ONE_ROW], ids=["mixed", "one row"])
def test_two_launches_answer_every_question_as_its_own_prompt(rows):
    from vllm_d3.model_executor.layers.mamba.gdn.flashinfer_launches import (
        two_launch_rule,
    )

    starts, split = plan(rows)
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = draw(int(starts[-1]), generator)
    num_sequences = split.metadata.num_reqs
    zeros = torch.zeros(num_sequences, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device="cuda")
    out, _ = two_launch_rule(
        split,
        *(x[None] for x in inputs),
        initial_state=zeros,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    expected = expected_outputs(rows, starts, inputs)
    assert relative_error(out[0].float(), expected) < TOLERANCE


def test_packed_rows_read_as_one_sequence_are_clearly_wrong():
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        fi_chunk_gated_delta_rule,
    )

    starts, _ = plan(MIXED)
    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = draw(int(starts[-1]), generator)
    zeros = torch.zeros(len(MIXED), VALUE_HEADS, HEAD_DIM, HEAD_DIM, device="cuda")
    out, _ = fi_chunk_gated_delta_rule(
        *(x[None] for x in inputs),
        initial_state=zeros,
        output_final_state=True,
        cu_seqlens=torch.from_numpy(starts).cuda(),
        use_qk_l2norm_in_kernel=False,
    )
    expected = expected_outputs(MIXED, starts, inputs)
    assert relative_error(out[0].float(), expected) > 5 * TOLERANCE
