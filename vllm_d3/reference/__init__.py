"""Reference runtime for D3 decision checkpoints, independent of vLLM.

It answers /v1/systemone requests with transformers' Qwen3.5 modules and the
checkpoint's readout, under any D3 attention mode (``causal``,
``noncausal_full_attention``, ``prefix_bidir``), either one whole prompt per
question or with the state block read once. It imports nothing from ``vllm``
or from the rest of ``vllm_d3``, so it can judge the plugin's answers.
See docs/development.md, "The reference runtime".
"""

from .runtime import ReferenceRuntime, RenderedQuestion

__all__ = ["ReferenceRuntime", "RenderedQuestion"]
