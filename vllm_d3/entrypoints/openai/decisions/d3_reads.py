# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How ``D3Strategy`` reads a request's questions where a D3 checkpoint needs
more than one plain encode per question
(upstream: ``entrypoints/openai/decisions/d3_reads.py``, a new file).

``D3StateBlockReads``, a base of ``D3Strategy``: where
``needs_state_block_reads`` holds (prefix_bidir, or d3-ultra's
``temperature_by_questions``), ``read`` hands its rendered engine inputs to
``read_state_blocks``, which returns each question's code logits and the
tokens the engine computed and took from the prefix cache for it. Every
prefix_bidir prompt of a request shares its state block (``state_tokens``);
with state once the questions go packed into as few engine requests as one
step holds (``_plan``), otherwise one encode per question carries the state
size. With prefix caching a long state is also read alone first
(``read_state_blocks``).
"""

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from vllm.entrypoints.openai.decisions.question_types import (
    Question,
    StructuredDecisionError,
)
from vllm.inputs import EngineInput
from vllm.logger import init_logger
from vllm.outputs import PoolingRequestOutput
from vllm.pooling_params import PoolingParams

from vllm_d3.entrypoints.openai.decisions.d3_state_key import (
    checkpoint_grid,
    media_identifiers,
    state_cache_salt,
)
from vllm_d3.model_executor.models.d3_contract import (
    QUESTION_ENDS_KEY,
    STATE_TOKENS_KEY,
    TemperatureSchedule,
    is_prefix_bidir,
    state_cache_min_tokens_of,
    state_once_decided,
    temperature_schedule_of,
)

if TYPE_CHECKING:
    from vllm.entrypoints.openai.decisions.strategies import ReadContext

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")

#: Where a question prompt's text (upstream ``_prompt``: the system turn, the
#: media, ``State:``, the state, then ``Question:``) splits into the head the
#: request's questions share and the question's own tail, which opens with the
#: ``:``. Between a letter and ``:`` byte-level BPE's split pattern always
#: starts a new pre-token, and merges stay inside pre-tokens.
SHARED_HEAD_END = "\n\nQuestion"


def needs_state_block_reads(decision: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's reads go through ``read_state_blocks``:
    prefix_bidir, or a temperature by question count (d3-ultra's). Other D3
    checkpoints read as vLLM 0.33.0 reads them."""
    return is_prefix_bidir(decision) or temperature_schedule_of(decision) is not None


def _head_and_tail(text: str) -> tuple[str, str] | None:
    """``text`` split after its first ``SHARED_HEAD_END`` that a ``:`` follows;
    ``None`` where there is none."""
    cut = text.find(SHARED_HEAD_END + ":")
    if cut < 0:
        return None
    cut += len(SHARED_HEAD_END)
    return text[:cut], text[cut:]


def state_block_size(offsets: Sequence[tuple[int, int]], state_end: int) -> int:
    """How many leading tokens end at or before character ``state_end``: the
    checkpoint runtime's rule (a token that joins the state's last character
    to the question block belongs to the question; the system turn and the
    media come first, so they are inside the state)."""
    count = 0
    for _, end in offsets:
        if end > state_end:
            break
        count += 1
    return count


def pack_questions(
    state_tokens: int, question_lens: Sequence[int], limit: int
) -> list[list[int]]:
    """Consecutive questions grouped so that ``s + sum(q)`` stays within
    ``limit``; a question too long for any pack goes alone (and fails as its
    own prompt would). Returns lists of question indices."""
    packs: list[list[int]] = []
    length = limit + 1
    for n, q in enumerate(question_lens):
        if length + q > limit:
            packs.append([])
            length = state_tokens
        packs[-1].append(n)
        length += q
    return packs


class QuestionTokens(NamedTuple):
    """A question's usage: the tokens the engine computed for it, and those it
    took from the prefix cache."""

    computed: int
    cached: int


@dataclass
class _Read:
    """One engine request: its input, params, id, the questions it answers and
    each one's own tokens (a pack's state and what else its prompt holds count
    with its first question)."""

    engine_input: Any
    params: PoolingParams
    request_id: str
    questions: list[int]
    question_tokens: list[int]

    def usage(self, output: PoolingRequestOutput) -> list[QuestionTokens]:
        """Each of its questions' usage, from the engine's ``output``."""
        cached = output.num_cached_tokens or 0
        computed = len(self.engine_input["prompt_token_ids"]) - cached
        first = computed - sum(self.question_tokens[1:])
        rest = [QuestionTokens(q, 0) for q in self.question_tokens[1:]]
        return [QuestionTokens(first, cached), *rest]


def _per_question_reads(
    engine_inputs: Sequence[Any], params: PoolingParams, request_id: str, s: int
) -> list[_Read]:
    """One engine request per question, each prompt reading its ``s``-token
    state (0: none)."""
    return [
        _Read(
            inputs,
            params,
            f"{request_id}-{n}",
            [n],
            [len(inputs["prompt_token_ids"]) - s],
        )
        for n, inputs in enumerate(engine_inputs)
    ]


class D3StateBlockReads:
    # What D3Strategy provides.
    context: "ReadContext"
    temperature: float
    max_model_len: int
    tokenizer: Any
    VISION_END: str

    if TYPE_CHECKING:

        def _prompt(self, state: str, q: Question, placeholders: list[str]) -> str: ...

    def init_state_blocks(self) -> None:
        """Read the checkpoint's decision config (at the end of the strategy's
        ``__init__``)."""
        engine_client = self.context.engine_client
        decision = engine_client.model_config.hf_config.decision_config
        vllm_config = engine_client.vllm_config
        self.prefix_bidir = is_prefix_bidir(decision)
        self.temperature_schedule: TemperatureSchedule | None = temperature_schedule_of(
            decision
        )
        self.needs_state_block_reads = needs_state_block_reads(decision)
        self.state_once = self.prefix_bidir and state_once_decided(
            vllm_config.additional_config
        )
        self.max_pack_tokens = min(
            self.max_model_len, vllm_config.scheduler_config.max_num_batched_tokens
        )
        cache_config = vllm_config.cache_config
        #: Whether states are cached across requests, and the shortest state
        #: read alone first: longer than the cache's grid (a shorter one has
        #: no cached state inside it) and of at least the configured tokens.
        self.state_cache = self.prefix_bidir and cache_config.enable_prefix_caching
        self.state_read_alone_tokens = (
            max(
                checkpoint_grid(cache_config) + 1,
                state_cache_min_tokens_of(vllm_config.additional_config),
            )
            if self.state_cache
            else 0
        )
        #: The state-alone reads in flight, by key: a read of the same state
        #: sends none (its questions take the one in flight's blocks).
        self.state_reads: dict[str, asyncio.Task[PoolingRequestOutput]] = {}
        #: Whether prompts are tokenized as a shared head and a tail (None:
        #: not checked yet), and the last head with its tokens and their
        #: character offsets.
        self.splits_heads: bool | None = None if self.prefix_bidir else False
        self.last_head: tuple[str, list[int], list[tuple[int, int]]] = ("", [], [])
        #: Where the reads go (the engine client the strategy was built with).
        self.engine_client = engine_client

    def temperature_for(self, num_questions: int) -> float:
        """The temperature a request of ``num_questions`` questions divides its
        logits by (d3-ultra's ``temperature_by_questions``, else the config's)."""
        if self.temperature_schedule is None:
            return self.temperature
        return self.temperature_schedule.temperature_for(num_questions)

    def question_tokens(
        self,
        text: str,
        encode: Callable[[str], list[int]],
        tails: Mapping[str, list[int]] | None = None,
    ) -> list[int]:
        """``encode(text)`` for a question prompt's text, its shared head (up to
        ``SHARED_HEAD_END``) encoded once for consecutive prompts that share
        it, its tail taken from ``tails`` (``tail_tokens``) where it is there.
        The first split is checked against encoding the whole text; if they
        differ, whole texts from then on, and the log says so."""
        split = None if self.splits_heads is False else _head_and_tail(text)
        if split is None:
            return encode(text)
        head, tail = split
        if self.last_head[0] != head:
            self.last_head = (head, *self._encoded(head))
        tail_ids = (tails or {}).get(tail)
        ids = self.last_head[1] + (encode(tail) if tail_ids is None else tail_ids)
        if self.splits_heads is None:
            whole = encode(text)
            self.splits_heads = ids == whole
            if not self.splits_heads:
                logger.warning(
                    "D3 prefix_bidir: this tokenizer merges across %r, so every "
                    "question's prompt is tokenized whole",
                    SHARED_HEAD_END + ":",
                )
                return whole
        return ids

    def tail_tokens(self, prompts: Sequence[str]) -> dict[str, list[int]]:
        """The tokens of ``prompts``' tails (what ``question_tokens`` encodes
        after their head), encoded in one call: a fast tokenizer encodes a
        batch in parallel."""
        if self.splits_heads is False:
            return {}
        tails = list({split[1] for p in prompts if (split := _head_and_tail(p))})
        if not tails:
            return {}
        encoded = self.tokenizer(tails, add_special_tokens=False)["input_ids"]
        return dict(zip(tails, encoded, strict=True))

    def state_tokens(
        self, question: Question, state: str, media: Any, prompt_ids: list[int]
    ) -> int:
        """The state block size of ``prompt_ids``, one question's prompt as
        ``read`` rendered it (media ids, then the tokens of the text after the
        last media placeholder)."""
        placeholders = [m for m in ("image", "video") for _ in (media or {}).get(m, ())]
        text = self._prompt(state, question, placeholders)
        if placeholders:
            text = text[text.rindex(self.VISION_END) + len(self.VISION_END) :]
        head = "State:\n"
        start = text.find(f"{head}{state}{SHARED_HEAD_END}:\n")
        if start < 0:
            raise StructuredDecisionError(
                "the chat template did not render the D3 state block as expected"
            )
        text_ids, offsets = self._text_tokens(text)
        if list(prompt_ids[len(prompt_ids) - len(text_ids) :]) != list(text_ids):
            raise StructuredDecisionError("the D3 prompt was not rendered as expected")
        media_tokens = len(prompt_ids) - len(text_ids)
        state_end = start + len(head) + len(state)
        return media_tokens + state_block_size(offsets, state_end)

    def _encoded(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``text``'s tokens (as ``_tokens`` gives them) and their character
        offsets."""
        tokenizer = self.tokenizer  # a Hugging Face fast tokenizer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), list(encoded["offset_mapping"])

    def _text_tokens(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A question prompt's text as ``_encoded`` gives it, its head's part
        from the last head encoded where that is this text's (a long state is
        then not encoded again)."""
        split = _head_and_tail(text)  # where ``question_tokens`` splits
        if not self.splits_heads or split is None or split[0] != self.last_head[0]:
            return self._encoded(text)
        head = split[0]
        tail_ids, tail_offsets = self._encoded(text[len(head) :])
        shifted = [(start + len(head), end + len(head)) for start, end in tail_offsets]
        return self.last_head[1] + tail_ids, self.last_head[2] + shifted

    async def read_state_blocks(
        self,
        engine_inputs: Sequence[EngineInput],
        params: PoolingParams,
        questions: list[Question],
        state: str,
        media: Any,
        request_id: str,
        **encode_kwargs: Any,
    ) -> tuple[list[torch.Tensor], list[QuestionTokens]]:
        """Each question's code logits (a row of its engine request's output)
        and usage. With prefix caching (every engine request keyed by its whole
        state in the input processor), a state longer than the cache's grid and
        of at least ``d3_state_cache_min_tokens`` is also read alone, once for
        the reads of it in flight, sent right before the questions' requests,
        which find the blocks vLLM caches as it schedules the read."""
        reads, state_read = self._plan(
            engine_inputs, params, questions, state, media, request_id
        )
        usage = [QuestionTokens(0, 0) for _ in questions]
        # Sent first; its questions right behind it, not once it ended: in
        # between, other states' reads could evict it (docs/design.md).
        alone = (
            None if state_read is None else self._read_alone(state_read, encode_kwargs)
        )
        try:
            outputs = await asyncio.gather(
                *(self._send(read, encode_kwargs) for read in reads)
            )
            if state_read is not None and alone is not None:
                usage[0] = state_read.usage(await alone)[0]
        except BaseException:
            if alone is not None:
                alone.cancel()  # a read that fails or is cancelled leaves it
            raise
        logits: list[torch.Tensor] = [torch.empty(0)] * len(questions)
        for read, output in zip(reads, outputs, strict=True):
            rows = output.outputs.data.view(len(read.questions), -1)
            for n, row, tokens in zip(
                read.questions, rows, read.usage(output), strict=True
            ):
                logits[n] = row
                usage[n] = QuestionTokens(
                    usage[n].computed + tokens.computed, usage[n].cached + tokens.cached
                )
        return logits, usage

    def _plan(
        self,
        engine_inputs: Sequence[Any],
        params: PoolingParams,
        questions: list[Question],
        state: str,
        media: Any,
        request_id: str,
    ) -> tuple[list[_Read], _Read | None]:
        """The engine requests of one read, and the state-alone read to send
        before them (``None``: none): per question, request ids
        ``f"{request_id}-{n}"``, each with ``d3_state_tokens`` for
        prefix_bidir; state once, packs ``state || q1 || ... || qQ`` with
        ``d3_question_ends``, as many as ``max_model_len`` and
        ``max_num_batched_tokens`` need (each reading the state again, and
        logged). With the state cache, a state of at least
        ``state_read_alone_tokens`` is also read alone (sent first)."""
        ids = [engine_input["prompt_token_ids"] for engine_input in engine_inputs]
        if not self.prefix_bidir:
            return _per_question_reads(engine_inputs, params, request_id, 0), None
        s = self.state_tokens(questions[0], state, media, ids[0])
        if any(prompt[:s] != ids[0][:s] or len(prompt) <= s for prompt in ids):
            raise StructuredDecisionError(
                "the questions' prompts do not share their state block"
            )
        sized = params.clone()
        sized.extra_kwargs = {**(params.extra_kwargs or {}), STATE_TOKENS_KEY: s}
        if not self.state_once or len(ids) == 1:
            reads = _per_question_reads(engine_inputs, sized, request_id, s)
        else:
            reads = self._packed_reads(engine_inputs, sized, s, request_id)
        if not self.state_cache or s < self.state_read_alone_tokens:
            return reads, None
        alone = {**engine_inputs[0], "prompt_token_ids": ids[0][:s]}
        return reads, _Read(alone, sized, f"{request_id}-state", [], [])

    def _packed_reads(
        self,
        engine_inputs: Sequence[Any],
        sized: PoolingParams,
        s: int,
        request_id: str,
    ) -> list[_Read]:
        """The packs ``state || q1 || ... || qQ`` of one read (``sized``: the
        params with its state block size ``s``)."""
        ids = [engine_input["prompt_token_ids"] for engine_input in engine_inputs]
        question_lens = [len(prompt) - s for prompt in ids]
        packs = pack_questions(s, question_lens, self.max_pack_tokens)
        if len(packs) > 1:
            logger.info(
                "D3 request %s: %d questions in %d packs, each reading the %d-token "
                "state (a pack holds at most %d tokens)",
                request_id,
                len(ids),
                len(packs),
                s,
                self.max_pack_tokens,
            )
        reads = []
        for k, pack in enumerate(packs):
            packed_ids = list(ids[0][:s])
            ends = []
            for n in pack:
                packed_ids += ids[n][s:]
                ends.append(len(packed_ids))
            packed = sized.clone()
            packed.extra_kwargs = {
                **(sized.extra_kwargs or {}),
                QUESTION_ENDS_KEY: ends,
            }
            engine_input = {**engine_inputs[0], "prompt_token_ids": packed_ids}
            own_tokens = [question_lens[n] for n in pack]
            reads.append(
                _Read(engine_input, packed, f"{request_id}-pack{k}", pack, own_tokens)
            )
        return reads

    def _read_alone(
        self, read: _Read, encode_kwargs: dict[str, Any]
    ) -> "asyncio.Task[PoolingRequestOutput] | None":
        """Send ``read``, a state alone (its readout is not used), as a task;
        ``None`` where a read of the same state is in flight."""
        alone = read.engine_input
        # The key the input processor gives the state's blocks.
        key = state_cache_salt(
            alone.get("cache_salt"),
            alone["prompt_token_ids"],
            media_identifiers(alone),
        )
        if key in self.state_reads:
            return None
        task = asyncio.ensure_future(self._send(read, encode_kwargs))
        self.state_reads[key] = task
        task.add_done_callback(lambda _: self.state_reads.pop(key, None))
        return task

    async def _send(
        self, read: _Read, encode_kwargs: dict[str, Any]
    ) -> PoolingRequestOutput:
        """One engine request's output (one row of code logits per question
        it answers)."""
        output = None
        async for last in self.engine_client.encode(
            read.engine_input, read.params, read.request_id, **encode_kwargs
        ):
            output = last
        if output is None:
            raise ValueError("Failed to score the question")
        if output.error is not None:
            raise ValueError(f"Failed to score the question: {output.error.message}")
        return output
