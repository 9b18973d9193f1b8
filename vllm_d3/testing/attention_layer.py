"""One full-attention layer of a D3 checkpoint, served by vLLM's own classes.

``FullAttentionLayer(checkpoint, block_size)`` builds the engine config vLLM
builds for ``vllm serve checkpoint`` (the plugin's config hook included), a
real ``Attention`` layer at the checkpoint's head shape (so vLLM's selector picks
its backend), a paged bf16/fp16 KV cache of random keys and values, and the
backend's metadata builder. ``forward(prompts, query, path)`` then runs one
prefill step over whole prompts the way the model runner does: the batch's
``CommonAttentionMetadata`` carries each prompt's ranges (the state, then each
question block; a packed prompt has several), the builder makes the metadata,
and the layer's impl computes the attention, with the step's fresh keys and
values read back from the cache (where the runner has just written them).

``path`` picks the child of the D3 composite: ``"dense"`` (the plugin's dense
pieces on the layer's ``kernel``, which the config hook resolves as for
``--additional-config '{"d3_attention_kernel": kernel}'``) or ``"ranged"``
(vLLM's ranged Triton, which cannot run packed prompts), so both are measured
and checked on the same inputs. ``reference`` is an independent float32
PyTorch attention with the mask written out from its definition: a state query
sees the state, a question query sees the state and its own question block.
CUDA only: the GPU test and the attention benchmark use it.
"""

import itertools
from dataclasses import dataclass

import torch
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention.attention import Attention
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_d3.model_executor.models.d3_contract import (
    ATTENTION_KERNEL_KEY,
    AUTO_KERNEL,
    decided,
)
from vllm_d3.v1.attention.backends.d3_prefix_bidir import (
    D3PrefixBidirAttentionBackend,
    DensePieceRouting,
)

#: Which child of the composite serves each path (``DensePieceRouting``).
PATH_VARIANTS = {"ranged": 0, "dense": 1}
_layer_ids = itertools.count()


@dataclass(frozen=True)
class Prompt:
    """A prompt of ``prompt_len`` tokens whose first ``state_tokens`` are the
    state; ``computed`` tokens were computed in earlier steps. A packed prompt
    (the state read once) lists where each of its question blocks ends."""

    state_tokens: int
    prompt_len: int
    computed: int = 0
    question_ends: tuple[int, ...] = ()

    @property
    def query_len(self) -> int:
        return self.prompt_len - self.computed

    def question_blocks(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each question block (none: all state)."""
        ends = self.question_ends or (
            (self.prompt_len,) if self.state_tokens < self.prompt_len else ()
        )
        return list(zip((self.state_tokens, *ends), ends, strict=False))


def attention_pairs(prompt: Prompt) -> int:
    """(query, key) pairs the mask allows for the prompt's queries."""
    s, c = prompt.state_tokens, prompt.computed
    pairs = max(s - c, 0) * s
    for start, end in prompt.question_blocks():
        # A question block sees the state and itself (one question: every key).
        pairs += max(end - max(start, c), 0) * (s + end - start)
    return pairs


class FullAttentionLayer:
    def __init__(
        self,
        checkpoint: str,
        block_size: int,
        *,
        max_prompt_len: int,
        max_batch_tokens: int,
        num_blocks: int,
        kernel: str = AUTO_KERNEL,
    ) -> None:
        self.device = torch.device("cuda")
        self.block_size = block_size
        self.config = EngineArgs(
            model=checkpoint,
            max_model_len=max_prompt_len,
            max_num_batched_tokens=max_batch_tokens,
            load_format="dummy",
            additional_config={ATTENTION_KERNEL_KEY: kernel},
        ).create_engine_config()
        #: The dense pieces' kernel the config hook chose.
        self.kernel = decided(self.config.additional_config)[ATTENTION_KERNEL_KEY]
        text = self.config.model_config.hf_text_config
        self.num_heads = text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.head_size = text.head_dim
        dtype = self.config.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved by create_engine_config
        self.dtype = dtype
        # The layer takes the model's dtype from torch's default, as in model init.
        with set_current_vllm_config(self.config), set_default_torch_dtype(dtype):
            self.layer = Attention(
                self.num_heads,
                self.head_size,
                self.head_size**-0.5,
                num_kv_heads=self.num_kv_heads,
                cache_config=self.config.cache_config,
                prefix=f"d3_attention_check.{next(_layer_ids)}.attn",
            ).to(self.device)
            if self.layer.attn_backend is not D3PrefixBidirAttentionBackend:
                raise RuntimeError(
                    f"vLLM selected {self.layer.attn_backend.get_name()} for the "
                    "prefix_bidir full-attention layer, not the D3 composite"
                )
            spec = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                dtype=self.dtype,
            )
            self.builder = D3PrefixBidirAttentionBackend.get_builder_cls()(
                spec, [self.layer.layer_name], self.config, self.device
            )
        # vLLM hands attention a logical (blocks, kv_heads, block_size,
        # 2 * head_size) view; here the tokens of a block are outermost in memory.
        pages = torch.randn(
            (num_blocks, block_size, self.num_kv_heads, 2 * self.head_size),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_cache = pages.transpose(1, 2)

    def random_query(self, prompts: list[Prompt], seed: int = 0) -> torch.Tensor:
        generator = torch.Generator(self.device).manual_seed(seed)
        num_tokens = sum(p.query_len for p in prompts)
        return torch.randn(
            (num_tokens, self.num_heads, self.head_size),
            generator=generator,
            dtype=self.dtype,
            device=self.device,
        )

    def block_table(self, prompts: list[Prompt]) -> torch.Tensor:
        """Each prompt on its own consecutive blocks, in batch order."""
        blocks = [cdiv(p.prompt_len, self.block_size) for p in prompts]
        table = torch.zeros((len(prompts), max(blocks)), dtype=torch.int32)
        first = 0
        for row, count in enumerate(blocks):
            table[row, :count] = torch.arange(first, first + count)
            first += count
        if first > self.kv_cache.shape[0]:
            raise ValueError(f"{first} blocks needed, the cache has fewer")
        return table.to(self.device)

    def common_metadata(self, prompts: list[Prompt]) -> CommonAttentionMetadata:
        """One prefill step as the model runner describes it to the builders."""
        query_lens = torch.tensor([p.query_len for p in prompts], dtype=torch.int32)
        query_start_loc = torch.zeros(len(prompts) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(query_lens, 0)
        seq_lens = torch.tensor([p.prompt_len for p in prompts], dtype=torch.int32)
        num_tokens = int(query_start_loc[-1])
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens.to(self.device),
            seq_lens_cpu_upper_bound=seq_lens,
            num_reqs=len(prompts),
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=self.block_table(prompts),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            mm_req_doc_ranges={
                row: [
                    (start, end - 1)
                    for start, end in [(0, p.state_tokens), *p.question_blocks()]
                ]
                for row, p in enumerate(prompts)
            },
        )

    def routed_path(self, prompts: list[Prompt]) -> str:
        """The path ``DensePieceRouting`` picks for this batch."""
        variant = DensePieceRouting([], self.config).select(
            self.common_metadata(prompts)
        )
        return next(name for name, v in PATH_VARIANTS.items() if v == variant)

    def metadata(self, prompts: list[Prompt], path: str):
        """The attention metadata the chosen child's builder makes."""
        common = self.common_metadata(prompts)
        variant = PATH_VARIANTS[path]
        builder = (self.builder.general_builder, self.builder.causal_builder)[variant]
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
        # What the composite's own build records for its forward to dispatch on.
        metadata._attention_backend_variant = variant
        return metadata

    def fresh_keys_values(
        self, prompts: list[Prompt]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own keys and values, (tokens, kv_heads, head_size) each:
        what the runner wrote into the cache just before attention."""
        table = self.block_table(prompts)
        keys, values = [], []
        for row, prompt in enumerate(prompts):
            k, v = self.cached_keys_values(prompt, row, table, dtype=self.dtype)
            keys.append(k[prompt.computed :])
            values.append(v[prompt.computed :])
        return torch.cat(keys), torch.cat(values)

    def forward(
        self,
        query: torch.Tensor,
        metadata,
        keys_values: tuple[torch.Tensor, torch.Tensor],
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's attention; ``keys_values``: ``fresh_keys_values``."""
        if output is None:
            output = torch.empty_like(query)
        key, value = keys_values
        self.layer.impl.forward(
            self.layer,  # type: ignore[arg-type]
            query,
            key,
            value,
            self.kv_cache,
            metadata,
            output,
        )
        return output

    def cached_keys_values(
        self,
        prompt: Prompt,
        row: int,
        table: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's keys and values, (n, kv_heads, head_size) each."""
        blocks = table[row, : cdiv(prompt.prompt_len, self.block_size)].long()
        pages = self.kv_cache[blocks].transpose(1, 2)
        pages = pages.reshape(-1, self.num_kv_heads, 2 * self.head_size)
        pages = pages[: prompt.prompt_len].to(dtype)
        return pages[..., : self.head_size], pages[..., self.head_size :]

    def reference(self, prompts: list[Prompt], query: torch.Tensor) -> torch.Tensor:
        """float32 attention with the mask written from the definition: a state
        query sees the state, a question query sees the state and its own
        question block."""
        table = self.block_table(prompts)
        group = self.num_heads // self.num_kv_heads
        outputs = []
        start = 0
        for row, prompt in enumerate(prompts):
            keys, values = self.cached_keys_values(prompt, row, table)
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            q = query[start : start + prompt.query_len].float()
            start += prompt.query_len
            positions = torch.arange(prompt.computed, prompt.prompt_len)
            visible = torch.zeros(prompt.query_len, prompt.prompt_len, dtype=torch.bool)
            visible[:, : prompt.state_tokens] = True
            for first, end in prompt.question_blocks():
                in_block = (first <= positions) & (positions < end)
                visible[in_block, first:end] = True
            scores = torch.einsum("qhd,khd->hqk", q, keys) * self.head_size**-0.5
            scores.masked_fill_(~visible.to(self.device), float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            outputs.append(out)
        return torch.cat(outputs).to(query.dtype)
