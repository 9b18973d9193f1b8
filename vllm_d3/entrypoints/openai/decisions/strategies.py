# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 read strategy for prefix_bidir checkpoints
(upstream: ``entrypoints/openai/decisions/strategies.py``).

``D3Strategy`` extends 0.33.0's strategy of the same name and replaces it in
``READ_STRATEGIES``. Its ``read`` is 0.33.0's own: that renders every question's
prompt (media read once) and sends one classify ``encode`` per question, request
ids ``f"{request_id}-{n}"``, concurrently. The plugin changes only what those
calls reach, through the strategy's engine client (``_ReadingEngineClient``):

- A ``causal`` or ``noncausal_full_attention`` checkpoint without
  ``temperature_by_questions`` keeps vLLM's engine client: nothing changes.
- Otherwise a request's encodes are gathered (``_RequestReads``) and:
  - for ``prefix_bidir``, the state block size ``s`` is counted once with the
    checkpoint runtime's rule (``state_block_size``: the leading tokens whose
    text ends at or before the end of the state text; a token that joins the
    state's last character to the question block belongs to the question; the
    system turn and the media come first, so they are inside the state) and
    every prompt must share its first ``s`` tokens;
  - **state once** (the default where the dense-piece attention serves): the
    questions are packed into one engine request ``state || q1 || ... || qQ``
    with ``d3_state_tokens = s`` and ``d3_question_ends``; the engine returns
    the code logits of every question, flat. A pack longer than the engine
    takes in one step (``max_model_len``, ``max_num_batched_tokens``) is split
    into several packs, each reading the state again, and the log says so;
  - **per question** (``--additional-config '{"d3_state_once": false}'``, or
    where state once is unavailable): each encode goes to the engine as it came,
    its params carrying ``d3_state_tokens = s``;
  - with ``temperature_by_questions`` (d3-ultra), the request's question count
    picks the temperature: the logits reach 0.33.0's ``read``, which divides
    them by ``temperature``, already scaled by ``temperature / t(Q)``.
- ``usage.input_tokens`` counts what the engine computed: a pack's state once,
  with its first question.
"""

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import (
    Question,
    StructuredDecisionError,
)
from vllm.entrypoints.openai.decisions.strategies import QuestionRead, ReadContext
from vllm.inputs import EngineInput
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingOutput, PoolingRequestOutput
from vllm.pooling_params import PoolingParams

from vllm_d3.model_executor.models.d3_contract import (
    QUESTION_ENDS_KEY,
    STATE_TOKENS_KEY,
    is_prefix_bidir,
    state_once_of,
    temperature_schedule_of,
)

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")


def state_block_size(offsets: Sequence[tuple[int, int]], state_end: int) -> int:
    """How many leading tokens end at or before character ``state_end``."""
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


@dataclass
class _Read:
    """One engine request: its input, params, and the questions it answers."""

    engine_input: EngineInput
    params: PoolingParams
    request_id: str
    questions: list[int]


class _RequestReads:
    """One ``read``'s encodes: gathered, sized, then packed or sent one by one."""

    def __init__(
        self,
        strategy: "D3Strategy",
        request_id: str,
        questions: list[Question],
        state: str,
        media: Any,
    ) -> None:
        self.strategy = strategy
        self.request_id = request_id
        self.questions = questions
        self.state = state
        self.media = media
        self.inputs: dict[int, tuple[EngineInput, PoolingParams, dict[str, Any]]] = {}
        loop = asyncio.get_running_loop()
        self.results: list[asyncio.Future[PoolingRequestOutput]] = [
            loop.create_future() for _ in questions
        ]
        #: The tokens the engine computed for each question (usage).
        self.computed_tokens: list[int] = [0] * len(questions)
        self.task: asyncio.Task | None = None

    async def encode(
        self,
        n: int,
        engine_input: EngineInput,
        params: PoolingParams,
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        self.inputs[n] = (engine_input, params, kwargs)
        if len(self.inputs) == len(self.questions):
            self.task = asyncio.ensure_future(self._run())
        yield await self.results[n]

    async def _run(self) -> None:
        try:
            await asyncio.gather(*(self._send(read) for read in self._plan()))
        except Exception as e:
            # Each question's encode raises it, as an engine error would.
            for future in self.results:
                if not future.done():
                    future.set_exception(e)

    def _plan(self) -> list[_Read]:
        strategy = self.strategy
        request_id = self.request_id
        # Token or multimodal inputs: 0.33.0's read renders nothing else.
        inputs: list[Any] = [self.inputs[n][0] for n in range(len(self.questions))]
        ids = [engine_input["prompt_token_ids"] for engine_input in inputs]
        params = self.inputs[0][1]
        self.computed_tokens = [len(prompt) for prompt in ids]
        if not strategy.prefix_bidir:
            return [
                _Read(inputs[n], params, f"{request_id}-{n}", [n])
                for n in range(len(ids))
            ]
        s = strategy.state_tokens(self.questions[0], self.state, self.media, ids[0])
        if any(prompt[:s] != ids[0][:s] or len(prompt) <= s for prompt in ids):
            raise StructuredDecisionError(
                "the questions' prompts do not share their state block"
            )
        sized = params.clone()
        sized.extra_kwargs = {**(params.extra_kwargs or {}), STATE_TOKENS_KEY: s}
        if not strategy.state_once or len(ids) == 1:
            return [
                _Read(inputs[n], sized, f"{request_id}-{n}", [n])
                for n in range(len(ids))
            ]
        packs = pack_questions(s, [len(p) - s for p in ids], strategy.max_pack_tokens)
        if len(packs) > 1:
            logger.info(
                "D3 request %s: %d questions in %d packs, each reading the %d-token "
                "state (a pack holds at most %d tokens)",
                request_id,
                len(ids),
                len(packs),
                s,
                strategy.max_pack_tokens,
            )
        reads = []
        for k, pack in enumerate(packs):
            packed_ids = list(ids[0][:s])
            ends = []
            for n in pack:
                packed_ids += ids[n][s:]
                ends.append(len(packed_ids))
                self.computed_tokens[n] = len(ids[n]) - s
            self.computed_tokens[pack[0]] += s
            packed = params.clone()
            packed.extra_kwargs = {
                **(sized.extra_kwargs or {}),
                QUESTION_ENDS_KEY: ends,
            }
            engine_input: Any = {**inputs[0], "prompt_token_ids": packed_ids}
            reads.append(_Read(engine_input, packed, f"{request_id}-pack{k}", pack))
        return reads

    async def _send(self, read: _Read) -> None:
        kwargs = self.inputs[read.questions[0]][2]
        output = None
        async for last in self.strategy.engine_client.encode(
            read.engine_input, read.params, read.request_id, **kwargs
        ):
            output = last
        if output is None:
            raise ValueError("Failed to score the question: no output")
        if output.error is not None:
            for n in read.questions:
                self.results[n].set_result(output)
            return
        # One row of code logits per question; scaled for the question count.
        rows = output.outputs.data.view(len(read.questions), -1)
        rows = rows * self.strategy.logit_scale(len(self.questions))
        for n, row in zip(read.questions, rows, strict=True):
            self.results[n].set_result(
                PoolingRequestOutput(
                    read.request_id,
                    PoolingOutput(data=row),
                    output.prompt_token_ids,
                    output.num_cached_tokens,
                    finished=True,
                )
            )


class _ReadingEngineClient:
    """The engine client as ``D3Strategy.read`` sees it: its encodes go to the
    request's ``_RequestReads``; everything else is vLLM's engine client."""

    def __init__(self, engine_client: Any, strategy: "D3Strategy") -> None:
        self._engine_client = engine_client
        self._strategy = strategy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine_client, name)

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        **kwargs: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        read_id, _, n = request_id.rpartition("-")
        reads = self._strategy.requests.get(read_id)
        if reads is None or not n.isdigit():
            return self._engine_client.encode(
                prompt, pooling_params, request_id, **kwargs
            )
        return reads.encode(int(n), prompt, pooling_params, kwargs)


class D3Strategy(upstream.D3Strategy):
    def __init__(self, context: ReadContext):
        super().__init__(context)
        engine_client = context.engine_client
        decision = engine_client.model_config.hf_config.decision_config
        self.prefix_bidir = is_prefix_bidir(decision)
        self.temperature_schedule = temperature_schedule_of(decision)
        vllm_config = engine_client.vllm_config
        #: Set by the config hook: whether packs are served (see the docstring).
        self.state_once = self.prefix_bidir and state_once_of(
            vllm_config.additional_config
        )
        self.max_pack_tokens = min(
            self.max_model_len, vllm_config.scheduler_config.max_num_batched_tokens
        )
        self.engine_client = engine_client
        #: The reads in flight, by request id.
        self.requests: dict[str, _RequestReads] = {}
        if self.prefix_bidir or self.temperature_schedule is not None:
            reading: Any = _ReadingEngineClient(engine_client, self)
            self.context = replace(context, engine_client=reading)

    def temperature_for(self, num_questions: int) -> float:
        if self.temperature_schedule is None:
            return self.temperature
        return self.temperature_schedule.temperature_for(num_questions)

    def logit_scale(self, num_questions: int) -> float:
        """What turns 0.33.0's ``logit / temperature`` into ``logit / t(Q)``."""
        return self.temperature / self.temperature_for(num_questions)

    def state_tokens(
        self, question: Question, state: str, media: Any, prompt_ids: list[int]
    ) -> int:
        """The state block size of ``prompt_ids``, one question's prompt as
        0.33.0's ``read`` rendered it (media ids, then the tokens of the text
        after the last media placeholder)."""
        placeholders = [m for m in ("image", "video") for _ in (media or {}).get(m, ())]
        text = self._prompt(state, question, placeholders)
        if placeholders:
            text = text[text.rindex(self.VISION_END) + len(self.VISION_END) :]
        head = "State:\n"
        start = text.find(f"{head}{state}\n\nQuestion:\n")
        if start < 0:
            raise StructuredDecisionError(
                "the chat template did not render the D3 state block as expected"
            )
        tokenizer: Any = self.tokenizer  # a Hugging Face fast tokenizer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        text_ids = encoded["input_ids"]
        if list(prompt_ids[len(prompt_ids) - len(text_ids) :]) != list(text_ids):
            raise StructuredDecisionError("the D3 prompt was not rendered as expected")
        media_tokens = len(prompt_ids) - len(text_ids)
        state_end = start + len(head) + len(state)
        return media_tokens + state_block_size(encoded["offset_mapping"], state_end)

    async def read(
        self,
        questions: list[Question],
        instructions: str | None,
        state: str,
        *,
        request_id: str,
        chat_template_kwargs: dict[str, Any] | None,
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
        media: Mapping[str, Sequence[str]] | None = None,
    ) -> list[QuestionRead]:
        read = partial(
            super().read,
            questions,
            instructions,
            state,
            request_id=request_id,
            chat_template_kwargs=chat_template_kwargs,
            lora_request=lora_request,
            priority=priority,
            cache_salt=cache_salt,
            trace_headers=trace_headers,
            media=media,
        )
        if not isinstance(self.context.engine_client, _ReadingEngineClient):
            return await read()
        reads = _RequestReads(self, request_id, questions, state, media)
        self.requests[request_id] = reads
        try:
            answers = await read()
        finally:
            del self.requests[request_id]
            if reads.task is not None:
                # A cancelled or failed read stops its engine requests too.
                reads.task.cancel()
        for answer, tokens in zip(answers, reads.computed_tokens, strict=True):
            answer.input_tokens = tokens
        return answers
