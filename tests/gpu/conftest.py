"""GPU tests' shared fixtures."""

import pytest
import torch


@pytest.fixture
def served_kernel(request) -> str:
    """The Gated DeltaNet prefill kernel the engine of a test parametrized by
    ``GDN_KERNELS`` (its ``logits`` fixture) must run: the one forced, else
    FlashInfer's on Hopper, vLLM's choice there for the tiny checkpoint's GDN
    heads of 128."""
    kernel = request.node.callspec.params["logits"]
    if kernel != "auto":
        return kernel
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the default GDN kernel is known here for Hopper only")
    return "flashinfer"
