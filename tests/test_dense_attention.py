"""The dense-piece attention path on the CPU: pieces, routing, selection.

``dense_pieces`` and ``dense_piece_metadata`` run on vLLM's real
``CommonAttentionMetadata``; the pieces are checked against the prefix_bidir
mask written from its definition. The config hook runs through vLLM's own
``EngineArgs.create_engine_config``; only the platform probe is replaced where a
test needs a Hopper GPU.
"""

import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from vllm_d3.v1.attention.backends import d3_prefix_bidir
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DenseFlashAttentionBackend,
    D3PrefixBidirAttentionBackend,
    DensePieceRouting,
    dense_piece_metadata,
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
        # Row i's blocks are 10 i, 10 i + 1, ...
        block_table_tensor=10 * torch.arange(len(rows), dtype=torch.int32)[:, None]
        + torch.arange(4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        mm_req_doc_ranges=ranges,
    )


def allowed(s: int, n: int, c: int) -> torch.Tensor:
    """prefix_bidir for the queries [c, n): a state query sees the state, a
    question query sees every token."""
    queries = torch.arange(c, n)[:, None]
    keys = torch.arange(n)[None, :]
    return (queries >= s) | (keys < s)


def mask_from_metadata(metadata: CommonAttentionMetadata, rows: list[Row]):
    """What the rewritten metadata lets each row's queries see: every query of
    a sequence sees keys [0, seq_len) of the block-table row it names."""
    masks = [torch.zeros(n - c, n, dtype=torch.bool) for _, n, c in rows]
    row_starts = [0]
    for _, n, c in rows:
        row_starts.append(row_starts[-1] + n - c)
    cu = metadata.query_start_loc_cpu.tolist()
    assert torch.equal(metadata.query_start_loc, metadata.query_start_loc_cpu)
    assert torch.equal(metadata.seq_lens, metadata.seq_lens_cpu_upper_bound)
    assert cu[0] == 0 and cu[-1] == row_starts[-1]
    for piece in range(metadata.num_reqs):
        row = int(metadata.block_table_tensor[piece, 0]) // 10
        assert metadata.block_table_tensor[piece].tolist() == [
            10 * row + b for b in range(4)
        ]
        first, last = cu[piece] - row_starts[row], cu[piece + 1] - row_starts[row]
        assert 0 <= first < last <= rows[row][1] - rows[row][2]
        masks[row][first:last, : int(metadata.seq_lens[piece])] = True
    return masks


@pytest.mark.parametrize("seed", range(20))
def test_pieces_give_exactly_the_prefix_bidir_mask(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 60)
        s = rng.randint(1, n)  # s == n: a prompt that is all state
        c = rng.choice([0, 0, rng.randint(0, n - 1)])
        rows.append((s, n, c))
    metadata = batch(rows)
    pieces = dense_pieces(metadata)
    assert pieces is not None
    rewritten = dense_piece_metadata(metadata, pieces)
    assert rewritten.causal is False
    assert rewritten.mm_req_doc_ranges is None
    assert rewritten.num_actual_tokens == metadata.num_actual_tokens
    assert rewritten.max_query_len == max(np.diff(pieces.query_start_loc))
    for got, (s, n, c) in zip(mask_from_metadata(rewritten, rows), rows, strict=True):
        assert torch.equal(got, allowed(s, n, c))


def test_two_pieces_per_fresh_prompt():
    pieces = dense_pieces(batch([(4, 10, 0), (7, 7, 0), (3, 5, 4)]))
    assert pieces is not None
    assert pieces.rows.tolist() == [0, 0, 1, 2]
    assert pieces.query_start_loc.tolist() == [0, 4, 10, 17, 18]
    assert pieces.seq_lens.tolist() == [4, 10, 7, 5]


def test_single_queries_without_ranges_join_the_pieces():
    # A one-token row needs no range: its causal keys are all its keys.
    rows = [(4, 10, 0), (1, 9, 8)]
    pieces = dense_pieces(batch(rows, ranges={0: [(0, 3), (4, 9)]}))
    assert pieces is not None
    assert pieces.seq_lens.tolist() == [4, 10, 9]


@pytest.mark.parametrize(
    ("rows", "ranges", "query_lens", "why"),
    [
        ([(4, 10, 0)], None, [6], "a prompt split across steps"),
        ([(4, 10, 0), (1, 8, 0)], {0: [(0, 3), (4, 9)]}, None, "a causal row"),
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
    assert routing.select(batch([(4, 10, 0), (2, 3, 1)])) == 1
    # No ranges (profiling, dummy rows): plain causal FlashAttention.
    assert routing.select(batch([(4, 10, 0)], ranges={})) == 1


def test_backend_registration():
    load_general_plugins()  # as every vLLM process does
    assert MEMBER.get_class() is D3PrefixBidirAttentionBackend
    # The layer looks its backend up in AttentionBackendEnum by this name.
    assert D3PrefixBidirAttentionBackend.get_name() == MEMBER.name
    assert D3PrefixBidirAttentionBackend.general_backend_cls is TritonAttentionBackend
    assert D3PrefixBidirAttentionBackend.causal_backend_cls is (
        D3DenseFlashAttentionBackend
    )
    # Whole 80-token key tiles per page: d3-turbo's 783-token Mamba page
    # rounds up to 800, not to 784.
    assert D3PrefixBidirAttentionBackend.supports_block_size(800)
    assert not D3PrefixBidirAttentionBackend.supports_block_size(784)


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
    assert d3_prefix_bidir.dense_attention_unavailable() == "not a CUDA GPU"


def engine_config(path, **kwargs):
    return EngineArgs(model=path, max_model_len=4096, **kwargs).create_engine_config()


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
    """The platform probe as on a Hopper GPU with FlashAttention 3."""
    monkeypatch.setattr(d3_prefix_bidir, "dense_attention_unavailable", lambda: None)


def test_hook_selects_dense_pieces_where_they_run(make_checkpoint, hopper, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    selected = config.attention_config.backend_per_kind
    assert selected == {"full_attention": MEMBER}
    assert config.attention_config.backend is None
    assert "full-attention layers on D3_PREFIX_BIDIR" in "\n".join(hook_log)


def test_state_once_where_dense_pieces_run(make_checkpoint, hopper, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    assert config.additional_config == {
        "d3_state_once": True,
        "gdn_prefill_backend": "triton",
    }
    log = "\n".join(hook_log)
    assert "reads each request's state once" in log
    assert "Gated DeltaNet prefill on triton" in log


@pytest.mark.parametrize(
    ("additional", "expected"),
    [
        ({"d3_state_once": False}, False),
        ({"gdn_prefill_backend": "flashinfer"}, True),
    ],
)
def test_the_state_once_switch_and_a_chosen_gdn_kernel(
    make_checkpoint, hopper, additional, expected
):
    config = engine_config(
        make_checkpoint(weights=False), additional_config=dict(additional)
    )
    assert config.additional_config["d3_state_once"] is expected
    chosen = additional.get("gdn_prefill_backend", "triton")
    assert config.additional_config["gdn_prefill_backend"] == chosen


def test_a_quantized_kv_cache_reads_one_question_per_request(
    make_checkpoint, hopper, hook_log
):
    config = engine_config(make_checkpoint(weights=False), kv_cache_dtype="fp8")
    assert config.additional_config["d3_state_once"] is False
    assert "one engine request per question (reading the state once needs a " in (
        "\n".join(hook_log)
    )


def test_a_bad_state_once_switch_stops_start_up(make_checkpoint, hopper):
    with pytest.raises(ValueError, match="d3_state_once must be true or false"):
        engine_config(
            make_checkpoint(weights=False), additional_config={"d3_state_once": 1}
        )


def test_hook_keeps_vllm_selection_without_a_hopper_gpu(make_checkpoint, hook_log):
    config = engine_config(make_checkpoint(weights=False))
    assert config.attention_config.backend_per_kind == {}
    assert "not D3_PREFIX_BIDIR: not a CUDA GPU" in "\n".join(hook_log)
    # No dense pieces, no packed questions: one engine request per question.
    assert config.additional_config["d3_state_once"] is False


def test_a_chosen_backend_wins(make_checkpoint, hopper, hook_log):
    config = engine_config(
        make_checkpoint(weights=False), attention_backend="TRITON_FLASH_ATTN"
    )
    assert config.attention_config.backend_per_kind == {}
    assert config.attention_config.backend == AttentionBackendEnum.TRITON_FLASH_ATTN
    assert "not D3_PREFIX_BIDIR: TRITON_FLASH_ATTN was chosen" in "\n".join(hook_log)


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
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the engine: without "
        f"chunked prefill its steps hold up to {steps} tokens"
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
    assert config.additional_config["d3_state_once"] is False
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
    rows, ranges, packed = [], {}, {}
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
        packed[row] = ends
    metadata = batch(rows, ranges)
    pieces = dense_pieces(metadata)
    assert pieces is not None
    masks = mask_from_metadata(dense_piece_metadata(metadata, pieces), rows)
    # Each own-key piece adds its block's keys to its block's queries.
    row_starts = np.cumsum([0] + [n for _, n, _ in rows])
    for first, end in pieces.questions.tolist():
        row = int(np.searchsorted(row_starts, first, side="right")) - 1
        a, b = first - row_starts[row], end - row_starts[row]
        masks[row][a:b, a:b] = True
    for row, (s, _, _) in enumerate(rows):
        assert torch.equal(masks[row], packed_allowed(s, packed[row]))
    # Only rows with two or more questions have own-key pieces.
    assert len(pieces.questions) == sum(len(e) for e in packed.values() if len(e) > 1)


def test_a_packed_row_split_across_steps_is_refused():
    metadata = batch([(4, 12, 0)], {0: [(0, 3), (4, 7), (8, 11)]}, query_lens=[6])
    assert dense_pieces(metadata) is None
    with pytest.raises(d3_prefix_bidir.PackedRowError):
        DensePieceRouting([], VllmConfig()).select(metadata)
