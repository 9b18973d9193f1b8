"""GPU: vLLM 0.33.0 + vllm-d3 against the reference runtime, end to end.

One command on any CUDA machine with vLLM 0.33.0 and this package installed:

    pytest -m gpu tests/gpu            # quick sets (one request each, no long states)
    VLLM_D3_FULL_VALIDATION=1 pytest -m gpu tests/gpu   # + 24K and 64K-token states
    VLLM_D3_VALIDATION_DTYPE=bfloat16 pytest -m gpu tests/gpu  # serve in another dtype
    VLLM_D3_VALIDATION_SERVE_ARGS="--tensor-parallel-size=2" pytest -m gpu tests/gpu
    VLLM_D3_VALIDATION_GDN_PREFILL=triton pytest -m gpu tests/gpu  # Triton/FLA GDN

``VLLM_D3_VALIDATION_SERVE_ARGS`` (flags for both servers, e.g. a parallel mode
that ``vllm.LLM`` does not run in one process) runs the HTTP part only; the
tests of the in-process engines and start-up checks are then skipped.
``VLLM_D3_VALIDATION_GDN_PREFILL`` serves every engine, in process and over
HTTP, on that Gated DeltaNet prefill kernel instead of the default.

The run (``benchmarks.validation``) also writes ``results.json`` and
``validation.md`` under ``VLLM_D3_VALIDATION_OUT`` (default: a pytest temp dir).
"""

import os
import shlex
from pathlib import Path

import pytest

from benchmarks.validation import (
    CONTROL_TABLES,
    GPU_CHECK_TABLE,
    HTTP_TABLE,
    INPROCESS_TABLE,
    LONG_MAX_MODEL_LEN,
    MERGED_CONTROL,
    PACKED_TABLE,
    SERVED_TABLES,
    STATE_ONCE_TABLE,
    VALIDATED_LENGTH,
    run,
    verdict_of,
)
from vllm_d3.testing.compare import CONTROL_MARGIN, TOLERANCE, passes

pytestmark = pytest.mark.gpu
#: The 24K/64K-token states, served with --max-model-len LONG_MAX_MODEL_LEN.
FULL = os.environ.get("VLLM_D3_FULL_VALIDATION") == "1"
SERVE_ARGS = shlex.split(os.environ.get("VLLM_D3_VALIDATION_SERVE_ARGS", ""))
#: With serve args, only the servers run (``run(..., http_only=True)``).
HTTP_ONLY = bool(SERVE_ARGS)


def table_of(results: dict, name: str) -> dict:
    """One table of the run; a table of the in-process part is skipped in an
    HTTP-only run."""
    if HTTP_ONLY and name not in results["tables"]:
        pytest.skip(f"{name}: not run with VLLM_D3_VALIDATION_SERVE_ARGS")
    table = results["tables"][name]
    # A table without rows would pass every check below.
    assert table, f"{name}: no sets"
    return table


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = os.environ.get("VLLM_D3_VALIDATION_OUT")
    out_dir = Path(out) if out else tmp_path_factory.mktemp("validation")
    quick = not FULL
    work = tmp_path_factory.mktemp("work")
    dtype = os.environ.get("VLLM_D3_VALIDATION_DTYPE")
    return run(
        out_dir,
        quick=quick,
        work=work,
        parallel=True,
        dtype=dtype,
        serve_args=SERVE_ARGS,
        http_only=HTTP_ONLY,
        gdn_prefill_backend=os.environ.get("VLLM_D3_VALIDATION_GDN_PREFILL"),
    )


@pytest.mark.parametrize("table", SERVED_TABLES)
def test_answers_match_the_reference(results, table):
    failing = {
        name: stats
        for name, stats in table_of(results, table).items()
        if not passes(stats)
    }
    assert not failing


def test_state_once_answers_as_one_request_per_question(results):
    # The same engine and weights, the state read once or once per question:
    # kernel rounding only, on every set.
    _, meets = verdict_of(STATE_ONCE_TABLE)
    table = table_of(results, STATE_ONCE_TABLE)
    failing = {name: stats for name, stats in table.items() if not meets(stats)}
    assert not failing


def test_packs_of_different_requests_in_one_step_answer_as_per_question(results):
    # Packs of different states and question counts, sent at once, fit one
    # step's token budget: vLLM's scheduler (no chunked prefill) batched them.
    table = table_of(results, PACKED_TABLE)
    batch = results["packed_batch"]
    assert batch["prompts"] >= 2 and len(batch["question_counts"]) >= 2
    assert batch["tokens"] <= batch["max_num_batched_tokens"]
    _, meets = verdict_of(PACKED_TABLE)
    failing = {name: stats for name, stats in table.items() if not meets(stats)}
    assert not failing


def test_a_question_that_reads_another_is_clearly_wrong(results):
    stats = table_of(results, MERGED_CONTROL).values()
    assert max(s["max_dp"] for s in stats) > CONTROL_MARGIN * TOLERANCE


def test_the_reference_agrees_with_itself_on_cpu_and_gpu(results):
    table = table_of(results, GPU_CHECK_TABLE)
    failing = {name: stats for name, stats in table.items() if not passes(stats)}
    assert not failing


@pytest.mark.parametrize("control", CONTROL_TABLES)
def test_wrong_masks_are_clearly_wrong(results, control):
    stats = table_of(results, control).values()
    assert max(s["max_dp"] for s in stats) > CONTROL_MARGIN * TOLERANCE
    # The served answers the controls are held against: in process, or over
    # HTTP in an HTTP-only run.
    served = table_of(results, HTTP_TABLE if HTTP_ONLY else INPROCESS_TABLE)
    changed = sum(s["decisions_changed"] for s in stats)
    assert changed > sum(served[name]["decisions_changed"] for name in served)


def test_bad_input_is_refused_and_serving_goes_on(results):
    http = results["http"]
    assert http["classify_list"] == {"status": 200, "results": 2}
    assert all(400 <= b["status"] < 500 for b in http["bad_inputs"]), http["bad_inputs"]
    assert http["decompression_bomb"] == 413
    assert http["valid_after_bad_inputs"] == 200


def test_max_model_len_default_and_override(results):
    http = results["http"]
    # No flag: the checkpoint's validated_length; --max-model-len 131072 wins.
    expected = LONG_MAX_MODEL_LEN if FULL else VALIDATED_LENGTH
    assert http["max_model_len"] == expected


def test_chunked_prefill_is_refused_at_start_up(results):
    if HTTP_ONLY:
        pytest.skip("a start-up check: not run with VLLM_D3_VALIDATION_SERVE_ARGS")
    assert results["chunked_prefill"] == {"refused": True, "message_present": True}
