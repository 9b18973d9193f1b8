# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Gated DeltaNet metadata of a D3 step with packed rows
(upstream: ``v1/attention/backends/d3_packed_gdn.py``, a new file).

In a packed row ``state[0, s) || q1 || ... || qQ`` each question must see the
layer's state after exactly ``s`` tokens. ``packed_step_metadata`` gives each
Gated DeltaNet group the metadata of the form its step runs in, built once by
vLLM's own builder on scratch or resolved state slots: the one pass
(``SplitGDNAttentionMetadata``: every block a sequence of its own) where the
layers' prefill has one and the step allows it; else two phases
(``PackedGDNAttentionMetadata``: everything but the question blocks, then each
question block from its row's state; first, where align mode's prefill
checkpoints lie inside phase A, each such row up to its checkpoint), or, for a
small step, one scan of each question's own prompt. The layer forms that run
them are in ``model_executor/layers/mamba/gdn``.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from itertools import pairwise

import numpy as np
import torch
from vllm.model_executor.layers.mamba.checkpoint import (
    MambaPrefillCheckpointBuilder,
    MambaPrefillCheckpointMetadata,
)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from vllm_d3.model_executor.models.d3_contract import StateBlock


@dataclass(frozen=True)
class PackedRow:
    """A packed row of the batch: its row, the batch index its prompt's first
    token has (before the step's own tokens where the row's first tokens came
    from the prefix cache, inside its state), and its request's state and
    question blocks (prompt offsets)."""

    row: int
    token_start: int
    block: StateBlock


#: A phase's batch tokens: a slice where they are consecutive, else their indices.
PhaseTokens = slice | torch.Tensor


#: A scan whose tokens repeat (a re-read state's): the scan's position of each
#: batch token's first occurrence, and those batch tokens, ascending.
WriteBack = tuple[torch.Tensor, torch.Tensor]


#: Question blocks per phase-B scan. Each question costs two copies of a
#: recurrent state slot in the scan (the core's gather of its initial state and
#: its final state; 3.1 MB each at d3-turbo's float32 48 x 128 x 128), none of
#: which vLLM's memory profile sees: its profiling run skips the GDN core. A step
#: of 64 packed requests can hold thousands of questions.
QUESTIONS_PER_SCAN = 64


#: A step whose question blocks fit one scan, and whose packed rows' states
#: (each row's state once per question after its first) sum to at most this many
#: tokens, runs its Gated DeltaNet as that one scan, each question block after
#: its row's state again: the same sequences as one prompt per question, so the
#: same answers. Phase B is a second pass through the layer's host code, which
#: costs a short step more than these tokens cost the GPU (docs/performance.md,
#: ``benchmarks.packed_step``). Slots are then
#: not written: the final states of a prompt that ran whole are never read (no
#: prefix-cache hit reaches a packed prompt's questions, and a step with
#: prefill checkpoints to write runs in two phases).
STATE_REREAD_TOKENS_MAX = 1024

#: Most sequences (states, whole rows and question blocks) a step may have to
#: run in one pass; each holds three recurrent states in the layer's core (its
#: initial one, where its first recurrence ends, its final one: 3.1 MB each at
#: d3-turbo's shape), which vLLM's memory profile does not see. A larger step
#: runs in two phases, ``QUESTIONS_PER_SCAN`` blocks a scan.
SPLIT_SEQUENCES_MAX = QUESTIONS_PER_SCAN


def phase_tokens(indices: np.ndarray, device: torch.device) -> PhaseTokens:
    """``indices`` (ascending, distinct) as a slice if they are consecutive."""
    if len(indices) and indices[-1] - indices[0] + 1 == len(indices):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return torch.from_numpy(indices).to(device)


@dataclass(frozen=True)
class QuestionScan:
    """One scan on scratch slots: some of phase B's question blocks, or the
    whole step as each question's own prompt (the state re-read), in batch
    order."""

    tokens: PhaseTokens
    """The blocks' batch tokens, in order (a re-read state's tokens repeat)."""
    write_back: WriteBack | None
    """Where ``tokens`` repeat: which of the scan's outputs are written back."""
    rows: torch.Tensor
    """(blocks,) int64, the batch row whose slot each block reads."""
    metadata: CommonAttentionMetadata
    """Block ``i`` from scratch slot ``1 + i``."""


@dataclass(frozen=True)
class CheckpointScan:
    """Phase A's first scan where rows hold a prefill checkpoint inside what
    phase A scans: each such row's tokens up to its checkpoint, row ``i`` of
    the scan on scratch slot ``1 + i``."""

    tokens: PhaseTokens
    rows: torch.Tensor
    """(rows,) int64, the batch rows, ascending."""
    metadata: CommonAttentionMetadata


@dataclass(frozen=True)
class StepPhases:
    """A step's GDN scans, for every KV-cache group: phase A (after its
    checkpoint scan, if any) and phase B's scans, or one scan with the states
    re-read."""

    state_tokens: PhaseTokens | None
    """The batch tokens phase A scans, in order (None: no phase A)."""
    phase_a: CommonAttentionMetadata | None
    question_scans: tuple[QuestionScan, ...]
    to_checkpoints: CheckpointScan | None = None


@dataclass(frozen=True)
class BuiltQuestionScan:
    """A ``QuestionScan`` as one KV-cache group runs it."""

    tokens: PhaseTokens
    write_back: WriteBack | None
    metadata: GDNAttentionMetadata
    scratch_sources: torch.Tensor
    """(1 + blocks,) the group's state slot each scratch slot stands for:
    the null block, then each block's row."""


@dataclass(frozen=True)
class BuiltCheckpointScan:
    """A ``CheckpointScan`` as one KV-cache group runs it: on copies of its
    rows' states (``sources``: the null block, then each row's slot), whose
    final states then go to each row's checkpoint slot and to its own slot
    (``destinations``, in that order), where phase A continues from them."""

    tokens: PhaseTokens
    metadata: GDNAttentionMetadata
    sources: torch.Tensor
    destinations: torch.Tensor


@dataclass
class PackedGDNAttentionMetadata(GDNAttentionMetadata):
    """A step's GDN metadata (the fields, as built) plus its packed phases."""

    phase_a: GDNAttentionMetadata | None = None
    state_tokens: PhaseTokens | None = None
    question_scans: tuple[BuiltQuestionScan, ...] = ()
    to_checkpoints: BuiltCheckpointScan | None = None


def common_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: torch.Tensor,
    device: torch.device,
) -> CommonAttentionMetadata:
    """A step of prefill rows of ``query_lens`` tokens ending at ``seq_lens``,
    row ``r`` on the state slots of ``block_table[r]``."""
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    query_start_loc_cpu = torch.from_numpy(query_start_loc)
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        max_seq_len=int(seq_lens.max()),
        num_reqs=len(query_lens),
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(query_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        is_prefilling=torch.ones(len(query_lens), dtype=torch.bool),
    )


@dataclass(frozen=True)
class _Block:
    """A sequence of a scan: its batch tokens, the row whose slot it reads, and
    how many tokens that slot's state has seen."""

    tokens: np.ndarray
    row: int
    restart_from: int


def _write_back(tokens: np.ndarray, device: torch.device) -> WriteBack | None:
    """``tokens``' ``WriteBack``; None if no token repeats."""
    written, firsts = np.unique(tokens, return_index=True)
    if len(firsts) == len(tokens):
        return None
    return torch.from_numpy(firsts).to(device), torch.from_numpy(written).to(device)


def scratch_slots(n: int, device: torch.device) -> torch.Tensor:
    """(n, 1) int32: sequence ``i`` of a scan on scratch slot ``1 + i`` (slot 0
    is the null block, which the kernels skip)."""
    return torch.arange(1, n + 1, dtype=torch.int32, device=device)[:, None]


def _scans(blocks: list[_Block], device: torch.device) -> tuple[QuestionScan, ...]:
    """``blocks`` as scans of ``QUESTIONS_PER_SCAN``, block ``i`` of a scan on
    scratch slot ``1 + i``."""
    slots = scratch_slots(QUESTIONS_PER_SCAN, device)
    scans = []
    for first in range(0, len(blocks), QUESTIONS_PER_SCAN):
        scan = blocks[first : first + QUESTIONS_PER_SCAN]
        lens = np.asarray([len(block.tokens) for block in scan], dtype=np.int64)
        tokens = np.concatenate([block.tokens for block in scan])
        scans.append(
            QuestionScan(
                tokens=phase_tokens(tokens, device),
                write_back=_write_back(tokens, device),
                rows=torch.as_tensor(
                    [block.row for block in scan], dtype=torch.int64, device=device
                ),
                metadata=common_metadata(
                    lens,
                    np.asarray([block.restart_from for block in scan]) + lens,
                    slots[: len(scan)],
                    device,
                ),
            )
        )
    return tuple(scans)


def _reread_blocks(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, packed: Sequence[PackedRow]
) -> list[_Block] | None:
    """The step as one scan of each question's own prompt (module docstring),
    or None where ``STATE_REREAD_TOKENS_MAX`` or ``QUESTIONS_PER_SCAN`` rule
    it out, or where a row continues a sequence (its final state is kept)."""
    reread = sum(
        p.block.state_tokens * (len(p.block.question_ends) - 1) for p in packed
    )
    num_rows = len(query_start_loc) - 1
    num_blocks = num_rows + sum(len(p.block.question_ends) - 1 for p in packed)
    fresh = np.array_equal(np.diff(query_start_loc), seq_lens)
    if reread > STATE_REREAD_TOKENS_MAX or num_blocks > QUESTIONS_PER_SCAN or not fresh:
        return None
    by_row = {p.row: p for p in packed}
    blocks = []
    for row, (start, end) in enumerate(pairwise(query_start_loc)):
        if row not in by_row:
            blocks.append(_Block(np.arange(start, end), row, 0))
            continue
        state = np.arange(start, start + by_row[row].block.state_tokens)
        for q_start, q_end in by_row[row].block.question_blocks():
            own = np.concatenate([state, np.arange(start + q_start, start + q_end)])
            blocks.append(_Block(own, row, 0))
    return blocks


def _phase_a_lens(
    query_start_loc: np.ndarray, packed: Sequence[PackedRow]
) -> np.ndarray:
    """(rows,) int64: how many of each row's tokens phase A scans (what the
    step computes of a packed row's state block, any other row whole)."""
    lens_a = np.diff(query_start_loc).astype(np.int64)
    for p in packed:
        lens_a[p.row] = p.token_start + p.block.state_tokens - query_start_loc[p.row]
    return lens_a


def step_checkpoint_offsets(metadata: GDNAttentionMetadata) -> list[int]:
    """Each row's align-mode prefill checkpoint as a Gated DeltaNet group's
    step metadata gives it: the offset into the row's query (0: none; none at
    all outside align mode)."""
    checkpoint = metadata.checkpoint
    if checkpoint is None:
        return []
    # vLLM lists them by request row, every row where no row is a spec decode.
    assert checkpoint.offsets is not None and metadata.spec_sequence_masks is None
    return checkpoint.offsets


def phase_a_checkpoints(
    query_start_loc: np.ndarray, packed: Sequence[PackedRow], offsets: Sequence[int]
) -> list[tuple[int, int]]:
    """``(row, offset)`` for each row whose align-mode prefill checkpoint,
    ``offsets[row]`` tokens into its query (0: none), lies strictly inside
    what phase A scans of it. The others are never read: a hit stays strictly
    inside a state (``state_hit_limit``), and a checkpoint at a plain row's end
    is its final state, which phase A writes."""
    lens_a = _phase_a_lens(query_start_loc, packed)
    return [(row, int(o)) for row, o in enumerate(offsets) if 0 < o < lens_a[row]]


def _checkpoint_scan(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    checkpoints: Sequence[tuple[int, int]],
    device: torch.device,
) -> CheckpointScan:
    rows, offsets = np.asarray(checkpoints, dtype=np.int64).T
    starts = query_start_loc[rows]
    context = seq_lens[rows] - (query_start_loc[rows + 1] - starts)
    tokens = np.concatenate(
        [np.arange(a, a + o) for a, o in zip(starts, offsets, strict=True)]
    )
    return CheckpointScan(
        tokens=phase_tokens(tokens, device),
        rows=torch.from_numpy(rows).to(device),
        metadata=common_metadata(
            offsets, context + offsets, scratch_slots(len(rows), device), device
        ),
    )


def step_phases(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    packed: Sequence[PackedRow],
    device: torch.device,
    checkpoints: Sequence[tuple[int, int]] = (),
) -> StepPhases:
    """The phases of a step of ``len(seq_lens)`` prefill rows, whose packed
    rows are scheduled to their ends (after a prefix-cache hit inside the
    state, phase A continues the row's state from it). Phase A's state slots
    are each group's own (set by ``packed_gdn_metadata``). With ``checkpoints``
    (``phase_a_checkpoints``) the step runs in two phases, and phase A first
    scans those rows up to their checkpoints."""
    reread = None if checkpoints else _reread_blocks(query_start_loc, seq_lens, packed)
    if reread is not None:
        return StepPhases(None, None, _scans(reread, device))
    query_lens = np.diff(query_start_loc).astype(np.int64)
    lens_a = _phase_a_lens(query_start_loc, packed)
    ends_a = seq_lens - (query_lens - lens_a)
    # Each question continues from its row's state, which has seen s tokens.
    blocks = []
    for p in packed:
        s = p.block.state_tokens
        for start, end in p.block.question_blocks():
            tokens = np.arange(p.token_start + start, p.token_start + end)
            blocks.append(_Block(tokens, p.row, s))
    starts_a = query_start_loc[:-1].astype(np.int64)
    to_checkpoints = None
    if checkpoints:
        to_checkpoints = _checkpoint_scan(
            query_start_loc, seq_lens, checkpoints, device
        )
        # Those rows' phase A continues from their checkpoints.
        for row, offset in checkpoints:
            starts_a[row] += offset
            lens_a[row] -= offset
    state_tokens = np.concatenate(
        [np.arange(start, start + n) for start, n in zip(starts_a, lens_a, strict=True)]
    )
    return StepPhases(
        state_tokens=phase_tokens(state_tokens, device),
        phase_a=common_metadata(
            lens_a,
            ends_a,
            torch.empty(0, 1, dtype=torch.int32, device=device),
            device,
        ),
        question_scans=_scans(blocks, device),
        to_checkpoints=to_checkpoints,
    )


#: A Gated DeltaNet KV-cache group of the step: its metadata, its builder and
#: each row's state slot, (rows, 1) (``step_state_slots``).
GDNGroup = tuple[GDNAttentionMetadata, GDNAttentionMetadataBuilder, torch.Tensor]


def step_state_slots(metadata: GDNAttentionMetadata) -> torch.Tensor:
    """(rows, 1): each row's state slot in a Gated DeltaNet group's step
    metadata, as vLLM resolved it (in align mode, the block of the row's
    length, into which vLLM copied a cached state)."""
    slots = metadata.non_spec_state_indices_tensor
    # prefix_bidir steps hold prefills alone, so no row is a spec decode.
    assert slots is not None and metadata.spec_sequence_masks is None
    return slots[:, None]


class _NoCheckpoints(MambaPrefillCheckpointBuilder):
    """Places no prefill checkpoint: the plugin's scans write the step's own,
    which vLLM's metadata for the step names."""

    def build(
        self, m: CommonAttentionMetadata, request_rows: list[int]
    ) -> MambaPrefillCheckpointMetadata | None:
        return None


@contextmanager
def _on_slots(
    builder: GDNAttentionMetadataBuilder, table: torch.Tensor
) -> Iterator[None]:
    """``builder`` building one of the plugin's scans: row ``r``'s state slot
    is ``table[r, 0]`` in any cache mode (``build`` takes the table Model
    Runner V2 computes for align mode, ``mamba_aligned_state_indices``, before
    resolving one from the block table by sequence length), and no checkpoint
    is placed."""
    saved = {
        name: vars(builder)[name]
        for name in ("mamba_aligned_state_indices", "checkpoint_builder")
        if name in vars(builder)
    }
    builder.mamba_aligned_state_indices = table
    builder.checkpoint_builder = _NoCheckpoints(
        builder.vllm_config, builder.kv_cache_spec
    )
    try:
        yield
    finally:
        del builder.mamba_aligned_state_indices, builder.checkpoint_builder
        for name, value in saved.items():
            setattr(builder, name, value)


def build_on_slots(
    builder: GDNAttentionMetadataBuilder, common: CommonAttentionMetadata
) -> GDNAttentionMetadata:
    """``common`` as ``builder`` builds it, each row on the slot in column 0
    of its block table, with no checkpoint."""
    with _on_slots(builder, common.block_table_tensor):
        return builder.build(0, common)


def _phase_a_per_group(
    groups: Sequence[GDNGroup], phase_a: CommonAttentionMetadata | None
) -> list[GDNAttentionMetadata | None]:
    """Phase A built once, by the first group's builder, then re-gathered for
    each group's state slots, as vLLM does for its own groups
    (``update_block_table``)."""
    if phase_a is None:
        return [None] * len(groups)
    _, first_builder, first_slots = groups[0]
    rows = phase_a.num_reqs
    built = build_on_slots(
        first_builder, phase_a.replace(block_table_tensor=first_slots[:rows])
    )
    per_group: list[GDNAttentionMetadata | None] = []
    for _, builder, slots in groups:
        with _on_slots(builder, slots[:rows]):
            per_group.append(
                builder.update_block_table(built, slots[:rows], phase_a.slot_mapping)
            )
    return per_group


def _build_scan(
    builder: GDNAttentionMetadataBuilder, common: CommonAttentionMetadata
) -> GDNAttentionMetadata:
    """A scan as ``builder`` builds it. Where every block continues from its
    row's state (phase B), the prefill rows' initial-state mask, which 0.33.0's
    core only zeroes absent states by, is given on the host: all set, it zeroes
    nothing and launches nothing (on the GPU, its masked fill reads and writes
    every gathered state, 3.1 MB a question a layer at d3-turbo's shape)."""
    built = build_on_slots(builder, common)
    assert common.seq_lens_cpu_upper_bound is not None
    context = common.seq_lens_cpu_upper_bound - common.query_start_loc_cpu.diff()
    mask = built.prefill_has_initial_state
    if mask is None or not bool((context > 0).all()):
        return built
    on_host = torch.ones(len(mask), dtype=torch.bool)
    return replace(built, prefill_has_initial_state=on_host)


def packed_gdn_metadata(
    groups: Sequence[GDNGroup], phases: StepPhases
) -> list[PackedGDNAttentionMetadata]:
    """Each KV-cache group's step metadata (``groups``: the metadata, its
    builder and its rows' state slots) with the packed phases. Every scan is built
    once, by the first group's builder; phase A is re-gathered per group, the
    other scans read scratch slots, the same for every group, each standing for
    a slot of the group's own (the checkpoint scan two: the row's own and its
    checkpoint's)."""
    _, first_builder, _ = groups[0]
    scans = [
        (scan, _build_scan(first_builder, scan.metadata))
        for scan in phases.question_scans
    ]
    checkpoint_scan = None
    if phases.to_checkpoints is not None:
        built = _build_scan(first_builder, phases.to_checkpoints.metadata)
        checkpoint_scan = (phases.to_checkpoints, built)
    return [
        PackedGDNAttentionMetadata(
            **{f.name: getattr(metadata, f.name) for f in fields(GDNAttentionMetadata)},
            phase_a=phase_a,
            state_tokens=phases.state_tokens,
            to_checkpoints=None
            if checkpoint_scan is None
            else _checkpoint_slots(*checkpoint_scan, metadata, slots),
            question_scans=tuple(
                BuiltQuestionScan(
                    tokens=scan.tokens,
                    write_back=scan.write_back,
                    metadata=built,
                    scratch_sources=_scratch_sources(slots, scan.rows),
                )
                for scan, built in scans
            ),
        )
        for (metadata, _, slots), phase_a in zip(
            groups, _phase_a_per_group(groups, phases.phase_a), strict=True
        )
    ]


def _scratch_sources(slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(1 + blocks,) int64: the group's state slot each scratch slot of a scan
    stands for: the null block, then the slot of each block's row."""
    return torch.nn.functional.pad(slots[rows, 0].long(), (1, 0))


def _checkpoint_slots(
    scan: CheckpointScan,
    built: GDNAttentionMetadata,
    metadata: GDNAttentionMetadata,
    slots: torch.Tensor,
) -> BuiltCheckpointScan:
    """``scan`` on one group's slots: its rows' own and the checkpoint slots
    vLLM's metadata for the step names."""
    assert metadata.checkpoint is not None, "a checkpoint scan needs vLLM's"
    sources = _scratch_sources(slots, scan.rows)
    return BuiltCheckpointScan(
        tokens=scan.tokens,
        metadata=built,
        sources=sources,
        destinations=torch.cat(
            [metadata.checkpoint.state_indices[scan.rows].long(), sources[1:]]
        ),
    )


@dataclass(frozen=True)
class Launch:
    """Some of a one-pass step's sequences as one kernel launch: their batch
    tokens in order and their boundaries."""

    tokens: PhaseTokens
    cu_seqlens: torch.Tensor
    """(sequences + 1,) int64."""
    sequences: torch.Tensor
    """(sequences,) int64: their indices among the step's."""


@dataclass(frozen=True)
class SplitRecurrence:
    """A step's sequences in batch order, sequence ``i`` on scratch slot
    ``1 + i``: each packed row's state block then its question blocks, each
    other row whole."""

    metadata: CommonAttentionMetadata
    questions: torch.Tensor
    """(questions,) int64: the sequences that are question blocks."""
    question_slots: torch.Tensor
    """(questions,) int64: their scratch slots."""
    sources: torch.Tensor
    """(questions,) int64: the sequence of each one's state block."""
    window_tokens: torch.Tensor
    """(questions * width,) int64: the batch tokens of each question's
    convolution window, its state's last ``width`` tokens."""
    launches: tuple[Launch, Launch]
    """The state blocks and whole rows, then the question blocks, for a rule
    that runs them one launch after the other."""
    launch_sources: torch.Tensor
    """(questions,) int64: each question's state block among the first
    launch's sequences."""


def split_recurrence(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    packed: list[PackedRow],
    width: int,
    device: torch.device,
) -> SplitRecurrence | None:
    """The plan of a step of fresh prefill rows, whose packed rows are
    scheduled whole; None where a row continues a sequence, a state block is
    shorter than the convolution's window ``width``, a block is one token
    (0.33.0's builder takes it for a decode), or the step has more than
    ``SPLIT_SEQUENCES_MAX`` sequences."""
    if not np.array_equal(np.diff(query_start_loc), seq_lens):
        return None
    if any(p.block.state_tokens < width for p in packed):
        return None
    by_row = {p.row: p.block for p in packed}
    starts: list[int] = []
    lens: list[int] = []
    restarts: list[int] = []
    sources: list[int] = []
    for row, (start, end) in enumerate(pairwise(query_start_loc.tolist())):
        block = by_row.get(row)
        starts.append(start)
        lens.append(end - start if block is None else block.state_tokens)
        restarts.append(0)
        if block is None:
            continue
        state = len(starts) - 1
        for q_start, q_end in block.question_blocks():
            sources.append(state)
            starts.append(start + q_start)
            lens.append(q_end - q_start)
            restarts.append(block.state_tokens)
    if len(starts) > SPLIT_SEQUENCES_MAX or min(lens) == 1:
        return None
    return _plan(
        np.asarray(starts),
        np.asarray(lens),
        np.asarray(restarts),
        sources,
        width,
        device,
    )


def _plan(
    starts: np.ndarray,
    lens: np.ndarray,
    restarts: np.ndarray,
    sources: list[int],
    width: int,
    device: torch.device,
) -> SplitRecurrence:
    questions = np.flatnonzero(restarts)
    # A question block's window is its state block's last ``width`` tokens.
    state_ends = starts[sources] + restarts[questions]
    window = (state_ends[:, None] + np.arange(-width, 0)).reshape(-1)

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(device)

    def launch(sequences: np.ndarray, on_gpu: torch.Tensor) -> Launch:
        """``sequences`` as one launch (``on_gpu``: them on the device)."""
        cu_seqlens = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lens[sequences], out=cu_seqlens[1:])
        spans = [np.arange(starts[i], starts[i] + lens[i]) for i in sequences]
        tokens = np.concatenate(spans)
        return Launch(
            tokens=phase_tokens(tokens, device),
            cu_seqlens=on_device(cu_seqlens),
            sequences=on_gpu,
        )

    opening = np.flatnonzero(restarts == 0)
    # The question sequences on the device once, for either rule.
    questions_on_gpu = on_device(questions)
    return SplitRecurrence(
        metadata=common_metadata(
            lens, restarts + lens, scratch_slots(len(starts), device), device
        ),
        questions=questions_on_gpu,
        question_slots=on_device(questions + 1),
        sources=on_device(np.asarray(sources)),
        window_tokens=on_device(window),
        launches=(
            launch(opening, on_device(opening)),
            launch(questions, questions_on_gpu),
        ),
        launch_sources=on_device(np.searchsorted(opening, sources)),
    )


@dataclass
class SplitGDNAttentionMetadata(GDNAttentionMetadata):
    """A step's GDN metadata (the fields, as built) plus its one pass: the
    metadata it runs with (sequence ``i`` on scratch slot ``1 + i``) and the
    plan."""

    one_pass: GDNAttentionMetadata | None = None
    split: SplitRecurrence | None = None


def split_gdn_metadata(
    groups: Sequence[GDNGroup], split: SplitRecurrence
) -> list[SplitGDNAttentionMetadata]:
    """Each KV-cache group's step metadata with the one pass, which is the same
    for every group (it runs on scratch slots): built once, by the first
    group's builder. Its initial-state mask stays the builder's, on the device:
    the masked fill over the gathered states (zeros, ``FreshStates``) is one
    kernel a layer, where a host mask would copy to the device from pageable
    memory and so wait for the GPU, every layer."""
    _, builder, _ = groups[0]
    one_pass = build_on_slots(builder, split.metadata)
    return [
        SplitGDNAttentionMetadata(
            **{f.name: getattr(metadata, f.name) for f in fields(GDNAttentionMetadata)},
            one_pass=one_pass,
            split=split,
        )
        for metadata, _, _ in groups
    ]


def packed_step_metadata(
    groups: Sequence[GDNGroup],
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    packed: Sequence[PackedRow],
    checkpoints: Sequence[tuple[int, int]],
    one_pass_window: int | None,
) -> list[GDNAttentionMetadata]:
    """Each group's metadata of a step of ``len(seq_lens)`` prefill rows: its
    one pass where ``one_pass_window`` (the layers' convolution window) is
    given and the step allows it, else ``step_phases``' scans (one scan of
    each question's own prompt for a small step, else two phases). Only the
    two phases write ``checkpoints`` (``phase_a_checkpoints``)."""
    device = groups[0][2].device
    if one_pass_window is not None and not checkpoints:
        split = split_recurrence(
            query_start_loc, seq_lens, list(packed), one_pass_window, device
        )
        if split is not None:
            return list(split_gdn_metadata(groups, split))
    phases = step_phases(query_start_loc, seq_lens, packed, device, checkpoints)
    return list(packed_gdn_metadata(groups, phases))
