"""The reference runtime's side of the D3 benchmark.

The reference's ``state_once`` path reads a request's state block once and
answers every question from a copy of its caches: it stands in for the
checkpoint runtime the mission compares vLLM against.

Contract:
- ``RandomInitRuntime(checkpoint, device=..., dtype=..., seed=...)`` is a
  ``ReferenceRuntime`` for a package without backbone weights: the backbone is
  built from the package's ``config.json`` with transformers' random
  initialisation directly on ``device`` (nothing is read from disk but the
  config); the readout, tokenizer and processor come from the package as usual.
  ``device="meta"`` allocates nothing and can only ``render``.
- ``open_runtime(...)`` loads the package's weights when it has them, else
  builds a ``RandomInitRuntime``. Both run attention with ``KERNEL`` (torch's
  fused SDPA kernels), not the reference's exact default, which is for
  checking answers.
- ``token_accounting(rendered)``: the tokens each side computes for one
  request and how many times it reads the state. vLLM (``state || q1 || ... ||
  qQ`` in one engine request) and the reference's ``state_once`` read the state
  once: ``s + sum(n_i - s)``. vLLM per question runs one prompt per question:
  ``sum(n_i)``, the state read Q times. Each vLLM count is what that server's
  ``usage.input_tokens`` reports.
- ``run_reference(...)`` times start-up (runtime built to first answer) and
  every latency row with ``answer(request, path="state_once")``, synchronising
  CUDA around each call, and records the peak of ``torch.cuda`` allocations.
  A row that raises (out of memory, say) is recorded as failed and the next
  row runs.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from vllm_d3.reference import ReferenceRuntime, RenderedQuestion
from vllm_d3.reference import runtime as reference_runtime

from .rows import STATE_ONCE_SIDES, Row
from .timing import Budget, RowGate, log, measure
from .validation import GPU_ONLY_KERNEL_PACKAGES

GIB = 2**30
#: The reference's attention kernel when it is timed: torch's fused SDPA kernels.
KERNEL = "sdpa"


class _RandomBackbone:
    """Stands in for ``Qwen3_5Model`` while ``ReferenceRuntime`` loads it."""

    def __init__(self, device: str):
        self.device = device

    def from_pretrained(
        self,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype,
        attn_implementation: str,
        output_loading_info: bool,
    ) -> tuple[Qwen3_5Model, dict[str, list[str]]]:
        config = Qwen3_5Config.from_pretrained(path)
        with torch.device(self.device):
            model = Qwen3_5Model._from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        return model, {"missing_keys": []}


class RandomInitRuntime(ReferenceRuntime):
    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        backbone = _RandomBackbone(device)
        with mock.patch.object(reference_runtime, "Qwen3_5Model", backbone):
            super().__init__(checkpoint, device=device, dtype=dtype, kernel=KERNEL)


def has_weights(checkpoint: str | os.PathLike[str]) -> bool:
    path = Path(checkpoint)
    return any(
        (path / name).exists()
        for name in ("model.safetensors", "model.safetensors.index.json")
    )


def open_runtime(
    checkpoint: str | os.PathLike[str],
    *,
    device: str,
    dtype: torch.dtype,
    seed: int,
) -> ReferenceRuntime:
    if has_weights(checkpoint):
        return ReferenceRuntime(checkpoint, device=device, dtype=dtype, kernel=KERNEL)
    return RandomInitRuntime(checkpoint, device=device, dtype=dtype, seed=seed)


def token_accounting(rendered: list[RenderedQuestion]) -> dict[str, Any]:
    s = rendered[0].state_tokens
    lengths = [len(r.token_ids) for r in rendered]
    once = s + sum(n - s for n in lengths)
    # vLLM splits a pack longer than its max_model_len; every benchmark row
    # fits one pack on the server that runs it, so the state is read once.
    accounting: dict[str, Any] = {"state_tokens": s, "prompt_lengths": lengths}
    for side in STATE_ONCE_SIDES:
        accounting[f"tokens_{side}"] = once
        accounting[f"state_reads_{side}"] = 1
    accounting["tokens_vllm_per_question"] = sum(lengths)
    accounting["state_reads_vllm_per_question"] = len(lengths)
    return accounting


def gdn_kernels() -> dict[str, bool]:
    """Whether transformers finds the optimised Gated DeltaNet kernels; without
    them it runs its (much slower) PyTorch reference implementation."""
    return {
        name: importlib.util.find_spec(name) is not None
        for name in GPU_ONLY_KERNEL_PACKAGES
    }


def _failure(error: BaseException) -> dict[str, Any]:
    return {"status": f"failed: {type(error).__name__}: {str(error)[:300]}"}


def _synchronised_answer(
    runtime: ReferenceRuntime, cuda: bool
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``answer(request, path="state_once")``, CUDA synchronised on both sides."""

    def answer(request: dict[str, Any]) -> dict[str, Any]:
        if cuda:
            torch.cuda.synchronize()
        out = runtime.answer(request, path="state_once")
        if cuda:
            torch.cuda.synchronize()
        return out

    return answer


def run_reference(
    checkpoint: str | os.PathLike[str],
    rows: list[Row],
    requests: dict[str, list[dict[str, Any]]],
    startup_request: dict[str, Any],
    *,
    device: str,
    dtype: torch.dtype,
    warmup: int,
    budget: Budget,
    seed: int,
) -> dict[str, Any]:
    """Start-up and latency of every row; ``requests[row.id]`` holds the
    warm-up requests first, then the timed ones."""
    cuda = device.startswith("cuda")
    started = time.perf_counter()
    try:
        runtime = open_runtime(checkpoint, device=device, dtype=dtype, seed=seed)
        built = time.perf_counter() - started
        answer = _synchronised_answer(runtime, cuda)
        answer(startup_request)
    except Exception as error:  # reported in the results, like a failed row
        failure = _failure(error)["status"]
        log(f"reference: start-up {failure}")
        return {
            "status": failure,
            "rows": {row.id: {"status": failure} for row in rows},
            "gdn_kernels": gdn_kernels(),
        }
    startup = {
        "status": "ok",
        "runtime_built_s": built,
        "first_answer_s": time.perf_counter() - started,
        "weights": "loaded" if has_weights(checkpoint) else "random init",
    }
    log(f"reference up in {startup['first_answer_s']:.1f}s ({startup['weights']})")
    peaks = [torch.cuda.max_memory_allocated() / GIB] if cuda else []
    results: dict[str, Any] = {}
    gate = RowGate(budget, warmup, "reference")
    try:
        for row in rows:
            if refusal := gate.refusal(row):
                results[row.id] = {"status": refusal}
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                timed = measure(answer, requests[row.id], warmup=warmup, budget=budget)
            except Exception as error:  # one row failing must not end the run
                results[row.id] = _failure(error)
                log(f"reference: {row.id} {results[row.id]['status']}")
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                continue
            result = timed.summary()
            if cuda:
                result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
                peaks.append(result["peak_memory_gib"])
            results[row.id] = result
            gate.measured(row, result["p50_s"])
            log(f"reference: {row.id} p50 {result['p50_s'] * 1e3:.1f} ms")
    finally:
        del runtime, answer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {
        "startup": startup,
        "rows": results,
        "peak_memory_gib": max(peaks) if peaks else None,
        "gdn_kernels": gdn_kernels(),
    }
