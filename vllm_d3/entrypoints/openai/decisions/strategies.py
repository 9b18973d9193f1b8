# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The D3 read strategy for prefix_bidir checkpoints
(upstream: ``entrypoints/openai/decisions/strategies.py``).

``D3Strategy`` extends 0.33.0's strategy of the same name and replaces it in
``READ_STRATEGIES``:

- A ``causal`` or ``noncausal_full_attention`` checkpoint without
  ``temperature_by_questions`` is read by 0.33.0's ``read`` itself, untouched.
- Otherwise each question is still one classify read of the same D3 prompt, and:
  for ``prefix_bidir`` the read carries the prompt's state block size as the plain
  int ``PoolingParams.extra_kwargs["d3_state_tokens"]``; with
  ``temperature_by_questions`` the request's question count picks the temperature
  that replaces ``temperature``.

The state block is counted with the checkpoint runtime's rule: the leading tokens
whose text ends at or before the end of the state text (``state_block_size``). A
token that joins the state's last character to the question block belongs to the
question. The system turn and the media placeholders come first, so they are inside
the state block.
"""

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import (
    Question,
    StructuredDecisionError,
    label_softmax,
)
from vllm.entrypoints.openai.decisions.strategies import QuestionRead, ReadContext
from vllm.inputs import EngineInput, MultiModalInput, tokens_input
from vllm.lora.request import LoRARequest
from vllm.pooling_params import PoolingParams

from vllm_d3.model_executor.models.d3_contract import (
    STATE_TOKENS_KEY,
    is_prefix_bidir,
    temperature_schedule_of,
)


@dataclass(frozen=True)
class _Read:
    """One question's classify read."""

    engine_input: EngineInput
    prompt_ids: list[int]
    state_tokens: int


def state_block_size(offsets: Sequence[tuple[int, int]], state_end: int) -> int:
    """How many leading tokens end at or before character ``state_end``."""
    count = 0
    for _, end in offsets:
        if end > state_end:
            break
        count += 1
    return count


class D3Strategy(upstream.D3Strategy):
    def __init__(self, context: ReadContext):
        super().__init__(context)
        decision = context.engine_client.model_config.hf_config.decision_config
        self.prefix_bidir = is_prefix_bidir(decision)
        self.temperature_schedule = temperature_schedule_of(decision)

    def temperature_for(self, num_questions: int) -> float:
        if self.temperature_schedule is None:
            return self.temperature
        return self.temperature_schedule.temperature_for(num_questions)

    def _state_end(self, prompt: str, state: str) -> int:
        """The character offset where the state text ends in a rendered prompt."""
        head = "State:\n"
        start = prompt.find(f"{head}{state}\n\nQuestion:\n")
        if start < 0:
            raise StructuredDecisionError(
                "the chat template did not render the D3 state block as expected"
            )
        return start + len(head) + len(state)

    def _tokens_and_state_size(self, text: str, state: str) -> tuple[list[int], int]:
        tokenizer: Any = self.tokenizer  # a Hugging Face fast tokenizer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        size = state_block_size(encoded["offset_mapping"], self._state_end(text, state))
        return list(encoded["input_ids"]), size

    async def _reads(
        self,
        prompts: list[str],
        state: str,
        media: Mapping[str, Sequence[str]],
        cache_salt: str | None,
    ) -> list[_Read]:
        """Each prompt's engine input, token ids and state block size."""
        if not media:
            reads = []
            for prompt in prompts:
                ids, size = self._tokens_and_state_size(prompt, state)
                reads.append(_Read(tokens_input(ids, cache_salt=cache_salt), ids, size))
            return reads
        # The media come first: every prompt shares the prefix that ends at the
        # last placeholder, rendered (and its media read) once.
        split = prompts[0].rindex(self.VISION_END) + len(self.VISION_END)
        prefix = prompts[0][:split]
        if any(not p.startswith(prefix) for p in prompts):
            raise StructuredDecisionError("the questions' prompts do not share media")
        media_input = await self._render_media(prefix, media, cache_salt)
        media_ids = media_input["prompt_token_ids"]
        reads = []
        for prompt in prompts:
            ids, size = self._tokens_and_state_size(prompt[split:], state)
            prompt_ids = media_ids + ids
            engine_input = MultiModalInput(**media_input)
            engine_input["prompt_token_ids"] = prompt_ids
            reads.append(_Read(engine_input, prompt_ids, len(media_ids) + size))
        return reads

    async def _code_logits(
        self,
        read: _Read,
        request_id: str,
        lora_request: LoRARequest | None,
        trace_headers: Mapping[str, str] | None,
        priority: int,
    ) -> list[float]:
        extra = (
            {STATE_TOKENS_KEY: int(read.state_tokens)} if self.prefix_bidir else None
        )
        params = PoolingParams(
            task="classify", use_activation=False, extra_kwargs=extra
        )
        outputs = [
            output
            async for output in self.context.engine_client.encode(
                read.engine_input,
                params,
                request_id,
                lora_request=lora_request,
                trace_headers=trace_headers,
                priority=priority,
            )
        ]
        if not outputs:
            raise ValueError("Failed to score the question: no output")
        if (error := outputs[-1].error) is not None:
            raise ValueError(f"Failed to score the question: {error.message}")
        return outputs[-1].outputs.data.tolist()

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
        if not self.prefix_bidir and self.temperature_schedule is None:
            return await super().read(
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
        if instructions:
            raise StructuredDecisionError(
                "this model reads a fixed prompt, so it takes no instructions"
            )
        media = media or {}
        placeholders = [m for m in ("image", "video") for _ in media.get(m, ())]
        prompts = [self._prompt(state, q, placeholders) for q in questions]
        reads = await self._reads(prompts, state, media, cache_salt)
        for q, read in zip(questions, reads, strict=True):
            if len(read.prompt_ids) > self.max_model_len:
                raise StructuredDecisionError(
                    f"question {q.id!r}: the prompt has {len(read.prompt_ids)} "
                    f"tokens, more than max_model_len={self.max_model_len}; "
                    "nothing is truncated"
                )
        logits = await asyncio.gather(
            *(
                self._code_logits(
                    read, f"{request_id}-{n}", lora_request, trace_headers, priority
                )
                for n, read in enumerate(reads)
            )
        )
        temperature = self.temperature_for(len(questions))
        answers = []
        for q, read, row in zip(questions, reads, logits, strict=True):
            texts, order = self._options(q)
            probs = label_softmax([v / temperature for v in row[: len(texts)]])
            answers.append(
                QuestionRead(
                    probs=[probs[i] for i in order],
                    label_mass=1.0,
                    argmax_is_label=True,
                    input_tokens=len(read.prompt_ids),
                    output_tokens=0,
                )
            )
        return answers
