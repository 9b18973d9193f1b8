# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The start-up check of a dense-piece kernel
(upstream: ``v1/attention/backends/d3_kernel_check.py``, a new file).

Off the GPU family the kernels were validated on, the config hook has
``check_kernels`` run its candidates first, in a process of its own (``python
-m vllm_d3.v1.attention.backends.d3_kernel_check KERNEL...`` prints the first
that passes and why the others failed): ``check_dense_kernel`` runs a kernel
through the dense pieces on ``CHECK_BATCHES``, at d3-turbo's head shape,
against a float32 attention with the mask written out.
"""

import json
import subprocess
import sys
from collections.abc import Sequence

import torch

from vllm_d3.model_executor.models.d3_contract import StateBlock
from vllm_d3.v1.attention.backends.d3_dense_kernels import dense_kernel
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesMetadata,
    dense_pieces,
    run_dense_pieces,
    step_metadata,
)

#: How long a start-up check may take (Triton compiles its kernel in it).
CHECK_TIMEOUT_S = 300
#: The check's bound on |dense - float32 masked attention| (bf16 outputs).
CHECK_TOLERANCE = 2e-2

#: The start-up check's batches: a packed row, a prompt that is all state and
#: one question that spans several key tiles; then rows of one question token
#: each (the state pass's query bound would then be 1, ``Pass``).
CHECK_BATCHES = (
    (
        StateBlock(100, 230, (140, 153, 230)),
        StateBlock(37, 37, ()),
        StateBlock(200, 470, (470,)),
    ),
    (StateBlock(30, 31, (31,)), StateBlock(7, 8, (8,))),
)


def check_kernels(names: list[str]) -> tuple[str | None, list[str]]:
    """The first of ``names`` whose check passes on this machine's GPU, and why
    each one before it failed (module docstring); None if none passes."""
    command = [sys.executable, "-m", __name__, *names]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None, [f"the check took more than {CHECK_TIMEOUT_S} s"]
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, [f"the check process failed ({tail})"]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["passed"], result["failures"]


def _check_in_this_process(names: list[str]) -> tuple[str | None, list[str]]:
    failures: list[str] = []
    for name in names:
        try:
            error = check_dense_kernel(name)
        except Exception as e:  # any failure of an unverified kernel is a no
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
        if error is None:
            return name, failures
        failures.append(f"{name}: {error}")
    return None, failures


def check_dense_kernel(name: str, seed: int = 0) -> str | None:
    """Run kernel ``name`` through ``run_dense_pieces`` on ``CHECK_BATCHES`` at
    d3-turbo's head shape, on this process's GPU, against a float32 attention
    with the mask written out; what is wrong, or None."""
    for rows in CHECK_BATCHES:
        if (error := _check_batch(name, rows, seed)) is not None:
            return f"{error} ({len(rows)} rows, {rows})"
    return None


def _check_batch(name: str, rows: Sequence[StateBlock], seed: int) -> str | None:
    device = torch.device("cuda")
    heads, kv_heads, head_size = 24, 4, 256
    generator = torch.Generator(device).manual_seed(seed)
    common = step_metadata(rows, device)
    tokens = common.num_actual_tokens

    def draw(num_heads: int) -> torch.Tensor:
        shape = (tokens, num_heads, head_size)
        return torch.randn(shape, generator=generator, device=device).bfloat16()

    query, key, value = draw(heads), draw(kv_heads), draw(kv_heads)
    pieces = dense_pieces(common)
    assert pieces is not None
    output = torch.empty_like(query)
    scale = head_size**-0.5
    run_dense_pieces(
        dense_kernel(name),
        query,
        key,
        value,
        D3DensePiecesMetadata.of(pieces, tokens, device),
        scale,
        output,
    )
    # The mask from its definition: a state query sees the state, a question
    # query the state and its own block.
    visible = torch.zeros(tokens, tokens, dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        first = int(common.query_start_loc_cpu[index])
        visible[first : first + row.prompt_len, first : first + row.state_tokens] = True
        for a, b in row.question_blocks():
            visible[first + a : first + b, first + a : first + b] = True
    group = heads // kv_heads
    scores = torch.einsum(
        "qhd,khd->hqk", query.float(), key.float().repeat_interleave(group, 1)
    )
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    expected = torch.einsum(
        "hqk,khd->qhd", scores.softmax(-1), value.float().repeat_interleave(group, 1)
    )
    error = (output.float() - expected).abs().max().item()
    if not error <= CHECK_TOLERANCE:  # also catches NaN
        return f"max |error| {error:.3g} against the float32 reference"
    return None


if __name__ == "__main__":
    passed, failures = _check_in_this_process(sys.argv[1:])
    print(json.dumps({"passed": passed, "failures": failures}))
