"""The tiny D3 package's random weights: backbone and readout.

Contract
--------
``skeleton(config)`` is ``Qwen3_5Model`` on the meta device: the tensor names
(those of ``Qwen3_5Model.state_dict()``, ``language_model.*`` and
``visual.*``, which is what ``Qwen3_5Model.save_pretrained`` writes), shapes
and owning modules. ``backbone_tensors(model, seed, shape)`` draws every tensor
from ``torch.Generator`` seeded with ``seed``, tensor by tensor in state-dict
order: unit-variance embeddings, fan-in scaled projections, norm scales near 1,
Gated DeltaNet ``A_log = log(U(1, 16))`` and ``dt_bias`` near 1, and, so that
the readout depends on the context and on the attention mask, sharper full
attention (query/key norm scale ``ATTENTION_QK_NORM_SCALE``) with a stronger
output (``ATTENTION_OUTPUT_GAIN``, ``FIRST_ATTENTION_OUTPUT_GAIN`` for the first
full-attention layer), while the Gated DeltaNet and MLP outputs are damped
(``SUBLAYER_OUTPUT_GAIN``) so their rounding stays small; tensors are stored in
``STORAGE_DTYPES[shape]``. ``write_backbone`` writes them as
``model.safetensors``, or as shards of at most ``max_shard_bytes`` plus
``model.safetensors.index.json``, named as transformers names them.

``readout_weight(...)`` is the ``weight`` of ``readout.safetensors``: float32
rows N(0, 1) from a second stream, scaled so one logit's std is about
``READOUT_LOGIT_STD``; given the backbone (shape ``"tiny"``) they are also made
orthogonal to the last hidden state that every D3 prompt shares (measured on
the tokenizer's reference prompts with the backbone in float32 on one thread,
then rounded), because all prompts end with the same tokens.

``parameter_counts(model)`` gives the text and vision parameter counts the
manifest records. The same arguments give the same tensors, bit for bit.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .configs import STORAGE_DTYPES, write_json
from .tokenizer import NUM_CODES, reference_prompts

#: Typical standard deviation of one readout logit. Kept small: rounding
#: moves the logits by a fixed fraction of it, and how far that moves the
#: probabilities grows with their spread.
READOUT_LOGIT_STD = 0.7
#: Scale of the query/key norms of full attention (random ones are too flat to
#: single out tokens), and the gain of its output projection (so what the last
#: token attends to outweighs the prompt's common suffix). Both make the
#: readout depend on the context and on the attention mask.
#: Sharper attention amplifies rounding noise about as much as the mask's effect;
#: a milder scale with a stronger output keeps the mask's effect and less noise.
ATTENTION_QK_NORM_SCALE = 1.5
ATTENTION_OUTPUT_GAIN = 8.0
#: Output gain of the first full-attention layer. The pooled last token sees
#: the whole prompt under every mode, so a layer's mask changes the readout only
#: through the other tokens' states that later layers read: the first
#: full-attention layer writes most of what the mask changes.
FIRST_ATTENTION_OUTPUT_GAIN = 12.0
#: Gain of the Gated DeltaNet and MLP output projections. Their rounding
#: error enters the residual stream in proportion to their output, and the
#: full-attention layers amplify it; small, they leave the mask's effect and
#: carry less noise.
SUBLAYER_OUTPUT_GAIN = 0.3


def _generator(seed: int, stream: int) -> torch.Generator:
    """Independent streams for the backbone (0) and the readout (1)."""
    return torch.Generator().manual_seed(2 * seed + stream)


def skeleton(config: dict[str, Any]) -> torch.nn.Module:
    """``Qwen3_5Model`` on the meta device: names, shapes and owning modules."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    hf_config = Qwen3_5Config(**config)
    with torch.device("meta"):
        return Qwen3_5Model(hf_config)


def _draw(
    model: torch.nn.Module, name: str, shape: torch.Size, generator: torch.Generator
) -> torch.Tensor:
    """One backbone tensor, scaled by the role of the module that owns it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5Attention,
        Qwen3_5GatedDeltaNet,
        Qwen3_5MLP,
        Qwen3_5RMSNorm,
        Qwen3_5RMSNormGated,
    )

    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    owner = model.get_submodule(module_name.rpartition(".")[0])

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std + mean

    if isinstance(module, Qwen3_5GatedDeltaNet) and param == "A_log":
        return torch.rand(shape, generator=generator).mul(15).add(1).log()
    if isinstance(module, Qwen3_5GatedDeltaNet) and param == "dt_bias":
        return normal(0.1, mean=1.0)
    if isinstance(module, Qwen3_5RMSNorm):  # scales by (1 + weight)
        if isinstance(owner, Qwen3_5Attention):
            return normal(0.05, mean=ATTENTION_QK_NORM_SCALE - 1)
        return normal(0.05)
    if isinstance(module, (Qwen3_5RMSNormGated, torch.nn.LayerNorm)):
        return normal(0.05, mean=1.0) if param == "weight" else normal(0.02)
    if isinstance(module, torch.nn.Embedding):
        return normal(1.0)
    if param == "bias":
        return normal(0.02)
    gain = 1.0
    if isinstance(owner, Qwen3_5Attention) and module is owner.o_proj:
        layer_types: list[str] = owner.config.layer_types
        first = owner.layer_idx == layer_types.index("full_attention")
        gain = FIRST_ATTENTION_OUTPUT_GAIN if first else ATTENTION_OUTPUT_GAIN
    elif (
        isinstance(owner, Qwen3_5GatedDeltaNet)
        and module is owner.out_proj
        or isinstance(owner, Qwen3_5MLP)
        and module is owner.down_proj
    ):
        gain = SUBLAYER_OUTPUT_GAIN
    return normal(gain / math.sqrt(math.prod(shape[1:])))


class _ShardWriter:
    """Write tensors into safetensors shards of at most ``max_bytes``, each as
    soon as it is full, so memory holds one shard at a time."""

    def __init__(self, out: pathlib.Path, max_bytes: int):
        self.out = out
        self.max_bytes = max_bytes
        self.written: list[list[str]] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def close(self) -> None:
        """Name the shards as transformers does; index them if more than one."""
        self._flush()
        count = len(self.written)
        if count == 1:
            self._provisional(0).rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for index, names in enumerate(self.written):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            self._provisional(index).rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        write_json(
            self.out / "model.safetensors.index.json",
            {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )

    def _provisional(self, index: int) -> pathlib.Path:
        return self.out / f"model-shard-{index}.partial"

    def _flush(self) -> None:
        path = self._provisional(len(self.written))
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append(list(self.pending))
        self.pending = {}
        self.pending_bytes = 0


def backbone_tensors(
    model: torch.nn.Module, seed: int, shape: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every backbone tensor, drawn in state-dict order, in the shape's dtype."""
    generator = _generator(seed, 0)
    dtype = getattr(torch, STORAGE_DTYPES[shape])
    for name, meta in model.state_dict().items():
        yield name, _draw(model, name, meta.shape, generator).to(dtype)


def write_backbone(
    out: pathlib.Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int,
) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` and
    their index."""
    writer = _ShardWriter(out, max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()


def _last_hidden_states(
    config: dict[str, Any], backbone: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> torch.Tensor:
    """The final hidden state at the last token of each reference prompt, in
    float32 on one thread so that it does not depend on the machine's cores.

    On a machine with CUDA it runs there: transformers then binds GPU-only
    linear-attention kernels (flash-linear-attention) that refuse CPU tensors.
    The caller rounds what it derives from these states, so both give the same
    checkpoint up to that rounding."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        model = Qwen3_5Model(Qwen3_5Config(**config))
    model.load_state_dict(backbone)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.float().eval().to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return torch.stack(
                [
                    model(input_ids=torch.tensor([ids], device=device))
                    .last_hidden_state[0, -1]
                    .cpu()
                    for ids in (
                        tokenizer.encode(prompt, add_special_tokens=False).ids
                        for prompt in reference_prompts()
                    )
                ]
            )
    finally:
        torch.set_num_threads(threads)


def readout_weight(
    seed: int,
    config: dict[str, Any],
    tokenizer: Tokenizer,
    backbone: dict[str, torch.Tensor] | None,
) -> torch.Tensor:
    """Readout rows ~ N(0, 1), scaled so a logit's std is about
    ``READOUT_LOGIT_STD``.

    Given the backbone, the rows are also made orthogonal to the direction every
    prompt's last hidden state shares (all D3 prompts end with the same tokens),
    so the logits follow what differs between prompts, and are scaled by that
    difference; the direction and scale are rounded, to stay byte-stable across
    machines. Without it (``d3-turbo``) the scale is ``1 / sqrt(hidden)``.
    """
    hidden = config["text_config"]["hidden_size"]
    rows = torch.randn((NUM_CODES, hidden), generator=_generator(seed, 1))
    if backbone is None:
        return rows * (READOUT_LOGIT_STD / math.sqrt(hidden))
    states = _last_hidden_states(config, backbone, tokenizer)
    mean = states.mean(dim=0)
    shared = torch.round(mean / mean.norm() * 1024) / 1024
    rows -= torch.outer(rows @ shared, shared) / shared.dot(shared)
    spread = float(f"{(states - mean).norm(dim=-1).mean().item():.2g}")
    return rows * (READOUT_LOGIT_STD / spread)


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """The skeleton's text and vision (``visual.*``) parameter counts."""
    counts = {"text": 0, "vision": 0}
    for name, meta in model.state_dict().items():
        counts["vision" if name.startswith("visual.") else "text"] += meta.numel()
    return counts
