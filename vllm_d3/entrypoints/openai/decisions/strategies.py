# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 read strategy for prefix_bidir checkpoints, on vLLM 0.33.0
(upstream: ``entrypoints/openai/decisions/strategies.py``, an edit: the series'
strategy commit, ``vllm_d3.export.series``).

In-tree, ``D3Strategy`` derives from ``D3StateBlockReads`` (``d3_reads.py``) and
its ``read`` hands the engine inputs it rendered to ``read_state_blocks`` where
the checkpoint needs it, then divides the logits by ``temperature_for(Q)``.
This module gives vLLM 0.33.0 the same without editing ``read``: its
``D3Strategy`` extends 0.33.0's class of the same name, replaces it in
``READ_STRATEGIES``, and keeps 0.33.0's own ``read``. That renders every
question's prompt (media read once) and sends one classify ``encode`` per
question, request ids ``f"{request_id}-{n}"``, concurrently. The plugin changes
only what those calls reach, through the strategy's engine client
(``_ReadingEngineClient``):

- a ``causal`` or ``noncausal_full_attention`` checkpoint without
  ``temperature_by_questions`` keeps vLLM's engine client: nothing changes;
- otherwise a request's encodes are gathered (``_RequestReads``) and handed to
  ``read_state_blocks`` together; each question's logits come back to 0.33.0's
  ``read`` scaled by ``temperature / temperature_for(Q)``, so that its division
  by ``temperature`` divides them by ``temperature_for(Q)``, and its
  ``usage.input_tokens`` is set to what the engine computed.

Its ``_tokens`` tokenizes a prefix_bidir question prompt's shared head once for
the request's questions (``question_tokens``); the tokens are 0.33.0's.
"""

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import Question
from vllm.entrypoints.openai.decisions.strategies import QuestionRead, ReadContext
from vllm.inputs import EngineInput
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingOutput, PoolingRequestOutput
from vllm.pooling_params import PoolingParams

from vllm_d3.entrypoints.openai.decisions.d3_reads import D3StateBlockReads


class _RequestReads:
    """One ``read``'s encodes: gathered, then read together."""

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
        strategy = self.strategy
        # 0.33.0's read sends every question with the same params and kwargs.
        _, params, kwargs = self.inputs[0]
        try:
            logits, self.computed_tokens = await strategy.read_state_blocks(
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
                    f"{self.request_id}-{n}",
                    PoolingOutput(data=torch.tensor(row) * scale),
                    engine_input["prompt_token_ids"],
                    0,
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


class D3Strategy(upstream.D3Strategy, D3StateBlockReads):
    def __init__(self, context: ReadContext):
        super().__init__(context)
        self.init_state_blocks()
        #: The reads in flight, by request id.
        self.requests: dict[str, _RequestReads] = {}
        if self.reads_state_blocks:
            reading: Any = _ReadingEngineClient(self.engine_client, self)
            self.context = replace(context, engine_client=reading)

    def _tokens(self, text: str) -> list[int]:
        # A request's questions share their head (d3_reads.py).
        return self.question_tokens(text, super()._tokens)

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
