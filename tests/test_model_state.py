"""The prefix_bidir model and its Model Runner V2 state, on vLLM's real classes.

The model is built on the CPU from a tiny checkpoint; the state's ``prepare_attn``
runs vLLM's own hybrid ``prepare_attn`` and ``build_attn_metadata`` into the real
attention metadata builders: Triton's, whose range tensor is what the ranged
kernel reads, and the D3 composite's FlashAttention builder, whose virtual
sequences (cu_seqlens, seqused_k, block-table rows) are what FlashAttention reads.
"""

import inspect
import socket

import numpy as np
import pytest
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
from vllm.model_executor.models import d3 as upstream_d3
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
from vllm.v1.worker.gpu import warmup as gpu_warmup
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states import default as default_model_state
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
from vllm.v1.worker.utils import AttentionGroup

from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3PrefixBidirAttentionBackend,
)
from vllm_d3.v1.worker.gpu.model_states.d3_prefix_bidir import (
    WARMUP_REQUEST_PREFIX,
    D3PrefixBidirModelState,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
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
    yield
    cleanup_dist_env_and_memory()


def vllm_config_for(path: str):
    return EngineArgs(model=path, max_model_len=4096).create_engine_config()


def build_model(model_cls, config):
    with set_current_vllm_config(config):
        return model_cls(vllm_config=config)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("prefix_bidir", D3PrefixBidirModelState),
        ("causal", MambaHybridModelState),
        ("noncausal_full_attention", None),
    ],
)
def test_model_state_resolution(make_checkpoint, mode, expected):
    path = make_checkpoint(attention_mode=mode, weights=False)
    config = vllm_config_for(path)
    arch = config.model_config.architectures
    model_cls, _ = ModelRegistry.resolve_model_cls(arch, config.model_config)
    assert model_cls.__module__ == "vllm_d3.model_executor.models.d3"
    model = build_model(model_cls, config)
    resolved = resolve_model_state_cls(config, model)
    if mode == "prefix_bidir":
        assert resolved is expected
        assert issubclass(resolved, MambaHybridModelState)
        return
    # causal and noncausal resolve exactly as 0.33.0's own class does.
    # (Each model registers its layers in its own config.)
    reference_config = vllm_config_for(path)
    reference = build_model(upstream_d3.D3ForSequenceClassification, reference_config)
    assert not hasattr(model, "get_model_state_cls")
    assert resolved is resolve_model_state_cls(reference_config, reference)
    if expected is not None:
        assert resolved is expected


def new_request(req_id: str, prompt_len: int, extra) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        mm_features=[],
        sampling_params=None,
        pooling_params=PoolingParams(task="classify", extra_kwargs=extra),
        block_ids=([0],),
        num_computed_tokens=0,
        lora_request=None,
    )


@pytest.fixture
def state(make_checkpoint, monkeypatch):
    # The M-RoPE position buffers need pinned host memory, i.e. a GPU driver;
    # positions play no part in the ranges, so this CPU state goes without them.
    monkeypatch.setattr(default_model_state, "get_rope_state", lambda *a, **k: None)
    config = vllm_config_for(make_checkpoint(weights=False))
    model_cls, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architectures, config.model_config
    )
    model = build_model(model_cls, config)
    with set_current_vllm_config(config):
        yield D3PrefixBidirModelState(config, model, None, CPU), config


def prefill_batch(req_ids, prompt_lens) -> InputBatch:
    """One step that schedules each prompt whole, as the runner schedules D3
    prompts (the dummy batch splits its tokens evenly instead)."""
    lens = np.asarray(prompt_lens, dtype=np.int32)
    batch = InputBatch.make_dummy(
        len(req_ids), int(lens.sum()), InputBuffers(8, 256, CPU)
    )
    batch.req_ids[:] = req_ids
    batch.num_scheduled_tokens[:] = lens
    batch.query_start_loc_np[1:] = np.cumsum(lens)
    batch.query_start_loc.copy_(torch.from_numpy(batch.query_start_loc_np))
    batch.seq_lens.copy_(torch.from_numpy(lens))
    batch.seq_lens_cpu_upper_bound.copy_(torch.from_numpy(lens))
    batch.max_query_len = int(lens.max())
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


def dense_mask(ranges: list[tuple[int, int]], n: int) -> torch.Tensor:
    """vLLM's range semantics: causal OR (q and k inside one inclusive range)."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    mask = k <= q
    for start, end in ranges:
        if start < end:
            mask |= (start <= q) & (q <= end) & (start <= k) & (k <= end)
    return mask


def prefix_bidir_mask(s: int, n: int) -> torch.Tensor:
    """The spec, written independently: state both ways, question sees the state
    and itself both ways, the state never sees the question."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:s, :s] = True
    mask[s:, :] = True
    return mask


def test_ranges_reach_the_triton_builder(state):
    model_state, _ = state
    requests = {"a": (10, 4), "b": (7, 7), "c": (5, 1), "d": (9, 8)}
    for index, (req_id, (n, s)) in enumerate(requests.items()):
        model_state.add_request(index, new_request(req_id, n, {"d3_state_tokens": s}))
    # A batch in another order than the requests were added.
    order = ["c", "a", "d", "b"]
    metadata = attention_metadata(state, order, [requests[r][0] for r in order])
    for row, req_id in enumerate(order):
        n, s = requests[req_id]
        # A prompt that is all state has no question range.
        question = [(s, n - 1)] if s < n else []
        assert metadata.mm_prefix_range[row] == [(0, s - 1), *question]
        ranges = [tuple(r) for r in metadata.mm_prefix_range_tensor[row].tolist()]
        assert torch.equal(dense_mask(ranges, n), prefix_bidir_mask(s, n))


def test_ranges_become_dense_pieces_for_flash_attention(state):
    model_state, _ = state
    requests = {"a": (10, 4), "b": (7, 7), "c": (5, 1), "d": (40, 20)}
    for index, (req_id, (n, s)) in enumerate(requests.items()):
        model_state.add_request(index, new_request(req_id, n, {"d3_state_tokens": s}))
    order = ["d", "b", "a", "c"]
    metadata = attention_metadata(
        state, order, [requests[r][0] for r in order], D3PrefixBidirAttentionBackend
    )
    assert metadata._attention_backend_variant == 1  # the FlashAttention child
    assert metadata.causal is False
    assert metadata.mm_prefix_query_range_tensor is None
    cu_seqlens = metadata.query_start_loc.tolist()
    seqused_k = metadata.seq_lens.tolist()
    table = metadata.block_table.tolist()
    assert len(cu_seqlens) == len(seqused_k) + 1 == len(table) + 1
    # Rebuild each prompt's mask from the virtual sequences: every query of a
    # sequence sees keys [0, seqused_k) of the row its block-table row names.
    starts = [0]
    for req_id in order:
        starts.append(starts[-1] + requests[req_id][0])
    masks = {
        r: torch.zeros(requests[r][0], requests[r][0], dtype=torch.bool) for r in order
    }
    for piece, keys in enumerate(seqused_k):
        row = table[piece][0] // 100
        assert table[piece] == [100 * row + b for b in range(16)]
        req_id = order[row]
        first, last = (
            cu_seqlens[piece] - starts[row],
            cu_seqlens[piece + 1] - starts[row],
        )
        assert 0 <= first < last <= requests[req_id][0]
        masks[req_id][first:last, :keys] = True
    for req_id, (n, s) in requests.items():
        assert torch.equal(masks[req_id], prefix_bidir_mask(s, n))


@pytest.mark.parametrize("for_capture", [False, True])
def test_hybrid_cache_dense_attention_beside_a_causal_gdn(state, for_capture):
    """A real hybrid KV-cache config: the model's full-attention layers in one
    group (the D3 composite), its Gated DeltaNet layers in another (vLLM's GDN
    backend, the spec its layers declare)."""
    model_state, config = state
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
    requests = {"a": (10, 4), "b": (7, 7)}
    for index, (req_id, (n, s)) in enumerate(requests.items()):
        model_state.add_request(index, new_request(req_id, n, {"d3_state_tokens": s}))
    order = ["b", "a"]
    batch = prefill_batch(order, [requests[r][0] for r in order])
    batch.is_prefilling_np[:] = True
    with set_current_vllm_config(config):
        metadata = model_state.prepare_attn(
            batch,
            CUDAGraphMode.NONE,
            (
                torch.arange(32, dtype=torch.int32).reshape(2, 16),
                torch.tensor([[3], [5]], dtype=torch.int32),
            ),
            torch.zeros(2, batch.num_tokens, dtype=torch.int64),
            [[groups[0]], [groups[1]]],
            kv_cache_config,
            for_capture=for_capture,
        )
    full = metadata[attention[0]]
    if for_capture:
        # Graph capture gets no ranges: plain causal attention over the rows.
        assert full.causal is True
        assert full.query_start_loc.tolist() == [0, 7, 17]
    else:
        # b (s = n = 7) is one piece; a (s = 4, n = 10) is two.
        assert full.causal is False
        assert full.query_start_loc.tolist() == [0, 7, 11, 17]
        assert full.seq_lens.tolist() == [7, 4, 10]
        assert [row[0] for row in full.block_table.tolist()] == [0, 16, 16]
    # The Gated DeltaNet scans each request's own tokens, causally, from its
    # own state slot: the ranges never reach it.
    scan = metadata[gdn[0]]
    assert scan.num_prefills == 2 and scan.num_decodes == 0
    assert scan.non_spec_query_start_loc.tolist() == [0, 7, 17]
    assert scan.non_spec_state_indices_tensor.tolist() == [3, 5]
    assert scan.has_initial_state.tolist() == [False, False]


def test_removed_requests_are_forgotten(state):
    model_state, _ = state
    model_state.add_request(0, new_request("a", 6, {"d3_state_tokens": 2}))
    model_state.remove_request("a")
    assert model_state.state_blocks == {}
    model_state.add_request(0, new_request("a", 6, {"d3_state_tokens": 3}))
    assert model_state.prefix_ranges(["a"]) == {0: [(0, 2), (3, 5)]}


def test_warmup_requests_are_split_in_two(state):
    model_state, _ = state
    model_state.add_request(0, new_request("_warmup_0_", 9, None))
    assert model_state.prefix_ranges(["_warmup_0_"]) == {0: [(0, 3), (4, 8)]}


def test_vllm_names_its_warmup_requests_so():
    # The prefix the state recognises is the one vLLM's warm-up gives its rows.
    source = inspect.getsource(gpu_warmup)
    assert f'req_ids = [f"{WARMUP_REQUEST_PREFIX}{{i}}_"' in source


def test_dummy_rows_get_no_ranges(state):
    metadata = attention_metadata(state, ["dummy_0", "dummy_1"], [5, 6])
    assert not metadata.mm_prefix_range
    assert metadata.mm_prefix_range_tensor is None


@pytest.mark.parametrize(
    "extra",
    [
        None,
        {},
        {"d3_state_tokens": True},
        {"d3_state_tokens": 2.0},
        {"d3_state_tokens": -1},
        {"d3_state_tokens": 0},
        {"d3_state_tokens": 11},
    ],
)
def test_bad_state_tokens_never_run_as_one_block(state, extra):
    model_state, _ = state
    with pytest.raises(ValueError, match="d3_state_tokens"):
        model_state.add_request(0, new_request("bad", 10, extra))
    assert "bad" not in model_state.state_blocks
