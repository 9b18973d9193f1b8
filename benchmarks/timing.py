"""Time budget, progress lines and the warm-up-then-repeat timing loop.

Contract:
- ``log(message)`` prints one progress line with the wall-clock time and the
  seconds since the run started.
- ``Budget(seconds)`` is the run's time budget (``None``: unlimited).
  ``exhausted()`` says whether no new row may start; ``share(fraction)`` is a
  budget ending after ``fraction`` of what is left (for one phase of the run).
- ``RowGate(budget, warmup, side)``: ``refusal(row)`` says (and logs, under
  ``side``) why a row must not start (``None``: it may): the budget is spent,
  or the row is long and the estimate of its warm-up plus one timed request is
  longer than what is left. The estimate scales the p50 of the last long row
  passed to ``measured(row, p50)`` by questions x (state tokens)^2, an upper
  bound: a pass grows between linearly and quadratically with its length.
- ``run_record()``: what every results file records of its run: the date
  (UTC), the commit of the checkout it ran from (``None`` outside one) and the
  GPU (``"none"`` without CUDA).
- ``measure(call, requests, warmup=..., budget=...)`` calls ``call(request)``
  on the first ``warmup`` requests untimed, then times each of the others.
  Once the first timed call is done, another one starts only while the budget
  has at least the previous call's duration left. It returns a ``Measurement``
  (times, p50, what each call returned).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .rows import Row

_STARTED = time.perf_counter()


def log(message: str) -> None:
    elapsed = time.perf_counter() - _STARTED
    print(f"[bench {time.strftime('%H:%M:%S')} +{elapsed:6.0f}s] {message}", flush=True)


class Budget:
    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def remaining(self) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - time.perf_counter()

    def exhausted(self) -> bool:
        return self.remaining() <= 0

    def share(self, fraction: float) -> Budget:
        part = Budget(None)
        if self.deadline is not None:
            part.deadline = time.perf_counter() + fraction * max(0.0, self.remaining())
        return part


class RowGate:
    def __init__(self, budget: Budget, warmup: int, side: str):
        self.budget = budget
        self.warmup = warmup
        self.side = side
        self.last_long: tuple[Row, float] | None = None

    def estimate_s(self, row: Row) -> float | None:
        if row.state_tokens is None or self.last_long is None:
            return None
        last, p50_s = self.last_long
        assert last.state_tokens is not None
        scale = (
            row.questions / last.questions * (row.state_tokens / last.state_tokens) ** 2
        )
        return (self.warmup + 1) * p50_s * scale

    def refusal(self, row: Row) -> str | None:
        needed, left = self.estimate_s(row), self.budget.remaining()
        if self.budget.exhausted():
            refusal = "skipped (time budget)"
        elif needed is not None and needed > left:
            refusal = (
                f"skipped (time budget: about {needed:.0f} s needed, {left:.0f} s left)"
            )
        else:
            return None
        log(f"{self.side}: {row.id} {refusal}")
        return refusal

    def measured(self, row: Row, p50_s: float) -> None:
        if row.state_tokens is not None:
            self.last_long = (row, p50_s)


@dataclass
class Measurement:
    warmup_s: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)

    @property
    def p50_s(self) -> float:
        return statistics.median(self.times_s)

    def summary(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "p50_s": self.p50_s,
            "times_s": self.times_s,
            "warmup_s": self.warmup_s,
            "repeats": len(self.times_s),
        }


def measure(
    call: Callable[[dict[str, Any]], Any],
    requests: list[dict[str, Any]],
    *,
    warmup: int,
    budget: Budget,
) -> Measurement:
    if len(requests) <= warmup:
        raise ValueError("measure needs at least one request beyond the warm-up")
    result = Measurement()
    for request in requests[:warmup]:
        started = time.perf_counter()
        call(request)
        result.warmup_s.append(time.perf_counter() - started)
    for request in requests[warmup:]:
        if result.times_s and budget.remaining() < result.times_s[-1]:
            break
        started = time.perf_counter()
        result.outputs.append(call(request))
        result.times_s.append(time.perf_counter() - started)
    return result


def run_record() -> dict[str, Any]:
    """The date, the commit and the GPU of this run (module docstring)."""
    import torch

    here = Path(__file__).parent
    done = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": done.stdout.strip() if done.returncode == 0 else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
    }
