# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernels that run D3's dense attention pieces, and which one a GPU gets
(upstream: ``v1/attention/backends/d3_dense_kernels.py``, a new file).

A ``DenseKernel`` attends each sequence's queries to all its keys, over
contiguous tensors with their own ``cu_seqlens``, writes ``out`` and returns
the log-sum-exp ``(heads, total_q)``: ``fa3`` and ``fa2`` (vLLM's
FlashAttention), ``torch_flash`` (PyTorch's; AOTriton on ROCm) and ``triton``
(``ops/dense_piece_attention.py``). ``platform_kernels`` lists a GPU family's
candidates present (``DEFAULT_KERNELS``); off ``VALIDATED_FAMILY`` the config
hook has each checked first (``d3_kernel_check``).
"""

from collections.abc import Callable

import torch
from vllm.platforms import current_platform

#: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, out)
#: -> log-sum-exp; the module docstring says what it computes.
DenseKernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        int,
        float,
        torch.Tensor,
    ],
    torch.Tensor,
]
#: Kernels per platform family, best first (the first one present serves).
DEFAULT_KERNELS = {
    "Hopper": ("fa3", "triton"),
    "Blackwell": ("fa2", "triton"),
    "Ampere/Ada": ("fa2", "triton"),
    "ROCm": ("torch_flash", "triton"),
    "another CUDA GPU": ("triton",),
}
KERNEL_NAMES = ("fa3", "fa2", "torch_flash", "triton")
#: The family every kernel was validated on, end to end, with this package.
VALIDATED_FAMILY = "Hopper"


def platform_family() -> str | None:
    """This process's GPU family (``DEFAULT_KERNELS``), or None without one."""
    if current_platform.is_rocm():
        return "ROCm"
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    major = capability.major if capability is not None else 0
    if major >= 10:
        return "Blackwell"
    return {9: "Hopper", 8: "Ampere/Ada"}.get(major, "another CUDA GPU")


def _flash_attention_unavailable(version: int) -> str | None:
    """Why vLLM's FlashAttention ``version`` (2 or 3) cannot run here."""
    if not current_platform.is_cuda():
        return "vLLM's FlashAttention runs on CUDA GPUs"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except ImportError:
        return "vLLM's FlashAttention is not installed"
    if version == 3:
        if not fa.FA3_AVAILABLE:
            return f"FlashAttention 3 is unavailable: {fa.FA3_UNAVAILABLE_REASON}"
        if not current_platform.is_device_capability_family(90):
            return "FlashAttention 3 runs on Hopper (compute capability 9.x)"
        return None
    if not fa.FA2_AVAILABLE:
        return f"FlashAttention 2 is unavailable: {fa.FA2_UNAVAILABLE_REASON}"
    if not current_platform.has_device_capability(80):
        return "FlashAttention 2 needs compute capability 8.0"
    return None


def kernel_unavailable(name: str) -> str | None:
    """Why kernel ``name`` cannot run in this process (None: it can)."""
    if platform_family() is None:
        return "not a CUDA or ROCm GPU"
    if name in ("fa3", "fa2"):
        return _flash_attention_unavailable(int(name[-1]))
    if name == "torch_flash":
        if current_platform.is_cuda() and not current_platform.has_device_capability(
            80
        ):
            return "PyTorch's flash attention needs compute capability 8.0"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this PyTorch build has no flash attention"
        return None
    from vllm import triton_utils

    return None if triton_utils.HAS_TRITON else "Triton is not available"


def platform_kernels() -> tuple[str | None, list[str], str | None]:
    """(family, the kernels present for it best first, why none is, if so)."""
    family = platform_family()
    if family is None:
        return None, [], "not a CUDA or ROCm GPU"
    why_not = {k: kernel_unavailable(k) for k in DEFAULT_KERNELS[family]}
    present = [k for k, reason in why_not.items() if reason is None]
    reasons = "; ".join(f"{k}: {reason}" for k, reason in why_not.items())
    return family, present, None if present else reasons


def _vllm_flash_attention(version: int) -> DenseKernel:
    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, out):
        # Defined only where vLLM's FlashAttention is built.
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

        _, lse = flash_attn_varlen_func(
            q=q, k=k, v=v, out=out,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_k,
            softmax_scale=scale, causal=False, return_softmax_lse=True,
            fa_version=version,
        )  # fmt: skip
        return lse

    return run


def _torch_flash_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, out
):
    result, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        0.0, False, False, scale=scale,
    )  # fmt: skip
    out.copy_(result)
    return lse


def _triton_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, out
):
    from vllm_d3.v1.attention.ops.dense_piece_attention import dense_piece_attention

    return dense_piece_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, out
    )


def dense_kernel(name: str) -> DenseKernel:
    """The kernel called ``name`` (``KERNEL_NAMES``)."""
    kernels: dict[str, DenseKernel] = {
        "fa3": _vllm_flash_attention(3),
        "fa2": _vllm_flash_attention(2),
        "torch_flash": _torch_flash_attention,
        "triton": _triton_attention,
    }
    return kernels[name]
