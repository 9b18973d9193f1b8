"""The upstream patch series, in the order a reviewer reads it
(``vllm_d3.export``; docs/upstream.md lists what is still to come).

Each commit's changes to vLLM's own files are a diff in ``edits/``, which
shows only the change; the code it adds calls functions of the new files, so
the rules live there, in the modules this package serves with.
``tests/test_export.py`` applies every diff and lints what it adds.
"""

from . import Diff, NewFile, Patch, TreeFile

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
        Diff("01-contract.diff"),
        TreeFile("tests/models/language/pooling/d3_utils.py"),
        TreeFile("tests/models/language/pooling/test_d3_prefix_bidir_config.py"),
    ),
    tests=("tests/test_config.py",),
    control="tests/test_config.py::test_prefix_bidir_contract",
)


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
        Diff("02-systemone-bodies.diff"),
        TreeFile(
            "tests/entrypoints/serve/middleware/test_systemone_body_middleware.py"
        ),
    ),
    tests=("tests/test_systemone_body.py",),
    control="tests/test_systemone_body.py::test_compressed_bodies",
)


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
        Diff("03-state-tokens.diff"),
        TreeFile("tests/entrypoints/pooling/test_d3_state_tokens.py"),
    ),
    # Packed requests need the state-once decision, a later commit's.
    tests=(
        "tests/test_entrypoints.py",
        "--deselect=tests/test_entrypoints.py::test_packed_requests_need_state_once",
    ),
    control="tests/test_entrypoints.py::test_bad_state_tokens_are_client_errors",
)


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
    changes=(Diff("04-prefix-ranges-hook.diff"),),
    tests=("tests/test_model_state_hook.py",),
    control="tests/test_model_state_hook.py::"
    "test_the_hooks_ranges_reach_the_attention_builder",
    backports=("v1/worker/gpu/model_states/mamba_hybrid.py",),
)

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
  tokens, the way chunked prefill continues a sequence; a small step, where
  that second pass would cost more host time than reading its states again
  costs GPU time, instead runs as one scan of each question's own prompt; on
  the Triton/FLA and FlashInfer prefills a step instead runs in one pass,
  every block a sequence of its own: FLA's chunked rule with its recurrence
  across chunks run twice, first to find where each state ends, then with each
  question starting there (layers/mamba/gdn/split_recurrence.py), and
  FlashInfer's as two launches in one core call, the state blocks then the
  question blocks from their ends (layers/mamba/gdn/flashinfer_launches.py);
  the metadata of each form is built by vLLM's own GDN builder
  (v1/attention/backends/d3_packed_gdn.py);
- the classify pooler reads a packed request out at the last token of each
  question block, the logits flat, question by question.

For prefix caching's align mode (which the contract refuses for prefix_bidir
until a later commit serves it as the state cache), the Gated DeltaNet layers
declare prefill checkpoints on the Triton prefill too (on FlashInfer's, at any
token rather than every 64), and the two phases write those
inside what their first phase reads; every scan runs on the state slots vLLM
resolved for the step, and a packed row after a prefix-cache hit inside its
state continues from the cached state.

The D3 model gives a prefix_bidir instance the get_model_state_cls hook and
the per-question readout (models/d3_prefix_bidir.py); the other attention
modes are unchanged.""",
    changes=(
        NewFile("v1/attention/backends/d3_packed_gdn.py"),
        NewFile("model_executor/layers/mamba/gdn/packed_questions.py"),
        NewFile("model_executor/layers/mamba/gdn/flashinfer_launches.py"),
        NewFile("model_executor/layers/mamba/gdn/split_recurrence.py"),
        Diff("05-model-state.diff"),
        NewFile("model_executor/models/d3_prefix_bidir.py"),
        NewFile("v1/worker/gpu/model_states/d3_prefix_bidir.py"),
    ),
    tests=("tests/test_model_state.py", "tests/test_flashinfer_launches.py"),
    control="tests/test_model_state.py::test_model_state_resolution",
    backports=(
        "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
        "model_executor/models/d3.py",
    ),
)


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
  usage.input_tokens what the engine computed and in cached_tokens what it
  took from the prefix cache;
- with prefix caching (which the contract refuses for prefix_bidir until a
  later commit serves it as the state cache), reads a state longer than the
  cache's grid and of at least additional_config d3_state_cache_min_tokens
  (8192 by default: the read costs a step, which a request whose state is
  never asked again pays) alone, once for the reads of it in flight (found
  by the state's key, the new d3_state_key module), its questions sent
  right behind it, so that they find it cached;
- tokenizes the head the questions of a request share (system turn, media,
  state) once, and each question's own tail, after checking the split once
  against whole prompts (question_tokens).

Checkpoints that need none of it keep read's plain encodes.""",
    changes=(
        NewFile("entrypoints/openai/decisions/d3_reads.py"),
        NewFile("entrypoints/openai/decisions/d3_state_key.py"),
        Diff("06-state-block-reads.diff"),
        TreeFile(
            "tests/entrypoints/generate/structured_decisions/"
            "test_d3_state_block_reads.py"
        ),
    ),
    # The packed reads need the config hook's decision, a later commit's.
    tests=(
        "tests/test_strategy.py",
        "--deselect=tests/test_strategy.py::test_state_once_packs_the_questions",
        "--deselect=tests/test_strategy.py::test_a_pack_too_long_for_the_engine_is_split",
        "--deselect=tests/test_strategy.py::"
        "test_an_engine_error_fails_the_read_naming_it[True]",
        "--deselect=tests/test_strategy.py::"
        "test_a_state_is_read_alone_first_with_its_questions[True]",
        "--deselect=tests/test_strategy.py::"
        "test_usage_counts_what_was_computed_and_what_was_cached[True]",
        # The key comes with the state cache's commit.
        "--deselect=tests/test_strategy.py::"
        "test_every_engine_request_is_keyed_by_the_whole_state",
        "--deselect=tests/test_strategy.py::"
        "test_the_same_text_with_other_images_gets_another_key",
        # The state cache's commit checks d3_state_cache_min_tokens at start-up.
        "--deselect=tests/test_strategy.py::"
        "test_a_malformed_state_cache_min_tokens_is_refused",
    ),
    control="tests/test_strategy.py::test_a_straddling_token_goes_to_the_question",
    backports=("entrypoints/openai/decisions/strategies.py",),
)


#: The dense-piece tests of the config hook: DENSE_SERVING's, left out of
#: DENSE_BACKEND's.
DENSE_SERVING_TESTS = tuple(
    f"tests/test_dense_attention.py::{name}"
    for name in (
        "test_hook_selects_dense_pieces_where_they_run",
        "test_state_once_where_dense_pieces_run",
        "test_the_state_once_switch_and_a_chosen_gdn_kernel",
        "test_a_quantized_kv_cache_reads_one_question_per_request",
        "test_a_bad_state_once_switch_stops_start_up",
        "test_hook_keeps_vllm_selection_without_a_hopper_gpu",
        "test_a_chosen_backend_wins",
        "test_flashinfer_autotune_is_skipped_by_default",
        "test_the_engine_allocator_gets_expandable_segments",
        "test_the_users_allocator_settings_are_kept",
        "test_a_kv_connector_keeps_the_allocator_segments_fixed",
        "test_each_gpu_family_gets_its_kernels_checked",
        "test_a_kernel_that_fails_its_check_gives_way_to_the_next",
        "test_no_kernel_passing_its_check_serves_the_ranged_path",
        "test_the_switch_forces_a_kernel",
        "test_a_flash_attention_version_chooses_its_kernel",
        "test_the_switch_forces_the_ranged_path",
        "test_an_unknown_or_unavailable_kernel_stops_start_up",
        "test_a_forced_kernel_that_fails_its_check_stops_start_up",
        "test_a_forced_kernel_beside_a_chosen_backend_stops_start_up",
    )
)


DENSE_BACKEND = Patch(
    title="[Attention] D3 prefix_bidir: a dense-piece attention backend",
    body="""\
A prefix_bidir row is not causal attention, and the ranged Triton kernel that
applies its ranges scans every key for every query (about 50 TFLOP/s on long
prompts on a Hopper GPU). prefix_bidir refuses chunked prefill and prefix caching,
so a ranged row is computed whole in one step and its mask is two passes of
plain non-causal attention over the step's own keys and values: every range
(the state, each question block) over itself, and each row's question rows
over its state, merged by log-sum-exp (merge_attn_states). The same two passes
serve a row that packs several questions after one state, and a row whose
first tokens (inside its state) came from the prefix cache, which the state
cache will turn on: its cached keys and values are gathered from the paged
cache into the passes' key layout, each row's keys in prompt order.

D3_PREFIX_BIDIR, a composite of ranged Triton and a Triton-layout child whose
builder turns a batch of whole ranged rows into the two passes' cu_seqlens and
whose impl runs them on a variable-length kernel that returns its log-sum-exp
(d3_dense_kernels): FlashAttention 3 on Hopper, FlashAttention 2 on
Ampere/Ada and Blackwell, PyTorch's flash attention on ROCm, and a new Triton
kernel (ops/dense_piece_attention.py) as the next choice everywhere. A batch
that does not split into pieces (a prompt split across steps) runs on ranged
Triton, logged once; a packed row there is refused, since no kernel computes
its mask.

Nothing selects it yet: the next commit's config hook does, where a kernel
runs.""",
    changes=(
        Diff("07-dense-backend.diff"),
        NewFile("v1/attention/backends/d3_prefix_bidir.py"),
        NewFile("v1/attention/backends/d3_dense_kernels.py"),
        NewFile("v1/attention/ops/dense_piece_attention.py"),
        TreeFile("tests/v1/attention/test_d3_prefix_bidir_backend.py"),
    ),
    # The config hook's tests come with the next commit.
    tests=(
        "tests/test_dense_attention.py",
        *(f"--deselect={test}" for test in DENSE_SERVING_TESTS),
    ),
    control="tests/test_dense_attention.py::test_backend_registration",
)


DENSE_SERVING = Patch(
    title="[Attention] D3 prefix_bidir: dense pieces where a kernel runs, state once",
    body="""\
The D3 config hook (the new d3_serving module) puts the full-attention layers
of prefix_bidir checkpoints on it where a kernel runs and the user chose no
backend: the one additional_config d3_attention_kernel forces, else the
platform's first, which on any GPU but Hopper (where they were validated)
first runs a small prefix_bidir batch against a float32 reference in a process
of its own; if none passes, vLLM's ranged attention stays. It then decides
once, for every process, whether /v1/systemone reads each request's state once
(packed questions; additional_config d3_state_once, which the user can turn
off); it writes the Gated DeltaNet prefill kernel every process runs: the
user's --gdn-prefill-backend, else vLLM's own choice, except that FlashInfer's
(vLLM's choice on Hopper for any head dim) gives way to Triton/FLA for GDN
heads other than 128, which its kernel does not take; for an unquantized
checkpoint it skips FlashInfer's autotune pass (a dummy step of
max_num_batched_tokens tokens, here max_model_len, for kernels the model does
not run, FlashInfer's GDN prefill not using the autotuner) unless the user set
it. It
writes its decisions under additional_config d3_decided, beside the user's
switches, and logs each with its reason.""",
    changes=(
        Diff("08-dense-serving.diff"),
        NewFile("v1/attention/backends/d3_kernel_check.py"),
        NewFile("model_executor/models/d3_serving.py"),
        TreeFile("tests/models/language/pooling/test_d3_prefix_bidir_serving.py"),
    ),
    tests=(
        *DENSE_SERVING_TESTS,
        "tests/test_gdn_prefill.py",
        "tests/test_strategy.py::test_state_once_packs_the_questions",
        "tests/test_strategy.py::test_a_pack_too_long_for_the_engine_is_split",
        "tests/test_strategy.py::test_an_engine_error_fails_the_read_naming_it[True]",
        "tests/test_strategy.py::test_a_state_is_read_alone_first_with_its_questions[True]",
        "tests/test_strategy.py::"
        "test_usage_counts_what_was_computed_and_what_was_cached[True]",
        "tests/test_entrypoints.py::test_packed_requests_need_state_once",
    ),
    control="tests/test_dense_attention.py::"
    "test_hook_selects_dense_pieces_where_they_run",
)

STATE_CACHE = Patch(
    title="[Core] D3 prefix_bidir: a state cached across requests",
    body="""\
A prefix_bidir state block's keys, values and Gated DeltaNet states depend on
the whole state block and nothing else, so a request whose whole state was
read before may take them from the prefix cache and compute only its
questions. --enable-prefix-caching is refused for prefix_bidir today; serve it
as that cache, on by default (measured on a Hopper GPU: a state asked again 20x
faster, pages of 4 requests 3.5x, a short miss no slower, a KV cache 6%
smaller):

- left unset, it is on for prefix_bidir (EngineArgs' default, from the new
  d3_state_cache module's state_cache_by_default, marked as the default);
- the config hook accepts it where the state is read once on the Triton or
  FlashInfer GDN prefill and no KV connector is configured; otherwise it
  refuses it, naming why, or, where it was the default, turns it off and logs
  why; it turns on
  chunked prefill, which prefix caching of a hybrid model asserts, while the
  token budget stays the one vLLM sized without chunking (at least
  max_model_len); it checks d3_state_cache_min_tokens and logs it;
- the input processor keys every prefix_bidir request, of every entry point,
  by its whole state block (its token ids, or its embeddings' digest, and the
  media inside it) under the user's cache_salt, so that two states that
  differ anywhere share no block;
- align mode's demand for chunked media input (which CUDA and ROCm turn off
  for a prefix-LM model, so the engine would not start) is waived for it
  (VllmConfig.validate_block_size): its scheduler cuts no prompt;
- the scheduler reads a prompt that carries d3_state_tokens whole or lets it
  wait (whatever would cut it: the token budget, Mamba's block-aligned split,
  an encoder cap), bounds its prefix-cache hit strictly inside its state, and
  queues one whose state is cached ahead of the waiting ones that would read
  theirs (first-come-first-served queues), so that a KV cache holding a few
  states does not evict a state between its read and its questions; other
  requests are scheduled as before.

The key itself, the strategy's state-alone reads and the model side's hits
are in the earlier commits; explicit --enable-chunked-prefill stays
refused.""",
    changes=(
        NewFile("v1/core/d3_state_cache.py"),
        Diff("09-state-cache.diff"),
        TreeFile("tests/v1/core/test_d3_state_cache.py"),
    ),
    tests=(
        "tests/test_state_cache.py",
        "tests/test_strategy.py::test_every_engine_request_is_keyed_by_the_whole_state",
        "tests/test_strategy.py::test_the_same_text_with_other_images_gets_another_key",
        "tests/test_strategy.py::test_a_malformed_state_cache_min_tokens_is_refused",
    ),
    control="tests/test_state_cache.py::"
    "test_prefix_caching_is_served_as_the_state_cache",
    backports=("v1/core/sched/scheduler.py",),
)

DOCS_AND_CI = Patch(
    title="[Doc][CI] D3 prefix_bidir: a docs page and its Buildkite step",
    body="""\
A page for serving D3 prefix_bidir checkpoints beside the other pooling models
(what the mode is, the request fields, the state read once and the state
cache), and a Buildkite area, models_d3.yaml, whose step (labelled as the
extended-pooling one) runs the D3 tests on one GPU when a file they cover
changes.""",
    changes=(
        TreeFile("docs/models/pooling_models/d3_prefix_bidir.md"),
        TreeFile(".buildkite/test_areas/models_d3.yaml"),
    ),
    tests=(),
    control=None,
)


SERIES: tuple[Patch, ...] = (
    CONTRACT,
    SYSTEMONE_BODIES,
    STATE_TOKENS,
    PREFIX_RANGES_HOOK,
    MODEL_STATE,
    STATE_BLOCK_READS,
    DENSE_BACKEND,
    DENSE_SERVING,
    STATE_CACHE,
    DOCS_AND_CI,
)
