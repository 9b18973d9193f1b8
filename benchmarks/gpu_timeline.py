"""Where the GPU waits within one profiled call: a chrome trace's summary.

Contract:
- ``timeline(events, span)`` takes the ``traceEvents`` of a torch profiler
  chrome trace and the name of the host annotation around the call
  (``record_function(span)``; its copy on the GPU's timeline is ignored). GPU
  work is every event of the categories in ``GPU_CATEGORIES``, clipped to the
  span. It returns, in milliseconds:
  ``call_ms`` (the span), ``gpu_busy_ms`` (the union of GPU work),
  ``before_first_kernel_ms`` and ``after_last_kernel_ms`` (GPU idle at the
  span's two ends), ``idle_between_ms`` (GPU idle between its first and last
  work) and ``largest_gaps``: the ``GAPS_KEPT`` longest idle gaps between two
  pieces of GPU work, each ``{"at_ms", "ms", "after", "before"}`` (where the
  gap starts from the span's start, its length and the kernels either side).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: Chrome-trace categories of work on the GPU.
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
GAPS_KEPT = 10
#: The category of the host's annotation (the GPU's copy of it has its own).
HOST_SPAN = "user_annotation"


def _ms(microseconds: float) -> float:
    return round(microseconds / 1e3, 3)


def timeline(events: Iterable[Mapping[str, Any]], span: str) -> dict[str, Any]:
    events = list(events)
    (call,) = [e for e in events if e.get("name") == span and e.get("cat") == HOST_SPAN]
    begin, end = call["ts"], call["ts"] + call["dur"]
    work = sorted(
        (max(e["ts"], begin), min(e["ts"] + e["dur"], end), e["name"])
        for e in events
        if e.get("cat") in GPU_CATEGORIES
        and e["ts"] < end
        and e["ts"] + e["dur"] > begin
    )
    if not work:
        raise ValueError(f"no GPU work inside {span!r}")
    busy = 0.0
    gaps = []
    covered_to, last_name = work[0][0], work[0][2]
    for start, stop, name in work:
        if start > covered_to:
            gaps.append((start - covered_to, covered_to, last_name, name))
        busy += max(0.0, stop - max(start, covered_to))
        if stop >= covered_to:
            covered_to, last_name = stop, name
    gaps.sort(reverse=True)
    return {
        "call_ms": _ms(end - begin),
        "gpu_busy_ms": _ms(busy),
        "before_first_kernel_ms": _ms(work[0][0] - begin),
        "after_last_kernel_ms": _ms(end - covered_to),
        "idle_between_ms": _ms(sum(gap[0] for gap in gaps)),
        "largest_gaps": [
            {"at_ms": _ms(at - begin), "ms": _ms(length), "after": a, "before": b}
            for length, at, a, b in gaps[:GAPS_KEPT]
        ],
    }
