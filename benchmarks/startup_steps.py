"""Where an engine's start-up goes, step by step, in process.

``python -m benchmarks.startup_steps --out FILE [--layers 64]
[--max-model-len N] [--enable-flashinfer-autotune] [--checkpoint DIR]
[--gdn-prefill-backend KERNEL]``

Contract:
- Serves ``packed_step``'s weight-less d3-turbo package (``--layers`` decoder
  layers) with ``vllm.LLM`` in this process, its engine core too
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``load_format="dummy"``, the Gated
  DeltaNet prefill kernel vLLM and the plugin choose unless
  ``--gdn-prefill-backend`` names one, ``--max-model-len`` or else the
  package's; with
  ``--enable-flashinfer-autotune`` vLLM runs its FlashInfer autotune whatever
  the plugin decides; ``--checkpoint`` serves that package instead (e.g.
  ``benchmarks.d3``'s, whose servers' compile caches then apply).
- Wraps vLLM 0.33.0's start-up steps (``STEPS``: the worker's model load, its
  memory profile and warm-up; the model runner's profile run, dummy steps,
  pooler and encoder profiles and graph captures; the kernel warm-up, FlashInfer
  autotune and JIT warm-up steps) and times each call from a synchronised GPU
  to a synchronised GPU, naming it by the steps it ran inside.
- Counts the calls FlashInfer's autotuner was asked to choose a kernel for
  during the run (``AutoTuner.choose_one``; ``None`` without FlashInfer).
- Writes ``FILE`` (JSON: the settings, the GDN prefill kernel that served,
  ``"steps"``: a list of ``{"step",
  "tokens", "s"}`` in the order they ended, ``"engine_s"``: ``vllm.LLM``'s
  construction, ``"flashinfer_choices"``) and prints each step. CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_d3.testing.gdn_forms import served_gdn_prefill

from .packed_step import write_package
from .timing import run_record

#: (module, attribute path) of each wrapped step.
STEPS = (
    ("vllm.v1.worker.gpu_worker", "Worker.load_model"),
    ("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory"),
    ("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model"),
    ("vllm.v1.worker.gpu_worker", "kernel_warmup"),
    ("vllm.v1.worker.gpu_worker", "warmup_kernels"),
    ("vllm.model_executor.warmup.kernel_warmup", "flashinfer_autotune"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.profile_run"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_run"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_pooler_run"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.capture_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.profile_cudagraph_memory"),
    ("vllm.v1.worker.gpu.mm.encoder_runner", "EncoderRunner.profile_encoder_cache"),
)


class StepClock:
    """Times wrapped calls on a synchronised GPU, nested names joined by ``/``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._open: list[str] = []

    @contextlib.contextmanager
    def step(self, name: str, tokens: int | None) -> Iterator[None]:
        import torch

        torch.cuda.synchronize()
        self._open.append(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            path = "/".join(self._open)
            self._open.pop()
            self.steps.append({"step": path, "tokens": tokens, "s": round(seconds, 3)})
            print(f"{path} ({tokens} tokens): {seconds:.2f} s", flush=True)

    def wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            tokens = kwargs.get("num_tokens", args[1] if len(args) > 1 else None)
            with self.step(name, tokens if isinstance(tokens, int) else None):
                return call(*args, **kwargs)

        return timed


def wrap_steps(clock: StepClock) -> None:
    """Replace each of ``STEPS`` by its timed wrapper where vLLM looks it up."""
    for module_name, path in STEPS:
        owner: Any = importlib.import_module(module_name)
        *parents, attribute = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, attribute, clock.wrap(attribute, getattr(owner, attribute)))


def count_flashinfer_choices() -> Callable[[], int | None]:
    """Count ``AutoTuner.choose_one`` calls from now on; ``None`` without
    FlashInfer."""
    try:
        from flashinfer.autotuner import AutoTuner
    except ImportError:
        return lambda: None
    calls = [0]
    choose_one = AutoTuner.choose_one

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return choose_one(self, *args, **kwargs)

    AutoTuner.choose_one = counted  # type: ignore[method-assign]
    return lambda: calls[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--gdn-prefill-backend",
        help="a Gated DeltaNet prefill kernel (default: vLLM's and the plugin's)",
    )
    parser.add_argument("--enable-flashinfer-autotune", action="store_true")
    parser.add_argument("--checkpoint", type=Path, default=None)
    args = parser.parse_args(argv)
    # Before vLLM starts an engine: its core, and so its worker, in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    clock = StepClock()
    wrap_steps(clock)
    choices = count_flashinfer_choices()
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        llm = LLM(
            model=str(args.checkpoint or write_package(Path(scratch), args.layers)),
            load_format="dummy",
            gdn_prefill_backend=args.gdn_prefill_backend,
            max_model_len=args.max_model_len,
            # None leaves it to the plugin and vLLM.
            enable_flashinfer_autotune=args.enable_flashinfer_autotune or None,
        )
        engine_s = time.perf_counter() - started
    result = {
        "run": run_record(),
        "checkpoint": str(args.checkpoint) if args.checkpoint else None,
        "layers": args.layers,
        "max_model_len": args.max_model_len,
        "enable_flashinfer_autotune": args.enable_flashinfer_autotune,
        "gdn_prefill_backend": served_gdn_prefill(llm),
        "engine_s": round(engine_s, 3),
        "flashinfer_choices": choices(),
        "steps": clock.steps,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"engine {engine_s:.1f} s; FlashInfer choices: {result['flashinfer_choices']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
