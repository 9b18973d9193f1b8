# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gated DeltaNet for packed D3 requests in two phases: every question
restarts from the state (upstream:
``model_executor/layers/mamba/gdn/packed_questions.py``, a new file).

``_forward_core`` first calls ``forward_packed_questions``, which runs a step
whose metadata is a ``PackedGDNAttentionMetadata`` (``d3_packed_gdn``) as its
scans through the layer's own core: each row up to its prefill checkpoint
(its final state copied to the checkpoint's slot), phase A, then phase B's
question blocks from their rows' states on scratch slots (``RowStates``), or
the one scan of each question's own prompt. ``write_prefill_checkpoints``
declares a layer's align-mode checkpoints the scans' to write, on the prefill
kernels the state cache was validated on (its ties to 0.33.0:
docs/upstream.md).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_d3.v1.attention.backends.d3_packed_gdn import (
    BuiltCheckpointScan,
    BuiltQuestionScan,
    PackedGDNAttentionMetadata,
    PhaseTokens,
    WriteBack,
)

if TYPE_CHECKING:
    # Only a type here: that module imports this one.
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

#: vLLM's Gated DeltaNet prefill kernels, as its layers name them.
TRITON_GDN_PREFILL = "triton"
FLASHINFER_GDN_PREFILL = "flashinfer"
#: The prefill kernels on which the packed scans write the layers' prefill
#: checkpoints, the Gated DeltaNet states the state cache keeps (validated).
STATE_CACHE_GDN_PREFILLS = (TRITON_GDN_PREFILL, FLASHINFER_GDN_PREFILL)


class RowStates:
    """A scan's recurrent states on scratch slots, as 0.33.0's prefill path uses them
    (module docstring): ``states[indices]`` is each scratch slot's row's state
    in the cache; ``states[indices] = final`` drops ``final``."""

    def __init__(self, cache: torch.Tensor, scratch_sources: torch.Tensor) -> None:
        self.cache = cache
        self.scratch_sources = scratch_sources
        self.dtype = cache.dtype

    def __getitem__(self, indices: torch.Tensor) -> torch.Tensor:
        return self.cache.index_select(0, self.scratch_sources[indices])

    def __setitem__(self, indices: torch.Tensor, final: torch.Tensor) -> None:
        pass


def _states_like(cache: torch.Tensor, slots: int) -> torch.Tensor:
    """``slots`` scratch state slots laid out as ``cache``'s are, a page apart:
    0.33.0's causal convolution makes compile-time constants of its state
    cache's strides, so scratch slots packed closer would compile a kernel of
    their own during a server's first packed step. A page holds a slot's
    convolution and recurrent states, so a scratch convolution slot takes
    about 3.2 MB at d3-turbo's shape (its own state is 60 KB), for the
    layer's call."""
    return torch.empty_strided(
        (slots, *cache.shape[1:]),
        cache.stride(),
        dtype=cache.dtype,
        device=cache.device,
    )


def zeroed_states(cache: torch.Tensor, slots: int) -> torch.Tensor:
    """``slots`` zeroed scratch state slots (``_states_like``)."""
    return _states_like(cache, slots).zero_()


def gathered_states(cache: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """Copies of ``cache``'s slots ``sources`` as scratch slots (``_states_like``)."""
    return torch.index_select(cache, 0, sources, out=_states_like(cache, len(sources)))


def write_prefill_checkpoints(layer: "QwenGatedDeltaNetAttention") -> None:
    """In align mode on a prefill of ``STATE_CACHE_GDN_PREFILLS``, declare that
    ``layer``'s prefill checkpoints are the two phases' to write: vLLM then
    gives its Mamba spec a checkpoint block and the step metadata the
    checkpoints, and every step that has one runs the plugin's scans. A split
    scan may stop at any token, so the alignment is 1 and vLLM's grid stays
    the block (or ``prefix_match_unit``). The workspace 0.33.0 reserves for
    FlashInfer's own checkpoint output, which no step then runs, is sized to
    one state."""
    cache_config = layer.vllm_config.cache_config
    if (
        cache_config.mamba_cache_mode != "align"
        or layer.gdn_prefill_backend not in STATE_CACHE_GDN_PREFILLS
    ):
        return
    layer._checkpoint_alignment = 1
    # The checkpoint workspace holds one state per grid step of this many tokens.
    layer._max_num_batched_tokens = 1


def _scan(
    forward_core: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    core_attn_out: torch.Tensor,
    tokens: PhaseTokens,
    write_back: WriteBack | None = None,
) -> None:
    """One scan through ``forward_core`` of the layer's ``inputs`` (mixed qkv,
    b, a) at ``tokens``, its output written to those rows of ``core_attn_out``
    (a re-read state's tokens once each, ``write_back``)."""
    if isinstance(tokens, slice):
        # Row slices of the layer's tensors: the core writes in place.
        forward_core(*(x[tokens] for x in inputs), core_attn_out[tokens])
        return
    out = core_attn_out.new_zeros((len(tokens), *core_attn_out.shape[1:]))
    forward_core(*(x.index_select(0, tokens) for x in inputs), out)
    if write_back is not None:
        firsts, tokens = write_back
        out = out[firsts]
    core_attn_out.index_copy_(0, tokens, out)


def _question_states(
    cache: tuple[torch.Tensor, ...], question_scan: BuiltQuestionScan
) -> tuple[torch.Tensor, torch.Tensor | RowStates]:
    """The layer's cache as ``question_scan`` binds it. Each block starts from
    its row's state (after s tokens in phase B; none where it re-reads the
    state): its own copy of the convolution state, which the kernel updates in
    place, and the recurrent state as the core gathers it, or, where the builder
    took one-token blocks for decodes, copies too: 0.33.0's decode kernel takes
    the states as a tensor and updates them in place."""
    conv_states, recurrent_states = cache
    sources = question_scan.scratch_sources
    if question_scan.metadata.num_decodes:
        return (
            gathered_states(conv_states, sources),
            gathered_states(recurrent_states, sources),
        )
    return gathered_states(conv_states, sources), RowStates(recurrent_states, sources)


_Metadata = TypeVar("_Metadata", bound=GDNAttentionMetadata)


def layer_step_metadata(
    layer: "QwenGatedDeltaNetAttention", kind: type[_Metadata]
) -> tuple[dict[str, Any], _Metadata] | None:
    """The forward context's metadata of every layer and ``layer``'s own, if
    that is a ``kind``; else None (not a step of that form)."""
    all_metadata = get_forward_context().attn_metadata
    if not isinstance(all_metadata, dict):
        return None
    metadata = all_metadata.get(layer.prefix)
    return (all_metadata, metadata) if isinstance(metadata, kind) else None


def forward_packed_questions(
    layer: "QwenGatedDeltaNetAttention",
    forward_core: Callable[..., Any],
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> bool:
    """Run ``layer``'s step as its scans through ``forward_core`` if the step
    holds packed rows; returns whether it did."""
    found = layer_step_metadata(layer, PackedGDNAttentionMetadata)
    if found is None:
        return False
    all_metadata, metadata = found
    inputs = (mixed_qkv, b, a)
    cache = layer.kv_cache
    try:
        if metadata.to_checkpoints is not None:
            all_metadata[layer.prefix] = metadata.to_checkpoints.metadata
            _scan_to_checkpoints(
                layer, forward_core, inputs, core_attn_out, metadata.to_checkpoints
            )
        if metadata.phase_a is not None:
            assert metadata.state_tokens is not None
            all_metadata[layer.prefix] = metadata.phase_a
            _scan(forward_core, inputs, core_attn_out, metadata.state_tokens)
        for question_scan in metadata.question_scans:
            # RowStates stands in for a tensor where the core only indexes it.
            layer.kv_cache = _question_states(cache, question_scan)  # type: ignore[assignment]
            all_metadata[layer.prefix] = question_scan.metadata
            _scan(
                forward_core,
                inputs,
                core_attn_out,
                question_scan.tokens,
                question_scan.write_back,
            )
    finally:
        layer.kv_cache = cache
        all_metadata[layer.prefix] = metadata
    return True


def _scan_to_checkpoints(
    layer: "QwenGatedDeltaNetAttention",
    forward_core: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    core_attn_out: torch.Tensor,
    scan: BuiltCheckpointScan,
) -> None:
    """The checkpoint scan on copies of its rows' states (the core updates
    them in place), then each final state to the row's checkpoint slot and to
    its own slot, where phase A continues."""
    cache = layer.kv_cache
    scratch = tuple(gathered_states(states, scan.sources) for states in cache)
    layer.kv_cache = scratch  # type: ignore[assignment]
    _scan(forward_core, inputs, core_attn_out, scan.tokens)
    for states, ends in zip(cache, scratch, strict=True):
        states.index_copy_(0, scan.destinations, torch.cat([ends[1:], ends[1:]]))
    layer.kv_cache = cache
