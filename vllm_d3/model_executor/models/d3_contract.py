# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decision 3.0's ``decision_config.json`` rules and the state-size contract.

Functions over a checkpoint's ``decision_config.json`` (a dict) and the
plugin's switches and request fields (each declared once, an ``Option`` with
its default and effect), shared by the config hook (start-up), the read
strategy (API server) and the worker: the declared attention mode,
``validated_length``, prompt layout and d3-ultra temperature schedule; the
engine options prefix_bidir refuses; the ``d3_state_tokens`` and
``d3_question_ends`` a request carries, and ``StateBlock``, the worker's one
home for the blocks and ranges they give. Every malformed value raises
``ValueError`` naming the field and the value; nothing is ignored or clamped.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

# Under the "vllm" logger, so that it shares vLLM's handlers and level.
logger = init_logger(f"vllm.{__name__}")

PREFIX_BIDIR = "prefix_bidir"
ATTENTION_MODES = ("causal", "noncausal_full_attention", PREFIX_BIDIR)


@dataclass(frozen=True)
class Option:
    """A setting the plugin reads, declared once: its name as the user writes
    it, where it is given (``where``), its default and what it does."""

    name: str
    where: str
    default: Any
    effect: str


#: ``Option.where``: the JSON of ``--additional-config``, a field of a pooling
#: request (and ``PoolingParams.extra_kwargs``), an environment variable.
ADDITIONAL_CONFIG = "--additional-config"
REQUEST_FIELD = "request field"
ENVIRONMENT = "environment"

#: Its values besides a kernel's name: the platform's choice, or vLLM's ranged
#: attention with one engine request per question.
AUTO_KERNEL, RANGED_KERNEL = "auto", "ranged"
ATTENTION_KERNEL_OPTION = Option(
    "d3_attention_kernel",
    ADDITIONAL_CONFIG,
    AUTO_KERNEL,
    "The kernel of the full-attention layers' dense state and question "
    "pieces. `auto`: the GPU family's first kernel that runs; `fa3`, `fa2`, "
    "`torch_flash` or `triton` force one (start-up stops if it cannot run "
    "here or fails its check); `ranged`: vLLM's ranged attention, one engine "
    "request per question.",
)
STATE_ONCE_OPTION = Option(
    "d3_state_once",
    ADDITIONAL_CONFIG,
    True,
    "Where the dense pieces serve, `/v1/systemone` packs a request's questions "
    "after one copy of its state, one engine request. `false`: one engine "
    "request per question, each reading the state again.",
)
STATE_CACHE_MIN_TOKENS_OPTION = Option(
    "d3_state_cache_min_tokens",
    ADDITIONAL_CONFIG,
    8192,
    "With prefix caching on, a state of at least this many tokens (and longer "
    "than one cache block) is read alone first, its questions sent right "
    "behind it, so that a later request with the same state finds it cached. "
    "A shorter state is read with its questions. 0: every state longer than a "
    "block.",
)
STATE_TOKENS_OPTION = Option(
    "d3_state_tokens",
    REQUEST_FIELD,
    None,
    "`/classify` and `/pooling` (or `PoolingParams.extra_kwargs` offline): the "
    "number of leading prompt tokens that are the state block, an int, or a "
    "list with one per input. A prefix_bidir model needs it; `/v1/systemone` "
    "counts it itself.",
)
QUESTION_ENDS_OPTION = Option(
    "d3_question_ends",
    REQUEST_FIELD,
    None,
    "`PoolingParams.extra_kwargs`: where each question block of a packed "
    "prompt (a state, then its questions) ends, increasing to the prompt's "
    "length. Without it the prompt is one question; more than one end needs "
    "`d3_state_once`.",
)
STATE_TOKENS_KEY = STATE_TOKENS_OPTION.name
QUESTION_ENDS_KEY = QUESTION_ENDS_OPTION.name
STATE_ONCE_KEY = STATE_ONCE_OPTION.name
STATE_CACHE_MIN_TOKENS_KEY = STATE_CACHE_MIN_TOKENS_OPTION.name
STATE_CACHE_MIN_TOKENS: int = STATE_CACHE_MIN_TOKENS_OPTION.default
ATTENTION_KERNEL_KEY = ATTENTION_KERNEL_OPTION.name
#: Where the config hook writes what it decided for the engine, under the two
#: switches' keys (the kernel, ``ranged`` for none; whether the state is read
#: once); the user's switches stay as given.
DECIDED_KEY = "d3_decided"
#: The prompt layouts this plugin renders. ``header-v1`` (d3-ultra) is not public.
PROMPT_LAYOUTS = ("d3",)


def _is_int(value: Any) -> bool:
    """A real int: ``True`` is not a one-token anything."""
    return isinstance(value, int) and not isinstance(value, bool)


def decision_config_of(hf_config: Any) -> Mapping[str, Any] | None:
    """The ``decision_config.json`` vLLM's D3 detection attached, if any."""
    decision = getattr(hf_config, "decision_config", None)
    return decision if isinstance(decision, Mapping) else None


def attention_mode_of(decision: Mapping[str, Any]) -> str:
    """The declared attention mode; ``causal`` when absent."""
    return decision.get("attention_mode", "causal")


def is_prefix_bidir(decision: Any) -> TypeGuard[Mapping[str, Any]]:
    return isinstance(decision, Mapping) and attention_mode_of(decision) == PREFIX_BIDIR


def validated_length_of(decision: Mapping[str, Any]) -> int | None:
    """The declared ``validated_length``, a positive int, or None."""
    value = decision.get("validated_length")
    if value is None:
        return None
    if not _is_int(value) or value <= 0:
        raise ValueError(
            "decision_config.json validated_length must be a positive integer, "
            f"not {value!r}"
        )
    return value


def apply_validated_length(
    model_config: "ModelConfig", decision: Mapping[str, Any]
) -> None:
    """``max_model_len`` from ``validated_length``, unless the user chose one or
    the model has fewer positions; the log says which."""
    validated_length = validated_length_of(decision)
    if validated_length is None:
        return
    given = model_config.original_max_model_len
    if given is not None:
        logger.info(
            "D3: --max-model-len %s given; the checkpoint's validated_length %d "
            "is not applied",
            given,
            validated_length,
        )
        return
    derived = model_config.max_model_len
    if validated_length > derived:
        logger.warning(
            "D3: validated_length %d exceeds the model's %d positions; using %d",
            validated_length,
            derived,
            derived,
        )
        return
    model_config.max_model_len = validated_length
    logger.info(
        "D3: max_model_len %d from the checkpoint's validated_length "
        "(pass --max-model-len to override)",
        validated_length,
    )


def check_prefix_bidir_serving(vllm_config: "VllmConfig") -> None:
    """Refuse what a prefix_bidir checkpoint cannot be served with."""
    if not is_prefix_bidir(decision_config_of(vllm_config.model_config.hf_config)):
        return
    if not vllm_config.use_v2_model_runner:
        raise ValueError(
            "D3 prefix_bidir checkpoints need Model Runner V2: Model Runner V1 "
            "does not pass the state/question ranges to attention and would "
            "answer with the wrong mask. V1 was selected (an earlier log line "
            "says why, e.g. VLLM_USE_V2_MODEL_RUNNER=0 or no Triton)."
        )
    if vllm_config.scheduler_config.enable_chunked_prefill:
        raise ValueError(
            "D3 prefix_bidir checkpoints do not support chunked prefill: a state "
            "or question block must be read whole. Drop --enable-chunked-prefill "
            "(--enable-prefix-caching alone sets what it needs)."
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "D3 prefix_bidir checkpoints are served on several GPUs with "
            "--tensor-parallel-size or --data-parallel-size; pipeline "
            "parallelism has not been validated with their state/question ranges "
            "and packed reads. Drop --pipeline-parallel-size."
        )


def check_prompt_layout(decision: Mapping[str, Any]) -> None:
    """Only the ``d3`` prompt layout (or none declared) is understood."""
    if "prompt_layout" not in decision:
        return
    layout = decision["prompt_layout"]
    if layout not in PROMPT_LAYOUTS:
        raise ValueError(
            f"decision_config.json prompt_layout {layout!r} is not supported: "
            f"vllm-d3 renders only {list(PROMPT_LAYOUTS)}, and serving another "
            "layout with the d3 prompt would give wrong answers"
        )


@dataclass(frozen=True)
class TemperatureSchedule:
    """``temperature_by_questions``: a request of n questions uses
    ``temperatures[i]`` for the first i with ``n <= max_questions[i]``, and the
    last temperature beyond the last threshold."""

    max_questions: tuple[int, ...]
    temperatures: tuple[float, ...]

    def temperature_for(self, num_questions: int) -> float:
        for limit, temperature in zip(
            self.max_questions, self.temperatures, strict=False
        ):
            if num_questions <= limit:
                return temperature
        return self.temperatures[-1]


def temperature_schedule_of(decision: Mapping[str, Any]) -> TemperatureSchedule | None:
    """d3-ultra's ``temperature_by_questions`` rule, or None."""
    if "temperature_by_questions" not in decision:
        return None
    value = decision["temperature_by_questions"]

    def malformed(why: str) -> ValueError:
        return ValueError(
            f"decision_config.json temperature_by_questions {value!r} is malformed: "
            + why
        )

    if not isinstance(value, Mapping) or set(value) != {"max_questions", "temperature"}:
        raise malformed("it must be an object with exactly max_questions, temperature")
    limits, temperatures = value["max_questions"], value["temperature"]
    if not isinstance(limits, list) or not limits:
        raise malformed("max_questions must be a non-empty list")
    if not all(_is_int(n) and n > 0 for n in limits):
        raise malformed("max_questions must hold positive integers")
    if any(a >= b for a, b in zip(limits, limits[1:], strict=False)):
        raise malformed("max_questions must be strictly increasing")
    if not isinstance(temperatures, list) or len(temperatures) != len(limits) + 1:
        raise malformed("temperature must hold one more value than max_questions")
    if not all(
        isinstance(t, (int, float))
        and not isinstance(t, bool)
        and math.isfinite(t)
        and t > 0
        for t in temperatures
    ):
        raise malformed("temperatures must be finite positive numbers")
    return TemperatureSchedule(tuple(limits), tuple(float(t) for t in temperatures))


def check_decision_fields(decision: Mapping[str, Any]) -> None:
    """Start-up check of every field that 0.33.0's D3 contract does not read."""
    mode = attention_mode_of(decision)
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unsupported decision_config.json attention_mode {mode!r}")
    validated_length_of(decision)
    check_prompt_layout(decision)
    temperature_schedule_of(decision)


def state_tokens_of(extra_kwargs: Mapping[str, Any] | None, prompt_len: int) -> int:
    """The state block size of one prefix_bidir request, with ``1 <= s <= n``."""
    if not extra_kwargs or STATE_TOKENS_KEY not in extra_kwargs:
        raise ValueError(
            f"this prefix_bidir D3 model needs the state block size: pass "
            f'PoolingParams(extra_kwargs={{"{STATE_TOKENS_KEY}": s}}) or the '
            f'request field "{STATE_TOKENS_KEY}" (an int, 1 <= s <= prompt length)'
        )
    value = extra_kwargs[STATE_TOKENS_KEY]
    if not _is_int(value):
        raise ValueError(
            f"{STATE_TOKENS_KEY} must be an int, not {type(value).__name__} {value!r}"
        )
    if not 1 <= value <= prompt_len:
        raise ValueError(
            f"{STATE_TOKENS_KEY}={value} is outside 1..{prompt_len} (the prompt length)"
        )
    return value


def question_ends_of(
    extra_kwargs: Mapping[str, Any] | None, prompt_len: int, state_tokens: int
) -> list[int]:
    """Where each question block ends: ``s < e1 < ... < eQ == n``, block ``i``
    being ``[e(i-1), ei)`` with ``e0 = s``. A prompt without the key is one
    question, ``[n]`` (or none when it is all state)."""
    if not extra_kwargs or QUESTION_ENDS_KEY not in extra_kwargs:
        return [prompt_len] if state_tokens < prompt_len else []
    ends = extra_kwargs[QUESTION_ENDS_KEY]
    if (
        not isinstance(ends, list)
        or not ends
        or not all(_is_int(e) for e in ends)
        or ends[-1] != prompt_len
        or any(a >= b for a, b in zip([state_tokens, *ends], ends, strict=False))
    ):
        raise ValueError(
            f"{QUESTION_ENDS_KEY} must be a non-empty list of ints increasing from "
            f"above {STATE_TOKENS_KEY}={state_tokens} to the prompt length "
            f"{prompt_len}, not {ends!r}"
        )
    return list(ends)


def state_once_of(additional_config: Any) -> bool:
    """``additional_config["d3_state_once"]``: a bool, true when absent."""
    if not isinstance(additional_config, Mapping):
        return True
    value = additional_config.get(STATE_ONCE_KEY, STATE_ONCE_OPTION.default)
    if not isinstance(value, bool):
        raise ValueError(
            f"--additional-config {STATE_ONCE_KEY} must be true or false, not {value!r}"
        )
    return value


def state_cache_min_tokens_of(additional_config: Any) -> int:
    """``additional_config["d3_state_cache_min_tokens"]``: an int of at least
    0, ``STATE_CACHE_MIN_TOKENS`` when absent."""
    if not isinstance(additional_config, Mapping):
        return STATE_CACHE_MIN_TOKENS
    value = additional_config.get(STATE_CACHE_MIN_TOKENS_KEY, STATE_CACHE_MIN_TOKENS)
    if not _is_int(value) or value < 0:
        raise ValueError(
            f"--additional-config {STATE_CACHE_MIN_TOKENS_KEY} must be an int of at "
            f"least 0 (tokens), not {value!r}"
        )
    return value


def attention_kernel_of(additional_config: Any, kernels: tuple[str, ...]) -> str:
    """``additional_config["d3_attention_kernel"]``: one of ``kernels``, or
    ``auto`` (also when absent) or ``ranged``."""
    if not isinstance(additional_config, Mapping):
        return AUTO_KERNEL
    value = additional_config.get(ATTENTION_KERNEL_KEY, ATTENTION_KERNEL_OPTION.default)
    choices = (AUTO_KERNEL, *kernels, RANGED_KERNEL)
    if value not in choices:
        raise ValueError(
            f"--additional-config {ATTENTION_KERNEL_KEY} must be one of "
            f"{', '.join(choices)}, not {value!r}"
        )
    return value


def decided(additional_config: Any) -> dict[str, Any]:
    """What the config hook decided for this engine (``DECIDED_KEY``; empty
    before it ran)."""
    if not isinstance(additional_config, Mapping):
        return {}
    value = additional_config.get(DECIDED_KEY)
    return dict(value) if isinstance(value, Mapping) else {}


def decisions_to_write(additional_config: dict[str, Any]) -> dict[str, Any]:
    """The config hook's decisions in ``additional_config`` (``DECIDED_KEY``),
    to write into; a fresh record where there is none."""
    decisions = additional_config.get(DECIDED_KEY)
    if not isinstance(decisions, dict):
        decisions = additional_config[DECIDED_KEY] = {}
    return decisions


def state_once_decided(additional_config: Any) -> bool:
    """Whether requests are read state once, as the config hook decided."""
    return decided(additional_config).get(STATE_ONCE_KEY) is True


#: Per batch row, the ranges ``StateBlock.ranges`` gives (inclusive ends).
PrefixRanges = dict[int, list[tuple[int, int]]]


@dataclass(frozen=True)
class StateBlock:
    """A request's state block size and where its question blocks end
    (``question_ends_of``)."""

    state_tokens: int
    prompt_len: int
    question_ends: tuple[int, ...]

    @property
    def packed(self) -> bool:
        return len(self.question_ends) > 1

    def question_blocks(self) -> list[tuple[int, int]]:
        """Each question block as ``[start, end)`` (none: all state)."""
        starts = (self.state_tokens, *self.question_ends)
        return list(zip(starts, self.question_ends, strict=False))

    def ranges(self) -> list[tuple[int, int]]:
        """The state range, then one per question block, ends inclusive."""
        blocks = [(0, self.state_tokens), *self.question_blocks()]
        return [(start, end - 1) for start, end in blocks]
