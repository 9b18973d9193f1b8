"""A Model Runner V2 model state on the CPU, for tests of what it hands the
attention metadata builders.

- ``single_process_group()``: vLLM's distributed state for one process (gloo);
- ``vllm_config_for(path)`` and ``build_model(model_cls, config)``: the engine
  config ``vllm serve path`` builds (or, ``align_block``, with prefix
  caching's align mode), and a model built under it;
- ``CpuRopeState``: vLLM's ``RopeState`` (its real ``init_prefill_positions``)
  over a plain record of the staged positions, where vLLM's pinned buffer needs
  a GPU driver;
- ``cpu_model_state(state_cls, path)``: a model state of ``state_cls`` for the
  model ``vllm serve path`` builds (with ``CpuRopeState``), and its config,
  under that config;
- ``prefill_batch(req_ids, prompt_lens)``: one step scheduling each prompt
  to its end, as the runner schedules D3 prompts (whole, or after a
  prefix-cache hit);
- ``attention_metadata(state_and_config, req_ids, prompt_lens, backend)``: the
  state's ``prepare_attn`` over such a step, through vLLM's
  ``build_attn_metadata`` into ``backend``'s real builder for one of the
  model's full-attention layers; returns that layer's metadata;
- ``new_request(req_id, prompt_len, extra)``: the scheduler's record of a new
  classify request whose pooling parameters carry ``extra``; ``PACKED`` is a
  packed request's ``extra`` and ``STEP`` a step of packed and plain rows, which
  the packed-phase tests share;
- ``hybrid_groups(config)`` and ``hybrid_metadata(state_and_config, order,
  prompt_lens, slots)``: the model's two KV-cache groups (full attention on the
  D3 composite, Gated DeltaNet on vLLM's GDN backend) and the state's
  ``prepare_attn`` over a step on them; returns a full-attention layer's
  metadata, a GDN layer's, and the GDN layer names; ``step_metadata(
  state_and_config, step)`` adds ``step``'s rows (``STEP``'s form) to the
  state first; both take align mode's prefill checkpoints as given
  (``GivenCheckpoints``);
- ``dense_pieces_mask(metadata)``: the (query, key) token pairs of a step that
  the dense-piece attention metadata lets attend, rebuilt from its two passes
  (each query's two key sets must not overlap: their results are merged).
"""

import itertools
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata
from vllm.model_executor.models.registry import ModelRegistry
from vllm.pooling_params import PoolingParams
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.mm.rope import RopeState
from vllm.v1.worker.gpu.model_states import default as default_model_state
from vllm.v1.worker.utils import AttentionGroup

from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesMetadata,
    D3PrefixBidirAttentionBackend,
)

CPU = torch.device("cpu")


@contextmanager
def single_process_group() -> Iterator[None]:
    """vLLM's distributed state for one CPU process (gloo), torn down after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        cleanup_dist_env_and_memory()


def vllm_config_for(path: str, align_block: int | None = None):
    """``align_block``: prefix caching's align mode on blocks of that many
    tokens, as an engine resolves it (set after the config hook, which without
    a GPU refuses prefix caching: the state cache serves the state-once reads)."""
    config = EngineArgs(model=path, max_model_len=4096).create_engine_config()
    if align_block is not None:
        cache = config.cache_config
        cache.enable_prefix_caching = True
        cache.mamba_cache_mode = "align"
        cache.mamba_block_size = cache.hash_block_size = align_block
        cache.cache_hit_alignment_tokens = align_block
    return config


def build_model(model_cls, config):
    with set_current_vllm_config(config):
        return model_cls(vllm_config=config)


class StagedPositions:
    """Stands in for ``RopeState``'s pinned-memory buffer (which needs a GPU
    driver): keeps what is staged, position by position."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, int]] = {}

    def stage_write(self, index: int, start: int, values) -> None:
        row = self.rows.setdefault(index, {})
        for offset, value in enumerate(values):
            row[start + offset] = value


class CpuRopeState(RopeState):
    """vLLM's ``RopeState`` (its real ``init_prefill_positions``, which calls the
    model's own M-RoPE) over ``StagedPositions``."""

    def __init__(self, *args, **kwargs) -> None:
        self.num_dims = 3
        self.staged_positions = StagedPositions()
        # Where vLLM's state has its pinned buffers: what its methods call.
        self.prefill_positions = self.staged_positions  # type: ignore[assignment]
        self.prefill_delta = SimpleNamespace(  # type: ignore[assignment]
            np=np.zeros(8, dtype=np.int32)
        )

    def staged(self, req_index: int, length: int) -> torch.Tensor:
        rows = self.staged_positions.rows
        return torch.tensor(
            [
                [rows[3 * req_index + axis][t] for t in range(length)]
                for axis in range(3)
            ]
        )


@contextmanager
def cpu_model_state(
    state_cls: type, path: str, align_block: int | None = None
) -> Iterator[tuple[Any, VllmConfig]]:
    config = vllm_config_for(path, align_block)
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architectures, config.model_config
    )
    model = build_model(model_cls, config)
    vllms_rope_state = default_model_state.get_rope_state
    default_model_state.get_rope_state = CpuRopeState
    try:
        with set_current_vllm_config(config):
            yield state_cls(config, model, None, CPU), config
    finally:
        default_model_state.get_rope_state = vllms_rope_state


def prefill_batch(req_ids, prompt_lens, computed=None) -> InputBatch:
    """One step that schedules each prompt to its end, as the runner schedules
    D3 prompts (the dummy batch splits its tokens evenly instead), after
    ``computed[req_id]`` tokens found in the prefix cache (default none)."""
    lens = np.asarray(prompt_lens, dtype=np.int32)
    hits = np.asarray([(computed or {}).get(r, 0) for r in req_ids], dtype=np.int32)
    query_lens = lens - hits
    batch = InputBatch.make_dummy(
        len(req_ids), int(query_lens.sum()), InputBuffers(8, 256, CPU)
    )
    batch.req_ids[:] = req_ids
    batch.num_scheduled_tokens[:] = query_lens
    batch.query_start_loc_np[1:] = np.cumsum(query_lens)
    batch.query_start_loc.copy_(torch.from_numpy(batch.query_start_loc_np))
    batch.seq_lens.copy_(torch.from_numpy(lens))
    batch.seq_lens_cpu_upper_bound.copy_(torch.from_numpy(lens))
    batch.max_query_len = int(query_lens.max())
    return batch


def attention_metadata(
    state_and_config, req_ids, prompt_lens, backend=TritonAttentionBackend
):
    """Run the state's prepare_attn over one prefill batch of whole prompts."""
    model_state, config = state_and_config
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=256, dtype=torch.bfloat16
    )
    # One of the model's own full-attention layers (the composite's routing
    # reads the layers of its group).
    layer = next(
        name
        for name, module in config.compilation_config.static_forward_context.items()
        if isinstance(module, Attention)
    )
    group = AttentionGroup(
        backend=backend,
        layer_names=[layer],
        kv_cache_spec=spec,
        kv_cache_group_id=0,
    )
    group.create_metadata_builders(config, CPU)
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([layer], spec)],
    )
    num_tokens = sum(prompt_lens)
    batch = prefill_batch(req_ids, prompt_lens)
    with set_current_vllm_config(config):
        metadata = model_state.prepare_attn(
            batch,
            CUDAGraphMode.NONE,
            # Row r's blocks are 100 r, 100 r + 1, ...: each row is recognisable.
            (
                100 * torch.arange(len(req_ids), dtype=torch.int32)[:, None]
                + torch.arange(16, dtype=torch.int32),
            ),
            torch.zeros(1, num_tokens, dtype=torch.int64),
            [[group]],
            kv_cache_config,
        )
    return metadata[layer]


#: A packed request's ``extra``: a 5-token state, then three questions.
PACKED = {"d3_state_tokens": 5, "d3_question_ends": [9, 12, 20]}
#: Two packed requests of different states and question counts beside a plain
#: one, in one step: (request, prompt length, extra, state slot; in align mode
#: the row's Gated DeltaNet block table).
STEP = [
    ("a", 10, {"d3_state_tokens": 4}, 3),
    ("p", 20, PACKED, 5),
    ("r", 14, {"d3_state_tokens": 6, "d3_question_ends": [10, 14]}, 7),
]


def new_request(req_id: str, prompt_len: int, extra) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        prefill_token_ids=list(range(prompt_len)),
        mm_features=[],
        sampling_params=None,
        pooling_params=PoolingParams(task="classify", extra_kwargs=extra),
        block_ids=([0],),
        num_computed_tokens=0,
        lora_request=None,
    )


def hybrid_groups(config):
    """The model's full-attention layers in one KV-cache group (the D3
    composite), its Gated DeltaNet layers in another (vLLM's GDN backend, the
    spec its layers declare)."""
    layers = config.compilation_config.static_forward_context
    attention = [n for n, m in layers.items() if isinstance(m, Attention)]
    gdn = [n for n, m in layers.items() if isinstance(m, MambaBase)]
    assert attention and gdn
    attention_spec = FullAttentionSpec(
        block_size=80, num_kv_heads=1, head_size=256, dtype=torch.float16
    )
    gdn_spec = layers[gdn[0]].get_kv_cache_spec(config)
    assert isinstance(gdn_spec, MambaSpec)
    groups = [
        AttentionGroup(
            backend=D3PrefixBidirAttentionBackend,
            layer_names=attention,
            kv_cache_spec=attention_spec,
            kv_cache_group_id=0,
        ),
        AttentionGroup(
            backend=layers[gdn[0]].get_attn_backend(),
            layer_names=gdn,
            kv_cache_spec=gdn_spec,
            kv_cache_group_id=1,
        ),
    ]
    for group in groups:
        group.create_metadata_builders(config, CPU)
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(attention, attention_spec),
            KVCacheGroupSpec(gdn, gdn_spec),
        ],
    )
    return attention, gdn, groups, kv_cache_config


class GivenCheckpoints:
    """Stands in for a GDN builder's ``checkpoint_builder``, which places
    align mode's prefill checkpoints by block (and needs align mode's block
    tables): a build gets vLLM's checkpoint metadata for ``checkpoints``
    (row: (offset into its query, slot)). The plugin's own scans are built
    with none (``d3_packed_gdn._on_slots``)."""

    def __init__(self, checkpoints: dict[int, tuple[int, int]]) -> None:
        self.checkpoints = checkpoints

    def build(self, m, request_rows):
        given = self.checkpoints
        offsets = [given.get(row, (0, 0))[0] for row in request_rows]
        slots = [given.get(row, (0, 0))[1] for row in request_rows]
        return MambaPrefillCheckpointMetadata(
            checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32),
            state_indices=torch.tensor(slots, dtype=torch.int64),
            offsets=offsets,
            query_lens=m.query_start_loc_cpu.diff()[request_rows].tolist(),
        )


def hybrid_metadata(
    state,
    order,
    prompt_lens,
    slots,
    for_capture=False,
    checkpoints=None,
    computed=None,
):
    """prepare_attn over one prefill batch on the hybrid groups; row r's GDN
    state slot is ``slots[r]``; ``checkpoints``: ``GivenCheckpoints``;
    ``computed``: as ``prefill_batch`` takes it."""
    model_state, config = state
    attention, gdn, groups, kv_cache_config = hybrid_groups(config)
    if checkpoints:
        builder = groups[1].get_metadata_builder(0)
        builder.checkpoint_builder = GivenCheckpoints(checkpoints)
    batch = prefill_batch(order, prompt_lens, computed)
    batch.is_prefilling_np[:] = True
    with set_current_vllm_config(config):
        metadata = model_state.prepare_attn(
            batch,
            CUDAGraphMode.NONE,
            (
                torch.arange(16 * len(order), dtype=torch.int32).reshape(-1, 16),
                torch.tensor(
                    [slot if isinstance(slot, list) else [slot] for slot in slots],
                    dtype=torch.int32,
                ),
            ),
            torch.zeros(2, batch.num_tokens, dtype=torch.int64),
            [[groups[0]], [groups[1]]],
            kv_cache_config,
            for_capture=for_capture,
        )
    return metadata[attention[0]], metadata[gdn[0]], gdn


def step_metadata(state, step=STEP, checkpoints=None, computed=None):
    """``hybrid_metadata`` over ``step``: each row ``(request, prompt length,
    extra, state slot)`` added to the model state as a new request, then
    scheduled to its end, in order (after ``computed[request]`` cached
    tokens)."""
    model_state, _ = state
    for index, (req_id, prompt_len, extra, _) in enumerate(step):
        model_state.add_request(index, new_request(req_id, prompt_len, extra))
    return hybrid_metadata(
        state,
        [req_id for req_id, *_ in step],
        [prompt_len for _, prompt_len, _, _ in step],
        [slot for *_, slot in step],
        checkpoints=checkpoints,
        computed=computed,
    )


def dense_pieces_mask(metadata: D3DensePiecesMetadata) -> torch.Tensor:
    """(tokens, keys) bool: which keys each query of the step reads (the keys
    in the passes' layout: the step's tokens, or each row's prompt in order
    where some came from the prefix cache)."""
    num_tokens = metadata.num_actual_tokens
    own_q = metadata.own_keys.cu_seqlens_q.cpu().tolist()
    own_k = metadata.own_keys.cu_seqlens_k.cpu().tolist()
    assert own_q[0] == own_k[0] == 0 and own_q[-1] == num_tokens
    mask = torch.zeros(num_tokens, own_k[-1], dtype=torch.bool)
    for (a, b), (c, d) in zip(
        itertools.pairwise(own_q), itertools.pairwise(own_k), strict=True
    ):
        mask[a:b, c:d] = True
    questions = metadata.question_tokens.cpu()
    state = metadata.state_keys
    cu_q, cu_k = state.cu_seqlens_q.cpu().tolist(), state.cu_seqlens_k.cpu().tolist()
    assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == len(questions)
    for seq in range(len(cu_q) - 1):
        rows = questions[cu_q[seq] : cu_q[seq + 1]]
        keys = slice(cu_k[seq], cu_k[seq + 1])
        assert not mask[rows, keys].any(), "a key read in both passes"
        mask[rows, keys] = True
    return mask
