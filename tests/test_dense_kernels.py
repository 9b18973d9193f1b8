"""The dense pieces on this package's Triton kernel, on the CPU.

A process of its own runs Triton's interpreter (chosen before the kernel is
decorated; ``vllm_d3.testing.gdn_kernels.ENVIRONMENT``) and puts random queries,
keys and values of a step through ``run_dense_pieces`` with the ``triton``
kernel: both passes and the log-sum-exp merge, as the served layer runs them.
The oracle here is a float32 attention with the mask written from the
definition. As a control, the same step read as one question per row (every
query after the state sees every key) is far from it.
"""

import os
import subprocess
import sys

import pytest
import torch

from vllm_d3.model_executor.models.d3_contract import StateBlock
from vllm_d3.testing.gdn_kernels import ENVIRONMENT

# The process of its own imports the package, not a patched tree.
pytestmark = pytest.mark.plugin

RUN_STEP = """
import sys, torch
from vllm_d3.v1.attention.backends.d3_dense_kernels import dense_kernel
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesMetadata, dense_pieces, run_dense_pieces, step_metadata)
rows, query, key, value = torch.load(sys.argv[1], weights_only=False)
common = step_metadata(rows, torch.device("cpu"))
metadata = D3DensePiecesMetadata.of(
    dense_pieces(common), common.num_actual_tokens, torch.device("cpu"))
output = torch.empty_like(query)
run_dense_pieces(dense_kernel("triton"), query, key, value, metadata,
                 query.shape[-1] ** -0.5, output)
torch.save(output, sys.argv[2])
"""
#: (state tokens, question block ends) per row: packed rows, a prompt that is
#: all state, one question, and blocks that end inside a 16-key tile.
ROWS = ((20, (29, 30, 61)), (7, (7,)), (33, (50,)), (5, (21, 40)), (9, (10,)))
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 32


def reference(rows, query, key, value, packed: bool) -> torch.Tensor:
    """float32 attention; ``packed``: a question block sees the state and
    itself, else every key of its row."""
    outputs, first = [], 0
    for s, ends in rows:
        n = ends[-1]
        visible = torch.zeros(n, n, dtype=torch.bool)
        visible[:, :s] = True
        blocks = zip((s, *ends[:-1]), ends, strict=True) if packed else [(s, n)]
        for a, b in blocks:
            visible[a:b, a : b if packed else n] = True
        group = HEADS // KV_HEADS
        q = query[first : first + n].float()
        k = key[first : first + n].float().repeat_interleave(group, 1)
        v = value[first : first + n].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_SIZE**-0.5
        scores.masked_fill_(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        first += n
    return torch.cat(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dense_pieces_match_the_reference(tmp_path, dtype):
    generator = torch.Generator().manual_seed(0)
    tokens = sum(ends[-1] for _, ends in ROWS)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, HEAD_SIZE, generator=generator).to(dtype)

    query, key, value = draw(HEADS), draw(KV_HEADS), draw(KV_HEADS)
    blocks = [StateBlock(s, ends[-1], ends if ends[-1] > s else ()) for s, ends in ROWS]
    torch.save((blocks, query, key, value), tmp_path / "step.pt")
    subprocess.run(
        [sys.executable, "-c", RUN_STEP, tmp_path / "step.pt", tmp_path / "out.pt"],
        check=True,
        env={**os.environ, **ENVIRONMENT},
    )
    output = torch.load(tmp_path / "out.pt").float()
    expected = reference(ROWS, query, key, value, packed=True)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-3
    assert (output - expected).abs().max() < tolerance
    wrong = reference(ROWS, query, key, value, packed=False)
    assert (wrong - expected).abs().max() > 100 * tolerance
