# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 read strategy for prefix_bidir checkpoints, on vLLM 0.33.0
(upstream: ``entrypoints/openai/decisions/strategies.py``, an edit: the series'
strategy commit, ``vllm_d3.export.series``).

In-tree, ``D3Strategy.read`` hands its rendered engine inputs to
``read_state_blocks`` (``d3_reads.py``) where the checkpoint needs it. Here,
without editing 0.33.0's ``read`` (which renders every question's prompt and
sends one classify encode per question, concurrently), ``D3Strategy`` extends
0.33.0's class and keeps that ``read``; the plugin serves it where
``needs_state_block_reads`` holds (``patches.py``), and 0.33.0's class
elsewhere. There, ``read`` makes the request's
``_RequestReads`` the current read (``CURRENT_READ``) for the duration of
0.33.0's ``read``; the engine client that ``read`` sees (``_ReadingEngineClient``)
hands the current read each encode, which gathers them and reads them together.
"""

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from functools import partial
from typing import Any

from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import Question
from vllm.entrypoints.openai.decisions.strategies import (
    QuestionRead,
    ReadContext,
)
from vllm.inputs import EngineInput
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingOutput, PoolingRequestOutput
from vllm.pooling_params import PoolingParams

from vllm_d3.entrypoints.openai.decisions.d3_reads import (
    D3StateBlockReads,
    QuestionTokens,
)


def question_request_id(request_id: str, n: int) -> str:
    """The request id 0.33.0's ``read`` gives question ``n``'s encode (the
    tests hold 0.33.0 to it)."""
    return f"{request_id}-{n}"


class _RequestReads:
    """One ``read``'s encodes, one per question, known by the request id
    0.33.0's ``read`` gives each (``question_request_id``): gathered, then read
    together by ``read_state_blocks``. Each question's logits go back to
    0.33.0's ``read`` scaled by ``temperature / temperature_for(Q)`` (its
    division by ``temperature`` then divides them by ``temperature_for(Q)``),
    with the tokens the engine computed and took from the prefix cache for it
    as its usage."""

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
        self.question_of = {
            question_request_id(request_id, n): n for n in range(len(questions))
        }
        self.inputs: dict[int, tuple[EngineInput, PoolingParams, dict[str, Any]]] = {}
        loop = asyncio.get_running_loop()
        self.results: list[asyncio.Future[PoolingRequestOutput]] = [
            loop.create_future() for _ in questions
        ]
        #: Each question's usage.
        self.usage = [QuestionTokens(0, 0) for _ in questions]
        #: The prompts 0.33.0's read rendered, all before it tokenizes the
        #: first; then their tails' tokens, encoded together at that first.
        self.prompts: list[str] = []
        self.tails: dict[str, list[int]] | None = None
        self.task: asyncio.Task | None = None

    async def encode(
        self,
        request_id: str,
        engine_input: EngineInput,
        params: PoolingParams,
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        n = self.question_of.get(request_id)
        if n is None or n in self.inputs:
            raise RuntimeError(
                f"D3 read {self.request_id}: an encode {request_id!r} that is not "
                "one of its questions' (vLLM's D3Strategy.read names them "
                f"{question_request_id(self.request_id, 0)!r} on)"
            )
        self.inputs[n] = (engine_input, params, kwargs)
        if len(self.inputs) == len(self.questions):
            self.task = asyncio.ensure_future(self._run())
        yield await self.results[n]

    async def _run(self) -> None:
        strategy = self.strategy
        # 0.33.0's read sends every question with the same params and kwargs.
        _, params, kwargs = self.inputs[0]
        try:
            logits, self.usage = await strategy.read_state_blocks(
                [self.inputs[n][0] for n in range(len(self.questions))],
                params,
                self.questions,
                self.state,
                self.media,
                self.request_id,
                **kwargs,
            )
        except Exception as e:
            # Each question's encode raises it, as an engine error would.
            for future in self.results:
                if not future.done():
                    future.set_exception(e)
            return
        scale = strategy.logit_scale(len(self.questions))
        for n, row in enumerate(logits):
            # Token or multimodal inputs: 0.33.0's read renders nothing else.
            engine_input: Any = self.inputs[n][0]
            self.results[n].set_result(
                PoolingRequestOutput(
                    question_request_id(self.request_id, n),
                    PoolingOutput(data=row * scale),
                    engine_input["prompt_token_ids"],
                    self.usage[n].cached,
                    finished=True,
                )
            )


#: The read in flight: set by ``D3Strategy.read`` around 0.33.0's ``read``, so
#: the tasks that ``read`` starts for its questions (which copy the context)
#: see it too; ``None`` elsewhere.
CURRENT_READ: ContextVar[_RequestReads | None] = ContextVar(
    "d3_current_read", default=None
)


class _ReadingEngineClient:
    """The engine client as ``D3Strategy.read`` sees it: encodes go to the
    current read (``CURRENT_READ``) while there is one; everything else is
    vLLM's engine client."""

    def __init__(self, engine_client: Any) -> None:
        self._engine_client = engine_client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine_client, name)

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        **kwargs: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        reads = CURRENT_READ.get()
        if reads is None:
            return self._engine_client.encode(
                prompt, pooling_params, request_id, **kwargs
            )
        return reads.encode(request_id, prompt, pooling_params, kwargs)


class D3Strategy(upstream.D3Strategy, D3StateBlockReads):
    def __init__(self, context: ReadContext):
        super().__init__(context)
        self.init_state_blocks()
        if self.needs_state_block_reads:
            reading: Any = _ReadingEngineClient(self.engine_client)
            self.context = replace(context, engine_client=reading)

    def _prompt(self, state: str, q: Question, media: Sequence[str]) -> str:
        prompt = super()._prompt(state, q, media)
        reads = CURRENT_READ.get()
        if reads is not None:
            reads.prompts.append(prompt)
        return prompt

    def _tokens(self, text: str) -> list[int]:
        # A request's questions share their head, tokenized once, and their
        # tails are tokenized together (d3_reads.py); the tokens are 0.33.0's.
        reads = CURRENT_READ.get()
        if reads is not None and reads.tails is None:
            reads.tails = self.tail_tokens(reads.prompts)
        tails = None if reads is None else reads.tails
        return self.question_tokens(text, super()._tokens, tails)

    def logit_scale(self, num_questions: int) -> float:
        """What turns 0.33.0's ``logit / temperature`` into ``logit / t(Q)``."""
        return self.temperature / self.temperature_for(num_questions)

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
        current = CURRENT_READ.set(reads)
        try:
            answers = await read()
        finally:
            CURRENT_READ.reset(current)
            if reads.task is not None:
                # A cancelled or failed read stops its engine requests too.
                reads.task.cancel()
        for answer, tokens in zip(answers, reads.usage, strict=True):
            answer.input_tokens = tokens.computed
            answer.cached_tokens = tokens.cached
        return answers
