"""The D3 read strategy on a real tokenizer, renderer and multimodal processor.

The engine is the one boundary replaced (``RecordingEngine``): it records what the
strategy sends and answers with fixed code logits. The state block size the
strategy sends is checked against an independent count done here on raw bytes:
the byte-level BPE token strings mapped back to UTF-8 bytes, against the UTF-8
length of the prompt up to the end of the state text.
"""

import asyncio
import base64
import io
import math
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.decisions import state as decisions_state
from vllm.entrypoints.openai.decisions import strategies as upstream
from vllm.entrypoints.openai.decisions.question_types import build_question
from vllm.entrypoints.openai.decisions.strategies import ReadContext
from vllm.pooling_params import PoolingParams
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.renderers.registry import renderer_from_config
from vllm.v1.engine.input_processor import InputProcessor

ULTRA = {"max_questions": [1, 4], "temperature": [2.0, 1.0, 0.5]}
STATES = [
    "plain words",
    "Is it ok?",
    "The end.",
    "ends with spaces   ",
    "ends with newlines\n\n",
    "tab and space \t ",
    "状态：你好，世界",
    "emoji at the end 👍🏽",
    {"user": "ana", "items": [1, 2.5, None], "note": "trailing space "},
    None,
    "",
]


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character table, built here."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def independent_state_size(
    tokenizer, ids: list[int], text_bytes_to_state_end: int
) -> int:
    """Leading tokens whose bytes end by the end of the state text."""
    decoder = byte_level_decoder()
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    consumed, count = 0, 0
    for token in tokenizer.convert_ids_to_tokens(ids):
        size = len(token.encode()) if token in added else len(token)
        assert token in added or all(ch in decoder for ch in token)
        if consumed + size > text_bytes_to_state_end:
            break
        consumed += size
        count += 1
    return count


class RecordingEngine:
    """Stands in for the GPU engine: records each read, answers fixed logits,
    scaled by k + 1 for the k-th question of a packed read."""

    def __init__(self, vllm_config, num_codes: int):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.reads: list[tuple[dict, object]] = []
        self.request_ids: list[str] = []
        self.logits = torch.linspace(2.0, -2.0, num_codes)
        #: The tokens each request (by id) finds in the prefix cache.
        self.cached: dict[str, int] = {}
        #: The message of the error every read answers, if set.
        self.error: str | None = None

    def cache_keys(self) -> list[str | None]:
        """The ``cache_salt`` vLLM's input processor gives each read recorded
        (with prefix caching, the state cache's key)."""
        processor = InputProcessor(self.vllm_config)
        return [
            processor.process_inputs(
                f"k{n}", engine_input, params, supported_tasks=("classify",)
            ).cache_salt
            for n, (engine_input, params) in enumerate(self.reads)
        ]

    async def encode(self, engine_input, params, request_id, **kwargs):
        self.reads.append((engine_input, params))
        self.request_ids.append(request_id)
        questions = len((params.extra_kwargs or {}).get("d3_question_ends", [0]))
        data = torch.cat([self.logits * (k + 1) for k in range(questions)])
        yield SimpleNamespace(
            error=None if self.error is None else SimpleNamespace(message=self.error),
            outputs=SimpleNamespace(data=data),
            prompt_token_ids=engine_input["prompt_token_ids"],
            num_cached_tokens=self.cached.get(request_id, 0),
        )


def make_strategy(
    path: str,
    state_once: bool = False,
    max_model_len: int = 4096,
    engine_cls: type = RecordingEngine,
    cache_grid: int | None = None,
    state_cache_min_tokens: int | None = 0,
):
    """The strategy as the front end builds it. The config hook turns state once
    off without a Hopper GPU; ``state_once`` sets what it would decide there.
    ``cache_grid`` turns prefix caching on, as align mode would set it with a
    Gated DeltaNet block of that many tokens (without a GPU the config hook
    refuses prefix caching: the state cache serves the state-once reads).
    ``state_cache_min_tokens`` is given as ``--additional-config`` (``None``:
    not given); the tiny checkpoint's states are tens of tokens."""
    extra = {}
    if state_cache_min_tokens is not None:
        extra["d3_state_cache_min_tokens"] = state_cache_min_tokens
    config = EngineArgs(
        model=path, max_model_len=max_model_len, additional_config=extra
    ).create_engine_config()
    if "d3_decided" in config.additional_config:
        config.additional_config["d3_decided"]["d3_state_once"] = state_once
    if cache_grid is not None:
        config.cache_config.enable_prefix_caching = True
        config.cache_config.mamba_block_size = cache_grid
    renderer = renderer_from_config(config)
    engine = engine_cls(config, 255)
    online = OnlineRenderer(
        config.model_config,
        renderer,
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
    )
    context = ReadContext(
        engine_client=engine,
        online_renderer=online,
        chat_template=None,
        chat_template_content_format="auto",
        default_chat_template_kwargs={},
    )
    # The strategy the front end's decisions state selects.
    strategy_cls = decisions_state.select_read_strategy(
        config.model_config, ("classify",)
    )
    return strategy_cls(context), engine


QUESTIONS = [
    ("q1", "noul", "Is it a greeting?", None),
    ("q2", "choice", "Which?", {"red": None, "blue": "the sea", "green": None}),
    ("q3", "score", "", ["low", "mid", "high"]),
]


def read_coroutine(
    strategy, state, media=None, request_id="t", questions=QUESTIONS, cache_salt=None
):
    return strategy.read(
        [
            build_question(qid, kind, text, criteria, 255, labeled=False)
            for qid, kind, text, criteria in questions
        ],
        None,
        strategy.render_state(state),
        request_id=request_id,
        chat_template_kwargs=None,
        lora_request=None,
        priority=0,
        cache_salt=cache_salt,
        media=media,
    )


def read(strategy, state, media=None):
    return asyncio.run(read_coroutine(strategy, state, media))


@pytest.fixture(scope="module")
def prefix_bidir(make_checkpoint):
    return make_strategy(make_checkpoint(weights=False))


@pytest.mark.parametrize("state", STATES, ids=repr)
def test_state_block_size_text(prefix_bidir, state):
    strategy, engine = prefix_bidir
    engine.reads.clear()
    read(strategy, state)
    rendered = strategy.render_state(state)
    assert len(engine.reads) == len(QUESTIONS)
    for (engine_input, params), (_, _kind, _text, _criteria) in zip(
        engine.reads, QUESTIONS, strict=True
    ):
        ids = engine_input["prompt_token_ids"]
        s = params.extra_kwargs["d3_state_tokens"]
        assert type(s) is int
        prompt = strategy.tokenizer.decode(ids)
        marker = "State:\n" + rendered
        state_end = prompt.index(marker + "\n\nQuestion:\n") + len(marker)
        expected = independent_state_size(
            strategy.tokenizer, ids, len(prompt[:state_end].encode())
        )
        assert s == expected
        assert 1 <= s < len(ids)


def test_a_straddling_token_goes_to_the_question(prefix_bidir):
    strategy, engine = prefix_bidir
    engine.reads.clear()
    read(strategy, "Is it ok?")
    engine_input, params = engine.reads[0]
    ids = engine_input["prompt_token_ids"]
    s = params.extra_kwargs["d3_state_tokens"]
    # The first question token starts inside the state text: the final "?"
    # joined the newlines that open the question block.
    first_question_token = strategy.tokenizer.decode(ids[s : s + 1])
    assert first_question_token.startswith("?") and "\n" in first_question_token
    assert strategy.tokenizer.decode(ids[:s]).endswith("Is it ok")


def png_data_url(width: int, height: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("num_images", [1, 3])
def test_media_are_inside_the_state_block(prefix_bidir, num_images):
    strategy, engine = prefix_bidir
    engine.reads.clear()
    images = [png_data_url(320, 256, i) for i in range(num_images)]
    read(strategy, "a photo   ", media={"image": images})
    tokenizer = strategy.tokenizer
    vision_end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for (engine_input, params), question in zip(engine.reads, QUESTIONS, strict=True):
        ids = engine_input["prompt_token_ids"]
        s = params.extra_kwargs["d3_state_tokens"]
        media_end = len(ids) - ids[::-1].index(vision_end)
        assert ids[:media_end].count(vision_end) == num_images
        assert ids.count(image_pad) > num_images  # placeholders were expanded
        rest = ids[media_end:]
        # The text after the media, as its whole text tokenizes.
        text = strategy._prompt(
            "a photo   ",
            build_question(*question, 255, labeled=False),
            ["image"] * num_images,
        )
        text = text[text.rindex("<|vision_end|>") + len("<|vision_end|>") :]
        assert rest == tokenizer.encode(text, add_special_tokens=False)
        prompt = tokenizer.decode(rest)
        state_end = prompt.index("State:\na photo   \n\n") + len("State:\na photo   ")
        expected = independent_state_size(
            tokenizer, rest, len(prompt[:state_end].encode())
        )
        assert s == media_end + expected
        assert len(engine_input["mm_kwargs"]["image"]) == num_images


def test_temperature_by_questions(make_checkpoint):
    path = make_checkpoint(
        weights=False, decision_overrides={"temperature_by_questions": ULTRA}
    )
    strategy, engine = make_strategy(path)
    reads = read(strategy, "x")  # three questions: 1 < 3 <= 4 -> 1.0
    logits = engine.logits.tolist()
    choice = reads[1].probs
    weights = [math.exp(v / 1.0) for v in logits[:3]]
    assert choice == pytest.approx([w / sum(weights) for w in weights])
    one = asyncio.run(
        strategy.read(
            [build_question("q", "choice", "", {"a": None, "b": None}, 255, False)],
            None,
            "x",
            request_id="t1",
            chat_template_kwargs=None,
            lora_request=None,
            priority=0,
        )
    )
    weights = [math.exp(v / 2.0) for v in logits[:2]]
    assert one[0].probs == pytest.approx([w / sum(weights) for w in weights])


@pytest.mark.parametrize("mode", ["causal", "noncausal_full_attention"])
def test_other_modes_read_as_before(make_checkpoint, mode):
    strategy, engine = make_strategy(
        make_checkpoint(attention_mode=mode, weights=False)
    )
    reads = read(strategy, "x")
    assert all(params.extra_kwargs is None for _, params in engine.reads)
    temperature = strategy.temperature
    weights = [math.exp(v / temperature) for v in engine.logits.tolist()[:3]]
    assert reads[1].probs == pytest.approx([w / sum(weights) for w in weights])


@pytest.mark.plugin
@pytest.mark.parametrize(
    ("mode", "decision", "plugins"),
    [
        ("prefix_bidir", {}, True),
        ("causal", {"temperature_by_questions": ULTRA}, True),
        ("causal", {}, False),
        ("noncausal_full_attention", {}, False),
    ],
)
def test_the_plugin_reads_only_checkpoints_that_need_state_blocks(
    make_checkpoint, mode, decision, plugins
):
    # prefix_bidir and a temperature by question count need the plugin's
    # reads; every other D3 checkpoint is read by vLLM 0.33.0's own class.
    path = make_checkpoint(
        attention_mode=mode, weights=False, decision_overrides=decision
    )
    model_config = EngineArgs(model=path, max_model_len=4096).create_model_config()
    chosen = decisions_state.select_read_strategy(model_config, ("classify",))
    if plugins:
        assert chosen is not upstream.D3Strategy
        assert issubclass(chosen, upstream.D3Strategy)
    else:
        assert chosen is upstream.D3Strategy
    # The task vLLM checks stays checked.
    with pytest.raises(ValueError, match="need the classify task"):
        decisions_state.select_read_strategy(model_config, ("embed",))


@pytest.mark.plugin
def test_per_question_reads_send_upstreams_engine_inputs(make_checkpoint):
    # 0.33.0's own D3Strategy over the same engine: the plugin's per-question
    # reads must send the same inputs and params, apart from extra_kwargs.
    from vllm.entrypoints.openai.decisions.strategies import (
        D3Strategy as UpstreamD3Strategy,
    )

    strategy, engine = make_strategy(make_checkpoint(weights=False))
    read(strategy, "the same state")
    upstream_strategy = UpstreamD3Strategy(strategy.context)
    upstream_strategy.context = ReadContext(
        **{**vars(strategy.context), "engine_client": engine}
    )
    plugin_reads = list(engine.reads)
    engine.reads.clear()
    read(upstream_strategy, "the same state")
    assert len(plugin_reads) == len(engine.reads) == len(QUESTIONS)
    for (ours, our_params), (theirs, their_params) in zip(
        plugin_reads, engine.reads, strict=True
    ):
        assert ours == theirs
        assert our_params.task == their_params.task
        assert our_params.use_activation == their_params.use_activation
        assert set(our_params.extra_kwargs) == {"d3_state_tokens"}
        assert their_params.extra_kwargs is None


@pytest.mark.plugin
def test_upstream_names_each_question_encode_as_the_plugin_expects(make_checkpoint):
    # The plugin knows a read's encodes by these ids (question_request_id);
    # 0.33.0's own read must send exactly them, one per question, in order.
    from vllm.entrypoints.openai.decisions.strategies import (
        D3Strategy as UpstreamD3Strategy,
    )

    from vllm_d3.entrypoints.openai.decisions.strategies import question_request_id

    strategy, engine = make_strategy(make_checkpoint(weights=False))
    upstream_strategy = UpstreamD3Strategy(strategy.context)
    upstream_strategy.context = ReadContext(
        **{**vars(strategy.context), "engine_client": engine}
    )
    read(upstream_strategy, "a state")
    assert engine.request_ids == [
        question_request_id("t", n) for n in range(len(QUESTIONS))
    ]


@pytest.mark.plugin
@pytest.mark.parametrize("state_once", [False, True])
def test_concurrent_reads_each_get_their_own_answers(make_checkpoint, state_once):
    path = make_checkpoint(weights=False)
    strategy, engine = make_strategy(path, state_once=state_once)
    states = ["the first state", "another, longer second state", "a third"]
    alone = []
    for state in states:
        engine.reads.clear()
        read(strategy, state)
        alone.append([inputs["prompt_token_ids"] for inputs, _ in engine.reads])

    async def together():
        return await asyncio.gather(
            *(
                read_coroutine(strategy, state, request_id=f"r{k}")
                for k, state in enumerate(states)
            )
        )

    engine.reads.clear()
    engine.request_ids.clear()
    answers = asyncio.run(together())
    prompts = [inputs["prompt_token_ids"] for inputs, _ in engine.reads]
    # Each read's engine requests are the ones it sends alone, under its own
    # request id, and its usage counts its own prompts.
    for k, own in enumerate(alone):
        ids = [i for i in engine.request_ids if i.startswith(f"r{k}-")]
        sent = [p for p, i in zip(prompts, engine.request_ids, strict=True) if i in ids]
        assert sent == own
        assert sum(a.input_tokens for a in answers[k]) == sum(len(p) for p in own)


@pytest.mark.plugin
def test_encodes_outside_a_read_reach_vllms_engine_client(make_checkpoint):
    strategy, engine = make_strategy(make_checkpoint(weights=False))
    params = PoolingParams(task="classify")

    async def encode():
        async for _ in strategy.context.engine_client.encode(
            {"prompt_token_ids": [1, 2]}, params, "not-a-read-0"
        ):
            pass

    asyncio.run(encode())
    assert engine.request_ids == ["not-a-read-0"]


@pytest.mark.plugin
def test_a_read_refuses_an_encode_that_is_none_of_its_questions(make_checkpoint):
    from vllm_d3.entrypoints.openai.decisions import strategies

    strategy, _ = make_strategy(make_checkpoint(weights=False))
    questions = [build_question("q", "choice", "", {"a": None, "b": None}, 255, False)]

    async def stray_encode():
        reads = strategies._RequestReads(strategy, "t", questions, "s", None)
        async for _ in reads.encode("t-7", {"prompt_token_ids": [1]}, None, {}):
            pass

    with pytest.raises(RuntimeError, match="'t-7' that is not one of its questions'"):
        asyncio.run(stray_encode())


def test_state_once_packs_the_questions(make_checkpoint):
    path = make_checkpoint(weights=False)
    strategy, engine = make_strategy(path, state_once=True)
    answers = read(strategy, "one state")
    per_question, separate = make_strategy(path)
    read(per_question, "one state")
    # One engine request: the state once, then every question block.
    assert len(engine.reads) == 1
    packed_input, params = engine.reads[0]
    packed = packed_input["prompt_token_ids"]
    s = params.extra_kwargs["d3_state_tokens"]
    ends = params.extra_kwargs["d3_question_ends"]
    prompts = [engine_input["prompt_token_ids"] for engine_input, _ in separate.reads]
    assert s == separate.reads[0][1].extra_kwargs["d3_state_tokens"]
    assert packed[:s] == prompts[0][:s]
    starts = [s, *ends[:-1]]
    for prompt, start, end in zip(prompts, starts, ends, strict=True):
        assert packed[start:end] == prompt[s:]
    assert ends[-1] == len(packed)
    # The k-th question's answer comes from the k-th row of logits.
    for k, (answer, (_, kind, _, criteria)) in enumerate(
        zip(answers, QUESTIONS, strict=True)
    ):
        options = 2 if kind == "noul" else len(criteria)
        logits = engine.logits.tolist()[:options]
        weights = [math.exp(v * (k + 1) / strategy.temperature) for v in logits]
        expected = [w / sum(weights) for w in weights]
        if kind == "noul":
            expected = expected[::-1]  # the model reads false, then true
        assert answer.probs == pytest.approx(expected)
    # Usage counts the state once.
    assert sum(a.input_tokens for a in answers) == len(packed)


def test_a_pack_too_long_for_the_engine_is_split(make_checkpoint, caplog):
    path = make_checkpoint(weights=False, validated_length=None)
    strategy, engine = make_strategy(path, state_once=True, max_model_len=4096)
    strategy.max_pack_tokens = 100  # the state and one question here
    answers = read(strategy, "a state")
    lengths = [len(inputs["prompt_token_ids"]) for inputs, _ in engine.reads]
    assert len(engine.reads) > 1
    assert all(length <= 100 for length in lengths)
    ends = [p.extra_kwargs.get("d3_question_ends", [0]) for _, p in engine.reads]
    assert sum(len(e) for e in ends) == len(QUESTIONS)
    # Each pack reads the state again, and usage says so.
    assert sum(a.input_tokens for a in answers) == sum(lengths)


@pytest.mark.parametrize("state_once", [False, True])
def test_an_engine_error_fails_the_read_naming_it(make_checkpoint, state_once):
    strategy, engine = make_strategy(
        make_checkpoint(weights=False), state_once=state_once
    )
    engine.error = "out of blocks"
    with pytest.raises(ValueError, match="Failed to score the question: out of blocks"):
        read(strategy, "a state")
    assert len(engine.reads) == (1 if state_once else len(QUESTIONS))


class HangingEngine(RecordingEngine):
    """An engine whose encodes never finish: it counts those it was made to
    leave, as vLLM's ``AsyncLLM.encode`` aborts its request when it is left."""

    def __init__(self, vllm_config, num_codes: int):
        super().__init__(vllm_config, num_codes)
        self.started = 0
        self.left = 0

    async def encode(self, engine_input, params, request_id, **kwargs):
        self.started += 1
        try:
            await asyncio.Event().wait()
            yield None
        except (asyncio.CancelledError, GeneratorExit):
            self.left += 1
            raise


@pytest.mark.parametrize("state_once", [False, True])
def test_a_cancelled_read_leaves_every_engine_request(make_checkpoint, state_once):
    # vLLM cancels the handler of a client that disconnected (with_cancellation
    # on /v1/systemone); the engine requests of its read must not run on.
    strategy, engine = make_strategy(
        make_checkpoint(weights=False), state_once=state_once, engine_cls=HangingEngine
    )
    expected = 1 if state_once else len(QUESTIONS)

    async def cancel_mid_read():
        task = asyncio.ensure_future(read_coroutine(strategy, "a state"))
        while engine.started < expected:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_read())
    assert engine.left == engine.started == expected


@pytest.mark.parametrize(
    "ends", [[], [5], [9, 8, 12], [9, 12, 13], [True, 12], "12", [9.0, 12]]
)
def test_bad_question_ends_are_refused(ends):
    from vllm_d3.model_executor.models.d3_contract import question_ends_of

    with pytest.raises(ValueError, match="d3_question_ends"):
        question_ends_of({"d3_question_ends": ends}, 12, 5)


def test_question_ends_default_to_one_question():
    from vllm_d3.model_executor.models.d3_contract import question_ends_of

    assert question_ends_of(None, 12, 5) == [12]
    assert question_ends_of({"d3_state_tokens": 12}, 12, 12) == []
    assert question_ends_of({"d3_question_ends": [7, 12]}, 12, 5) == [7, 12]


@pytest.mark.parametrize(
    ("question_lens", "limit", "packs"),
    [
        ([5, 5, 5], 20, [[0, 1], [2]]),  # 10 + 5 + 5 fills a pack to its limit
        ([5, 5, 5], 19, [[0], [1], [2]]),
        ([5, 5, 5], 25, [[0, 1, 2]]),
        ([20, 3, 3], 25, [[0], [1, 2]]),  # too long for any pack: alone
        ([3, 20, 3], 25, [[0], [1], [2]]),
        ([1, 1], 12, [[0, 1]]),  # one-token questions
        ([], 20, []),
    ],
)
def test_questions_are_packed_in_order_up_to_the_limit(question_lens, limit, packs):
    from vllm_d3.entrypoints.openai.decisions.d3_reads import pack_questions

    # Each pack reads the 10-token state again, then its questions.
    assert pack_questions(10, question_lens, limit) == packs


class EncodeSpy:
    """The strategy's tokenizer, recording each call (``calls``) and the texts
    it encodes (``encode``, or called on a text or a batch); with
    ``merge_at_colon``, a tokenizer that tokenizes a text opening with ``:``
    differently (as one that merges across the shared head's end would)."""

    def __init__(self, tokenizer, merge_at_colon: bool = False):
        self.tokenizer = tokenizer
        self.merge_at_colon = merge_at_colon
        self.texts: list[str] = []
        self.calls = 0

    def merged(self, text: str, ids: list[int]) -> list[int]:
        return [ids[0], *ids] if self.merge_at_colon and text[:1] == ":" else ids

    def encode(self, text, **kwargs):
        self.calls += 1
        self.texts.append(text)
        return self.merged(text, self.tokenizer.encode(text, **kwargs))

    def __call__(self, text, **kwargs):
        self.calls += 1
        if isinstance(text, str):
            self.texts.append(text)
            return self.tokenizer(text, **kwargs)
        self.texts += text
        encoded = self.tokenizer(text, **kwargs)
        ids = [
            self.merged(t, i) for t, i in zip(text, encoded["input_ids"], strict=True)
        ]
        return {**encoded, "input_ids": ids}

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


HEAD_IN_THE_QUESTION = ("q4", "noul", "Odd\n\nQuestion:\nreally?", None)


@pytest.mark.parametrize(
    "state", [*STATES, "a state\n\nQuestion:\nwith a question in it"], ids=repr
)
def test_questions_are_tokenized_as_whole_prompts(make_checkpoint, state):
    # One engine request per question: its prompt is what read tokenized (the
    # packs are made of those, test_state_once_packs_the_questions).
    strategy, engine = make_strategy(make_checkpoint(weights=False))
    tokenizer = strategy.tokenizer
    spy = strategy.tokenizer = EncodeSpy(tokenizer)
    questions = [
        build_question(qid, kind, text, criteria, 255, labeled=False)
        for qid, kind, text, criteria in [*QUESTIONS, HEAD_IN_THE_QUESTION]
    ]
    rendered = strategy.render_state(state)
    for request in ("a", "b"):
        spy.texts.clear()
        engine.reads.clear()
        asyncio.run(
            strategy.read(
                questions,
                None,
                rendered,
                request_id=request,
                chat_template_kwargs=None,
                lora_request=None,
                priority=0,
            )
        )
        # Every prompt as its whole text tokenizes.
        whole = [
            tokenizer.encode(
                strategy._prompt(rendered, q, []), add_special_tokens=False
            )
            for q in questions
        ]
        assert [inputs["prompt_token_ids"] for inputs, _ in engine.reads] == whole
        if "\n\nQuestion:" in rendered:
            continue  # the head ends inside the state: exact, saves less
        # The tokenizer sees the state once for all the questions of the first
        # request (their shared head, whose offsets also give the state's
        # size), and once more for the strategy's check of its first split;
        # the second request, with the same head, reuses its tokens.
        with_state = sum(f"State:\n{rendered}\n\n" in text for text in spy.texts)
        assert with_state == (2 if request == "a" else 0)
    assert strategy.splits_heads is True


def test_a_requests_question_tails_are_tokenized_in_one_call(make_checkpoint):
    # Their tokens are each whole prompt's (the test above reads through here).
    strategy, _ = make_strategy(make_checkpoint(weights=False), state_once=True)
    spy = strategy.tokenizer = EncodeSpy(strategy.tokenizer)
    read(strategy, "a first state")  # the strategy's one check of its split
    calls = {}
    for count in (3, 12):
        asked = [(f"q{n}", "noul", f"Is it the {n}th?", None) for n in range(count)]
        spy.calls = 0
        asyncio.run(read_coroutine(strategy, f"state {count}", questions=asked))
        calls[count] = spy.calls
    assert calls[12] == calls[3]


def test_a_state_size_takes_no_other_requests_head(make_checkpoint):
    # Another request's head ("... x\n\nQuestion") can open this prompt's
    # text without being its head (its state goes on "s are fine"): the state's
    # size is then read from the whole text, as the first time.
    strategy, engine = make_strategy(make_checkpoint(weights=False))
    state = "x\n\nQuestions are fine"
    read(strategy, state)
    inputs, params = engine.reads[0]
    read(strategy, "x")
    assert strategy.splits_heads and state.startswith("x")
    question = build_question(*QUESTIONS[0], 255, labeled=False)
    rendered = strategy.render_state(state)
    size = strategy.state_tokens(question, rendered, None, inputs["prompt_token_ids"])
    assert size == params.extra_kwargs["d3_state_tokens"]


def test_a_tokenizer_that_merges_across_the_split_gets_whole_prompts(
    make_checkpoint, monkeypatch
):
    from vllm_d3.entrypoints.openai.decisions import d3_reads

    warnings: list[str] = []
    monkeypatch.setattr(
        d3_reads.logger, "warning", lambda m, *a: warnings.append(m % a)
    )
    strategy, engine = make_strategy(make_checkpoint(weights=False))
    spy = strategy.tokenizer = EncodeSpy(strategy.tokenizer, merge_at_colon=True)
    read(strategy, "one state")
    questions = [
        build_question(qid, kind, text, criteria, 255, labeled=False)
        for qid, kind, text, criteria in QUESTIONS
    ]
    rendered = strategy.render_state("one state")
    whole = [
        spy.encode(strategy._prompt(rendered, q, []), add_special_tokens=False)
        for q in questions
    ]
    assert [inputs["prompt_token_ids"] for inputs, _ in engine.reads] == whole
    assert strategy.splits_heads is False
    assert warnings == [
        "D3 prefix_bidir: this tokenizer merges across '\\n\\nQuestion:', so every "
        "question's prompt is tokenized whole"
    ]


# The state cache's front end (docs/design.md): the key the input
# processor gives every engine request, the state read alone first, and the
# usage the engine reports.

OTHER_QUESTIONS = [("q9", "noul", "Is it something else?", None)]


def cache_salts(strategy, engine, state, **read_options) -> set[str | None]:
    """The cache salts of every engine request one read sends, as the input
    processor leaves them."""
    engine.reads.clear()
    asyncio.run(read_coroutine(strategy, state, **read_options))
    return set(engine.cache_keys())


@pytest.mark.parametrize("state_once", [False, True])
def test_every_engine_request_is_keyed_by_the_whole_state(make_checkpoint, state_once):
    path = make_checkpoint(weights=False)
    strategy, engine = make_strategy(path, state_once=state_once, cache_grid=16)
    key = cache_salts(strategy, engine, "one state")
    assert len(key) == 1 and None not in key
    assert cache_salts(strategy, engine, "one state", questions=OTHER_QUESTIONS) == key
    longer = cache_salts(strategy, engine, "one state, then more")
    tenants = [
        cache_salts(strategy, engine, "one state", cache_salt=salt)
        for salt in ("tenant-a", "tenant-b")
    ]
    assert len({*key, *longer, *tenants[0], *tenants[1]}) == 4
    # Control: without prefix caching the requests carry the user's salt.
    uncached, uncached_engine = make_strategy(path, state_once=state_once)
    assert cache_salts(uncached, uncached_engine, "one state") == {None}
    salted = cache_salts(uncached, uncached_engine, "one state", cache_salt="tenant-a")
    assert salted == {"tenant-a"}


def test_the_same_text_with_other_images_gets_another_key(make_checkpoint):
    strategy, engine = make_strategy(
        make_checkpoint(weights=False), state_once=True, cache_grid=16
    )
    images = [png_data_url(320, 256, seed) for seed in range(2)]
    keys, prompts = [], []
    for media in (images[:1], images[1:], images, images[::-1]):
        keys.append(cache_salts(strategy, engine, "a photo", media={"image": media}))
        prompts.append(engine.reads[-1][0]["prompt_token_ids"])
    # The token ids are the same for the same number of images of one size.
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
    assert len(set().union(*keys)) == 4


class GatedEngine(RecordingEngine):
    """Holds each state-alone read until ``release`` is set; records the ids of
    the requests sent (``sent``) and of those it was made to leave."""

    def __init__(self, vllm_config, num_codes: int):
        super().__init__(vllm_config, num_codes)
        self.release = asyncio.Event()
        self.sent: list[str] = []
        self.left: list[str] = []

    async def encode(self, engine_input, params, request_id, **kwargs):
        self.sent.append(request_id)
        try:
            if request_id.endswith("-state"):
                await self.release.wait()
        except asyncio.CancelledError:
            self.left.append(request_id)
            raise
        async for output in super().encode(engine_input, params, request_id):
            yield output


async def hold(engine: GatedEngine, tasks: list[asyncio.Future]) -> None:
    """Wait until ``tasks`` have sent their first request (or one has ended),
    and a while longer."""
    while not engine.sent and not any(task.done() for task in tasks):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)


async def sent_while_held(engine: GatedEngine, *reads) -> list[str]:
    """Start ``reads``; once the engine has held them a while, what they had
    sent. Then release the engine and finish them."""
    tasks = [asyncio.ensure_future(r) for r in reads]
    await hold(engine, tasks)
    sent = list(engine.sent)
    engine.release.set()
    await asyncio.gather(*tasks)
    return sent


@pytest.mark.parametrize("state_once", [False, True])
def test_a_state_is_read_alone_first_with_its_questions(make_checkpoint, state_once):
    strategy, engine = make_strategy(
        make_checkpoint(weights=False),
        state_once=state_once,
        cache_grid=16,
        engine_cls=GatedEngine,
    )
    held = asyncio.run(sent_while_held(engine, read_coroutine(strategy, "one state")))
    # Sent first, its questions at once (vLLM's scheduler hits its blocks once
    # it is scheduled), the read waiting for it too.
    question_ids = ["t-pack0"] if state_once else [f"t-{n}" for n in range(3)]
    assert held == ["t-state", *question_ids]
    sent = dict(zip(engine.request_ids, engine.reads, strict=True))
    alone, params = sent.pop("t-state")
    questions = list(sent.values())
    s = params.extra_kwargs["d3_state_tokens"]
    assert len(alone["prompt_token_ids"]) == s > 16
    assert "d3_question_ends" not in params.extra_kwargs
    assert len(questions) == (1 if state_once else len(QUESTIONS))
    for inputs, question_params in questions:
        assert inputs["prompt_token_ids"][:s] == alone["prompt_token_ids"]
        assert question_params.extra_kwargs["d3_state_tokens"] == s
    # Keyed alike, so that the questions find the state's blocks.
    assert len(set(engine.cache_keys())) == 1


@pytest.mark.parametrize(
    ("grid_below_state", "min_tokens_above_state", "read_alone"),
    [(0, 0, False), (1, 0, True), (1, 1, False), (1, None, False)],
)
def test_a_state_is_read_alone_where_longer_than_the_grid_and_the_set_length(
    make_checkpoint, grid_below_state, min_tokens_above_state, read_alone
):
    path = make_checkpoint(weights=False)
    probe, probe_engine = make_strategy(path)
    read(probe, "one state")
    s = probe_engine.reads[0][1].extra_kwargs["d3_state_tokens"]
    # None: d3_state_cache_min_tokens left out, its default far above s.
    min_tokens = None if min_tokens_above_state is None else s + min_tokens_above_state
    strategy, engine = make_strategy(
        path, cache_grid=s - grid_below_state, state_cache_min_tokens=min_tokens
    )
    read(strategy, "one state")
    questions = [f"t-{n}" for n in range(len(QUESTIONS))]
    assert engine.request_ids == (["t-state"] if read_alone else []) + questions


@pytest.mark.parametrize("value", [-1, 1.5, True, "8192"])
def test_a_malformed_state_cache_min_tokens_is_refused(make_checkpoint, value):
    path = make_checkpoint(weights=False)
    with pytest.raises(ValueError, match=f"d3_state_cache_min_tokens .*{value!r}"):
        EngineArgs(
            model=path, additional_config={"d3_state_cache_min_tokens": value}
        ).create_engine_config()


def test_reads_of_one_state_in_flight_read_it_alone_once(make_checkpoint):
    path = make_checkpoint(weights=False)

    def held(*states_and_salts) -> list[str]:
        strategy, engine = make_strategy(path, cache_grid=16, engine_cls=GatedEngine)
        reads = [
            read_coroutine(strategy, state, request_id=f"r{k}", cache_salt=salt)
            for k, (state, salt) in enumerate(states_and_salts)
        ]
        sent = asyncio.run(sent_while_held(engine, *reads))
        questions = [f"r{k}-{n}" for k in range(len(reads)) for n in range(3)]
        assert sorted(engine.request_ids) == sorted(sent)
        # Every read's questions go at once, whether it sent a state read or not.
        assert set(questions) <= set(sent)
        return sorted(set(sent) - set(questions))

    assert held(("one state", None), ("one state", None), ("one state", None)) == [
        "r0-state"
    ]
    # Controls: other states, another tenant.
    assert held(("one state", None), ("another state", None)) == [
        "r0-state",
        "r1-state",
    ]
    assert held(("one state", None), ("one state", "tenant-b")) == [
        "r0-state",
        "r1-state",
    ]


def test_a_cancelled_read_leaves_its_state_read_and_others_go_on(make_checkpoint):
    strategy, engine = make_strategy(
        make_checkpoint(weights=False), cache_grid=16, engine_cls=GatedEngine
    )

    async def cancel_the_first():
        first = asyncio.ensure_future(
            read_coroutine(strategy, "one state", request_id="a")
        )
        second = asyncio.ensure_future(
            read_coroutine(strategy, "one state", request_id="b")
        )
        await hold(engine, [first, second])
        first.cancel()
        answers = await asyncio.wait_for(second, timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await first
        return answers

    answers = asyncio.run(cancel_the_first())
    # The cancelled read leaves its state read; the other one's questions,
    # sent at once, are answered.
    assert engine.left == ["a-state"]
    assert sorted(engine.sent) == ["a-0", "a-1", "a-2", "a-state", "b-0", "b-1", "b-2"]
    assert len(answers) == len(QUESTIONS)


@pytest.mark.parametrize("state_once", [False, True])
def test_usage_counts_what_was_computed_and_what_was_cached(
    make_checkpoint, state_once
):
    strategy, engine = make_strategy(
        make_checkpoint(weights=False), state_once=state_once, cache_grid=16
    )
    engine.cached = {"t-state": 16, "t-pack0": 32, "t-0": 32, "t-1": 16, "t-2": 0}
    answers = read(strategy, "one state")
    lengths = {
        request_id: len(inputs["prompt_token_ids"])
        for request_id, (inputs, _) in zip(
            engine.request_ids, engine.reads, strict=True
        )
    }
    s = engine.reads[0][1].extra_kwargs["d3_state_tokens"]
    if state_once:
        ends = engine.reads[1][1].extra_kwargs["d3_question_ends"]
        # The first question counts the state (what the two requests computed
        # of it), the others their own tokens.
        own = [end - start for start, end in zip([s, *ends], ends, strict=False)]
        computed = [s - 16 + ends[0] - 32, *own[1:]]
        cached = [16 + 32, 0, 0]
    else:
        # Each question computes its prompt less what it found cached; the
        # first also counts the state read alone.
        cached = [16 + 32, 16, 0]
        computed = [
            lengths[f"t-{n}"] - engine.cached[f"t-{n}"] for n in range(len(QUESTIONS))
        ]
        computed[0] += s - 16
    assert [a.input_tokens for a in answers] == computed
    assert [a.cached_tokens for a in answers] == cached
