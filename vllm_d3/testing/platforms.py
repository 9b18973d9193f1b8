"""A GPU of a named family, faked at vLLM's interface for CPU tests.

``fake_gpu(monkeypatch, family)`` makes the dense-piece kernels and vLLM's
Gated DeltaNet prefill choice see a ``Platform`` of the family's enum and
compute capability (CUDA runtime 13), with vLLM's FlashAttention extensions
and Triton present; the test's ``monkeypatch`` undoes it.
``fake_cdna3(monkeypatch, flydsl)`` is a CDNA 3 ROCm GPU (gfx942), with or without
AITER's FlyDSL Gated DeltaNet prefill kernels, whose dense-piece start-up
check passes its first kernel (it is not run here).
"""

import sys
import types

import pytest
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

from vllm_d3.v1.attention.backends import d3_dense_kernels

#: (platform enum, compute capability) of each family the kernels know.
FAMILIES = {
    "Hopper": (PlatformEnum.CUDA, DeviceCapability(9, 0)),
    "Blackwell": (PlatformEnum.CUDA, DeviceCapability(10, 0)),
    "Ampere/Ada": (PlatformEnum.CUDA, DeviceCapability(8, 9)),
    "ROCm": (PlatformEnum.ROCM, DeviceCapability(9, 4)),
    "another CUDA GPU": (PlatformEnum.CUDA, DeviceCapability(7, 5)),
}


def fake_gpu(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """The kernels and the GDN prefill choice see a GPU of ``family`` through
    vLLM's ``Platform``, with vLLM's FlashAttention extensions and Triton
    present."""
    enum, capability = FAMILIES[family]

    class FakePlatform(Platform):
        _enum = enum

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return capability

        @classmethod
        def get_cuda_runtime_major(cls) -> int:
            return 13

    for module in (d3_dense_kernels, qwen_gdn_linear_attn):
        monkeypatch.setattr(module, "current_platform", FakePlatform())
    if enum == PlatformEnum.ROCM:
        # vLLM's ROCm module probes the GPU at import: a ROCm GPU outside the
        # MI3xx family it names (``on_mi3xx``), which a test may replace.
        rocm = types.SimpleNamespace(on_mi3xx=lambda: False)
        monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", rocm)
    interface = types.SimpleNamespace(FA2_AVAILABLE=True, FA3_AVAILABLE=True)
    package = types.SimpleNamespace(flash_attn_interface=interface)
    package_name = "vllm.vllm_flash_attn"
    monkeypatch.setitem(sys.modules, package_name, package)
    monkeypatch.setitem(sys.modules, f"{package_name}.flash_attn_interface", interface)
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True)


def fake_cdna3(monkeypatch: pytest.MonkeyPatch, flydsl: bool) -> None:
    """A CDNA 3 ROCm GPU (``fake_gpu``), with or without AITER's FlyDSL
    Gated DeltaNet prefill, the dense pieces' start-up check passing."""
    from vllm._aiter_ops import rocm_aiter_ops

    from vllm_d3.v1.attention.backends import d3_kernel_check

    fake_gpu(monkeypatch, "ROCm")
    monkeypatch.setattr(sys.modules["vllm.platforms.rocm"], "on_mi3xx", lambda: True)
    monkeypatch.setattr(
        rocm_aiter_ops, "is_gdn_flydsl_prefill_available", lambda: flydsl
    )
    monkeypatch.setattr(d3_kernel_check, "check_kernels", lambda names: (names[0], []))
