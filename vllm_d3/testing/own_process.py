"""A GPU test's engine in a process of its own.

``logits_from_script(script, checkpoint, out, *args)`` runs ``script`` (a test
file run as ``script CHECKPOINT OUT ARGS...``) with vLLM's engine core in that
process, so
that the script can change the plugin's behaviour per call, and returns the
tensors it saved to ``out``; in the script, ``classify_tokens`` reads token
prompts with their ``extra_kwargs`` and ``flat_logits`` joins the answers;
``relative_error`` compares two of them, within ``TOLERANCE`` where they
read the same sequences. ``GDN_KERNELS`` are the Gated DeltaNet prefill
kernels a GPU test runs on: the default (vLLM's and the plugin's choice) and
Triton/FLA forced.
"""

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: Ordinary token ids of the tiny checkpoint's tokenizer (1,437 ids in all).
TOKEN_IDS = (300, 1200)
#: Of ``relative_error``, for the same sequences on float16 kernels.
TOLERANCE = 2e-2
#: ``--gdn-prefill-backend`` of each GPU test's engines ("auto": vLLM's and the
#: plugin's choice, FlashInfer's on Hopper for the tiny checkpoint).
GDN_KERNELS = ("auto", "triton")


def logits_from_script(script: str, checkpoint: str, out: Path, *args: str) -> dict:
    done = subprocess.run(
        # -P: the script's folder is not put first on the path, where a module
        # of it (this package's ``requests``) would shadow a library's.
        [sys.executable, "-P", script, checkpoint, str(out), *args],
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the largest expected value."""
    return ((out - expected).abs().max() / expected.abs().max()).item()


def classify_tokens(llm: Any, prompts: Sequence[tuple[list[int], dict]]) -> list:
    """``llm.classify`` of (token ids, ``extra_kwargs``) pairs, raw logits."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    return llm.classify(
        [TokensPrompt(prompt_token_ids=ids) for ids, _ in prompts],
        pooling_params=[
            PoolingParams(task="classify", use_activation=False, extra_kwargs=extra)
            for _, extra in prompts
        ],
        use_tqdm=False,
    )


def flat_logits(outputs: list) -> torch.Tensor:
    """Every question's logits of ``classify_tokens``' outputs, in order."""
    return torch.cat([torch.as_tensor(o.outputs.probs).flatten() for o in outputs])
