"""The upstream patch series, in the order a reviewer reads it
(``vllm_d3.export``; docs/upstream.md lists what is still to come).

Each ``Edit`` anchors on vLLM 0.33.0's own lines and replaces them with the
same lines plus the change, so that the patch shows only the change. The code
an edit adds calls functions of the new files; the rules live there, in the
modules this package serves with.
"""

from . import Edit, NewFile, Patch

_CONFIG = "vllm/model_executor/models/config.py"
_CONVERTOR = "vllm/transformers_utils/model_arch_config_convertor.py"

CONTRACT = Patch(
    title="[Model] D3: serve prefix_bidir checkpoints' config contract",
    body="""\
Decision 3.0 packages that declare attention_mode "prefix_bidir" (vllm-sr/d3-turbo,
vllm-sr/d3-ultra) are refused at start-up today. Accept them in the D3 config
contract:

- The Qwen3.5 convertor turns is_mm_prefix_lm on for them, text-only serving
  included: each request's state and question ranges must reach attention, so
  only backends that apply such ranges may be selected.
- The text layers stay decoder attention with a KV cache; the model as a whole
  is marked non-causal, so chunked prefill and prefix caching default to off.
  Model Runner V1 (which passes no ranges), prefix caching and chunked prefill
  are refused with an error that says why.
- validated_length becomes max_model_len when the user gave none (every mode).
- The d3-ultra fields (prompt_layout, temperature_by_questions) are validated
  at start-up; a malformed field stops it with an error naming the field.

The decision_config.json rules live in the new d3_contract module, shared by the
config hook, the D3 read strategy and the worker in the following patches.""",
    changes=(
        NewFile("model_executor/models/d3_contract.py"),
        Edit(
            _CONVERTOR,
            anchor="""\
                hf_config.decision_config = get_hf_file_to_dict(
                    "decision_config.json", model_path, revision
                )
        super().__init__(hf_config, hf_text_config, revision)
""",
            text="""\
                hf_config.decision_config = get_hf_file_to_dict(
                    "decision_config.json", model_path, revision
                )
        super().__init__(hf_config, hf_text_config, revision)

    def is_mm_prefix_lm(self, supports_multimodal: bool = True) -> bool:
        # Imported here: vllm.config imports this module first.
        from vllm.model_executor.models.d3_contract import (
            decision_config_of,
            is_prefix_bidir,
        )

        # A D3 prefix_bidir checkpoint's state and question ranges must reach
        # attention even when the deployment serves text only.
        if is_prefix_bidir(decision_config_of(self.hf_config)):
            return True
        return super().is_mm_prefix_lm(supports_multimodal)
""",
        ),
        Edit(
            _CONFIG,
            anchor="""\
from vllm.logger import init_logger
""",
            text="""\
from vllm.logger import init_logger
from vllm.model_executor.models.d3_contract import (
    ATTENTION_MODES,
    PREFIX_BIDIR,
    apply_validated_length,
    attention_mode_of,
    check_decision_fields,
    check_prefix_bidir_serving,
)
""",
        ),
        Edit(
            _CONFIG,
            anchor="""\
        attention_mode = decision.get("attention_mode", "causal")
        if attention_mode not in ("causal", "noncausal_full_attention"):
""",
            text="""\
        attention_mode = attention_mode_of(decision)
        if attention_mode not in ATTENTION_MODES:
""",
        ),
        Edit(
            _CONFIG,
            anchor="""\
        # The full attention layers read the whole prompt in both directions;
        # the Gated DeltaNet layers stay causal.
        is_causal = attention_mode == "causal"
        for config in {
            id(config): config for config in (hf_config, model_config.hf_text_config)
        }.values():
            config.is_causal = is_causal
""",
            text="""\
        # noncausal_full_attention: the full attention layers read the whole
        # prompt in both directions; the Gated DeltaNet layers stay causal.
        # prefix_bidir: the text layers stay decoder attention and read each
        # request's state and question ranges (is_mm_prefix_lm).
        is_causal = attention_mode != "noncausal_full_attention"
        for config in {
            id(config): config for config in (hf_config, model_config.hf_text_config)
        }.values():
            config.is_causal = is_causal
        if attention_mode == PREFIX_BIDIR:
            # The model as a whole is not causal: the state and each question
            # read themselves both ways, so chunked prefill and prefix caching
            # default to off.
            hf_config.is_causal = False
""",
        ),
        Edit(
            _CONFIG,
            anchor="""\
        if pooler_config.use_activation is None:
            pooler_config.use_activation = False


class SnowflakeGteNewModelConfig(VerifyAndUpdateConfig):
""",
            text="""\
        if pooler_config.use_activation is None:
            pooler_config.use_activation = False

        check_decision_fields(decision)
        apply_validated_length(model_config, decision)

    @staticmethod
    def verify_and_update_config(vllm_config: "VllmConfig") -> None:
        Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(vllm_config)
        check_prefix_bidir_serving(vllm_config)


class SnowflakeGteNewModelConfig(VerifyAndUpdateConfig):
""",
        ),
    ),
    tests=("tests/test_config.py",),
    control="tests/test_config.py::test_prefix_bidir_contract",
)

_MIDDLEWARE = "vllm/entrypoints/serve/middleware/register.py"

SYSTEMONE_BODIES = Patch(
    title="[Frontend] /v1/systemone: compressed bodies and multipart asset uploads",
    body="""\
Existing /v1/systemone clients (the typesafe-sdk, 0.7.5) compress bodies of 1 KiB
or more with zstd and send images as multipart/form-data; the route reads only
plain application/json and answers 400 or 415 to both.

SystemOneBodyMiddleware, a pure ASGI middleware for POST /v1/systemone only,
hands the route the plain JSON it reads:

- Content-Encoding zstd or gzip is decompressed as it arrives, capped at
  VLLM_D3_MAX_BODY_BYTES decoded bytes (default 32 MiB; 413 past it, before
  the rest is decompressed); any other encoding but identity is a 415.
- A multipart form's "request" part is the JSON request; its "assets" map
  names each image's part. A reference that is the whole state, or a whole
  element of a state array, becomes the request's next image; every other use
  is a 400 that names it, since the checkpoint runtime's placement of such
  references is not public.

It is added before the other middleware, so that CORS and the API key check
wrap it. Every other route and every plain JSON body are untouched.""",
    changes=(
        NewFile("entrypoints/serve/middleware/systemone_body.py"),
        Edit(
            _MIDDLEWARE,
            anchor="""\
from .log_response import log_response
""",
            text="""\
from .log_response import log_response
from .systemone_body import add_systemone_body_middleware
""",
        ),
        Edit(
            _MIDDLEWARE,
            anchor="""\
    supported_tasks: tuple["SupportedTask", ...],
):
    app.add_middleware(
        CORSMiddleware,
""",
            text="""\
    supported_tasks: tuple["SupportedTask", ...],
):
    # First, so that the middleware added next (CORS, the API key) wraps it.
    add_systemone_body_middleware(app)
    app.add_middleware(
        CORSMiddleware,
""",
        ),
    ),
    tests=("tests/test_systemone_body.py",),
    control="tests/test_systemone_body.py::test_compressed_bodies",
)

_IO_PROCESSOR = "vllm/entrypoints/pooling/base/io_processor.py"
_INPUT_PROCESSOR = "vllm/v1/engine/input_processor.py"

STATE_TOKENS = Patch(
    title="[Frontend] D3: carry and check d3_state_tokens on every entry point",
    body="""\
A prefix_bidir prompt's attention mask depends on its state block size, which
the prompt itself does not carry. Every entry point carries it in
PoolingParams.extra_kwargs["d3_state_tokens"]:

- /classify and /pooling take the request field d3_state_tokens (an int, or a
  list with one int per input, which gives one PoolingParams per input);
- LLM.classify takes PoolingParams(extra_kwargs={"d3_state_tokens": s}).

The input processor checks every prefix_bidir request with its final prompt:
a missing or invalid size, or invalid question blocks (d3_question_ends, for
a request that packs several questions after one state), is a
VLLMValidationError naming the field, so that no request runs with a silent
single block and a bad one never reaches the engine core. Other models are
untouched.""",
    changes=(
        NewFile("entrypoints/pooling/d3_state_tokens.py"),
        Edit(
            _IO_PROCESSOR,
            anchor="""\
from vllm.renderers.inputs.preprocess import parse_model_prompt, prompt_to_seq
""",
            text="""\
from vllm.entrypoints.pooling.d3_state_tokens import with_state_tokens
from vllm.renderers.inputs.preprocess import parse_model_prompt, prompt_to_seq
""",
        ),
        Edit(
            _IO_PROCESSOR,
            anchor="""\
    def create_pooling_params(self, request):
        return request.to_pooling_params()
""",
            text="""\
    def create_pooling_params(self, request):
        return with_state_tokens(
            self.model_config, request, request.to_pooling_params()
        )
""",
        ),
        Edit(
            _INPUT_PROCESSOR,
            anchor="""\
from vllm.config import VllmConfig
""",
            text="""\
from vllm.config import VllmConfig
from vllm.entrypoints.pooling.d3_state_tokens import check_state_blocks
""",
        ),
        Edit(
            _INPUT_PROCESSOR,
            anchor="""\
        return EngineCoreRequest(
""",
            text="""\
        request = EngineCoreRequest(
""",
        ),
        Edit(
            _INPUT_PROCESSOR,
            anchor="""\
            kv_hints=kv_hints,
        )

    def _validate_prompt_len(
""",
            text="""\
            kv_hints=kv_hints,
        )
        check_state_blocks(self.vllm_config, request)
        return request

    def _validate_prompt_len(
""",
        ),
    ),
    # Packed requests need the state-once decision, a later commit's.
    tests=(
        "tests/test_entrypoints.py",
        "--deselect=tests/test_entrypoints.py::test_packed_requests_need_state_once",
    ),
    control="tests/test_entrypoints.py::test_bad_state_tokens_are_client_errors",
)

_DEFAULT_STATE = "vllm/v1/worker/gpu/model_states/default.py"
_HYBRID_STATE = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"

PREFIX_RANGES_HOOK = Patch(
    title="[Core] Model Runner V2: a get_mm_prefix_ranges hook for PrefixLM ranges",
    body="""\
DefaultModelState.prepare_attn computes each request's PrefixLM ranges (the
bidirectional image and video spans of is_mm_prefix_lm models) inline, and
MambaHybridModelState.prepare_attn passes none at all, so a hybrid model with
ranges of its own has no way to hand them to its attention backends.

Move the computation into DefaultModelState.get_mm_prefix_ranges(input_batch),
unchanged, and call it from both prepare_attn methods. The default keeps what
every model gets today; for hybrid models it returns what the default state
computes (None unless the model is an is_mm_prefix_lm multimodal model), and
Mamba metadata builders do not read ranges. A model state that knows its
requests' ranges overrides the hook (the D3 prefix_bidir state, next).""",
    changes=(
        Edit(
            _DEFAULT_STATE,
            anchor="""\
    def prepare_attn(
        self,
        input_batch: InputBatch,
""",
            text="""\
    def get_mm_prefix_ranges(
        self, input_batch: InputBatch
    ) -> dict[int, list[tuple[int, int]]] | None:
        \"\"\"Per batch row, the PrefixLM ranges attention reads both ways
        (inclusive ends), or None.\"\"\"
        if not (
            self.supports_mm_inputs
            and self.encoder_cache is not None
            and self.model_config.is_mm_prefix_lm
        ):
            return None
        mm_features = self.encoder_cache.mm_features
        hf_text_config = self.model_config.hf_text_config
        return compute_mm_prefix_ranges(
            [mm_features.get(req_id, ()) for req_id in input_batch.req_ids],
            sliding_window=self.model_config.get_sliding_window(),
            clamp_sliding_window=getattr(
                self.model, "mm_prefix_clamp_sliding_window", False
            )
            or getattr(hf_text_config, "mm_prefix_clamp_sliding_window", False),
            span_pad=getattr(self.model, "mm_prefix_span_leading_pad_modulus", 0),
        )

    def prepare_attn(
        self,
        input_batch: InputBatch,
""",
        ),
        Edit(
            _DEFAULT_STATE,
            anchor="""\
        req_doc_ranges: dict[int, list[tuple[int, int]]] | None = None
        if (
            self.supports_mm_inputs
            and self.encoder_cache is not None
            and self.model_config.is_mm_prefix_lm
        ):
            mm_features = self.encoder_cache.mm_features
            hf_text_config = self.model_config.hf_text_config
            req_doc_ranges = compute_mm_prefix_ranges(
                [mm_features.get(req_id, ()) for req_id in input_batch.req_ids],
                sliding_window=self.model_config.get_sliding_window(),
                clamp_sliding_window=getattr(
                    self.model, "mm_prefix_clamp_sliding_window", False
                )
                or getattr(hf_text_config, "mm_prefix_clamp_sliding_window", False),
                span_pad=getattr(self.model, "mm_prefix_span_leading_pad_modulus", 0),
            )
""",
            text="""\
        req_doc_ranges = self.get_mm_prefix_ranges(input_batch)
""",
        ),
        Edit(
            _HYBRID_STATE,
            anchor="""\
            positions=input_batch.positions,
            model_specific_attn_metadata=mamba_attn_metadata,
""",
            text="""\
            positions=input_batch.positions,
            mm_req_doc_ranges=self.get_mm_prefix_ranges(input_batch),
            model_specific_attn_metadata=mamba_attn_metadata,
""",
        ),
    ),
    tests=("tests/test_model_state_hook.py",),
    control="tests/test_model_state_hook.py::"
    "test_the_hooks_ranges_reach_the_attention_builder",
    backports=("v1/worker/gpu/model_states/mamba_hybrid.py",),
)

_GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
_D3_MODEL = "vllm/model_executor/models/d3.py"

MODEL_STATE = Patch(
    title="[Model] D3: the Model Runner V2 state for prefix_bidir checkpoints",
    body="""\
A prefix_bidir prompt is a state block of s tokens and a question block: the
state reads itself both ways, the question reads the state and itself both
ways, the state never sees the question. D3PrefixBidirModelState, derived from
the hybrid state Qwen3.5 gets, keeps each request's d3_state_tokens from its
PoolingParams and returns its state and question ranges from
get_mm_prefix_ranges, so that the attention metadata builders that apply
ranges see them; the Gated DeltaNet layers stay causal. vLLM's own warm-up
requests, which carry no size, are split in the middle.

A request may pack several questions after one state (d3_question_ends), so
that the state is computed once:

- the state keeps the positions vLLM computes for it; every question block
  gets the M-RoPE positions it has in its own prompt state || qi;
- the Gated DeltaNet layers run such a step in two phases
  (layers/mamba/gdn/packed_questions.py): everything but the question blocks,
  as today, then every question block from a copy of its row's state after s
  tokens, the way chunked prefill continues a sequence;
- the classify pooler reads a packed request out at the last token of each
  question block, the logits flat, question by question.

The D3 model gives a prefix_bidir instance the get_model_state_cls hook and
the per-question readout (models/d3_prefix_bidir.py); the other attention
modes are unchanged.""",
    changes=(
        NewFile("model_executor/layers/mamba/gdn/packed_questions.py"),
        Edit(
            _GDN,
            anchor="""\
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
""",
            text="""\
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.packed_questions import (
    forward_packed_questions,
)
""",
        ),
        Edit(
            _GDN,
            anchor="""\
            a: alpha gating vector                  (num_tokens, num_heads)
            core_attn_out: Pre-allocated output buffer for attention results.

        \"\"\"
""",
            text="""\
            a: alpha gating vector                  (num_tokens, num_heads)
            core_attn_out: Pre-allocated output buffer for attention results.

        \"\"\"
        # A step with packed D3 requests restarts every question from its
        # request's state: this method runs once per phase.
        if forward_packed_questions(
            self, self._forward_core, mixed_qkv, b, a, core_attn_out
        ):
            return
""",
        ),
        NewFile("model_executor/models/d3_prefix_bidir.py"),
        Edit(
            _D3_MODEL,
            anchor="""\
from .adapters import as_seq_cls_model
""",
            text="""\
from .adapters import as_seq_cls_model
from .d3_contract import decision_config_of, is_prefix_bidir
from .d3_prefix_bidir import serve_prefix_bidir
""",
        ),
        Edit(
            _D3_MODEL,
            anchor="""\
                allow_patterns_overrides=[READOUT_WEIGHTS],
            )
        ]
""",
            text="""\
                allow_patterns_overrides=[READOUT_WEIGHTS],
            )
        ]
        if is_prefix_bidir(decision_config_of(model_config.hf_config)):
            serve_prefix_bidir(self)
""",
        ),
        NewFile("v1/worker/gpu/model_states/d3_prefix_bidir.py"),
    ),
    tests=("tests/test_model_state.py",),
    control="tests/test_model_state.py::test_model_state_resolution",
    backports=(
        "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
        "model_executor/models/d3.py",
    ),
)

_STRATEGIES = "vllm/entrypoints/openai/decisions/strategies.py"

STATE_BLOCK_READS = Patch(
    title="[Frontend] D3Strategy: state blocks, packed reads, d3-ultra temperature",
    body="""\
A prefix_bidir checkpoint reads each prompt as a state block and a question
block; D3Strategy.read sends one classify encode per question and no block
size, and ignores d3-ultra's temperature_by_questions.

D3StateBlockReads (the new d3_reads module), a base of D3Strategy:

- counts each request's state block once, with the checkpoint runtime's rule
  (the leading tokens whose text ends at or before the end of the state text;
  the system turn and the media come first, so they are inside it), checks
  that every question's prompt shares it, and sends it as d3_state_tokens;
- packs the questions after one copy of the state (d3_question_ends), where
  the config says the state is read once (the d3_state_once decision in
  additional_config d3_decided, which a later commit's config hook writes); a
  pack longer than one engine step is split, each reading the state again,
  and the log says so;
- divides each question's logits by temperature_for(Q), the schedule's
  temperature for the request's question count (d3-ultra), and reports in
  usage.input_tokens what the engine computed;
- tokenizes the head the questions of a request share (system turn, media,
  state) once, and each question's own tail, after checking the split once
  against whole prompts (question_tokens).

Checkpoints that need none of it keep read's plain encodes.""",
    changes=(
        NewFile("entrypoints/openai/decisions/d3_reads.py"),
        Edit(
            _STRATEGIES,
            anchor="""\
from vllm.entrypoints.generate.label_reads import next_token_label_reads
""",
            text="""\
from vllm.entrypoints.generate.label_reads import next_token_label_reads
from vllm.entrypoints.openai.decisions.d3_reads import D3StateBlockReads
""",
        ),
        Edit(
            _STRATEGIES,
            anchor="""\
class D3Strategy(ReadStrategy):
""",
            text="""\
class D3Strategy(D3StateBlockReads, ReadStrategy):
""",
        ),
        Edit(
            _STRATEGIES,
            anchor="""\
        assert isinstance(prompt, str)
        return prompt

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
""",
            text="""\
        assert isinstance(prompt, str)
        return prompt

    def _tokens(self, text: str) -> list[int]:
        # A request's questions share their head (d3_reads.py).
        return self.question_tokens(
            text, partial(self.tokenizer.encode, add_special_tokens=False)
        )
""",
        ),
        Edit(
            _STRATEGIES,
            anchor="""\
        self.max_model_len = model_config.max_model_len
        self.tokenizer = context.online_renderer.renderer.get_tokenizer()
""",
            text="""\
        self.max_model_len = model_config.max_model_len
        self.tokenizer = context.online_renderer.renderer.get_tokenizer()
        self.init_state_blocks()
""",
        ),
        Edit(
            _STRATEGIES,
            anchor="""\
        logits = await asyncio.gather(
            *(read_one(n, inputs) for n, inputs in enumerate(engine_inputs))
        )

        reads = []
        for q, ids, code_logits in zip(questions, prompt_ids, logits):
            texts, order = self._options(q)
            scaled = [v / self.temperature for v in code_logits[: len(texts)]]
""",
            text="""\
        input_tokens = [len(ids) for ids in prompt_ids]
        if self.needs_state_block_reads:
            # State blocks, packed questions, d3-ultra (d3_reads.py).
            logits, input_tokens = await self.read_state_blocks(
                engine_inputs,
                PoolingParams(task="classify", use_activation=False),
                questions,
                state,
                media,
                request_id,
                lora_request=lora_request,
                trace_headers=trace_headers,
                priority=priority,
            )
        else:
            logits = await asyncio.gather(
                *(read_one(n, inputs) for n, inputs in enumerate(engine_inputs))
            )
        temperature = self.temperature_for(len(questions))

        reads = []
        for q, tokens, code_logits in zip(questions, input_tokens, logits):
            texts, order = self._options(q)
            scaled = [v / temperature for v in code_logits[: len(texts)]]
""",
        ),
        Edit(
            _STRATEGIES,
            anchor="""\
                    input_tokens=len(ids),
""",
            text="""\
                    input_tokens=tokens,
""",
        ),
    ),
    # The packed reads need the config hook's decision, a later commit's.
    tests=(
        "tests/test_strategy.py",
        "--deselect=tests/test_strategy.py::test_state_once_packs_the_questions",
        "--deselect=tests/test_strategy.py::test_a_pack_too_long_for_the_engine_is_split",
        "--deselect=tests/test_strategy.py::"
        "test_an_engine_error_fails_the_read_naming_it[True]",
    ),
    control="tests/test_strategy.py::test_a_straddling_token_goes_to_the_question",
    backports=("entrypoints/openai/decisions/strategies.py",),
)

_REGISTRY = "vllm/v1/attention/backends/registry.py"

DENSE_ATTENTION = Patch(
    title="[Attention] D3 prefix_bidir: dense pieces on any GPU, state once",
    body="""\
A prefix_bidir row is not causal attention, and the ranged Triton kernel that
applies its ranges scans every key for every query (about 50 TFLOP/s on long
prompts on an H200). prefix_bidir refuses chunked prefill and prefix caching,
so a ranged row is computed whole in one step and its mask is two passes of
plain non-causal attention over the step's own keys and values: every range
(the state, each question block) over itself, and each row's question rows
over its state, merged by log-sum-exp (merge_attn_states). The same two passes
serve a row that packs several questions after one state.

D3_PREFIX_BIDIR, a composite of ranged Triton and a Triton-layout child whose
builder turns a batch of whole ranged rows into the two passes' cu_seqlens and
whose impl runs them on a variable-length kernel that returns its log-sum-exp
(d3_dense_kernels): FlashAttention 3 on Hopper, FlashAttention 2 on
Ampere/Ada and Blackwell, PyTorch's flash attention on ROCm, and a new Triton
kernel (ops/dense_piece_attention.py) as the next choice everywhere. A batch
that does not split into pieces (a prompt split across steps) runs on ranged
Triton, logged once; a packed row there is refused, since no kernel computes
its mask.

The D3 config hook (the new d3_serving module) puts the full-attention layers
of prefix_bidir checkpoints on it where a kernel runs and the user chose no
backend: the one additional_config d3_attention_kernel forces, else the
platform's first, which on any GPU but Hopper (where they were validated)
first runs a small prefix_bidir batch against a float32 reference in a process
of its own; if none passes, vLLM's ranged attention stays. It then decides
once, for every process, whether /v1/systemone reads each request's state once
(packed questions; additional_config d3_state_once, which the user can turn
off), and keeps the Gated DeltaNet prefill on Triton/FLA, the kernel the
packed path was validated on, unless --gdn-prefill-backend chose another. It
writes its decisions under additional_config d3_decided, beside the user's
switches, and logs each with its reason.""",
    changes=(
        Edit(
            _REGISTRY,
            anchor="""\
    TRITON_FLASH_ATTN = (
        "vllm.v1.attention.backends.triton_flash_attn.TritonFlashAttentionBackend"
    )
""",
            text="""\
    TRITON_FLASH_ATTN = (
        "vllm.v1.attention.backends.triton_flash_attn.TritonFlashAttentionBackend"
    )
    D3_PREFIX_BIDIR = (
        "vllm.v1.attention.backends.d3_prefix_bidir.D3PrefixBidirAttentionBackend"
    )
""",
        ),
        NewFile(
            "v1/attention/backends/d3_prefix_bidir.py",
            in_tree=(
                (
                    """\
#: The ``AttentionBackendEnum`` member the layers look this backend up by: the
#: plugin registers it as ``CUSTOM``, a member every process has, so that a
#: config naming it unpickles in spawned engine and worker processes (one added
#: at run time would not).
REGISTRY_MEMBER = "CUSTOM"
""",
                    """\
#: The ``AttentionBackendEnum`` member the layers look this backend up by.
REGISTRY_MEMBER = BACKEND_NAME
""",
                ),
            ),
        ),
        NewFile("v1/attention/backends/d3_dense_kernels.py"),
        NewFile("v1/attention/ops/dense_piece_attention.py"),
        NewFile("model_executor/models/d3_serving.py"),
        Edit(
            _CONFIG,
            anchor="""\
    check_prefix_bidir_serving,
)
""",
            text="""\
    check_prefix_bidir_serving,
)
from vllm.model_executor.models.d3_serving import select_prefix_bidir_serving
""",
        ),
        Edit(
            _CONFIG,
            anchor="""\
        check_prefix_bidir_serving(vllm_config)
""",
            text="""\
        check_prefix_bidir_serving(vllm_config)
        select_prefix_bidir_serving(vllm_config)
""",
        ),
    ),
    tests=(
        "tests/test_dense_attention.py",
        "tests/test_strategy.py::test_state_once_packs_the_questions",
        "tests/test_strategy.py::test_a_pack_too_long_for_the_engine_is_split",
        "tests/test_strategy.py::test_an_engine_error_fails_the_read_naming_it[True]",
        "tests/test_entrypoints.py::test_packed_requests_need_state_once",
    ),
    control="tests/test_dense_attention.py::"
    "test_hook_selects_dense_pieces_where_they_run",
)

SERIES: tuple[Patch, ...] = (
    CONTRACT,
    SYSTEMONE_BODIES,
    STATE_TOKENS,
    PREFIX_RANGES_HOOK,
    MODEL_STATE,
    STATE_BLOCK_READS,
    DENSE_ATTENTION,
)
