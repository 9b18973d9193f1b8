"""The validation's CPU oracle runs transformers' PyTorch code even where GPU-only
kernel packages are importable (a fake ``fla`` stands in for them here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import validation
from vllm_d3.reference import ReferenceRuntime
from vllm_d3.testing import server as server_module
from vllm_d3.testing.compare import compare, flatten
from vllm_d3.testing.own_process import logits_from_script

FAKE_FLA = """
def chunk_gated_delta_rule(*args, **kwargs):
    raise RuntimeError("the GPU-only fake fla kernel ran")


fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
"""
REQUEST = {
    "state": "Ticket 12: the invoice shows the wrong address.",
    "questions": {
        "billing": {"type": "noul", "instructions": "Is this about billing?"},
        "tone": {"type": "score", "criteria": ["calm", "upset"]},
    },
}


@pytest.fixture
def fake_fla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "site" / "fla"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_FLA)
    path = os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    return package.parent


def test_cpu_reference_avoids_gpu_only_kernels(make_checkpoint, fake_fla) -> None:
    checkpoint = make_checkpoint()
    # The premise: with the fake importable, transformers binds it.
    script = (
        "import json, sys\n"
        "from vllm_d3.reference import ReferenceRuntime\n"
        "ReferenceRuntime(sys.argv[1]).answer(json.loads(sys.argv[2]))\n"
    )
    bound = subprocess.run(
        [sys.executable, "-c", script, checkpoint, json.dumps(REQUEST)],
        capture_output=True,
        text=True,
    )
    assert "the GPU-only fake fla kernel ran" in bound.stderr
    # The validation's CPU oracle blocks it and answers as this process does.
    got = validation.reference_answers(checkpoint, {"set": [REQUEST]}, None, "cpu")
    expected = ReferenceRuntime(checkpoint).answer(REQUEST)
    stats = compare(flatten([expected]), flatten(got["set"]))
    assert stats["max_dp"] < 1e-6, stats


def test_the_reference_cache_keeps_answers_by_what_they_depend_on(
    make_checkpoint, tmp_path, monkeypatch
) -> None:
    checkpoint = shutil.copytree(make_checkpoint(), tmp_path / "checkpoint")
    sets, cache = {"set": [REQUEST]}, tmp_path / "cache"
    first = validation.reference_answers(str(checkpoint), sets, None, "cpu", cache)
    expected = ReferenceRuntime(str(checkpoint)).answer(REQUEST)
    assert compare(flatten([expected]), flatten(first["set"]))["max_dp"] < 1e-6

    # A later run reads them back: the reference does not run again.
    def reference_ran(*args, **kwargs):
        raise AssertionError("the reference ran again")

    monkeypatch.setattr(validation.subprocess, "run", reference_ran)
    again = validation.reference_answers(str(checkpoint), sets, None, "cpu", cache)
    assert again == first
    # Other requests, another mask or device, or a changed file: another key.
    keys = {
        validation.reference_key(str(checkpoint), sets, None, "cpu"),
        validation.reference_key(str(checkpoint), sets, "causal", "cpu"),
        validation.reference_key(str(checkpoint), sets, None, "cuda"),
        validation.reference_key(str(checkpoint), {"set": [REQUEST] * 2}, None, "cpu"),
    }
    config = checkpoint / "decision_config.json"
    config.write_text(config.read_text().replace("0.75", "0.5"))
    keys.add(validation.reference_key(str(checkpoint), sets, None, "cpu"))
    assert len(keys) == 5
    with pytest.raises(AssertionError, match="the reference ran again"):
        validation.reference_answers(str(checkpoint), sets, None, "cpu", cache)


def test_a_failed_engine_names_its_log_and_error(make_checkpoint, tmp_path) -> None:
    job = validation.InProcess(
        make_checkpoint(),
        {"set": [REQUEST]},
        tmp_path,
        "broken",
        False,
        {"no_such_engine_arg": 1},
    )
    with pytest.raises(RuntimeError) as failure:
        job.result()
    message = str(failure.value)
    assert "broken-inprocess.log" in message
    assert "no_such_engine_arg" in message
    assert message.split("): ", 1)[1].split(":", 1)[0].endswith("Error")
    assert "Traceback" in (tmp_path / "broken-inprocess.log").read_text()


def test_a_server_that_exits_names_its_log_and_error(tmp_path) -> None:
    log_file = tmp_path / "serve.log"
    checkpoint = str(tmp_path / "no-such-checkpoint")
    with (
        server_module.Server(checkpoint, log_file=log_file) as server,
        pytest.raises(server_module.ServerExited) as exited,
    ):
        server.wait(timeout=300)
    message = str(exited.value)
    assert str(log_file) in message
    assert message.split("): ", 1)[1].split(":", 1)[0].endswith("Error")
    assert "Traceback" in log_file.read_text()


def test_a_script_in_its_own_process_imports_libraries_not_its_neighbours(
    tmp_path: Path,
) -> None:
    # A module beside the script named like a library it imports, as
    # vllm_d3/testing/requests.py sits beside state_cache_reads.py.
    (tmp_path / "json.py").write_text("raise ImportError('the neighbour ran')\n")
    script = tmp_path / "script.py"
    script.write_text(
        "import json, sys, torch\n"
        "torch.save({'dumped': torch.tensor([len(json.dumps([1]))])}, sys.argv[2])\n"
    )
    out = tmp_path / "out.pt"
    assert logits_from_script(str(script), "unused", out)["dumped"].item() == 3


def test_a_packed_prompt_holds_each_question_prompt_after_one_state(
    make_checkpoint,
) -> None:
    request = {
        **REQUEST,
        "questions": {
            **REQUEST["questions"],
            "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        },
    }
    questions = ReferenceRuntime(make_checkpoint()).render(request)
    ids, extra, read = validation.packed_prompt(questions)
    s = extra["d3_state_tokens"]
    assert read == [0, 1, 2] and extra["d3_question_ends"][-1] == len(ids)
    starts = [s, *extra["d3_question_ends"][:-1]]
    ends = extra["d3_question_ends"]
    for q, start, end in zip(questions, starts, ends, strict=True):
        # The state, then the question's own block: its one-question prompt.
        assert ids[:s] + ids[start:end] == q.token_ids
    # The control: the second question's block also holds the first's; the
    # third stands alone.
    merged_ids, merged, read = validation.packed_prompt(questions, merge_pairs=True)
    assert merged_ids == ids and read == [1, 2]
    assert merged["d3_question_ends"] == extra["d3_question_ends"][1:]


def test_a_request_whose_questions_differ_in_state_is_not_packed(
    make_checkpoint,
) -> None:
    renderer = ReferenceRuntime(make_checkpoint())
    first = renderer.render(REQUEST)[0]
    other = renderer.render({**REQUEST, "state": "Ticket 13: a refund."})[1]
    with pytest.raises(ValueError, match="do not share their state"):
        validation.packed_prompt([first, other])


def _noul(yes: float) -> dict:
    return {"type": "noul", "noul": yes, "probabilities": {"yes": yes, "no": 1 - yes}}


def test_a_parallel_run_is_appended_to_the_page_as_its_own_section(tmp_path) -> None:
    def results(served_yes: float) -> dict:
        stats = compare([_noul(0.7)], [_noul(served_yes)])
        return {
            "versions": {"vllm": "0.33.0"},
            "tables": {validation.HTTP_TABLE: {"text, 1 question": stats}},
        }

    page = tmp_path / "validation.md"
    runs = {"one.json": results(0.71), "tp2.json": results(0.2)}
    for name, run_results in runs.items():
        (tmp_path / name).write_text(json.dumps(run_results))
    report = ["report", "--out", str(page), "--run-command"]
    validation.main([*report, "run one", str(tmp_path / "one.json")])
    validation.main(
        [*report, "run tp2", str(tmp_path / "tp2.json"), "--append", "Two GPUs: TP=2"]
    )
    text = page.read_text()
    main, appended = text.split("\n## Two GPUs: TP=2\n")
    assert main.startswith("# Validation") and "Command: `run one`" in main
    assert f"\n## {validation.HTTP_TABLE}\n" in main and "| yes |" in main
    # The appended run: its own command, its tables one level down, its verdict.
    assert "Command: `run tp2`" in appended and "run one" not in appended
    assert f"\n### {validation.HTTP_TABLE}\n" in appended and "| NO |" in appended
    assert "\n## " not in appended


@pytest.mark.parametrize("command", ["run", "references", "report", "inprocess"])
def test_every_validation_command_prints_its_help(command, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        validation.main([command, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
