"""``vllm-d3 demo`` on a machine without a CUDA GPU: it says so, never pretends
vLLM ran, and shows the reference runtime's answers for the demo request."""

import json
import os
import subprocess
import sys

import pytest
import torch


def demo(cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_d3.cli", "demo", "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_demo_without_gpu(tmp_path):
    done = demo(tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    notices = [line for line in out.splitlines() if "no CUDA GPU" in line]
    assert len(notices) == 1
    assert "vLLM + vllm-d3" not in out and "vllm serve" not in out
    assert "building a tiny prefix_bidir checkpoint" in out
    decision = json.loads(
        (tmp_path / "tiny-prefix-bidir" / "decision_config.json").read_text()
    )
    assert decision["attention_mode"] == "prefix_bidir"
    # The printed answers are the reference runtime's for the demo request,
    # recomputed here in this process.
    from vllm_d3.cli import DEMO_REQUEST
    from vllm_d3.reference import ReferenceRuntime

    checkpoint = tmp_path / "tiny-prefix-bidir"
    expected = ReferenceRuntime(checkpoint).answer(DEMO_REQUEST)["answers"]
    lines = out.splitlines()
    start = lines.index("reference runtime (transformers, float32, CPU):")
    printed = {line.split()[0]: line for line in lines[start + 1 : start + 4]}
    assert set(printed) == set(expected) == {"damaged", "intent", "urgency"}
    for qid, answer in expected.items():
        for option, probability in answer["probabilities"].items():
            assert f"{option}={probability:.3f}" in printed[qid]
    assert f"choice={expected['intent']['choice']}" in printed["intent"]
    # A second run reuses the cached checkpoint.
    again = demo(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "using the tiny prefix_bidir checkpoint" in again.stdout
