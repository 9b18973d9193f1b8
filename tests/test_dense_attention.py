"""The dense-piece attention path on the CPU: pieces, routing, kernel choice.

``dense_pieces`` and the dense metadata run on vLLM's real
``CommonAttentionMetadata``; the pieces are checked against the prefix_bidir
mask written from its definition. The config hook runs through vLLM's own
``EngineArgs.create_engine_config``; where a test needs a GPU, the platform is
faked at vLLM's interface (a ``Platform`` of the family's enum and compute
capability, vLLM's FlashAttention extensions and Triton present).
"""

import os
import pickle
import random
import subprocess
import sys
import types

import pytest
import torch
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from vllm_d3.testing.model_runner import dense_pieces_mask
from vllm_d3.testing.platforms import fake_gpu
from vllm_d3.v1.attention.backends import (
    d3_dense_kernels,
    d3_kernel_check,
    d3_prefix_bidir,
)
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesBackend,
    D3DensePiecesMetadata,
    D3PrefixBidirAttentionBackend,
    DensePieceRouting,
    dense_pieces,
)

#: The registry member the full-attention layers get: vLLM's CUSTOM with the
#: plugin, the backend's own in-tree.
MEMBER = AttentionBackendEnum[d3_prefix_bidir.REGISTRY_MEMBER]

# (state tokens s, prompt length n, tokens computed before this step c)
Row = tuple[int, int, int]


def batch(rows: list[Row], ranges=None, query_lens=None) -> CommonAttentionMetadata:
    """One step over ``rows``, each scheduled to its end unless ``query_lens``
    says otherwise; ``ranges`` defaults to the model state's two per row."""
    if query_lens is None:
        query_lens = [n - c for _, n, c in rows]
    if ranges is None:
        ranges = {i: [(0, s - 1), (s, n - 1)] for i, (s, n, _) in enumerate(rows)}
    starts = torch.zeros(len(rows) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    seq_lens = torch.tensor(
        [c + q for (_, _, c), q in zip(rows, query_lens, strict=True)],
        dtype=torch.int32,
    )
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros((len(rows), 4), dtype=torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        mm_req_doc_ranges=ranges,
    )


def step_mask(metadata: CommonAttentionMetadata) -> torch.Tensor:
    """The (query, key) pairs the dense pieces of ``metadata`` attend."""
    pieces = dense_pieces(metadata)
    assert pieces is not None
    device_metadata = D3DensePiecesMetadata.of(
        pieces,
        metadata.num_actual_tokens,
        torch.device("cpu"),
        metadata.block_table_tensor,
    )
    return dense_pieces_mask(device_metadata)


def expected_step_mask(rows: list[Row], row_masks: list[torch.Tensor]) -> torch.Tensor:
    """Each row's mask on the diagonal: no row reads another's keys."""
    return torch.block_diag(*row_masks) if rows else torch.zeros(0, 0)


def allowed(s: int, n: int) -> torch.Tensor:
    """prefix_bidir: a state query sees the state, a question query sees every
    token."""
    queries = torch.arange(n)[:, None]
    keys = torch.arange(n)[None, :]
    return (queries >= s) | (keys < s)


@pytest.mark.parametrize("seed", range(20))
def test_pieces_give_exactly_the_prefix_bidir_mask(seed):
    # Some rows found their first c tokens in the prefix cache (c < s): their
    # queries c..n-1 read the keys of their whole prompt, in prompt order.
    rng = random.Random(seed)
    rows = [(9, 15, 4)]
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 60)
        s = rng.randint(1, n)  # s == n: a prompt all state
        rows.append((s, n, rng.choice([0, rng.randrange(s)])))
    got = step_mask(batch(rows))
    expected = expected_step_mask(rows, [allowed(s, n)[c:] for s, n, c in rows])
    assert torch.equal(got, expected)


def test_two_passes_per_step():
    pieces = dense_pieces(batch([(4, 10, 0), (7, 7, 0), (3, 5, 0)]))
    assert pieces is not None
    # Every range over itself: [0, 4) [4, 10) | [10, 17) | [17, 20) [20, 22).
    assert pieces.own_cu_seqlens_q.tolist() == [0, 4, 10, 17, 20, 22]
    assert pieces.own_cu_seqlens_k.tolist() == [0, 4, 10, 17, 20, 22]
    assert pieces.cached is None
    # Each row's question rows over its state, then its question keys skipped.
    assert pieces.question_tokens.tolist() == [4, 5, 6, 7, 8, 9, 20, 21]
    assert pieces.state_cu_seqlens_q.tolist() == [0, 6, 6, 6, 6, 8, 8]
    assert pieces.state_cu_seqlens_k.tolist() == [0, 4, 10, 17, 17, 20, 22]


def test_cached_keys_are_laid_out_in_prompt_order():
    # Row 0 found 3 tokens cached, row 1 none, row 2 found 2.
    pieces = dense_pieces(batch([(4, 10, 3), (3, 5, 0), (6, 8, 2)]))
    assert pieces is not None and pieces.cached is not None
    # The step's 7 + 5 + 6 tokens, then the cached keys (indices 18 on).
    assert pieces.cached.rows.tolist() == [0, 0, 0, 2, 2]
    assert pieces.cached.positions.tolist() == [0, 1, 2, 0, 1]
    assert pieces.cached.key_tokens.tolist() == [
        *(18, 19, 20),
        *range(0, 7),
        *range(7, 12),
        *(21, 22),
        *range(12, 18),
    ]
    assert pieces.own_cu_seqlens_q.tolist() == [0, 1, 7, 10, 12, 16, 18]
    assert pieces.own_cu_seqlens_k.tolist() == [0, 4, 10, 13, 15, 21, 23]


def test_the_cached_keys_are_read_from_the_paged_cache():
    from vllm_d3.v1.attention.backends.d3_prefix_bidir import with_cached_keys

    # Triton's cache: 6 blocks of 4 tokens, 2 KV heads of 8, keys then values.
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(6, 2, 4, 16, generator=generator)
    block_table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    # Row 0: 6 cached tokens (blocks 5, then 2), 4 computed; row 1: 1 cached.
    rows = [(8, 10, 6), (3, 4, 1)]
    pieces = dense_pieces(batch(rows))
    assert pieces is not None
    metadata = D3DensePiecesMetadata.of(pieces, 7, torch.device("cpu"), block_table)
    key = torch.randn(7, 2, 8, generator=generator)
    value = torch.randn(7, 2, 8, generator=generator)
    assert metadata.cached_keys is not None
    keys, values = with_cached_keys(key, value, kv_cache, metadata.cached_keys, 8)

    def cached(block: int, offset: int) -> torch.Tensor:
        return kv_cache[block, :, offset]

    prompt_0 = [cached(5, t) for t in range(4)] + [cached(2, t) for t in range(2)]
    expected = torch.stack(
        [*prompt_0, *(torch.cat([key[t], value[t]], -1) for t in range(4))]
        + [cached(1, 0), *(torch.cat([key[t], value[t]], -1) for t in range(4, 7))]
    )
    assert torch.equal(torch.cat([keys, values], -1), expected)


def test_the_query_bound_is_never_one():
    # Rows of one question token: the state pass's sequences have one query or
    # none, and a bound of 1 would make PyTorch's flash attention regroup the heads as
    # for one query in every sequence.
    pieces = dense_pieces(batch([(4, 5, 0), (9, 10, 0)]))
    assert pieces is not None
    metadata = D3DensePiecesMetadata.of(pieces, 15, torch.device("cpu"))
    assert metadata.state_keys.cu_seqlens_q.tolist() == [0, 1, 1, 2, 2]
    assert metadata.state_keys.max_seqlen_q == 2
    assert metadata.own_keys.max_seqlen_q == 9


@pytest.mark.parametrize(
    ("rows", "ranges", "query_lens", "why"),
    [
        ([(4, 10, 0)], None, [6], "a prompt split across steps"),
        ([(4, 10, 4)], None, None, "a row computed past its state before"),
        ([(4, 10, 0), (1, 8, 0)], {0: [(0, 3), (4, 9)]}, None, "a causal row"),
        ([(4, 10, 0), (1, 9, 8)], {0: [(0, 3), (4, 9)]}, None, "one causal query"),
        ([(4, 10, 0)], {0: [(0, 3), (5, 9)]}, None, "a gap between ranges"),
        ([(4, 10, 0)], {0: [(1, 3), (4, 9)]}, None, "ranges from 1"),
        ([(4, 10, 0)], {0: [(0, 3), (4, 12)]}, None, "ranges past the end"),
    ],
)
def test_batches_that_are_not_dense_pieces(rows, ranges, query_lens, why):
    metadata = batch(rows, ranges, query_lens)
    assert dense_pieces(metadata) is None, why
    assert DensePieceRouting([], VllmConfig()).select(metadata) == 0


def test_routing():
    routing = DensePieceRouting([], VllmConfig())
    assert routing.select(batch([(4, 10, 0), (2, 3, 0)])) == 1
    # No ranges (profiling, dummy rows): plain causal Triton in the dense child.
    assert routing.select(batch([(4, 10, 0)], ranges={})) == 1


def test_backend_registration():
    load_general_plugins()  # as every vLLM process does
    assert MEMBER.get_class() is D3PrefixBidirAttentionBackend
    # The layer looks its backend up in AttentionBackendEnum by this name.
    assert D3PrefixBidirAttentionBackend.get_name() == MEMBER.name
    assert D3PrefixBidirAttentionBackend.general_backend_cls is TritonAttentionBackend
    assert D3PrefixBidirAttentionBackend.causal_backend_cls is D3DensePiecesBackend
    # Both children share vLLM's Triton cache layout and block sizes: the
    # dense pieces read the step's own keys, not the pages.
    assert issubclass(D3DensePiecesBackend, TritonAttentionBackend)
    assert D3PrefixBidirAttentionBackend.supports_block_size(784)


def test_the_selection_survives_a_spawned_process():
    # A spawned engine core unpickles the config before any plugin loads: the
    # backend must be a member every process has.
    pickled = pickle.dumps({"full_attention": MEMBER})
    code = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=pickled,
        capture_output=True,
        check=True,
        env={**os.environ, "VLLM_PLUGINS": ""},
    )
    assert f"AttentionBackendEnum.{MEMBER.name}".encode() in result.stdout


def test_platform_probe_on_the_cpu():
    assert d3_dense_kernels.platform_kernels() == (
        None,
        [],
        "not a CUDA or ROCm GPU",
    )


def engine_config(path, **kwargs):
    return EngineArgs(model=path, max_model_len=4096, **kwargs).create_engine_config()


@pytest.fixture
def checks(monkeypatch):
    """The start-up checks asked for; each passes unless a test says otherwise."""
    asked: list[list[str]] = []
    failing: set[str] = set()

    def check(names):
        asked.append(list(names))
        passing = [n for n in names if n not in failing]
        return (passing[0] if passing else None), [f"{n}: wrong" for n in failing]

    monkeypatch.setattr(d3_kernel_check, "check_kernels", check)
    return types.SimpleNamespace(asked=asked, failing=failing)


def test_hook_selects_dense_pieces_where_they_run(make_checkpoint, hopper, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    selected = config.attention_config.backend_per_kind
    assert selected == {"full_attention": MEMBER}
    assert config.attention_config.backend is None
    assert "full-attention layers on D3_PREFIX_BIDIR" in "\n".join(hook_log)


def test_state_once_where_dense_pieces_run(make_checkpoint, hopper, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    # The decisions apart from the user's switches, of which none was given.
    assert config.additional_config == {
        "d3_decided": {
            "d3_attention_kernel": "fa3",
            "d3_state_once": True,
            "state_cache_by_default": True,
        },
        # vLLM's choice on Hopper for the tiny checkpoint's GDN heads of 128.
        "gdn_prefill_backend": "flashinfer",
    }
    log = "\n".join(hook_log)
    assert "reads each request's state once" in log
    assert "Gated DeltaNet prefill on flashinfer" in log


@pytest.mark.parametrize(
    ("additional", "expected"),
    [
        ({"d3_state_once": False}, False),
        ({"gdn_prefill_backend": "triton"}, True),
    ],
)
def test_the_state_once_switch_and_a_chosen_gdn_kernel(
    make_checkpoint, hopper, additional, expected
):
    config = engine_config(
        make_checkpoint(weights=False), additional_config=dict(additional)
    )
    assert config.additional_config["d3_decided"]["d3_state_once"] is expected
    chosen = additional.get("gdn_prefill_backend", "flashinfer")
    assert config.additional_config["gdn_prefill_backend"] == chosen


def test_a_quantized_kv_cache_reads_one_question_per_request(
    make_checkpoint, hopper, hook_log
):
    config = engine_config(make_checkpoint(weights=False), kv_cache_dtype="fp8")
    assert config.attention_config.backend_per_kind == {}
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == "ranged"
    assert config.additional_config["d3_decided"]["d3_state_once"] is False
    log = "\n".join(hook_log)
    assert "not D3_PREFIX_BIDIR: the dense pieces read a bf16/fp16 KV cache" in log


def test_a_bad_state_once_switch_stops_start_up(make_checkpoint, hopper):
    with pytest.raises(ValueError, match="d3_state_once must be true or false"):
        engine_config(
            make_checkpoint(weights=False), additional_config={"d3_state_once": 1}
        )


def test_hook_keeps_vllm_selection_without_a_hopper_gpu(make_checkpoint, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    assert config.attention_config.backend_per_kind == {}
    assert "not D3_PREFIX_BIDIR: not a CUDA or ROCm GPU" in "\n".join(hook_log)
    # No dense pieces, no packed questions: one engine request per question.
    assert config.additional_config["d3_decided"]["d3_state_once"] is False


def test_a_chosen_backend_wins(make_checkpoint, hopper, hook_log):
    config = engine_config(
        make_checkpoint(weights=False), attention_backend="TRITON_FLASH_ATTN"
    )
    assert config.attention_config.backend_per_kind == {}
    assert config.attention_config.backend == AttentionBackendEnum.TRITON_FLASH_ATTN
    assert "not D3_PREFIX_BIDIR: TRITON_FLASH_ATTN was chosen" in "\n".join(hook_log)


@pytest.mark.parametrize("gdn_prefill_backend", ["flashinfer", "triton"])
def test_flashinfer_autotune_is_skipped_by_default(
    make_checkpoint, hopper, hook_log, gdn_prefill_backend
):
    # FlashInfer's Gated DeltaNet prefill does not use its autotuner.
    config = engine_config(
        make_checkpoint(weights=False), gdn_prefill_backend=gdn_prefill_backend
    )
    assert config.kernel_config.enable_flashinfer_autotune is False
    assert "FlashInfer autotune off: no kernel of this unquantized model" in (
        "\n".join(hook_log)
    )


@pytest.mark.parametrize(
    ("attention_mode", "kwargs", "expected"),
    [
        # The user's choice stays, either way.
        ("prefix_bidir", {"enable_flashinfer_autotune": True}, True),
        ("prefix_bidir", {"enable_flashinfer_autotune": False}, False),
        # So may a quantized model's matrix multiplies.
        ("prefix_bidir", {"quantization": "fp8_per_tensor"}, True),
        # Other modes keep vLLM's default.
        ("causal", {}, True),
    ],
)
def test_flashinfer_autotune_is_left_to_the_user_and_vllm(
    make_checkpoint, hopper, hook_log, attention_mode, kwargs, expected
):
    checkpoint = make_checkpoint(attention_mode=attention_mode, weights=False)
    config = engine_config(checkpoint, **kwargs)
    assert config.kernel_config.enable_flashinfer_autotune is expected
    assert not any("FlashInfer autotune off" in line for line in hook_log)


@pytest.fixture
def no_allocator_settings(allocator_settings, monkeypatch):
    """None of the caching allocator's variables set (restored after)."""
    for name in allocator_settings:
        monkeypatch.delenv(name, raising=False)
    return allocator_settings


def test_the_engine_allocator_gets_expandable_segments(
    make_checkpoint, no_allocator_settings, hook_log
):
    config = engine_config(make_checkpoint(weights=False))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert {n for n in no_allocator_settings if n in os.environ} == {
        "PYTORCH_CUDA_ALLOC_CONF"
    }
    steps = config.scheduler_config.max_num_batched_tokens
    assert (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the engine: prompts "
        f"are read whole, so its steps hold up to {steps} tokens"
    ) in "\n".join(hook_log)


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [
        # Added to the settings in effect (this variable wins over the CUDA one).
        (
            "PYTORCH_ALLOC_CONF",
            "max_split_size_mb:512",
            "max_split_size_mb:512,expandable_segments:True",
        ),
        # The user's own choice, either way, stays.
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", None),
        (
            "PYTORCH_CUDA_ALLOC_CONF",
            "roundup_power2_divisions:4,expandable_segments:True",
            None,
        ),
    ],
)
def test_the_users_allocator_settings_are_kept(
    make_checkpoint, no_allocator_settings, hook_log, monkeypatch, name, given, expected
):
    monkeypatch.setenv(name, given)
    engine_config(make_checkpoint(weights=False))
    assert os.environ[name] == (expected or given)
    assert [n for n in no_allocator_settings if n in os.environ] == [name]
    if expected is None:
        assert f"CUDA caching allocator as configured ({given})" in "\n".join(hook_log)


def test_a_kv_connector_keeps_the_allocator_segments_fixed(
    make_checkpoint, no_allocator_settings, hook_log
):
    engine_config(
        make_checkpoint(weights=False),
        kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    )
    assert not any(name in os.environ for name in no_allocator_settings)
    assert "without expandable segments: a KV connector is configured" in (
        "\n".join(hook_log)
    )


def test_other_modes_leave_the_allocator_alone(make_checkpoint, no_allocator_settings):
    engine_config(make_checkpoint(attention_mode="causal", weights=False))
    assert not any(name in os.environ for name in no_allocator_settings)


@pytest.mark.plugin
def test_a_custom_backend_of_another_plugin_is_left_alone(
    make_checkpoint, hopper, hook_log, monkeypatch
):
    from vllm_d3.model_executor.models import config as plugin_hook

    monkeypatch.setattr(plugin_hook, "owns_custom_backend", lambda: False)
    config = engine_config(make_checkpoint(weights=False))
    assert config.attention_config.backend_per_kind == {}
    assert config.additional_config["d3_decided"]["d3_state_once"] is False
    assert "the CUSTOM attention backend belongs to another plugin" in (
        "\n".join(hook_log)
    )


@pytest.mark.parametrize("mode", ["causal", "noncausal_full_attention"])
def test_other_modes_keep_vllm_selection(make_checkpoint, hopper, mode):
    config = engine_config(make_checkpoint(attention_mode=mode, weights=False))
    assert config.attention_config.backend_per_kind == {}


def packed_allowed(s: int, ends: list[int]) -> torch.Tensor:
    """The state read once: a state query sees the state; a query of question
    block [a, b) sees the state and [a, b)."""
    n = ends[-1]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, :s] = True
    for a, b in zip([s, *ends[:-1]], ends, strict=True):
        mask[a:b, a:b] = True
    return mask


@pytest.mark.parametrize("seed", range(10))
def test_packed_rows_give_exactly_the_state_once_mask(seed):
    rng = random.Random(seed)
    rows, ranges, masks = [], {}, []
    for row in range(rng.randint(1, 5)):
        s = rng.randint(1, 40)
        ends = [s]
        for _ in range(rng.choice([1, 2, 3, 6])):
            ends.append(ends[-1] + rng.randint(1, 20))
        ends = ends[1:]
        rows.append((s, ends[-1], 0))
        ranges[row] = [(0, s - 1)] + [
            (a, b - 1) for a, b in zip([s, *ends[:-1]], ends, strict=True)
        ]
        masks.append(packed_allowed(s, ends))
    assert torch.equal(step_mask(batch(rows, ranges)), expected_step_mask(rows, masks))


def test_a_packed_row_split_across_steps_is_refused():
    metadata = batch([(4, 12, 0)], {0: [(0, 3), (4, 7), (8, 11)]}, query_lens=[6])
    assert dense_pieces(metadata) is None
    with pytest.raises(d3_prefix_bidir.PackedRowError):
        DensePieceRouting([], VllmConfig()).select(metadata)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("Blackwell", ["fa2", "triton"]),
        ("Ampere/Ada", ["fa2", "triton"]),
        ("ROCm", ["torch_flash", "triton"]),
        ("another CUDA GPU", ["triton"]),
    ],
)
def test_each_gpu_family_gets_its_kernels_checked(
    make_checkpoint, monkeypatch, checks, hook_log, family, expected
):
    fake_gpu(monkeypatch, family)
    config = engine_config(make_checkpoint(weights=False))
    assert checks.asked == [expected]
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == expected[0]
    assert config.attention_config.backend_per_kind == {"full_attention": MEMBER}
    assert config.additional_config["d3_decided"]["d3_state_once"] is True
    assert f"passed its start-up check on this {family} GPU" in "\n".join(hook_log)


def test_a_kernel_that_fails_its_check_gives_way_to_the_next(
    make_checkpoint, monkeypatch, checks
):
    fake_gpu(monkeypatch, "ROCm")
    checks.failing.add("torch_flash")
    config = engine_config(make_checkpoint(weights=False))
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == "triton"


def test_no_kernel_passing_its_check_serves_the_ranged_path(
    make_checkpoint, monkeypatch, checks, hook_log
):
    fake_gpu(monkeypatch, "Blackwell")
    checks.failing.update({"fa2", "triton"})
    config = engine_config(make_checkpoint(weights=False))
    assert config.attention_config.backend_per_kind == {}
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == "ranged"
    assert config.additional_config["d3_decided"]["d3_state_once"] is False
    assert (
        "not D3_PREFIX_BIDIR: no dense-piece kernel of ['fa2', 'triton'] passed its "
        "start-up check on this Blackwell GPU"
    ) in "\n".join(hook_log)


@pytest.mark.parametrize("kernel", ["fa3", "fa2", "torch_flash", "triton"])
def test_the_switch_forces_a_kernel(make_checkpoint, hopper, hook_log, kernel):
    config = engine_config(
        make_checkpoint(weights=False),
        additional_config={"d3_attention_kernel": kernel},
    )
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == kernel
    assert config.attention_config.backend_per_kind == {"full_attention": MEMBER}
    chose = "(--additional-config d3_attention_kernel chose it"
    assert f"pieces on {kernel} {chose}" in "\n".join(hook_log)


def test_a_flash_attention_version_chooses_its_kernel(
    make_checkpoint, hopper, hook_log
):
    config = engine_config(
        make_checkpoint(weights=False), attention_config={"flash_attn_version": 2}
    )
    assert config.additional_config["d3_decided"]["d3_attention_kernel"] == "fa2"
    chose = "(--attention-config flash_attn_version chose it"
    assert f"pieces on fa2 {chose}" in "\n".join(hook_log)


def test_the_switch_forces_the_ranged_path(make_checkpoint, hopper, hook_log):
    config = engine_config(
        make_checkpoint(weights=False),
        additional_config={"d3_attention_kernel": "ranged"},
    )
    assert config.attention_config.backend_per_kind == {}
    assert config.additional_config["d3_decided"]["d3_state_once"] is False
    assert "not D3_PREFIX_BIDIR: d3_attention_kernel is ranged" in "\n".join(hook_log)


@pytest.mark.parametrize(
    ("family", "additional", "match"),
    [
        ("Hopper", {"d3_attention_kernel": "fa4"}, "must be one of auto, fa3, fa2, "),
        ("Ampere/Ada", {"d3_attention_kernel": "fa3"}, "runs on Hopper"),
        ("another CUDA GPU", {"d3_attention_kernel": "torch_flash"}, "needs compute"),
    ],
)
def test_an_unknown_or_unavailable_kernel_stops_start_up(
    make_checkpoint, monkeypatch, checks, family, additional, match
):
    fake_gpu(monkeypatch, family)
    with pytest.raises(ValueError, match=match):
        engine_config(make_checkpoint(weights=False), additional_config=additional)


def test_a_forced_kernel_that_fails_its_check_stops_start_up(
    make_checkpoint, monkeypatch, checks
):
    fake_gpu(monkeypatch, "ROCm")
    checks.failing.add("triton")
    with pytest.raises(ValueError, match="'triton' cannot serve .* start-up check"):
        engine_config(
            make_checkpoint(weights=False),
            additional_config={"d3_attention_kernel": "triton"},
        )


def test_a_forced_kernel_beside_a_chosen_backend_stops_start_up(
    make_checkpoint, hopper
):
    with pytest.raises(ValueError, match="TRITON_FLASH_ATTN was chosen"):
        engine_config(
            make_checkpoint(weights=False),
            attention_backend="TRITON_FLASH_ATTN",
            additional_config={"d3_attention_kernel": "triton"},
        )


def test_the_start_up_check_fails_without_a_gpu():
    # The check's own process: on this machine there is no GPU to run on.
    passed, failures = d3_kernel_check.check_kernels(["triton"])
    assert passed is None
    assert len(failures) == 1 and failures[0].startswith("triton: ")


@pytest.mark.parametrize("rows", d3_kernel_check.CHECK_BATCHES)
def test_the_start_up_checks_steps_are_prefix_bidir_steps(rows):
    # The check's batches reach the passes as the model state's would: each
    # row whole, its mask the state-once mask (all state: the state both ways).
    common = d3_prefix_bidir.step_metadata(rows, torch.device("cpu"))
    masks = [
        packed_allowed(row.state_tokens, list(row.question_ends))
        if row.question_ends
        else torch.ones(row.prompt_len, row.prompt_len, dtype=torch.bool)
        for row in rows
    ]
    assert torch.equal(step_mask(common), torch.block_diag(*masks))


def test_the_dense_impl_refuses_what_it_does_not_compute():
    from vllm.config import set_current_vllm_config

    from vllm_d3.v1.attention.backends.d3_prefix_bidir import D3DensePiecesImpl

    # The impl serves the kernel the config hook decided.
    decided = {"d3_decided": {"d3_attention_kernel": "triton"}}
    config = VllmConfig(additional_config=decided)
    with set_current_vllm_config(config):
        plain = D3DensePiecesImpl(4, 32, 32**-0.5, 2, None, None, "auto")
        other = D3DensePiecesImpl(
            4, 32, 32**-0.5, 2, [1.0] * 4, 128, "fp8", logits_soft_cap=30.0
        )
    plain._check_supported(None, None)
    with pytest.raises(d3_prefix_bidir.PackedRowError, match="with fused output"):
        plain._check_supported(torch.ones(1), None)
    with pytest.raises(
        d3_prefix_bidir.PackedRowError,
        match="with a quantized KV cache, a sliding window, ALiBi, a logit soft cap;",
    ):
        other._check_supported(None, None)
