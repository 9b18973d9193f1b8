"""The conftest that ``vllm_own_tests`` puts in place of vLLM 0.33.0's own
top-level one (which needs GPUs, model downloads and test assets).

It loads the plugin as vLLM would, or checks that nothing of it is loaded
(``VLLM_D3_OWN_TESTS_PLUGIN``: ``on`` or ``off``), registers vLLM's markers,
gives the one fixture of vLLM's conftest that the chosen files use on a CPU
(``caplog_vllm``), and writes each test's outcome, by test id, to the JSON
file ``VLLM_D3_OWN_TESTS_REPORT`` names.
"""

import json
import logging
import os
from collections.abc import Iterator

import pytest

PLUGIN_ENV = "VLLM_D3_OWN_TESTS_PLUGIN"
REPORT_ENV = "VLLM_D3_OWN_TESTS_REPORT"

#: vLLM's own markers (its pyproject's list), so that none warns.
VLLM_MARKERS = (
    "slow_test",
    "skip_global_cleanup",
    "core_model",
    "hybrid_model",
    "cpu_model",
    "cpu_test",
    "split",
    "distributed",
    "optional",
)

#: Each test's outcome (passed, failed, error, skipped) by test id; a module
#: that fails to import is one error under its own id.
outcomes: dict[str, str] = {}
#: What the plugin installed (nothing in the run without it).
_installed_key = pytest.StashKey[list[str]]()


def check_plugin(plugin: str) -> list[str]:
    """Load vLLM's general plugins, as each vLLM process does; return what
    the plugin installed, after checking it is all there (``on``) or that
    nothing of it is (``off``)."""
    import vllm.plugins

    import vllm_d3
    from vllm_d3 import patches
    from vllm_d3.registration import installed_hooks, owns_custom_backend

    vllm.plugins.load_general_plugins()
    applied = [patches.is_applied(owner, name) for owner, name, _ in patches.PATCHES]
    if plugin == "on":
        assert all(applied), "vllm-d3's patches are not all applied"
        assert owns_custom_backend(), "vllm-d3 does not own the CUSTOM backend"
        assert vllm_d3.ARCHITECTURE in vllm.ModelRegistry.get_supported_archs()
    else:
        assert not any(applied) and not installed_hooks(), "vllm-d3 is loaded"
    return installed_hooks()


def pytest_configure(config: pytest.Config) -> None:
    for marker in VLLM_MARKERS:
        config.addinivalue_line("markers", marker)
    plugin = os.environ[PLUGIN_ENV]
    if plugin not in ("on", "off"):
        raise pytest.UsageError(f"{PLUGIN_ENV} is {plugin!r}, not 'on' or 'off'")
    config.stash[_installed_key] = check_plugin(plugin)


def pytest_report_header(config: pytest.Config) -> str:
    installed = config.stash[_installed_key]
    return "vllm-d3: " + (", ".join(installed) if installed else "not loaded")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        outcomes[report.nodeid] = "error"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.skipped:
        outcomes.setdefault(report.nodeid, report.outcome)
    if report.failed:
        # A failed set-up or tear-down is an error, as pytest counts it.
        outcomes[report.nodeid] = "failed" if report.when == "call" else "error"


def pytest_sessionfinish(session: pytest.Session) -> None:
    report = {
        "installed": session.config.stash[_installed_key],
        "outcomes": dict(sorted(outcomes.items())),
    }
    with open(os.environ[REPORT_ENV], "w") as f:
        json.dump(report, f, indent=0)


@pytest.fixture
def caplog_vllm(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> Iterator[pytest.LogCaptureFixture]:
    """vLLM's log records at INFO and above in ``caplog``: its logger does not
    propagate to the root logger, where caplog listens, unless told to (also
    in the logging config the first engine in a process applies again)."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog
