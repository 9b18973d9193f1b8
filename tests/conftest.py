"""Shared test set-up.

CPU runs select vLLM's CPU platform (there is no accelerator to detect) and load
the plugins the way vLLM's own processes do. GPU tests are marked ``gpu`` and are
skipped when CUDA is not available. Tests of how the plugin reaches vLLM (its
registrations and patches) are marked ``plugin`` and skipped when the tests run
in-tree, against vLLM with the upstream patch series applied and no plugin
loaded (``VLLM_D3_IN_TREE=1``, ``tests/test_export.py``).
"""

import importlib
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Without Triton's GPU backend vLLM would pick Model Runner V1; the D3
    # contract is stated for V2, the runner every CUDA/ROCm deployment gets.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")


#: Set by tests/test_export.py for its in-tree run.
IN_TREE = os.environ.get("VLLM_D3_IN_TREE") == "1"

if IN_TREE:
    from vllm_d3.export import in_tree_modules

    # The tests import the package's modules; in-tree, the vLLM files the series
    # made of them stand in their place (those a later commit adds stay the
    # package's, which the plugin-only modules also import).
    for plugin_name, upstream_name in in_tree_modules().items():
        if importlib.util.find_spec(upstream_name) is not None:
            sys.modules[plugin_name] = importlib.import_module(upstream_name)


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if IN_TREE:
        skips["plugin"] = pytest.mark.skip(reason="the plugin is not loaded in-tree")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def allocator_settings():
    """The caching allocator's environment variables, restored after each test:
    a prefix_bidir config writes them for the engine processes it starts."""
    from vllm.device_allocator.alloc_conf import ALLOC_CONF_ENV_VARS

    saved = {name: os.environ.get(name) for name in ALLOC_CONF_ENV_VARS}
    yield ALLOC_CONF_ENV_VARS
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """Write (once per set of options) a tiny D3 package and return its path."""
    from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

    made: dict[str, str] = {}

    def make(**options) -> str:
        key = repr(sorted(options.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("d3")
            made[key] = str(write_tiny_checkpoint(out, **options))
        return made[key]

    return make


@pytest.fixture(scope="module")
def process_group():
    """vLLM's distributed state for one CPU process, for a module's tests."""
    from vllm_d3.testing.model_runner import single_process_group

    with single_process_group():
        yield


@pytest.fixture
def hook_log(monkeypatch):
    """The config hook's INFO lines. (vLLM configures logging during the first
    config it builds, which resets the handlers of loggers under its own.)"""
    from vllm_d3.model_executor.models import d3_serving as hook

    lines: list[str] = []
    monkeypatch.setattr(hook.logger, "info", lambda msg, *a: lines.append(msg % a))
    return lines


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU with vLLM's FlashAttention 3, where the dense-piece kernels
    were validated (no start-up check)."""
    from vllm_d3.testing.platforms import fake_gpu
    from vllm_d3.v1.attention.backends import d3_kernel_check

    fake_gpu(monkeypatch, "Hopper")
    monkeypatch.setattr(
        d3_kernel_check, "check_kernels", lambda names: pytest.fail("checked")
    )
