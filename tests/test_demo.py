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
    lines = out.splitlines()
    start = lines.index("reference runtime (transformers, float32, CPU):")
    answers = {
        line.split()[0]: line.split()[1] for line in lines[start + 1 : start + 4]
    }
    assert set(answers) == {"damaged", "intent", "urgency"}
    assert answers["damaged"].startswith("noul=")
    assert answers["intent"].split("=")[1] in {
        "refund",
        "replacement",
        "information",
        "cancel",
    }
    assert answers["urgency"].startswith("score=")
    # A second run reuses the cached checkpoint.
    again = demo(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "using the tiny prefix_bidir checkpoint" in again.stdout
