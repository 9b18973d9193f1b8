"""The prefix_bidir model and its Model Runner V2 state, on vLLM's real classes.

The model is built on the CPU from a tiny checkpoint; the state's ``prepare_attn``
runs vLLM's own hybrid ``prepare_attn`` and ``build_attn_metadata`` into the real
attention metadata builders: Triton's, whose range tensor is what the ranged
kernel reads, and the D3 composite's FlashAttention builder, whose virtual
sequences (cu_seqlens, seqused_k, block-table rows) are what FlashAttention reads.
"""

import inspect
from functools import partial

import numpy as np
import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.model_executor.layers.mamba.abstract import (
    get_mamba_prefill_checkpoint_alignment,
)
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_gdn
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.models import d3 as upstream_d3
from vllm.model_executor.models.registry import ModelRegistry
from vllm.pooling_params import PoolingParams
from vllm.v1.pool.metadata import PoolingMetadata, PoolingStates
from vllm.v1.worker.gpu import warmup as gpu_warmup
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

from vllm_d3.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
from vllm_d3.model_executor.layers.mamba.gdn.packed_questions import (
    forward_packed_questions,
)
from vllm_d3.model_executor.models.d3 import D3ForSequenceClassification
from vllm_d3.model_executor.models.d3_contract import StateBlock
from vllm_d3.testing.gdn_forms import gdn_form
from vllm_d3.testing.model_runner import (
    CPU,
    PACKED,
    STEP,
    attention_metadata,
    build_model,
    cpu_model_state,
    dense_pieces_mask,
    hybrid_groups,
    hybrid_metadata,
    new_request,
    prefill_batch,
    step_metadata,
    vllm_config_for,
)
from vllm_d3.v1.attention.backends import d3_packed_gdn
from vllm_d3.v1.attention.backends.d3_packed_gdn import (
    PackedGDNAttentionMetadata,
    PackedRow,
    packed_gdn_metadata,
    phase_a_checkpoints,
    step_phases,
)
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3DensePiecesMetadata,
    D3PrefixBidirAttentionBackend,
)
from vllm_d3.v1.worker.gpu.model_states import d3_prefix_bidir as model_states
from vllm_d3.v1.worker.gpu.model_states.d3_prefix_bidir import (
    WARMUP_REQUEST_PREFIX,
    D3PrefixBidirModelState,
)

pytestmark = pytest.mark.usefixtures("process_group")

#: The rules as shipped; the tests below run packed steps in two phases unless
#: they restore one.
STATE_REREAD_TOKENS_MAX = d3_packed_gdn.STATE_REREAD_TOKENS_MAX
SPLIT_SEQUENCES_MAX = d3_packed_gdn.SPLIT_SEQUENCES_MAX


@pytest.fixture(autouse=True)
def two_phases(monkeypatch):
    monkeypatch.setattr(d3_packed_gdn, "STATE_REREAD_TOKENS_MAX", 0)
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", 0)


def reread_small_steps(monkeypatch, tokens_max: int = STATE_REREAD_TOKENS_MAX):
    monkeypatch.setattr(d3_packed_gdn, "STATE_REREAD_TOKENS_MAX", tokens_max)


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
    assert model_cls is D3ForSequenceClassification
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


@pytest.mark.parametrize(
    ("mode", "cache_mode", "declared", "kernel"),
    [
        ("prefix_bidir", "align", True, None),
        ("prefix_bidir", "none", False, None),
        # FlashInfer's prefill (vLLM's on Hopper), whose own checkpoints come
        # every 64 tokens: the scans write them at any token too.
        ("prefix_bidir", "align", True, "flashinfer"),
    ]
    # The control: 0.33.0's layers declare none on the Triton prefill.
    + [("causal", "align", False, None)],
)
def test_in_align_mode_the_gdn_layers_declare_prefill_checkpoints(
    make_checkpoint, monkeypatch, mode, cache_mode, declared, kernel
):
    if kernel is not None:
        # vLLM resolves the layers' prefill kernel as on a GPU that has it.
        monkeypatch.setattr(
            vllm_gdn, "_resolve_gdn_prefill_backend", lambda config: ("auto", kernel)
        )
    path = make_checkpoint(attention_mode=mode, weights=False)
    config = vllm_config_for(path, align_block=16 if cache_mode == "align" else None)
    model = build_model(D3ForSequenceClassification, config)
    layers = [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]
    expected = kernel or "triton"
    assert layers and all(layer.gdn_prefill_backend == expected for layer in layers)
    with set_current_vllm_config(config):
        specs = [layer.get_kv_cache_spec(config) for layer in layers]
        alignment = get_mamba_prefill_checkpoint_alignment(config)
    blocks = {spec.num_prefill_checkpoint_blocks for spec in specs}
    assert blocks == {int(declared)}
    if not declared:
        assert alignment is None
        return
    # Checkpoints on vLLM's own grid, the block; one state of FlashInfer's
    # checkpoint workspace (which the Triton prefill never writes).
    assert alignment == 1
    assert {spec.prefill_checkpoint_alignment for spec in specs} == {16}
    workspace_shape, _ = layers[0]._checkpoint_buffer_spec
    assert workspace_shape[0] == 1


def test_in_align_mode_the_scans_run_on_the_slots_vllm_resolved(make_checkpoint):
    # STEP's rows on 4-token blocks, each with a block table of its own. vLLM
    # resolves each row's slot as the block of its length, and places each
    # row's checkpoint at its last whole block before its end: a's at 8 (its
    # block 1), inside what phase A reads; p's at 16 and r's at 12, among
    # their questions. (Block 0 is vLLM's null block.)
    tables = [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 11, 12, 0]]
    step = [(*row[:3], table) for row, table in zip(STEP, tables, strict=True)]
    path = make_checkpoint(weights=False)
    with cpu_model_state(D3PrefixBidirModelState, path, align_block=4) as state:
        _, metadata, _ = step_metadata(state, step)
        _, config = state
        _, _, groups, _ = hybrid_groups(config)
    resolved = [3, 8, 12]
    assert metadata.non_spec_state_indices_tensor.tolist() == resolved
    assert metadata.checkpoint.offsets == [8, 16, 12]
    assert metadata.checkpoint.state_indices.tolist() == [2, 7, 11]
    # Phase A, the checkpoint scan (a up to 8, its final state to block 1
    # and to a's own slot) and the question scans on the resolved slots, none
    # with checkpoints of its own.
    assert metadata.phase_a.non_spec_state_indices_tensor.tolist() == resolved
    to_checkpoints = metadata.to_checkpoints
    assert to_checkpoints.sources.tolist() == [0, 3]
    assert to_checkpoints.destinations.tolist() == [2, 3]
    questions = [scan.scratch_sources[1:].tolist() for scan in metadata.question_scans]
    assert sorted(sum(questions, [])) == [8, 8, 8, 12, 12]
    built = [metadata.phase_a, to_checkpoints.metadata]
    built += [scan.metadata for scan in metadata.question_scans]
    assert all(scan.checkpoint is None for scan in built)
    # The control: vLLM's builder given phase A's lengths resolves other
    # blocks (p's and r's state ends, 5 and 6 tokens in).
    phases = step_phases(
        np.array([0, 10, 30, 44]),
        np.array([10, 20, 14]),
        step_packed_rows(state[0]),
        CPU,
        [(0, 8)],
    )
    assert phases.phase_a is not None
    builder = groups[1].get_metadata_builder(0)
    with set_current_vllm_config(config):
        by_vllm = builder.build(
            0,
            phases.phase_a.replace(
                block_table_tensor=torch.tensor(tables, dtype=torch.int32)
            ),
        )
    assert by_vllm.non_spec_state_indices_tensor.tolist() == [3, 5, 10]


@pytest.fixture
def state(make_checkpoint):
    path = make_checkpoint(weights=False)
    with cpu_model_state(D3PrefixBidirModelState, path) as state_and_config:
        yield state_and_config


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


def state_once_mask(s: int, ends: list[int]) -> torch.Tensor:
    """A row of question blocks ending at ``ends`` after its state, written
    independently: the state both ways, each question block the state and
    itself both ways."""
    mask = prefix_bidir_mask(s, ends[-1])
    mask[s:, s:] = False
    for start, end in zip([s, *ends], ends, strict=False):
        mask[start:end, start:end] = True
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


def test_ranges_become_dense_pieces(state):
    model_state, _ = state
    requests = {"a": (10, 4), "b": (7, 7), "c": (5, 1), "d": (40, 20)}
    for index, (req_id, (n, s)) in enumerate(requests.items()):
        model_state.add_request(index, new_request(req_id, n, {"d3_state_tokens": s}))
    order = ["d", "b", "a", "c"]
    metadata = attention_metadata(
        state, order, [requests[r][0] for r in order], D3PrefixBidirAttentionBackend
    )
    assert metadata._attention_backend_variant == 1  # the dense child
    assert isinstance(metadata, D3DensePiecesMetadata)
    # The pairs the two passes attend, rebuilt: each prompt's own mask on the
    # diagonal, in batch order.
    expected = torch.block_diag(
        *(prefix_bidir_mask(requests[r][1], requests[r][0]) for r in order)
    )
    assert torch.equal(dense_pieces_mask(metadata), expected)


@pytest.mark.parametrize("for_capture", [False, True])
def test_hybrid_cache_dense_attention_beside_a_causal_gdn(state, for_capture):
    """A real hybrid KV-cache config: the D3 composite beside vLLM's GDN."""
    model_state, _ = state
    requests = {"a": (10, 4), "b": (7, 7)}
    for index, (req_id, (n, s)) in enumerate(requests.items()):
        model_state.add_request(index, new_request(req_id, n, {"d3_state_tokens": s}))
    order = ["b", "a"]
    prompt_lens = [requests[r][0] for r in order]
    if for_capture:
        # Graph capture runs dummy rows that were never added, named as vLLM
        # names them (v1/worker/gpu/input_batch.py: f"req_{i}_{random_uuid()}").
        order = [f"req_{i}_capture" for i in range(len(order))]
    full, scan, _ = hybrid_metadata(state, order, prompt_lens, [3, 5], for_capture)
    if for_capture:
        # Graph capture gets no ranges: plain causal attention over the rows.
        assert full.causal is True
        assert full.query_start_loc.tolist() == [0, 7, 17]
    else:
        # b (s = n = 7) is one range over itself, a (s = 4, n = 10) two; a's
        # question rows (batch tokens 11-17) also read its state [7, 11).
        assert full.own_keys.cu_seqlens_q.tolist() == [0, 7, 11, 17]
        assert full.question_tokens.tolist() == list(range(11, 17))
        assert full.state_keys.cu_seqlens_k.tolist() == [0, 7, 7, 11, 17]
    # The Gated DeltaNet scans each request's own tokens, causally, from its
    # own state slot: the ranges never reach it.
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


# A packed request: the state [0, 5), then question blocks [5, 9), [9, 12),
# [12, 20); and a plain one (n = 10, s = 4).
def test_packed_questions_get_their_own_prompts_positions(state):
    model_state, _ = state
    model_state.add_request(2, new_request("p", 20, PACKED))
    staged = model_state.rope_state.staged(2, 20)
    ids = list(range(20))
    for start, end in [(5, 9), (9, 12), (12, 20)]:
        # The model's own M-RoPE over the question's own prompt, state || q.
        own, _ = model_state.model.get_mrope_input_positions(
            ids[:5] + ids[start:end], []
        )
        assert torch.equal(staged[:, :5], own[:, :5])
        assert torch.equal(staged[:, start:end], own[:, 5:])


def test_a_packed_row_becomes_state_once_pieces_and_gdn_phases(state):
    model_state, _ = state
    model_state.add_request(0, new_request("p", 20, PACKED))
    model_state.add_request(1, new_request("a", 10, {"d3_state_tokens": 4}))
    full, scan, _ = hybrid_metadata(state, ["a", "p"], [10, 20], [3, 5])
    # Attention: every range over itself (p's question blocks are batch tokens
    # 15-19, 19-22, 22-30), and each row's question rows over its state.
    assert full.own_keys.cu_seqlens_q.tolist() == [0, 4, 10, 15, 19, 22, 30]
    assert full.question_tokens.tolist() == [*range(4, 10), *range(15, 30)]
    assert full.state_keys.cu_seqlens_q.tolist() == [0, 6, 6, 21, 21]
    assert full.state_keys.cu_seqlens_k.tolist() == [0, 4, 10, 15, 30]
    # Gated DeltaNet, phase A: every token but p's questions, from the slots.
    # Both phases' tokens are consecutive: views, not gathers.
    assert scan.state_tokens == slice(0, 15)
    assert scan.phase_a.non_spec_query_start_loc.tolist() == [0, 10, 15]
    assert scan.phase_a.non_spec_state_indices_tensor.tolist() == [3, 5]
    assert scan.phase_a.has_initial_state.tolist() == [False, False]
    # Phase B, one scan: each question from p's slot (scratch slots 1, 2, 3;
    # slot 0 stands for the null block).
    (questions,) = scan.question_scans
    assert questions.tokens == slice(15, 30)
    assert questions.scratch_sources.tolist() == [0, 5, 5, 5]
    assert questions.metadata.non_spec_query_start_loc.tolist() == [0, 4, 7, 15]
    assert questions.metadata.non_spec_state_indices_tensor.tolist() == [1, 2, 3]
    assert questions.metadata.has_initial_state.tolist() == [True, True, True]
    # The mask the core zeroes absent states by: a host tensor of its own, all
    # set (on a GPU the builder's would be on the device).
    mask = questions.metadata.prefill_has_initial_state
    assert mask is not questions.metadata.has_initial_state
    assert mask.device.type == "cpu" and mask.tolist() == [True, True, True]


def test_a_packed_row_after_a_hit_reads_its_cached_keys(state):
    # p found its first 3 tokens in the prefix cache: the step computes its
    # tokens 3-19 (batch tokens 10-26), which read p's whole prompt's keys,
    # the first 3 from the paged cache (p's attention block table row).
    model_state, _ = state
    full, scan, _ = step_metadata(state, computed={"p": 3})
    cached = full.cached_keys
    assert cached is not None
    assert cached.rows.tolist() == [1, 1, 1]
    assert cached.positions.tolist() == [0, 1, 2]
    # Keys: a's 10, p's 3 cached then its 17, r's 14.
    assert cached.key_tokens.tolist() == [*range(10), 41, 42, 43, *range(10, 41)]
    a, p, r = (
        state_once_mask(4, [10]),
        state_once_mask(5, [9, 12, 20]),
        state_once_mask(6, [10, 14]),
    )
    assert torch.equal(dense_pieces_mask(full), torch.block_diag(a, p[3:], r))
    # Gated DeltaNet: phase A continues p's state from its slot (2 tokens).
    assert scan.phase_a.non_spec_query_start_loc.tolist() == [0, 10, 12, 18]
    assert scan.phase_a.has_initial_state.tolist() == [False, True, False]


def test_phase_b_scans_a_bounded_number_of_questions_at_a_time(state, monkeypatch):
    monkeypatch.setattr(d3_packed_gdn, "QUESTIONS_PER_SCAN", 2)
    _, scan, _ = step_metadata(state)
    # p's questions at batch tokens 15-19, 19-22, 22-30 (row slot 5); r's at
    # 36-40, 40-44 (slot 7): two at a time, the second scan across both rows.
    first, second, third = scan.question_scans
    assert first.tokens == slice(15, 22)
    assert second.tokens.tolist() == [*range(22, 30), *range(36, 40)]
    assert third.tokens == slice(40, 44)
    assert [s.scratch_sources.tolist() for s in scan.question_scans] == [
        [0, 5, 5],
        [0, 5, 7],
        [0, 7],
    ]
    assert second.metadata.non_spec_query_start_loc.tolist() == [0, 8, 12]
    assert second.metadata.non_spec_state_indices_tensor.tolist() == [1, 2]
    # Each continues from its row's state: p's after 5 tokens, r's after 6.
    assert second.metadata.has_initial_state.tolist() == [True, True]


def test_a_small_packed_step_is_one_scan_of_each_questions_own_prompt(
    state, monkeypatch
):
    reread_small_steps(monkeypatch)
    model_state, _ = state
    model_state.add_request(0, new_request("p", 20, PACKED))
    model_state.add_request(1, new_request("a", 10, {"d3_state_tokens": 4}))
    _, scan, _ = hybrid_metadata(state, ["a", "p"], [10, 20], [3, 5])
    # No phase A: a's prompt, then p's state (batch tokens 10-14) before each
    # of its questions (15-18, 19-21, 22-29), every sequence from no state.
    assert scan.phase_a is None and scan.state_tokens is None
    (one_scan,) = scan.question_scans
    state_p = list(range(10, 15))
    assert one_scan.tokens.tolist() == [
        *range(10),
        *state_p,
        *range(15, 19),
        *state_p,
        *range(19, 22),
        *state_p,
        *range(22, 30),
    ]
    # Each batch token written back once, from its first place in the scan.
    firsts, written = one_scan.write_back
    assert written.tolist() == list(range(30))
    assert one_scan.tokens[firsts].tolist() == list(range(30))
    assert firsts.tolist()[:15] == list(range(15))
    assert one_scan.scratch_sources.tolist() == [0, 3, 5, 5, 5]
    metadata = one_scan.metadata
    assert metadata.non_spec_query_start_loc.tolist() == [0, 10, 19, 27, 40]
    assert metadata.non_spec_state_indices_tensor.tolist() == [1, 2, 3, 4]
    assert metadata.has_initial_state.tolist() == [False] * 4
    # States to zero: the builder's own mask.
    assert metadata.prefill_has_initial_state is metadata.has_initial_state


@pytest.mark.parametrize(
    ("tokens_max", "per_scan", "one_scan"),
    [(16, 64, True), (15, 64, False), (16, 6, True), (16, 5, False)],
    ids=["at-the-bound", "one-token-over", "blocks-fit", "one-block-over"],
)
def test_the_step_re_reads_its_states_within_both_bounds(
    state, monkeypatch, tokens_max, per_scan, one_scan
):
    # STEP re-reads p's 5-token state twice and r's 6-token state once (16
    # tokens) in six blocks: a's prompt, p's three questions, r's two.
    reread_small_steps(monkeypatch, tokens_max)
    monkeypatch.setattr(d3_packed_gdn, "QUESTIONS_PER_SCAN", per_scan)
    _, scan, _ = step_metadata(state)
    assert (scan.phase_a is None) == one_scan


def test_a_step_with_a_row_that_continues_keeps_two_phases(state, monkeypatch):
    # The one scan writes no slot, so a row whose sequence goes on after this
    # step (a's 10 tokens after 6 computed ones) keeps the two phases.
    reread_small_steps(monkeypatch)
    model_state, _ = state
    model_state.add_request(1, new_request("p", 20, PACKED))
    packed = [PackedRow(1, 10, model_state.state_blocks["p"])]
    query_start_loc = np.array([0, 10, 30])
    fresh = step_phases(query_start_loc, np.array([10, 20]), packed, CPU)
    continued = step_phases(query_start_loc, np.array([16, 20]), packed, CPU)
    assert fresh.phase_a is None
    assert continued.phase_a is not None
    assert continued.phase_a.seq_lens.tolist() == [16, 5]


def test_the_log_says_which_packed_forms_serve(state, monkeypatch):
    logged: list[str] = []
    monkeypatch.setattr(model_states.logger, "info", lambda m, *a: logged.append(m % a))
    model_state, _ = state
    layers = [
        m
        for m in model_state.model.modules()
        if isinstance(m, QwenGatedDeltaNetAttention)
    ]
    assert model_states._one_pass_window(model_state.model) == 3
    # FlashInfer's prefill has a one pass of its own.
    for layer in layers:
        monkeypatch.setattr(layer, "gdn_prefill_backend", "flashinfer")
    assert model_states._one_pass_window(model_state.model) == 3
    # One layer on a prefill without one takes the one pass off.
    monkeypatch.setattr(layers[-1], "gdn_prefill_backend", "aiter_flydsl")
    assert model_states._one_pass_window(model_state.model) is None
    assert "runs in one pass on the triton prefill where the step" in logged[0]
    assert "runs in one pass on the flashinfer prefill where the step" in logged[1]
    assert "runs in two phases" in logged[2]
    assert "the aiter_flydsl/flashinfer prefill has no one pass" in logged[2]


@pytest.mark.parametrize(
    "reread_max", [0, STATE_REREAD_TOKENS_MAX], ids=["else-two-phases", "as-shipped"]
)
def test_a_packed_step_on_fla_runs_in_one_pass(state, monkeypatch, reread_max):
    # Shipped, the step is small enough for one scan: the one pass goes first.
    reread_small_steps(monkeypatch, reread_max)
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", SPLIT_SEQUENCES_MAX)
    model_state, _ = state
    # The tiny checkpoint's layers prefill on FLA's rule, with a convolution
    # of 4 taps: a window of 3 inputs.
    assert model_state.split_window == 3
    model_state.add_request(0, new_request("p", 20, PACKED))
    model_state.add_request(1, new_request("a", 10, {"d3_state_tokens": 4}))
    _, scan, _ = hybrid_metadata(state, ["a", "p"], [10, 20], [3, 5])
    assert isinstance(scan, d3_packed_gdn.SplitGDNAttentionMetadata)
    # In batch order, each on its scratch slot: a whole, p's state (batch
    # tokens 10-14), then p's questions (15-18, 19-21, 22-29) after it.
    one_pass = scan.one_pass
    assert one_pass.non_spec_query_start_loc.tolist() == [0, 10, 15, 19, 22, 30]
    assert one_pass.non_spec_state_indices_tensor.tolist() == [1, 2, 3, 4, 5]
    assert one_pass.has_initial_state.tolist() == [False, False, True, True, True]
    # States to zero: the builder's own mask, on the step's device (a host
    # mask would wait for the GPU every layer).
    assert one_pass.prefill_has_initial_state is one_pass.has_initial_state
    # The step's own fields stay the builder's: the rows on their slots.
    assert scan.non_spec_state_indices_tensor.tolist() == [3, 5]
    split = scan.split
    assert split.questions.tolist() == [2, 3, 4]
    assert split.question_slots.tolist() == [3, 4, 5]
    assert split.sources.tolist() == [1, 1, 1]
    # Each question's convolution window: the state's last 3 tokens.
    assert split.window_tokens.tolist() == [12, 13, 14] * 3
    # FlashInfer's two launches: a and p's state (batch tokens 0-14), then
    # p's questions (15-29), each from sequence 1 of the first launch.
    states, questions = split.launches
    assert (states.tokens, questions.tokens) == (slice(0, 15), slice(15, 30))
    assert states.cu_seqlens.tolist() == [0, 10, 15]
    assert questions.cu_seqlens.tolist() == [0, 4, 7, 15]
    assert states.sequences.tolist() == [0, 1]
    assert questions.sequences.tolist() == [2, 3, 4]
    assert split.launch_sources.tolist() == [1, 1, 1]


def test_two_launches_gather_rows_that_interleave(monkeypatch):
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", SPLIT_SEQUENCES_MAX)
    # a whole, p's state and questions, r's state and questions: the states'
    # launch skips p's questions, the questions' launch p's and r's states.
    packed = [
        PackedRow(1, 4, StateBlock(3, 9, (6, 9))),
        PackedRow(2, 13, StateBlock(4, 10, (7, 10))),
    ]
    split = d3_packed_gdn.split_recurrence(
        np.array([0, 4, 13, 23]), np.array([4, 9, 10]), packed, width=3, device=CPU
    )
    assert split is not None
    states, questions = split.launches
    assert states.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6, 13, 14, 15, 16]
    assert states.cu_seqlens.tolist() == [0, 4, 7, 11]
    assert questions.tokens.tolist() == [7, 8, 9, 10, 11, 12, 17, 18, 19, 20, 21, 22]
    assert questions.cu_seqlens.tolist() == [0, 3, 6, 9, 12]
    # p's questions read the launch's sequence 1, r's its sequence 2.
    assert split.launch_sources.tolist() == [1, 1, 2, 2]


@pytest.mark.parametrize(
    ("step", "sequences_max"),
    [
        # r's 6-token state and 4-token questions fit; p's too: 8 sequences.
        (STEP, 7),
        # A state shorter than the convolution's window.
        ([("p", 8, {"d3_state_tokens": 2, "d3_question_ends": [5, 8]}, 5)], 64),
        # A one-token question block (0.33.0's builder takes it for a decode).
        ([("p", 8, {"d3_state_tokens": 5, "d3_question_ends": [6, 8]}, 5)], 64),
    ],
    ids=["too-many-sequences", "short-state", "one-token-question"],
)
def test_steps_the_one_pass_does_not_take_keep_two_phases(
    state, monkeypatch, step, sequences_max
):
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", sequences_max)
    _, scan, _ = step_metadata(state, step)
    assert isinstance(scan, d3_packed_gdn.PackedGDNAttentionMetadata)
    assert scan.phase_a is not None


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        ("two phases", d3_packed_gdn.PackedGDNAttentionMetadata),
        ("one pass", d3_packed_gdn.SplitGDNAttentionMetadata),
    ],
)
def test_a_form_is_chosen_per_call_and_the_rules_restored(
    state, monkeypatch, form, expected
):
    # The re-read rule at the fixture's 0, the one pass bounded below STEP's 8
    # sequences: "one pass" lifts the bound, "two phases" sets it to 0.
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", 7)
    with gdn_form(form):
        _, scan, _ = step_metadata(state)
    assert type(scan) is expected
    assert d3_packed_gdn.STATE_REREAD_TOKENS_MAX == 0
    assert d3_packed_gdn.SPLIT_SEQUENCES_MAX == 7


def test_the_one_pass_needs_fresh_rows(monkeypatch):
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", SPLIT_SEQUENCES_MAX)
    block = StateBlock(5, 20, (9, 12, 20))
    packed = [PackedRow(1, 10, block)]
    query_start_loc = np.array([0, 10, 30])
    plan = partial(d3_packed_gdn.split_recurrence, width=3, device=CPU)
    assert plan(query_start_loc, np.array([10, 20]), packed) is not None
    # a's 10 tokens after 6 computed ones.
    assert plan(query_start_loc, np.array([16, 20]), packed) is None


class ScanLayer:
    """A Gated DeltaNet stand-in whose ``_forward_core`` reads the step's GDN
    metadata and state the way 0.33.0's prefill path does, with a scalar
    recurrence ``h = h / 2 + x`` per sequence (from the slot's state when it
    has one). ``tests/test_gdn_kernels.py`` runs 0.33.0's own layer."""

    def __init__(self, prefix: str, slots: int, restart: bool) -> None:
        self.prefix = prefix
        self.kv_cache = (torch.zeros(slots, 3, 1), torch.zeros(slots, 1))
        self.restart = restart

    def _forward_core(self, mixed_qkv, b, a, core_attn_out) -> None:
        # What the series adds at the top of 0.33.0's method.
        if self.restart and forward_packed_questions(
            self, self._forward_core, mixed_qkv, b, a, core_attn_out
        ):
            return
        metadata = get_forward_context().attn_metadata[self.prefix]
        starts = metadata.prefill_query_start_loc.tolist()
        ssm = self.kv_cache[1]
        # The initial states and the final ones, read and written as 0.33.0's
        # prefill path does (qwen_gdn_linear_attn.py:1816-1817, :1872).
        initial = ssm[metadata.prefill_state_indices]
        initial[~metadata.prefill_has_initial_state, ...] = 0
        final = []
        for row, h in enumerate(initial):
            for token in range(starts[row], starts[row + 1]):
                h = h / 2 + mixed_qkv[token]
                core_attn_out[token] = h
            final.append(h)
        ssm[metadata.prefill_state_indices] = torch.stack(final).to(ssm.dtype)


def scan_alone(x: torch.Tensor) -> torch.Tensor:
    h, out = torch.zeros(1), []
    for value in x:
        h = h / 2 + value
        out.append(h)
    return torch.stack(out)


#: One packed request alone: both phases' tokens are consecutive (views).
ALONE = [("p", 20, PACKED, 5)]


def scan_step(
    state, restart: bool, wrap=None, step=STEP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and outputs of one GDN-like layer over ``step`` (``wrap``, if
    given, is applied to the layer first)."""
    _, config = state
    _, scan, gdn = step_metadata(state, step)
    if scan.phase_a is not None:
        views = step is ALONE
        assert isinstance(scan.state_tokens, slice) == views
        gathered = [not isinstance(s.tokens, slice) for s in scan.question_scans]
        assert any(gathered) != views
    layer = ScanLayer(gdn[0], slots=8, restart=restart)
    if wrap is not None:
        wrap(layer)
    tokens = sum(n for _, n, _, _ in step)
    x = torch.randn(tokens, 1, generator=torch.Generator().manual_seed(0))
    out = torch.zeros_like(x)
    cache = layer.kv_cache
    with set_forward_context({gdn[0]: scan}, config):
        layer._forward_core(x, x, x, out)
        # The step's metadata and the layer's cache are back as they were.
        assert get_forward_context().attn_metadata[gdn[0]] is scan
    assert layer.kv_cache is cache
    return x, out


@pytest.mark.parametrize(
    ("step", "per_scan", "reread"),
    [(STEP, 64, False), (ALONE, 64, False), (STEP, 2, False), (STEP, 64, True)],
    ids=["gathered", "views", "two-per-scan", "states-re-read"],
)
def test_every_packed_question_restarts_from_its_own_state(
    state, monkeypatch, step, per_scan, reread
):
    monkeypatch.setattr(d3_packed_gdn, "QUESTIONS_PER_SCAN", per_scan)
    if reread:
        reread_small_steps(monkeypatch)
    x, out = scan_step(state, restart=True, step=step)
    # Each request from its first batch token: a plain one as it is; a packed
    # one's state as it is and each question as if alone after that state.
    first = 0
    for _, n, extra, _ in step:
        s = extra["d3_state_tokens"]
        ends = extra.get("d3_question_ends")
        if ends is None:
            own = x[first : first + n]
            assert torch.allclose(out[first : first + n], scan_alone(own))
        else:
            state_x = x[first : first + s]
            assert torch.allclose(out[first : first + s], scan_alone(state_x))
            for start, end in zip([s, *ends[:-1]], ends, strict=True):
                question = x[first + start : first + end]
                alone = scan_alone(torch.cat([state_x, question]))
                assert torch.allclose(out[first + start : first + end], alone[s:])
        first += n


def test_one_scan_over_a_packed_row_is_wrong(state):
    # Without the restart, p's second question runs on from its first.
    x, out = scan_step(state, restart=False)
    alone = scan_alone(torch.cat([x[10:15], x[19:22]]))
    assert not torch.allclose(out[19:22], alone[5:])


def test_without_packed_rows_the_core_is_the_original(state):
    model_state, config = state
    model_state.add_request(0, new_request("a", 10, {"d3_state_tokens": 4}))
    _, scan, gdn = hybrid_metadata(state, ["a"], [10], [3])
    layer = ScanLayer(gdn[0], slots=8, restart=True)
    x = torch.randn(10, 1)
    out = torch.zeros(10, 1)
    with set_forward_context({gdn[0]: scan}, config):
        assert not forward_packed_questions(layer, layer._forward_core, x, x, x, out)
        assert not out.any()
        layer._forward_core(x, x, x, out)
    assert torch.allclose(out, scan_alone(x))


@pytest.mark.plugin
def test_the_plugin_restarts_every_gdn_layer_of_the_model(state):
    """On 0.33.0 the layers' ``_forward_core`` runs the packed phases first."""
    model_state, _ = state
    cores = [
        module._forward_core
        for module in model_state.model.modules()
        if isinstance(module, QwenGatedDeltaNetAttention)
    ]
    assert cores
    wrapper = qwen_gdn_linear_attn.__name__
    assert all(core.__func__.__module__ == wrapper for core in cores)
    # Over 0.33.0's method (here the stand-in's), the wrapper computes what the
    # series' method does.
    x, out = scan_step(state, restart=True)
    wrapped_x, wrapped_out = scan_step(
        state, restart=False, wrap=qwen_gdn_linear_attn.restart_questions_from_state
    )
    assert torch.equal(wrapped_x, x) and torch.allclose(wrapped_out, out)


def test_a_packed_request_is_read_out_once_per_question(state):
    model_state, config = state
    model = model_state.model
    # A random readout (the model was built without weights), then what loading
    # does to the layer before it can run on the CPU.
    generator = torch.Generator().manual_seed(0)
    weight = model.score.weight.data
    weight.copy_(torch.randn(weight.shape, generator=generator))
    model.score.quant_method.process_weights_after_loading(model.score)
    pooler = model.pooler.poolers_by_task["classify"]
    plain = PoolingParams(task="classify", extra_kwargs={"d3_state_tokens": 4})
    packed = PoolingParams(task="classify", extra_kwargs=PACKED)
    for params in (plain, packed):
        params.use_activation = False  # what D3's pooler config makes of it
    metadata = PoolingMetadata(
        prompt_lens=torch.tensor([10, 20]),
        prompt_token_ids=None,
        prompt_token_ids_cpu=None,
        pooling_params=[plain, packed],
        pooling_states=[PoolingStates(), PoolingStates()],
    )
    metadata.build_pooling_cursor(np.array([10, 20]), torch.tensor([10, 20]), CPU)
    hidden = torch.randn(30, config.model_config.get_hidden_size())
    with set_current_vllm_config(config):
        out = pooler(hidden, metadata)
    # The readout at the plain prompt's last token (row 9) and at the last
    # token of each of the packed row's question blocks (rows 10 + 8, 11, 19).
    head_dtype = config.model_config.head_dtype
    rows = hidden[[9, 18, 21, 29]].to(head_dtype)
    readout = (rows @ model.score.weight.to(head_dtype).T).float()
    assert len(out) == 2
    assert torch.allclose(out[0].float(), readout[0])
    assert torch.allclose(out[1].float(), readout[1:].reshape(-1))


def test_each_gdn_group_restarts_from_its_own_slots(state):
    # Two Gated DeltaNet groups (their own state slots, one builder each): the
    # phases are built once and phase A re-gathered per group.
    model_state, config = state
    model_state.add_request(0, new_request("p", 20, PACKED))
    model_state.add_request(1, new_request("a", 10, {"d3_state_tokens": 4}))
    _, scan, _ = hybrid_metadata(state, ["a", "p"], [10, 20], [3, 5])
    _, _, groups, _ = hybrid_groups(config)
    builder = groups[1].get_metadata_builder(0)
    phases = step_phases(
        np.array([0, 10, 30]),
        np.array([10, 20]),
        [PackedRow(1, 10, model_state.state_blocks["p"])],
        CPU,
    )
    tables = [torch.tensor([[3], [5]]), torch.tensor([[6], [2]])]
    first, second = packed_gdn_metadata(
        [(scan, builder, table.int()) for table in tables], phases
    )
    assert first.phase_a.non_spec_state_indices_tensor.tolist() == [3, 5]
    assert second.phase_a.non_spec_state_indices_tensor.tolist() == [6, 2]
    assert second.phase_a.non_spec_query_start_loc.tolist() == [0, 10, 15]
    ((first_scan,), (second_scan,)) = first.question_scans, second.question_scans
    assert first_scan.scratch_sources.tolist() == [0, 5, 5, 5]
    assert second_scan.scratch_sources.tolist() == [0, 2, 2, 2]
    assert first_scan.metadata is second_scan.metadata


def step_packed_rows(model_state):
    """``STEP``'s packed rows as the model state finds them in its batch, once
    its requests are added."""
    return model_state.packed_rows(
        prefill_batch([req_id for req_id, *_ in STEP], [n for _, n, _, _ in STEP])
    )


def test_only_checkpoints_inside_what_phase_a_scans_are_written(state):
    # STEP: a plain 10-token row, then p (state 5 of 20) and r (state 6 of 14).
    model_state, _ = state
    step_metadata(state)
    query_start_loc = np.array([0, 10, 30, 44])
    packed = step_packed_rows(model_state)
    assert phase_a_checkpoints(query_start_loc, packed, [7, 3, 8]) == [(0, 7), (1, 3)]
    # At a plain row's end (its final state, which phase A writes), at a state's
    # end and among the questions (never read: hits stay inside the state).
    assert phase_a_checkpoints(query_start_loc, packed, [10, 5, 6]) == []
    assert phase_a_checkpoints(query_start_loc, packed, [0, 0, 0]) == []


def test_phase_a_first_scans_the_rows_up_to_their_checkpoints(state, monkeypatch):
    # Even where the step would run as one scan of each question's own prompt.
    reread_small_steps(monkeypatch)
    model_state, _ = state
    step_metadata(state)
    query_start_loc = np.array([0, 10, 30, 44])
    seq_lens = np.array([10, 20, 14])
    packed = step_packed_rows(model_state)
    phases = step_phases(query_start_loc, seq_lens, packed, CPU, [(0, 7), (1, 3)])
    scan = phases.to_checkpoints
    assert scan is not None and phases.phase_a is not None
    assert scan.rows.tolist() == [0, 1]
    assert np.arange(44)[scan.tokens].tolist() == [*range(7), 10, 11, 12]
    assert scan.metadata.query_start_loc_cpu.tolist() == [0, 7, 10]
    assert scan.metadata.seq_lens_cpu_upper_bound.tolist() == [7, 3]
    # Phase A then continues a from 7 and p from 3; r's state is read whole.
    assert np.arange(44)[phases.state_tokens].tolist() == [
        7,
        8,
        9,
        13,
        14,
        *range(30, 36),
    ]
    assert phases.phase_a.query_start_loc_cpu.tolist() == [0, 3, 5, 11]
    assert phases.phase_a.seq_lens_cpu_upper_bound.tolist() == [10, 5, 6]
    assert len(phases.question_scans) == 1


def test_a_step_with_checkpoints_gets_its_scans_without_packed_rows(state, monkeypatch):
    # vLLM's checkpoint metadata (align mode's) names row 0's checkpoint, 7
    # tokens in, on slot 10. A step of plain rows then runs its Gated DeltaNet
    # in two phases that write it, even where the one pass is allowed; with no
    # checkpoint it keeps vLLM's own metadata.
    monkeypatch.setattr(d3_packed_gdn, "SPLIT_SEQUENCES_MAX", SPLIT_SEQUENCES_MAX)
    plain = [("a", 10, {"d3_state_tokens": 4}, 3), ("b", 6, {"d3_state_tokens": 5}, 5)]
    model_state, _ = state
    _, unchanged, _ = step_metadata(state, plain)
    assert type(unchanged) is not PackedGDNAttentionMetadata
    _, scans, _ = step_metadata(state, plain, checkpoints={0: (7, 10)})
    assert isinstance(scans, PackedGDNAttentionMetadata)
    assert scans.to_checkpoints is not None
    assert scans.to_checkpoints.sources.tolist() == [0, 3]
    # The checkpoint's slot, then the row's own.
    assert scans.to_checkpoints.destinations.tolist() == [10, 3]
    assert scans.phase_a is not None and scans.question_scans == ()
    assert scans.phase_a.non_spec_query_start_loc.tolist() == [0, 3, 9]
