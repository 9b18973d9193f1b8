"""Benchmarks of vLLM + vllm-d3 against the reference runtime on D3 requests.

``python -m benchmarks.d3 --out DIR`` (see ``benchmarks.d3``) measures latency,
throughput, start-up time, peak GPU memory and the tokens computed per request,
and writes ``results.json``, ``results.md`` and ``latency_vs_state.png``.
``docs/performance.md`` explains the rows and how to run it.

Modules: ``rows`` (what is measured and the seeded requests), ``timing``
(time budget, warm-up and repeats), ``reference_side`` (the reference runtime,
random-initialised for weight-less packages), ``vllm_side`` (``vllm serve`` over
HTTP) and ``report`` (markdown and plot). ``soak`` drives one server for
minutes with a mixed workload (``python -m benchmarks.soak --out DIR``).
``validation`` is the GPU validation against the reference runtime
(``python -m benchmarks.validation run --out DIR``; ``tests/gpu/test_e2e.py``
runs it), kept here beside the benchmarks, outside the shipped package.
"""
