"""The comparison of vLLM 0.33.0's own tests without and with the plugin
(``vllm_d3.testing.vllm_own_tests``): its conftest's report, its config-only
model cache, and what it counts as a regression."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_d3.testing import config_only_models, vllm_own_conftest
from vllm_d3.testing.vllm_own_tests import plugin_env, regressions

pytestmark = pytest.mark.plugin

SAMPLE_TESTS = """
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3

@pytest.fixture
def broken():
    raise RuntimeError("set-up fails")

def test_errors(broken):
    pass

@pytest.mark.skip(reason="skipped")
def test_skipped():
    pass

def test_logs_reach_caplog_vllm(caplog_vllm):
    from vllm.logger import init_logger
    init_logger("vllm.sample").info("from vLLM's logger")
    assert "from vLLM's logger" in caplog_vllm.text
"""


def run_pytest(tmp_path: Path, plugin: str, tests: dict[str, str], **env: str):
    """pytest over ``tests`` (file name: source) under the comparison's
    conftest, with the plugin ``on`` or ``off`` and ``env`` on top."""
    folder = tmp_path / "tests"
    folder.mkdir()
    (folder / "conftest.py").write_text(Path(vllm_own_conftest.__file__).read_text())
    for name, source in tests.items():
        (folder / name).write_text(source)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--continue-on-collection-errors", "tests"]
    return subprocess.run(
        command,
        cwd=tmp_path,
        env={**plugin_env(plugin, tmp_path / "report.json"), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_sample(tmp_path: Path, plugin: str) -> dict:
    tests = {"test_sample.py": SAMPLE_TESTS}
    tests["test_broken_import.py"] = "import no_such_module\n"
    done = run_pytest(tmp_path, plugin, tests)
    assert done.returncode == 1, done.stdout + done.stderr
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("plugin", ["off", "on"])
def test_the_conftest_reports_each_tests_outcome_and_the_plugin(tmp_path, plugin):
    report = run_sample(tmp_path, plugin)
    assert report["outcomes"] == {
        "tests/test_broken_import.py": "error",
        "tests/test_sample.py::test_errors": "error",
        "tests/test_sample.py::test_fails": "failed",
        "tests/test_sample.py::test_logs_reach_caplog_vllm": "passed",
        "tests/test_sample.py::test_passes": "passed",
        "tests/test_sample.py::test_skipped": "skipped",
    }
    installed = report["installed"]
    if plugin == "off":
        assert installed == []
    else:
        assert "AttentionBackendEnum.CUSTOM" in installed
        assert (
            "patch vllm.entrypoints.openai.decisions.state.select_read_strategy"
            in installed
        )


def test_the_conftest_refuses_a_run_with_the_plugin_half_loaded(tmp_path):
    # "off" with vLLM loading the plugin: the run stops before any test.
    tests = {"test_one.py": "def test_one():\n    pass\n"}
    done = run_pytest(tmp_path, "off", tests, VLLM_PLUGINS="d3")
    assert done.returncode != 0
    assert "vllm-d3 is loaded" in done.stdout + done.stderr
    assert not (tmp_path / "report.json").exists()


def test_the_config_only_cache_serves_vllms_model_config_offline(tmp_path):
    config_only_models.write_cache(tmp_path / "hf")
    script = textwrap.dedent(
        """
        from vllm.config import ModelConfig
        for name in ("facebook/opt-125m", "Qwen/Qwen3-0.6B"):
            config = ModelConfig(name)
            print(name, config.architecture, config.max_model_len)
        """
    )
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_PLUGINS": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "facebook/opt-125m OPTForCausalLM 2048" in done.stdout
    assert "Qwen/Qwen3-0.6B Qwen3ForCausalLM 40960" in done.stdout


def test_a_regression_is_a_pass_that_no_longer_passes():
    without = {
        "a": "passed",
        "b": "passed",
        "c": "passed",
        "d": "failed",
        "e": "skipped",
        "f": "passed",
    }
    with_plugin = {"a": "passed", "b": "failed", "d": "failed", "e": "failed"}
    with_plugin["f"] = "error"
    # c: its module no longer imports, so it was not run at all.
    assert regressions(without, with_plugin) == ["b", "c", "f"]
