"""The reference runtime: a D3 checkpoint answered with transformers' Qwen3.5.

Contract:
- ``ReferenceRuntime(checkpoint, kernel=...)`` loads ``Qwen3_5Model``,
  ``readout.safetensors`` (``weight`` ``[codes, hidden]``, used in fp32),
  ``decision_config.json`` and the checkpoint's tokenizer and processor.
  ``kernel="exact"`` (the default) runs attention as ``exact_attention`` writes
  it out, the same operations on every device; ``kernel="sdpa"`` runs torch's
  fused kernels, faster, for timing rather than for checking answers.
- ``render(request)`` returns one ``RenderedQuestion`` per question.
- ``answer(request, path=..., attention=...)`` returns vLLM's /v1/systemone
  ``answers`` and ``usage`` (input tokens: the sum of the prompt lengths).
  ``attention`` ``None`` uses the checkpoint's ``attention_mode``.
  ``path="per_question"`` runs each whole prompt in one forward, the mask of
  ``masks.allowed`` on every full-attention layer (passed as transformers'
  per-layer-type mask mapping) and no mask on the Gated DeltaNet layers.
  ``path="state_once"`` (``prefix_bidir`` only) runs the state block once,
  keeps its KV cache and Gated DeltaNet recurrent and conv state, and continues
  every question from a copy of it with the question's rows of the same mask.
- The readout scores the last prompt token's final hidden state over the
  question's own codes; the logits are divided by the temperature and
  softmaxed. ``temperature_by_questions`` (``max_questions`` ascending,
  ``temperature`` one longer) replaces ``temperature``: a request with ``n``
  questions uses the first bucket with ``n <= max_questions[i]``, else the last.
- Positions are Qwen3.5's M-RoPE positions of the unpadded prompt.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, AutoTokenizer, DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from . import masks
from .decision import DecisionConfig
from .exact_attention import EXACT
from .media import (
    MediaInputs,
    configure_processor,
    load_image,
    load_video,
    process_media,
)
from .prompt import PromptTokenizer, render_prompt, state_text
from .questions import Question, parse_questions

PATHS = ("per_question", "state_once")
ATTENTION_KERNELS = {"exact": EXACT, "sdpa": "sdpa"}
VISION_END = "<|vision_end|>"


@dataclass(frozen=True)
class RenderedQuestion:
    """One question's prompt as the model reads it.

    ``text`` has one placeholder per media item; ``token_ids`` has them
    expanded. ``state_tokens`` is the state block size ``s``. ``media`` is shared
    by every question of the request.
    """

    question: Question
    text: str
    token_ids: list[int]
    state_tokens: int
    media: MediaInputs

    @property
    def qid(self) -> str:
        return self.question.qid

    @property
    def num_options(self) -> int:
        return self.question.num_options


class ReferenceRuntime:
    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernel: str = "exact",
    ):
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"unknown attention kernel {kernel!r}; expected one of "
                f"{list(ATTENTION_KERNELS)}"
            )
        self.path = Path(checkpoint)
        self.device = torch.device(device)
        self.dtype = dtype
        self.decision = DecisionConfig.load(self.path)
        self.codes = list(self.decision.codes)
        self.attention_mode = self.decision.attention_mode
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._prompts = PromptTokenizer(self.tokenizer)
        loaded: Any = Qwen3_5Model.from_pretrained(
            self.path,
            dtype=dtype,
            attn_implementation=ATTENTION_KERNELS[kernel],
            output_loading_info=True,
        )
        model, loading = loaded
        if loading["missing_keys"]:
            missing = sorted(loading["missing_keys"])
            raise ValueError(f"the checkpoint lacks backbone weights: {missing[:5]}")
        self.model: Qwen3_5Model = model.to(self.device).eval()
        readout = load_file(str(self.path / "readout.safetensors"))["weight"]
        text_config = self.model.config.text_config
        if not isinstance(text_config, Qwen3_5TextConfig):
            raise ValueError("the checkpoint is not a Qwen3.5 backbone")
        self.text_config = text_config
        hidden = text_config.hidden_size
        if tuple(readout.shape) != (len(self.codes), hidden):
            raise ValueError(
                f"readout weight is {tuple(readout.shape)}, expected "
                f"({len(self.codes)}, {hidden})"
            )
        self.readout = readout.float().to(self.device)

    def temperature_for(self, num_questions: int) -> float:
        """The temperature of a request with ``num_questions`` questions."""
        return self.decision.temperature_for(num_questions)

    @cached_property
    def processor(self) -> Any:
        processor = AutoProcessor.from_pretrained(self.path)
        configure_processor(processor)
        return processor

    def render(self, request: dict[str, Any]) -> list[RenderedQuestion]:
        if request.get("instructions"):
            raise ValueError(
                "this model reads a fixed prompt, so it takes no instructions"
            )
        if request.get("audio"):
            raise ValueError("this model does not take audio inputs")
        questions = parse_questions(request.get("questions"), len(self.codes))
        state = state_text(request.get("state"))
        images = [load_image(url) for url in request.get("images") or ()]
        videos = [load_video(url) for url in request.get("videos") or ()]
        prompts = [
            render_prompt(state, q, self.codes, len(images), len(videos))
            for q in questions
        ]
        media = MediaInputs()
        prefix_ids: list[int] = []
        expanded_prefix: list[int] = []
        if images or videos:
            first_text = prompts[0][0]
            prefix = first_text[: first_text.rindex(VISION_END) + len(VISION_END)]
            prefix_ids = self.tokenizer.encode(prefix, add_special_tokens=False)
            expanded_prefix, media = process_media(
                self.processor, prefix, images, videos
            )
        rendered = []
        for question, (text, state_end) in zip(questions, prompts, strict=True):
            encoded = self._prompts.encode(text, state_end)
            ids = encoded.token_ids
            # The media sit in the state block, ahead of everything a
            # question changes, so the expanded prefix replaces the plain one.
            if ids[: len(prefix_ids)] != prefix_ids:
                raise ValueError("the media prefix does not start the prompt's tokens")
            growth = len(expanded_prefix) - len(prefix_ids)
            rendered.append(
                RenderedQuestion(
                    question=question,
                    text=text,
                    token_ids=expanded_prefix + ids[len(prefix_ids) :],
                    state_tokens=encoded.state_tokens + growth,
                    media=media,
                )
            )
        return rendered

    def answer(
        self,
        request: dict[str, Any],
        *,
        path: str = "per_question",
        attention: str | None = None,
    ) -> dict[str, Any]:
        mode = self._mode(attention)
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; expected one of {list(PATHS)}")
        if path == "state_once" and mode != "prefix_bidir":
            raise ValueError("the state_once path needs prefix_bidir attention")
        rendered = self.render(request)
        with torch.no_grad():
            features = self._media_features(rendered[0].media)
            if path == "state_once":
                last = self._last_hidden_state_once(rendered, features)
            else:
                last = [self._hidden(r, mode, features)[-1] for r in rendered]
            temperature = self.temperature_for(len(rendered))
            answers = {}
            for r, hidden in zip(rendered, last, strict=True):
                logits = hidden.float() @ self.readout[: r.num_options].T
                probs = torch.softmax(logits.double() / temperature, dim=-1)
                answers[r.qid] = r.question.answer(probs.tolist())
        return {
            "answers": answers,
            "usage": {
                "input_tokens": sum(len(r.token_ids) for r in rendered),
                "output_tokens": 0,
            },
        }

    def final_hidden(
        self, rendered: RenderedQuestion, *, attention: str | None = None
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[n, hidden]`` of one whole-prompt forward."""
        mode = self._mode(attention)
        with torch.no_grad():
            return self._hidden(rendered, mode, self._media_features(rendered.media))

    def _mode(self, attention: str | None) -> str:
        mode = self.attention_mode if attention is None else attention
        if mode not in masks.ATTENTION_MODES:
            expected = list(masks.ATTENTION_MODES)
            raise ValueError(f"unknown attention {mode!r}; expected one of {expected}")
        return mode

    def _media_features(self, media: MediaInputs) -> dict[str, torch.Tensor]:
        """Vision encoder outputs, one row per placeholder token."""
        features = {}
        if media.pixel_values is not None and media.image_grid_thw is not None:
            images = self.model.get_image_features(
                media.pixel_values.to(self.device),
                _on(media.image_grid_thw, self.device),
                return_dict=True,
            )
            features["image"] = torch.cat(images.pooler_output).to(self.dtype)
        if media.pixel_values_videos is not None and media.video_grid_thw is not None:
            videos = self.model.get_video_features(
                media.pixel_values_videos.to(self.device),
                _on(media.video_grid_thw, self.device),
                return_dict=True,
            )
            features["video"] = torch.cat(videos.pooler_output).to(self.dtype)
        return features

    def _inputs(
        self,
        rendered: RenderedQuestion,
        features: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings ``[1, n, hidden]`` and M-RoPE positions ``[3, 1, n]``."""
        config = self.model.config
        ids = torch.tensor([rendered.token_ids], device=self.device)
        kinds = torch.zeros_like(ids, dtype=torch.int)
        kinds[ids == config.image_token_id] = 1
        kinds[ids == config.video_token_id] = 2
        embeds = self.model.get_input_embeddings()(ids)
        for kind, key in ((1, "image"), (2, "video")):
            slots = kinds[0] == kind
            if int(slots.sum()) != (len(features[key]) if key in features else 0):
                raise ValueError(f"{key} placeholders and features do not match")
            if key in features:
                embeds[0, slots] = features[key]
        media = rendered.media
        positions, _ = self.model.get_rope_index(
            cast(torch.LongTensor, ids),
            cast(torch.IntTensor, kinds),
            image_grid_thw=_on(media.image_grid_thw, self.device),
            video_grid_thw=_on(media.video_grid_thw, self.device),
        )
        return embeds, positions

    def _run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        out = self.model.language_model(
            inputs_embeds=embeds,
            position_ids=positions,
            attention_mask={"full_attention": mask, "linear_attention": None},
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state[0]

    def _hidden(
        self,
        rendered: RenderedQuestion,
        mode: str,
        features: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        embeds, positions = self._inputs(rendered, features)
        n = len(rendered.token_ids)
        allowed = masks.allowed(mode, n, rendered.state_tokens, self.device)
        return self._run(embeds, positions, masks.additive(allowed, self.dtype))

    def _last_hidden_state_once(
        self,
        rendered: list[RenderedQuestion],
        features: dict[str, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Each question's last hidden state, the state block read once."""
        s = rendered[0].state_tokens
        state_ids = rendered[0].token_ids[:s]
        if any(r.state_tokens != s or r.token_ids[:s] != state_ids for r in rendered):
            raise ValueError("the questions' prompts do not share one state block")
        embeds, positions = self._inputs(rendered[0], features)
        # Every state token reads the whole state: one row of the mask, broadcast
        # over the state's queries, stands for all of them (a full s x s mask
        # would take tens of GB at 100K tokens).
        state_row = masks.allowed("prefix_bidir", s, s, self.device, first_query=s - 1)
        cache = DynamicCache(config=self.text_config)
        self._run(
            embeds[:, :s],
            positions[..., :s],
            masks.additive(state_row, self.dtype),
            cache,
        )
        last = []
        for r in rendered:
            embeds, positions = self._inputs(r, features)
            n = len(r.token_ids)
            rows = masks.allowed("prefix_bidir", n, s, self.device, first_query=s)
            hidden = self._run(
                embeds[:, s:],
                positions[..., s:],
                masks.additive(rows, self.dtype),
                copy.deepcopy(cache),
            )
            last.append(hidden[-1])
        return last


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.LongTensor | None:
    return None if tensor is None else cast(torch.LongTensor, tensor.to(device))
