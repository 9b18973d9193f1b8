"""Start-up of ``vllm serve``: a d3-turbo-shaped package, prefix_bidir beside
its causal sibling, with cold and warm compile caches (GPU).

``python -m benchmarks.startup --out FILE --work DIR [--modes prefix_bidir,causal]
[--caches cold,warm] [--package-length] [--serve-arg=FLAG ...]``

Contract:
- For each of ``--modes`` a weight-less d3-turbo package of that attention mode
  (vision tower included) is written under WORK and served with
  ``--load-format dummy --max-model-len 131072`` (``--package-length``: no
  ``--max-model-len``, the package's declared length, as ``vllm serve
  <checkpoint>`` starts), the test servers' flags (``--gdn-prefill-backend
  triton``) and ``--serve-arg``; for a causal package the plugin's prefix_bidir
  hooks do not apply.
- Each mode's server keeps every compile cache (vLLM's torch.compile cache,
  Inductor's, Triton's, FlashInfer's) under ``WORK/home-<mode>`` (``HOME`` and
  the caches' variables point there, ``cache_environment``). ``cold`` empties
  it first; ``warm`` starts again on what the previous start left.
- ``first_answer_s``: from launching ``vllm serve`` to the answer of one
  4-question text request on ``/v1/systemone``; ``phases``: what the server's
  log says each step took (``startup_phases``).
- Before the first start, every file of the packages a server loads
  (``PRIMED_PACKAGES``) is read once, untimed, so that the first start is not
  the only one to find the OS's file cache empty (``prime_file_cache``).
- Writes ``FILE`` after every start: a list of ``{"mode", "cache",
  "first_answer_s", "phases"}``, in the order run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import time
from datetime import datetime
from pathlib import Path

from vllm_d3.testing.requests import request_sets, words_per_token
from vllm_d3.testing.server import Server, post
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

from .timing import log
from .validation import LONG_MAX_MODEL_LEN, VALIDATED_LENGTH
from .vllm_side import serve_flags

#: Steps whose length vLLM logs itself: name -> the line, its seconds captured.
LOGGED_DURATIONS = {
    "model loading": r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds",
    "torch.compile": r"torch\.compile took ([\d.]+) s in total",
    "profiling/warmup run": r"Initial profiling/warmup run took ([\d.]+) s",
    "CUDA graph capture": r"Graph capturing finished in ([\d.]+) secs",
    "engine init": r"init engine \(profile, create kv cache, warmup model\) took "
    r"([\d.]+) s",
}
#: The line FlashInfer logs when its autotune ends.
AUTOTUNE_END = r"Autotuning process ends"
#: Where the kernel warm-up's steps begin: FlashInfer's autotune ended, or vLLM
#: skipped it.
KERNEL_WARMUP = rf"{AUTOTUNE_END}|Skipping FlashInfer autotune"
#: Steps timed between two lines' time stamps: name -> (first line, last line);
#: ``None`` is the log's first time-stamped line.
LOGGED_SPANS = {
    "before the engine": (None, r"Initializing a V1 LLM engine"),
    "FlashInfer autotune": (r"Autotuning process starts", AUTOTUNE_END),
}
#: From the end (or the skip) of FlashInfer's autotune to the start of the last
#: graph capture (the serving one; its start is its end stamp less the seconds it
#: logs), where vLLM runs its kernel warm-up steps. Whole seconds: within about
#: one.
WARMUP_SPAN = "autotune end to serving capture"
CAPTURE = re.compile(r"Graph capturing finished in (\d+) secs")
#: vLLM's time stamp (no year), and the one FlashInfer's logger writes.
VLLM_STAMP = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d) \[")
FLASHINFER_STAMP = re.compile(r"^\d{4}-(\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
MODES = ("prefix_bidir", "causal")
#: The packages whose files a server reads as it starts: Python's and the GPU
#: libraries' (``nvidia``: CUDA's own, shipped as wheels).
PRIMED_PACKAGES = (
    "torch",
    "nvidia",
    "triton",
    "vllm",
    "flashinfer",
    "transformers",
    "vllm_d3",
)
CACHES = ("cold", "warm")


def _stamp(line: str) -> float | None:
    """A log line's time in seconds (of an arbitrary origin), if it has one."""
    if match := VLLM_STAMP.search(line):
        text, millis = match.group(1), 0
    elif match := FLASHINFER_STAMP.match(line):
        text, millis = match.group(1), int(match.group(2))
    else:
        return None
    when = datetime.strptime(f"2000-{text}", "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + millis / 1000


def startup_phases(log_text: str) -> dict[str, float]:
    """The seconds of each step of ``LOGGED_DURATIONS`` and ``LOGGED_SPANS``
    that the log shows, in that order (a span from its first start to its
    first end), then ``WARMUP_SPAN``."""
    phases = {}
    for name, pattern in LOGGED_DURATIONS.items():
        # A step logged twice ran twice (vLLM captures graphs once to measure
        # their memory, then for serving): the phase is their sum.
        if seconds := [float(s) for s in re.findall(pattern, log_text)]:
            phases[name] = round(sum(seconds), 6)
    lines = log_text.splitlines()
    stamped = [(t, line) for line in lines if (t := _stamp(line)) is not None]
    for name, (first, last) in LOGGED_SPANS.items():
        starts = [t for t, line in stamped if first is None or re.search(first, line)]
        ends = [t for t, line in stamped if re.search(last, line)]
        if starts and ends:
            phases[name] = round(ends[0] - starts[0], 3)
    autotuned = [t for t, line in stamped if re.search(KERNEL_WARMUP, line)]
    captures = [(t, int(m[1])) for t, line in stamped if (m := CAPTURE.search(line))]
    if autotuned and captures:
        end, capture_s = captures[-1]
        phases[WARMUP_SPAN] = round(end - capture_s - autotuned[0], 3)
    return phases


def prime_file_cache(packages: tuple[str, ...] = PRIMED_PACKAGES) -> int:
    """Read every file of ``packages`` (those installed) once; returns the
    bytes read."""
    read = 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in Path(root).rglob("*"):
                if path.is_file():
                    read += len(path.read_bytes())
    return read


def cache_environment(home: Path) -> dict[str, str]:
    """Variables that put every compile cache of a server under ``home``."""
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "VLLM_CACHE_ROOT": str(home / ".cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
        "TRITON_CACHE_DIR": str(home / ".triton" / "cache"),
        "FLASHINFER_WORKSPACE_BASE": str(home),
    }


def _cache(name: str) -> str:
    if name not in CACHES:
        raise argparse.ArgumentTypeError(f"--caches: {name!r} is not one of {CACHES}")
    return name


def package(work: Path, mode: str) -> Path:
    path = work / f"checkpoint-{mode}"
    if not (path / "MODEL_MANIFEST.json").exists():
        write_tiny_checkpoint(
            path,
            attention_mode=mode,
            vision=True,
            shape="d3-turbo",
            weights=False,
            validated_length=VALIDATED_LENGTH,
        )
    return path


def first_request(checkpoint: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    per_token = words_per_token(tokenizer)
    sets = request_sets(0, per_set=1, long=False, words_per_token=per_token)
    return sets["text, 4 questions"][0]


def start_once(
    work: Path, mode: str, cache: str, serve_args: list[str], package_length: bool
) -> dict:
    """One start of ``mode``'s server: seconds to its first answer, and phases."""
    checkpoint = package(work, mode)
    request = first_request(checkpoint)
    home = work / f"home-{mode}"
    if cache == "cold":
        shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    # --load-format dummy: the package has no weights (vllm_side's rule).
    length = [] if package_length else ["--max-model-len", str(LONG_MAX_MODEL_LEN)]
    flags = serve_flags(str(checkpoint), length)
    log_file = work / f"serve-{mode}-{cache}.log"
    started = time.time()
    with Server(
        str(checkpoint),
        *flags,
        *serve_args,
        log_file=log_file,
        environment=cache_environment(home),
    ) as server:
        server.wait(timeout=1800)
        status, body = post(server.url + "/v1/systemone", request)
        first_answer = time.time() - started
    if status != 200:
        raise RuntimeError(f"{mode}, {cache}: HTTP {status}: {body}")
    phases = startup_phases(log_file.read_text())
    log(f"{mode}, {cache}: first answer after {first_answer:.1f} s; {phases}")
    return {
        "mode": mode,
        "cache": cache,
        "first_answer_s": round(first_answer, 2),
        "phases": phases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--caches",
        type=lambda text: [_cache(part) for part in text.split(",")],
        default=list(CACHES),
    )
    parser.add_argument("--package-length", action="store_true")
    parser.add_argument("--serve-arg", action="append", default=[])
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"file cache primed: {prime_file_cache() / 2**30:.1f} GiB read")
    results = []
    for cache in args.caches:
        for mode in args.modes.split(","):
            results.append(
                start_once(args.work, mode, cache, args.serve_arg, args.package_length)
            )
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
