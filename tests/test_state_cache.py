# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The state cache's key, hit limit and scheduling on vLLM 0.33.0's real KV
cache manager and scheduler.

A hybrid cache (a full-attention group and a Gated DeltaNet group in Mamba
"align" mode, as prefix caching gives Qwen3.5) holds a first request's blocks;
later requests ask it for their longest hit. In the manager's tests the first
request is computed in chunks that end at 32 and 48, so that the Gated DeltaNet
states there are cached; the scheduler's tests take vLLM's prefill checkpoint
instead, which a state-only request puts at its state's last whole block
(docs/design.md). The controls ask without the key, without the limit or
with vLLM's own scheduler: blocks whose contents differ are then shared, or a
prompt is cut.
"""

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.engine import arg_utils
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.pooling_params import PoolingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_d3.entrypoints.openai.decisions.d3_state_key import (
    checkpoint_grid,
    media_identifiers,
    state_cache_salt,
)
from vllm_d3.v1.core import d3_state_cache
from vllm_d3.v1.core.d3_state_cache import request_state_tokens, state_hit_limit

BLOCK = 16
#: The first request: a 40-token state (its last whole block ends at 32)
#: and two questions; an image at the state's end, after that block.
STATE = list(range(1000, 1040))
QUESTIONS = list(range(2000, 2012)) + list(range(3000, 3010))
IMAGE = ("image-a", PlaceholderRange(offset=34, length=4))


def hybrid_cache_config(
    checkpoint: bool = False, num_blocks: int = 64
) -> KVCacheConfig:
    """A full-attention group and a Gated DeltaNet group in align mode. By
    default no prefill checkpoint, as with the GDN prefill the plugin serves
    with (Triton); FlashInfer's exports one."""
    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    gdn = MambaSpec(
        block_size=BLOCK,
        shapes=((4, 8),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=int(checkpoint),
        prefill_checkpoint_alignment=BLOCK if checkpoint else None,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attention"], attention),
            KVCacheGroupSpec(["gdn"], gdn),
        ],
    )


def d3_request(
    request_id: str,
    state: list[int],
    questions: list[int],
    *,
    keyed: bool = True,
    state_size: bool = True,
    user_salt: str | None = None,
    image: tuple[str, PlaceholderRange] | None = IMAGE,
) -> Request:
    """A prefix_bidir request ``state || questions``, keyed by its whole state
    (or, ``keyed=False``, by vLLM's hashes alone) and carrying its state block
    size (unless ``state_size=False``)."""
    media = [] if image is None else [image[0]]
    salt = state_cache_salt(user_salt, state, media) if keyed else user_salt
    features = None
    if image is not None:
        features = [MultiModalFeatureSpec(None, "image", image[0], image[1])]
    return Request(
        request_id,
        state + questions,
        None,
        PoolingParams(
            task="classify",
            extra_kwargs={"d3_state_tokens": len(state)} if state_size else None,
        ),
        mm_features=features,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


class Cache:
    """vLLM's KV cache manager over a hybrid layout, and how requests ask it."""

    def __init__(self, checkpoint: bool = False) -> None:
        init_none_hash(sha256)
        config = hybrid_cache_config(checkpoint)
        self.manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )
        self.count = 0

    def request(self, state: list[int], questions: list[int], **key) -> Request:
        self.count += 1
        return d3_request(f"r{self.count}", state, questions, **key)

    def compute(self, request: Request, chunk_ends: list[int]) -> None:
        """Compute ``request`` in chunks ending at ``chunk_ends``; the manager
        caches each chunk's full blocks and its block-aligned state."""
        for end in chunk_ends:
            added = end - request.num_computed_tokens
            assert self.manager.allocate_slots(request, added) is not None
            request.num_computed_tokens = end
            self.manager.new_step_starts()

    def hit(self, request: Request, *, limited: bool = True) -> int:
        """The tokens a later request finds cached, within the state's limit
        (or, ``limited=False``, vLLM's default limit)."""
        state_tokens = request_state_tokens(request)
        assert state_tokens is not None
        limit = state_hit_limit(state_tokens, request.num_tokens)
        _, hit, _ = self.manager.get_computed_blocks(
            request, limit if limited else None
        )
        return hit


@pytest.fixture
def cache() -> Cache:
    cache = Cache()
    first = cache.request(STATE, QUESTIONS)
    cache.compute(first, [32, 48, first.num_tokens])
    return cache


def test_the_same_state_hits_its_whole_blocks(cache: Cache):
    other_questions = list(range(4000, 4030))
    assert cache.hit(cache.request(STATE, other_questions)) == 32


def test_a_state_that_shares_a_prefix_misses(cache: Cache):
    # The same first 32 tokens; the state differs after them.
    shared_prefix = STATE[:35] + [9] + STATE[36:]
    assert cache.hit(cache.request(shared_prefix, QUESTIONS)) == 0
    # Control: vLLM's hashes cover only the tokens up to each block, so keyed
    # by them alone the two states would share blocks that hold different
    # keys, values and Gated DeltaNet states.
    cache.compute(cache.request(STATE, QUESTIONS, keyed=False), [32, 48, 62])
    assert cache.hit(cache.request(shared_prefix, QUESTIONS, keyed=False)) == 32


def test_the_same_text_with_another_image_misses(cache: Cache):
    other_image = ("image-b", IMAGE[1])
    assert cache.hit(cache.request(STATE, QUESTIONS, image=other_image)) == 0
    # Control: the image lies after the last whole block, so vLLM's own keys
    # of the blocks before it do not see it.
    cache.compute(cache.request(STATE, QUESTIONS, keyed=False), [32, 48, 62])
    unkeyed = cache.request(STATE, QUESTIONS, keyed=False, image=other_image)
    assert cache.hit(unkeyed) == 32


def test_another_users_salt_misses(cache: Cache):
    assert cache.hit(cache.request(STATE, QUESTIONS, user_salt="tenant-b")) == 0
    salted = cache.request(STATE, QUESTIONS, user_salt="tenant-b")
    cache.compute(salted, [32, 48, salted.num_tokens])
    assert cache.hit(cache.request(STATE, QUESTIONS, user_salt="tenant-b")) == 32
    assert cache.hit(cache.request(STATE, QUESTIONS, user_salt="tenant-c")) == 0


def test_no_hit_reaches_past_the_state(cache: Cache):
    # The same state and the same first question up to token 48, another
    # question after it: the block [32, 48) holds that question's first
    # tokens, whose keys read the whole question.
    request = cache.request(STATE, QUESTIONS[:9] + list(range(5000, 5013)))
    assert cache.hit(request) == 32
    # Control: vLLM's own limit takes the question's block too.
    assert cache.hit(request, limited=False) == 48


def test_no_hit_reaches_a_states_end():
    # A 48-token state ends on a block boundary. A packed prompt's checkpoint
    # can sit there (vLLM's rule: the prompt's last whole block), and the
    # plugin's phases write only checkpoints strictly inside a state, so a hit
    # stays strictly inside it: here at 32, the block before.
    cache = Cache()
    state = STATE + list(range(1040, 1048))
    first = cache.request(state, QUESTIONS, image=None)
    cache.compute(first, [32, 48, first.num_tokens])
    again = cache.request(state, list(range(4000, 4010)), image=None)
    assert cache.hit(again) == 32
    # Control: a limit at the state's end takes the block that ends there.
    _, hit, _ = cache.manager.get_computed_blocks(again, len(state))
    assert hit == 48


@pytest.mark.parametrize(("checkpoint", "identical_hit"), [(False, 0), (True, 48)])
def test_one_step_caches_no_state_inside_the_state_today(
    checkpoint: bool, identical_hit: int
):
    # What the state cache must change (docs/design.md): computed in one
    # step, a prompt leaves no Gated DeltaNet state cached inside its state
    # block. Without a prefill checkpoint none is cached at all; with one it
    # sits at the prompt's last whole block, among the questions.
    cache = Cache(checkpoint)
    first = cache.request(STATE, QUESTIONS)
    cache.compute(first, [first.num_tokens])
    identical = cache.request(STATE, QUESTIONS)
    assert cache.hit(identical, limited=False) == identical_hit
    assert cache.hit(cache.request(STATE, list(range(4000, 4022)))) == 0


def test_the_key_covers_exactly_the_state_and_its_media():
    salt = state_cache_salt(None, STATE, ["image-a"])
    assert salt == state_cache_salt(None, list(STATE), ("image-a",))
    assert salt != state_cache_salt(None, STATE[:-1], ["image-a"])
    assert salt != state_cache_salt(None, STATE, [])
    assert salt != state_cache_salt(None, STATE, ["image-a", "image-a"])
    assert salt != state_cache_salt("", STATE, ["image-a"])
    # What vLLM's requests accept as a cache_salt.
    validate_cache_salt(salt)


def test_the_keys_media_are_in_prompt_order():
    # A rendered input's hashes by modality, each with its placeholder: the
    # key reads them in the order the prompt holds them, across modalities.
    def place(offset: int) -> PlaceholderRange:
        return PlaceholderRange(offset=offset, length=4)

    rendered = {
        "mm_hashes": {"image": ["image-a", "image-b"], "video": ["video-a"]},
        "mm_placeholders": {"image": [place(30), place(2)], "video": [place(10)]},
    }
    assert media_identifiers(rendered) == ["image-b", "video-a", "image-a"]
    # A text-only input has none.
    assert media_identifiers({"prompt_token_ids": [1, 2]}) == []
    assert media_identifiers({"mm_hashes": None, "mm_placeholders": None}) == []
    # A hash without its placeholder is an error, not a key that leaves a
    # medium out.
    unplaced = {"mm_hashes": {"image": ["image-a", "image-b"]}}
    with pytest.raises(ValueError, match="zip"):
        media_identifiers({**unplaced, "mm_placeholders": {"image": [place(2)]}})


def test_the_checkpoint_grid_is_the_prefix_match_unit_or_the_mamba_block():
    def cache(unit, block):
        return SimpleNamespace(prefix_match_unit=unit, mamba_block_size=block)

    assert checkpoint_grid(cache(64, 16)) == 64
    assert checkpoint_grid(cache(None, 16)) == 16
    # Align mode always sets the block: without one there is no grid.
    with pytest.raises(AssertionError) as excinfo:
        checkpoint_grid(cache(None, None))
    assert str(excinfo.value) == "align mode sets the Mamba block size"


@pytest.mark.parametrize(
    ("state_tokens", "num_tokens", "limit"),
    [(40, 62, 39), (15, 30, 14), (48, 49, 47), (48, 48, 47), (1, 2, 0)],
)
def test_the_hit_limit(state_tokens: int, num_tokens: int, limit: int):
    assert state_hit_limit(state_tokens, num_tokens) == limit


def state_cache_config(model: str, **kwargs) -> VllmConfig:
    """The engine config of ``vllm serve model --enable-prefix-caching``."""
    return EngineArgs(
        model=model, enable_prefix_caching=True, **kwargs
    ).create_engine_config()


def uncached_config(model: str, **kwargs) -> VllmConfig:
    """The engine config of ``vllm serve model --no-enable-prefix-caching``."""
    return EngineArgs(
        model=model, enable_prefix_caching=False, **kwargs
    ).create_engine_config()


@pytest.fixture
def log(monkeypatch) -> list[str]:
    """The state cache's INFO lines."""
    lines: list[str] = []
    monkeypatch.setattr(
        d3_state_cache.logger, "info", lambda msg, *a: lines.append(msg % a)
    )
    return lines


def test_prefix_caching_is_served_as_the_state_cache(
    make_checkpoint, hopper, log, monkeypatch
):
    model = make_checkpoint(weights=False)
    warnings: list[str] = []
    monkeypatch.setattr(arg_utils.logger, "warning_once", warnings.append)
    config = state_cache_config(model)
    cache, scheduler = config.cache_config, config.scheduler_config
    # vLLM's prefix caching of a hybrid model: Gated DeltaNet states on block
    # boundaries (align mode), which needs chunked prefill on ...
    assert cache.mamba_cache_mode == "align"
    assert cache.mamba_block_size == cache.block_size
    assert scheduler.enable_chunked_prefill
    # ... while a step still holds a whole prompt, which is never cut.
    assert scheduler.max_num_batched_tokens >= config.model_config.max_model_len
    assert "states cached across requests" in log[-1]
    # vLLM warns that the model does not support prefix caching; the log answers it.
    (warning,) = [w for w in warnings if "prefix caching" in w]
    assert "does not officially support prefix caching" in warning
    assert "does not officially support prefix caching" in log[-1]
    # The length from which a state is read alone: the default, or the user's.
    assert "at least 8192 tokens (d3_state_cache_min_tokens)" in log[-1]
    state_cache_config(model, additional_config={"d3_state_cache_min_tokens": 0})
    assert "at least 0 tokens (d3_state_cache_min_tokens)" in log[-1]
    # Control: with --no-enable-prefix-caching nothing is cached, and the log
    # says so.
    plain = uncached_config(model)
    assert not plain.cache_config.enable_prefix_caching
    assert plain.cache_config.mamba_cache_mode == "none"
    assert not plain.scheduler_config.enable_chunked_prefill
    assert "states are not cached across requests" in log[-1]


def test_prefix_caching_is_on_by_default(make_checkpoint, hopper, log, monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(arg_utils.logger, "warning_once", warnings.append)
    model = make_checkpoint(weights=False)
    default = EngineArgs(model=model).create_engine_config()
    asked = state_cache_config(model)
    # Served as --enable-prefix-caching is, without vLLM's warning about a
    # flag the user did not give; the log says it is the default.
    for config in (default, asked):
        assert config.cache_config.enable_prefix_caching
        assert config.cache_config.mamba_cache_mode == "align"
        assert config.scheduler_config.enable_chunked_prefill
    assert default.scheduler_config.scheduler_cls == (
        asked.scheduler_config.scheduler_cls
    )
    assert len([w for w in warnings if "prefix caching" in w]) == 1
    assert "on by default (--no-enable-prefix-caching" in log[-2]
    assert "on by default" not in log[-1]
    # Control: the causal sibling keeps vLLM's default (on for it) and its
    # scheduler.
    causal = make_checkpoint(attention_mode="causal", weights=False)
    sibling = EngineArgs(model=causal).create_engine_config()
    assert sibling.scheduler_config.scheduler_cls is None
    assert "d3_decided" not in sibling.additional_config


@pytest.mark.parametrize(
    ("additional", "reason"),
    [({"d3_state_once": False}, "one engine request per question")],
)
def test_by_default_what_the_state_cache_cannot_run_with_turns_it_off(
    make_checkpoint, hopper, log, additional, reason
):
    model = make_checkpoint(weights=False)
    default = EngineArgs(
        model=model, additional_config=dict(additional)
    ).create_engine_config()
    assert "on by default, is off" in log[-1] and reason in log[-1]
    # The engine --no-enable-prefix-caching gives.
    plain = uncached_config(model, additional_config=dict(additional))
    for field in ("enable_prefix_caching", "mamba_cache_mode", "block_size"):
        assert getattr(default.cache_config, field) == getattr(
            plain.cache_config, field
        )
    for field in ("enable_chunked_prefill", "max_num_batched_tokens", "scheduler_cls"):
        assert getattr(default.scheduler_config, field) == getattr(
            plain.scheduler_config, field
        )


@pytest.mark.parametrize(
    ("additional", "reason"),
    [({"d3_state_once": False}, "one engine request per question")],
)
def test_what_the_state_cache_cannot_run_with_is_refused(
    make_checkpoint, hopper, additional, reason
):
    model = make_checkpoint(weights=False)
    with pytest.raises(ValueError, match=f"--enable-prefix-caching .*{reason}"):
        state_cache_config(model, additional_config=dict(additional))
    # Control: without prefix caching the same settings serve.
    uncached_config(model, additional_config=dict(additional))


def test_a_gdn_prefill_whose_checkpoints_were_not_validated_is_refused(
    make_checkpoint, monkeypatch, log
):
    from vllm_d3.testing.platforms import fake_cdna3

    # vLLM puts a bf16 model's Gated DeltaNet prefill on AITER FlyDSL there.
    fake_cdna3(monkeypatch, flydsl=True)
    model = make_checkpoint(weights=False)
    default = EngineArgs(model=model, dtype="bfloat16").create_engine_config()
    assert default.additional_config["gdn_prefill_backend"] == "aiter_flydsl"
    assert not default.cache_config.enable_prefix_caching
    assert "on by default, is off" in log[-1]
    assert "write on the triton or flashinfer prefill, not on aiter_flydsl" in log[-1]
    with pytest.raises(ValueError, match="--enable-prefix-caching .*aiter_flydsl"):
        state_cache_config(model, dtype="bfloat16")


def test_a_kv_connector_is_refused(make_checkpoint, hopper, log):
    # vLLM 0.33.0 builds no KV connector on a machine without GPUs, so the
    # hook is called on a config that names one.
    model = make_checkpoint(weights=False)
    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    config = state_cache_config(model)
    d3_state_cache.select_state_cache(config)
    config.kv_transfer_config = connector
    with pytest.raises(ValueError, match="KV connector"):
        d3_state_cache.select_state_cache(config)
    # By default it turns the state cache off instead.
    default = EngineArgs(model=model).create_engine_config()
    assert default.cache_config.enable_prefix_caching
    default.kv_transfer_config = connector
    d3_state_cache.select_state_cache(default)
    assert not default.cache_config.enable_prefix_caching
    assert "on by default, is off" in log[-1] and "KV connector" in log[-1]


def test_chunked_prefill_stays_refused(make_checkpoint, hopper):
    with pytest.raises(ValueError, match="--enable-chunked-prefill"):
        state_cache_config(make_checkpoint(weights=False), enable_chunked_prefill=True)


def test_every_request_is_keyed_by_its_whole_state(make_checkpoint, hopper):
    # Through vLLM's input processor, which every entry point's requests pass
    # (the strategy's, /classify's, LLM.classify's).
    model = make_checkpoint(weights=False)
    config = state_cache_config(model, enable_prompt_embeds=True)
    processor = InputProcessor(config)

    def key(config_processor: InputProcessor, prompt: dict, s: int = 40) -> str:
        params = PoolingParams(task="classify", extra_kwargs={"d3_state_tokens": s})
        return config_processor.process_inputs(
            "r", prompt, params, supported_tasks=("classify",)
        ).cache_salt

    # Token ids inside the tiny checkpoint's vocabulary.
    first_state, questions = list(range(10, 50)), list(range(60, 82))
    state = key(processor, {"prompt_token_ids": first_state + questions})
    others = {"prompt_token_ids": first_state + list(range(90, 112))}
    assert key(processor, others) == state
    assert key(processor, {"prompt_token_ids": first_state}) == state
    shared_prefix = first_state[:35] + [9] + first_state[36:]
    assert key(processor, {"prompt_token_ids": shared_prefix + questions}) != state
    tenant = {"prompt_token_ids": first_state + questions, "cache_salt": "tenant-b"}
    assert key(processor, tenant) not in (state, "tenant-b")
    # A prompt given as embeddings is keyed by its state rows.
    embeds = torch.randn(62, config.model_config.get_hidden_size())
    other_question, other_state = embeds.clone(), embeds.clone()
    other_question[50] += 1
    other_state[20] += 1
    by_embeds = key(processor, {"prompt_embeds": embeds})
    assert key(processor, {"prompt_embeds": other_question}) == by_embeds
    assert key(processor, {"prompt_embeds": other_state}) != by_embeds
    # Control: without prefix caching a request keeps the user's salt.
    plain = uncached_config(model, enable_prompt_embeds=True)
    assert key(InputProcessor(plain), tenant) == "tenant-b"


@pytest.mark.plugin
@pytest.mark.parametrize("async_scheduling", [None, False, True])
def test_the_plugin_serves_the_state_cache_with_its_scheduler(
    make_checkpoint, hopper, async_scheduling
):
    from vllm_d3.v1.core.sched.scheduler import D3AsyncScheduler, D3Scheduler

    model = make_checkpoint(weights=False)
    config = state_cache_config(model, async_scheduling=async_scheduling)
    # The kind asked for (a pooling model's async scheduling is off unless
    # asked for; of vLLM's platforms only the CPU's turns it off afterwards).
    served = D3AsyncScheduler if async_scheduling else D3Scheduler
    assert config.scheduler_config.get_scheduler_cls() is served
    # A scheduler of the user's serves if it is one of them.
    mine = type("Mine", (D3Scheduler,), {})
    config = state_cache_config(model, scheduler_cls=mine)
    assert config.scheduler_config.get_scheduler_cls() is mine
    with pytest.raises(ValueError, match="--scheduler-cls Scheduler cannot serve"):
        state_cache_config(model, scheduler_cls=Scheduler)
    # Control: without prefix caching vLLM's own is left.
    assert uncached_config(model).scheduler_config.scheduler_cls is None


@pytest.fixture
def make_scheduler(make_checkpoint, hopper):
    """The scheduler ``vllm serve --enable-prefix-caching`` builds for the tiny
    prefix_bidir checkpoint (the plugin's, or in-tree vLLM's with the edit),
    over the hybrid cache, with a 64-token budget unless asked otherwise."""
    init_none_hash(sha256)

    def make(
        async_scheduling: bool = False,
        checkpoint: bool = False,
        budget: int = 64,
        num_blocks: int = 64,
    ) -> Scheduler:
        config = state_cache_config(
            make_checkpoint(weights=False),
            max_num_batched_tokens=budget,
            max_model_len=budget,
            block_size=BLOCK,
            async_scheduling=async_scheduling,
        )
        config.cache_config.num_gpu_blocks = num_blocks
        return config.scheduler_config.get_scheduler_cls()(
            config,
            hybrid_cache_config(checkpoint, num_blocks),
            StructuredOutputManager(config),
            block_size=BLOCK,
            hash_block_size=BLOCK,
        )

    return make


def schedule(scheduler: Scheduler, *requests: Request) -> dict[str, tuple[int, int]]:
    """One step after adding ``requests``: each new request's (cached tokens,
    scheduled tokens)."""
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    return {
        new.req_id: (new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
        for new in out.scheduled_new_reqs
    }


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_is_scheduled_whole_or_waits(make_scheduler, async_scheduling):
    scheduler = make_scheduler(async_scheduling)
    a = d3_request("a", STATE, QUESTIONS)
    b = d3_request("b", STATE, list(range(4000, 4022)), user_salt="tenant-b")
    # 62 + 62 tokens against a budget of 64: b waits for the next step.
    assert schedule(scheduler, a, b) == {"a": (0, 62)}
    assert schedule(scheduler) == {"b": (0, 62)}


def test_a_request_without_a_state_is_cut_as_vllm_cuts_it(make_scheduler):
    # Control: without a state block size, align mode cuts a at the last block
    # boundary before its end (48), and chunked prefill gives b what is left
    # of the budget.
    scheduler = make_scheduler()
    a = d3_request("a", STATE, QUESTIONS, state_size=False)
    b_questions = list(range(4000, 4022))
    b = d3_request("b", STATE, b_questions, state_size=False, user_salt="tenant-b")
    assert schedule(scheduler, a, b) == {"a": (0, 48), "b": (0, 16)}


@pytest.mark.parametrize(
    ("state_size", "scheduled"), [(True, {}), (False, {"a": (0, 34)})]
)
def test_an_encoder_cap_makes_a_prompt_wait(make_scheduler, state_size, scheduled):
    # An encoder budget too small for the image at 34: vLLM computes a
    # request without a state size (the control) up to the image; a state
    # must wait.
    scheduler = make_scheduler()
    scheduler.max_num_encoder_input_tokens = 2
    request = d3_request("a", STATE, QUESTIONS, state_size=state_size)
    assert schedule(scheduler, request) == scheduled


@pytest.mark.parametrize(("state_size", "hit"), [(True, 32), (False, 48)])
def test_a_state_read_first_is_reused_within_the_state(make_scheduler, state_size, hit):
    scheduler = make_scheduler(checkpoint=True)
    # The state alone first: vLLM's prefill checkpoint is then the state's
    # last whole block (32).
    assert schedule(scheduler, d3_request("state", STATE, [])) == {"state": (0, 40)}
    assert schedule(scheduler, d3_request("a", STATE, QUESTIONS)) == {"a": (32, 30)}
    # a's own checkpoint is its prompt's last whole block (48), among its
    # questions: only a request without a state size (the control) reuses it.
    again = d3_request("again", STATE, QUESTIONS, state_size=state_size)
    assert schedule(scheduler, again) == {"again": (hit, 62 - hit)}


def serve_pages(
    scheduler: Scheduler, steps: int, *, at_once: bool = False, round_trip: int = 0
) -> list[int]:
    """The benchmark's page workload: each of 16 clients' states (312 tokens:
    its last whole block ends at 304) read alone and its four question
    requests, sent with the read (``at_once``, as the strategy sends them) or
    ``round_trip`` steps after it ended, then its next page; each step runs
    what it schedules to its end. The tokens each question request found
    cached."""
    pages = iter(range(1_000))
    states: dict[str, list[int]] = {}
    unanswered: dict[str, int] = {}
    asked_later: list[list[str]] = [[] for _ in range(round_trip)]
    found = []

    def ask(page: str) -> None:
        for q in range(4):
            asked = list(range(20 + 10 * q, 30 + 10 * q))
            scheduler.add_request(
                d3_request(f"{page}/{q}", states[page], asked, image=None)
            )

    def read(page: int) -> None:
        name, first = f"p{page}", 10_000 * (page + 1)
        states[name] = list(range(first, first + 312))
        scheduler.add_request(d3_request(name, states[name], [], image=None))
        unanswered[name] = 4
        if at_once:
            ask(name)

    for _ in range(16):
        read(next(pages))
    for _ in range(steps):
        out = scheduler.schedule()
        ended = [new.req_id for new in out.scheduled_new_reqs]
        found += [
            new.num_computed_tokens
            for new in out.scheduled_new_reqs
            if "/" in new.req_id
        ]
        scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED)
        read_now = [r for r in ended if "/" not in r and not at_once]
        asked_later.append(read_now)
        for page in asked_later.pop(0):
            ask(page)
        for request_id in ended:
            page, _, question = request_id.partition("/")
            if question:
                unanswered[page] -= 1
                if not unanswered[page]:
                    read(next(pages))
    return found


def scheduler_module(scheduler: Scheduler):
    """The module of ``scheduler``'s rules: the plugin's, or in-tree vLLM's."""
    return sys.modules[type(scheduler).add_request.__module__]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_miss_reads_its_state_once(make_scheduler, async_scheduling):
    # A state read alone and its questions, sent together and all fitting one
    # step: vLLM schedules the read and holds the questions, whose hit would
    # fall on the blocks the read allocates, to the next step.
    scheduler = make_scheduler(async_scheduling, True, budget=2048, num_blocks=200)
    state = list(range(1_000, 1_312))
    asked = [
        d3_request(f"q{q}", state, list(range(20 + 10 * q, 30 + 10 * q)), image=None)
        for q in range(2)
    ]
    alone = d3_request("state", state, [], image=None)
    assert schedule(scheduler, alone, *asked) == {"state": (0, 312)}
    assert schedule(scheduler) == {"q0": (304, 18), "q1": (304, 18)}
    # Control: questions on another state, never read, go at once, each
    # reading its state.
    scheduler = make_scheduler(async_scheduling, True, budget=2048, num_blocks=200)
    other = list(range(5_000, 5_312))
    elsewhere = [d3_request(f"e{q}", other, [20] * 10, image=None) for q in range(2)]
    alone = d3_request("state", state, [], image=None)
    assert schedule(scheduler, alone, *elsewhere) == {
        "state": (0, 312),
        "e0": (0, 322),
        "e1": (0, 322),
    }


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_questions_sent_with_their_states_read_find_it_cached(
    make_scheduler, async_scheduling
):
    # A KV cache of 60 blocks holds about three states; 16 clients' states
    # wait to be read. Questions queued with their state's read alone are
    # scheduled once it is (vLLM caches blocks as it schedules them) and take
    # its blocks (304 tokens) before other reads evict them.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=60)
    found = serve_pages(scheduler, steps=40, at_once=True)
    assert set(found) == {304}, found
    # Control: sent one step after the read ended (the front end's round
    # trip), the questions find the state evicted by the reads scheduled in
    # between and read it again, and fewer are answered.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=60)
    after_a_round_trip = serve_pages(scheduler, steps=40, round_trip=1)
    assert after_a_round_trip.count(0) > 10
    assert len(after_a_round_trip) < len(found) / 1.5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_states_questions_go_ahead_of_other_states_reads(
    make_scheduler, monkeypatch, async_scheduling
):
    # A KV cache of 60 blocks holds a few states; 16 clients' states wait to
    # be read. Each state's questions take its cached blocks (304 tokens)
    # before the reads queued ahead of them evict those.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=60)
    found = serve_pages(scheduler, steps=40)
    assert set(found) == {304}, found
    # Control: in vLLM's own order, questions wait behind other states' reads,
    # many find their state evicted and read it again, and fewer are answered.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=60)
    monkeypatch.setattr(
        scheduler_module(scheduler), "cached_states_first", lambda *_: None
    )
    found_in_vllms_order = serve_pages(scheduler, steps=40)
    assert found_in_vllms_order.count(0) > 10
    assert len(found_in_vllms_order) < len(found) / 1.5


def steps_until_read(scheduler: Scheduler, hits_per_step: int) -> int | None:
    """A cached state (312 tokens), then a read of another state (400 tokens)
    while ``hits_per_step`` questions on the cached one (18 tokens each to
    compute) come every step: the step that schedules the read (``None``
    within 10)."""
    cached = list(range(1_000, 1_312))
    assert schedule(scheduler, d3_request("cached", cached, [], image=None))
    scheduler.finish_requests(["cached"], RequestStatus.FINISHED_STOPPED)
    scheduler.add_request(d3_request("read", list(range(5_000, 5_400)), [], image=None))
    for step in range(10):
        for q in range(hits_per_step):
            asked = [20 + q] * 10
            scheduler.add_request(d3_request(f"{step}/{q}", cached, asked, image=None))
        scheduled = list(scheduler.schedule().num_scheduled_tokens)
        scheduler.finish_requests(scheduled, RequestStatus.FINISHED_STOPPED)
        if "read" in scheduled:
            return step
    return None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hits_hold_a_state_read_back_no_longer_than_their_step(
    make_scheduler, monkeypatch, async_scheduling
):
    # Seven hits a step (126 tokens) and a read of 400 overfill a step of 512:
    # six go ahead of the read, which shares the first step with them.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=200)
    assert steps_until_read(scheduler, hits_per_step=7) == 0
    # Control: every hit ahead of the read, whatever the step holds, and the
    # read waits for as long as hits keep coming.
    scheduler = make_scheduler(async_scheduling, True, budget=512, num_blocks=200)
    module = scheduler_module(scheduler)
    ahead_of_any = module.cached_states_first
    monkeypatch.setattr(
        module,
        "cached_states_first",
        lambda *args: ahead_of_any(*args[:3], step_tokens=10**9),
    )
    assert steps_until_read(scheduler, hits_per_step=7) is None


def test_align_mode_takes_the_platforms_media_rule(make_checkpoint, hopper):
    # CUDA and ROCm turn chunked media input off for a prefix-LM model; align
    # mode asks for it (to end a chunk on a block inside a media item), which
    # the state cache's scheduler never does: its engine starts.
    config = state_cache_config(make_checkpoint(weights=False))
    config.scheduler_config.disable_chunked_mm_input = True
    config.validate_block_size()
    assert config.scheduler_config.disable_chunked_mm_input
    # Control: the causal sibling with prefix caching is held to it.
    causal = state_cache_config(make_checkpoint(attention_mode="causal", weights=False))
    causal.scheduler_config.disable_chunked_mm_input = True
    with pytest.raises(AssertionError, match="Chunked MM input is required"):
        causal.validate_block_size()


def test_block_size_check_reads_only_its_own_fields_on_other_configs():
    # vLLM's tests call the check on stand-ins that carry only the fields it
    # reads (no model config): the plugin's wrapper reads no more of them, and
    # the check raises (or passes) as it would without the plugin.
    def stand_in(mamba_cache_mode: str, interleave: int) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=16, mamba_cache_mode=mamba_cache_mode
            ),
            parallel_config=SimpleNamespace(
                decode_context_parallel_size=2,
                cp_kv_cache_interleave_size=interleave,
            ),
            scheduler_config=SimpleNamespace(disable_chunked_mm_input=False),
            kv_transfer_config=None,
        )

    VllmConfig.validate_block_size(stand_in("align", 4))
    with pytest.raises(AssertionError, match="divisible by cp_kv_cache_interleave"):
        VllmConfig.validate_block_size(stand_in("none", 3))
