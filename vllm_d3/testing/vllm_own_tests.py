"""vLLM 0.33.0's own CPU tests, run without the plugin and with it loaded,
compared test by test.

``python -m vllm_d3.testing.vllm_own_tests --out FILE`` fetches vLLM 0.33.0's
source distribution from PyPI (its whole tree, ``tests/`` included), puts
``vllm_own_conftest`` in place of vLLM's top-level conftest, serves the models
the tests name from a config-only cache (``config_only_models``), runs
``TEST_PATHS`` twice and writes each run's counts and the regressions: tests
that pass without the plugin and fail with it. It exits 1 on a regression not
listed, with its reason, in ``vllm_own_regressions.json`` beside it.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_d3.testing import config_only_models, vllm_own_conftest

#: vLLM 0.33.0's source distribution on PyPI, and its digest there.
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/"
    "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
)
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SDIST_ROOT = "vllm-0.33.0"
#: Where the sdist and the runs go by default (the upstream series' test
#: fetches the sdist there too).
SDIST_WORK = Path("build/vllm-own-tests")

#: The files that can bite: the scheduler, KV cache and prefix cache (Mamba's
#: align mode among them), the engine arguments and configs the config hook
#: and the patches touch, the attention backend registry, the structured
#: decisions' read strategies, pooling's entry points, the input processor,
#: the API server's middleware and the model registry.
TEST_PATHS = (
    "tests/v1/core",
    "tests/engine/test_arg_utils.py",
    "tests/v1/engine/test_engine_args.py",
    "tests/test_config.py",
    "tests/config",
    "tests/test_attention_backend_registry.py",
    "tests/entrypoints/generate/structured_decisions",
    "tests/entrypoints/pooling",
    "tests/models/test_registry.py",
)

#: Tests left out, by test id prefix, with why: each builds another family's
#: model in a subprocess of its own or resolves speculative drafts, nothing
#: the plugin touches, and together they took 830 of the 1,540 seconds the
#: files ran for on a (busy) 2-core machine.
DESELECTED = {
    "tests/models/test_registry.py::test_registry_model_property": (
        "a subprocess per model (11 tests, 177 s); "
        "test_registry_imports looks every model up in process"
    ),
    "tests/models/test_registry.py::test_registry_supports_replayssm": (
        "a subprocess per model (5 tests, 106 s)"
    ),
    "tests/models/test_registry.py::test_registry_supports_hc_sp": (
        "a subprocess per model (4 tests, 95 s)"
    ),
    "tests/models/test_registry.py::test_registry_is_pp": (
        "a subprocess per model (2 tests, 33 s)"
    ),
    "tests/config/test_speculative_draft_hf_overrides.py::"
    "test_mtp_draft_architecture_follows_target_model_impl": (
        "speculative MTP drafts of MoE models (3 tests, 220 s)"
    ),
    "tests/test_config.py::test_draft_inherits_ep_only_for_moe": (
        "speculative drafts' expert parallelism (24 tests, 201 s)"
    ),
}

#: The tests that pass without the plugin and fail with it, each with why that
#: is right; any other such test fails the command.
KNOWN_REGRESSIONS = Path(__file__).with_name("vllm_own_regressions.json")
RUNS = {"without": "off", "with": "on"}
OUTCOMES = ("passed", "failed", "error", "skipped")


def fetch_sdist(work: Path) -> Path:
    """vLLM 0.33.0's tree under ``work``, from its sdist (downloaded once)."""
    tree = work / SDIST_ROOT
    if tree.is_dir():
        return tree
    archive = work / f"{SDIST_ROOT}.tar.gz"
    if not archive.is_file():
        work.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(SDIST_URL, timeout=300) as response:
            archive.write_bytes(response.read())
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{archive}: sha256 {digest}, not PyPI's {SDIST_SHA256}")
    with tarfile.open(archive) as sdist:
        sdist.extractall(work, filter="data")
    return tree


def plugin_env(plugin: str, report: Path) -> dict[str, str]:
    """This process's environment for a run with the plugin ``on`` or ``off``
    that reports to ``report``."""
    return {
        **os.environ,
        vllm_own_conftest.PLUGIN_ENV: plugin,
        vllm_own_conftest.REPORT_ENV: str(report),
        # Only this plugin is loaded, or none: the runs differ by it alone.
        "VLLM_PLUGINS": "d3" if plugin == "on" else "",
    }


def start_run(tree: Path, name: str, hf_home: Path, work: Path) -> subprocess.Popen:
    """Start ``TEST_PATHS`` with the plugin as run ``name`` sets it, on a copy
    of the tests of its own under ``work / name`` (its log beside it)."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(tree / "tests", root / "tests")
    conftest = Path(vllm_own_conftest.__file__).read_text()
    (root / "tests" / "conftest.py").write_text(conftest)
    # An ini file of its own makes ``root`` pytest's root directory (test ids
    # start at tests/), whatever project the work folder is inside.
    (root / "pytest.ini").write_text("[pytest]\n")
    env = {
        **plugin_env(RUNS[name], root / "report.json"),
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        # vLLM's CPU platform, as its own CPU CI builds it: with no accelerator
        # to detect, vLLM would find no device type.
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--continue-on-collection-errors", *TEST_PATHS]
    command += [f"--deselect={test}" for test in DESELECTED]
    # The child keeps its own copy of the log's descriptor.
    with open(root / "pytest.log", "w") as log:
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=log)


def run_both(tree: Path, hf_home: Path, work: Path) -> dict[str, dict[str, Any]]:
    """Both runs side by side (each mostly on one core), with their reports
    and wall times."""
    begun = time.monotonic()
    running = {name: start_run(tree, name, hf_home, work) for name in RUNS}
    runs = {}
    for name, process in running.items():
        # pytest's own status is 1: vLLM's GPU and model tests fail on a CPU.
        process.wait()
        report = work / name / "report.json"
        if not report.is_file():
            log = (work / name / "pytest.log").read_text().splitlines()
            raise SystemExit("\n".join([f"the run {name} stopped:", *log[-20:]]))
        seconds = round(time.monotonic() - begun)
        runs[name] = {"seconds": seconds, **json.loads(report.read_text())}
    return runs


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    return {o: sum(v == o for v in outcomes.values()) for o in OUTCOMES}


def regressions(without: dict[str, str], with_: dict[str, str]) -> list[str]:
    """Tests that pass without the plugin and do not pass with it."""
    return sorted(
        test
        for test, outcome in without.items()
        if outcome == "passed" and with_.get(test) in ("failed", "error", None)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--work", type=Path, default=SDIST_WORK, help="the sdist and the runs"
    )
    args = parser.parse_args(argv)
    # Absolute: each run works in a folder of its own, and reads the paths
    # it is given from there.
    work = args.work.resolve()
    tree = fetch_sdist(work)
    hf_home = work / "hf-home"
    config_only_models.write_cache(hf_home)
    runs = run_both(tree, hf_home, work)
    known = json.loads(KNOWN_REGRESSIONS.read_text())
    found = regressions(runs["without"]["outcomes"], runs["with"]["outcomes"])
    summary = {
        name: {
            "plugin": run["installed"],
            "seconds": run["seconds"],
            **counts(run["outcomes"]),
        }
        for name, run in runs.items()
    }
    result = {
        "command": "python -m vllm_d3.testing.vllm_own_tests --out " + str(args.out),
        "vllm": {"sdist": SDIST_URL, "sha256": SDIST_SHA256},
        "files": list(TEST_PATHS),
        "deselected": DESELECTED,
        "models": sorted(config_only_models.CONFIGS),
        "runs": summary,
        "regressions": [{"test": t, "reason": known.get(t)} for t in found],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, run in summary.items():
        tally = ", ".join(f"{run[o]} {o}" for o in OUTCOMES)
        print(f"{name} vllm-d3: {tally} ({run['seconds']} s)")
    unexplained = [t for t in found if t not in known]
    for test in unexplained:
        print(f"regression: {test} passes without vllm-d3 and fails with it")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
