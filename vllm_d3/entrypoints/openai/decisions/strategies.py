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
from typing import Any

from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import (
    Question,
    StructuredDecisionError,
    label_softmax,
)
from vllm.entrypoints.openai.decisions.strategies import QuestionRead, ReadContext
from vllm.inputs import EngineInput, tokens_input
from vllm.lora.request import LoRARequest
from vllm.pooling_params import PoolingParams

from vllm_d3.model_executor.models.d3_contract import (
    STATE_TOKENS_KEY,
    is_prefix_bidir,
    temperature_schedule_of,
)


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

    def _state_end(self, prompt: str, state: str, search_from: int) -> int:
        """The character offset where the state text ends in a rendered prompt."""
        head = "State:\n"
        block = f"{head}{state}\n\nQuestion:\n"
        start = prompt.find(block, search_from)
        if start < 0:
            raise StructuredDecisionError(
                "the chat template did not render the D3 state block as expected"
            )
        return start + len(head) + len(state)

    def _tokens_and_state_size(self, text: str, state_end: int) -> tuple[list[int], int]:
        encoded = self.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True
        )
        ids = list(encoded["input_ids"])
        return ids, state_block_size(encoded["offset_mapping"], state_end)

    async def _engine_inputs(
        self,
        prompts: list[str],
        state: str,
        media: Mapping[str, Sequence[str]],
        cache_salt: str | None,
    ) -> tuple[list[EngineInput], list[int]]:
        """Each prompt's engine input and its state block size."""
        if not media:
            inputs, sizes = [], []
            for prompt in prompts:
                ids, size = self._tokens_and_state_size(
                    prompt, self._state_end(prompt, state, 0)
                )
                inputs.append(tokens_input(ids, cache_salt=cache_salt))
                sizes.append(size)
            return inputs, sizes
        # The media come first: every prompt shares the prefix that ends at the
        # last placeholder, rendered (and its media read) once.
        split = prompts[0].rindex(self.VISION_END) + len(self.VISION_END)
        prefix = prompts[0][:split]
        if any(not p.startswith(prefix) for p in prompts):
            raise StructuredDecisionError("the questions' prompts do not share media")
        media_input = await self._render_media(prefix, media, cache_salt)
        media_ids = media_input["prompt_token_ids"]
        inputs, sizes = [], []
        for prompt in prompts:
            rest = prompt[split:]
            ids, size = self._tokens_and_state_size(
                rest, self._state_end(rest, state, 0)
            )
            inputs.append({**media_input, "prompt_token_ids": media_ids + ids})
            sizes.append(len(media_ids) + size)
        return inputs, sizes

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
        inputs, state_sizes = await self._engine_inputs(
            prompts, state, media, cache_salt
        )
        for q, engine_input in zip(questions, inputs):
            length = len(engine_input["prompt_token_ids"])
            if length > self.max_model_len:
                raise StructuredDecisionError(
                    f"question {q.id!r}: the prompt has {length} tokens, more than "
                    f"max_model_len={self.max_model_len}; nothing is truncated"
                )

        async def code_logits(n: int, engine_input: EngineInput, size: int) -> list:
            extra = {STATE_TOKENS_KEY: int(size)} if self.prefix_bidir else None
            params = PoolingParams(
                task="classify", use_activation=False, extra_kwargs=extra
            )
            output = None
            async for output in self.context.engine_client.encode(
                engine_input,
                params,
                f"{request_id}-{n}",
                lora_request=lora_request,
                trace_headers=trace_headers,
                priority=priority,
            ):
                pass
            if output is None or output.error is not None:
                why = "no output" if output is None else output.error.message
                raise ValueError(f"Failed to score the question: {why}")
            return output.outputs.data.tolist()

        logits = await asyncio.gather(
            *(
                code_logits(n, engine_input, size)
                for n, (engine_input, size) in enumerate(zip(inputs, state_sizes))
            )
        )
        temperature = self.temperature_for(len(questions))
        reads = []
        for q, engine_input, row in zip(questions, inputs, logits):
            texts, order = self._options(q)
            probs = label_softmax([v / temperature for v in row[: len(texts)]])
            reads.append(
                QuestionRead(
                    probs=[probs[i] for i in order],
                    label_mass=1.0,
                    argmax_is_label=True,
                    input_tokens=len(engine_input["prompt_token_ids"]),
                    output_tokens=0,
                )
            )
        return reads
