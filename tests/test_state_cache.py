# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The state cache's key and hit limit on vLLM 0.33.0's real KV cache manager.

A hybrid cache (a full-attention group and a Gated DeltaNet group in Mamba
"align" mode, as prefix caching gives Qwen3.5) holds a first request's blocks;
later requests ask it for their longest hit. The first request is computed in
chunks that end at 32 and 48, so that the Gated DeltaNet states there are
cached: the stand-in for the state cache's checkpoint at the state's last
whole block (docs/state-cache.md), which one D3 step does not take today.
The controls ask without the key or without the limit: vLLM's own hashing
then shares blocks whose contents differ.
"""

import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.pooling_params import PoolingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

from vllm_d3.v1.core.d3_state_cache import state_cache_salt, state_hit_limit

BLOCK = 16
#: The first request: a 40-token state (its last whole block ends at 32)
#: and two questions; an image at the state's end, after that block.
STATE = list(range(1000, 1040))
QUESTIONS = list(range(2000, 2012)) + list(range(3000, 3010))
IMAGE = ("image-a", PlaceholderRange(offset=34, length=4))


def _features(image: tuple[str, PlaceholderRange] | None):
    if image is None:
        return None
    identifier, position = image
    return [MultiModalFeatureSpec(None, "image", identifier, position)]


class Cache:
    """vLLM's KV cache manager over a hybrid layout, and how requests ask it."""

    def __init__(self, checkpoint: bool = False) -> None:
        init_none_hash(sha256)
        attention = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16
        )
        # By default no prefill checkpoint, as with the GDN prefill the plugin
        # serves with (Triton); FlashInfer's exports one.
        gdn = MambaSpec(
            block_size=BLOCK,
            shapes=((4, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=int(checkpoint),
            prefill_checkpoint_alignment=BLOCK if checkpoint else None,
        )
        config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["attention"], attention),
                KVCacheGroupSpec(["gdn"], gdn),
            ],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.count = 0

    def request(
        self,
        state: list[int],
        questions: list[int],
        *,
        keyed: bool = True,
        user_salt: str | None = None,
        image: tuple[str, PlaceholderRange] | None = IMAGE,
    ) -> Request:
        """A prefix_bidir request ``state || questions``, keyed by its whole
        state (or, ``keyed=False``, by vLLM's hashes alone)."""
        self.count += 1
        media = [] if image is None else [image[0]]
        salt = state_cache_salt(user_salt, state, media) if keyed else user_salt
        return Request(
            f"r{self.count}",
            state + questions,
            None,
            PoolingParams(task="classify"),
            mm_features=_features(image),
            cache_salt=salt,
            block_hasher=self.hasher,
        )

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
        limit = state_hit_limit(len(STATE), request.num_tokens, BLOCK)
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
    other_tail = STATE + QUESTIONS[:9] + list(range(5000, 5013))
    request = cache.request(STATE, other_tail[len(STATE) :])
    assert cache.hit(request) == 32
    # Control: vLLM's own limit takes the question's block too.
    assert cache.hit(request, limited=False) == 48


@pytest.mark.parametrize(("checkpoint", "identical_hit"), [(False, 0), (True, 48)])
def test_one_step_caches_no_state_inside_the_state_today(
    checkpoint: bool, identical_hit: int
):
    # What the state cache must change (docs/state-cache.md): computed in one
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
    # vLLM's request validation: at most 128 characters, none of "@/\\" or NUL.
    assert len(salt) <= 128 and not set(salt) & set("@/\\\0")


@pytest.mark.parametrize(
    ("state_tokens", "num_tokens", "limit"),
    [(40, 62, 32), (32, 62, 32), (15, 30, 0), (48, 49, 48), (48, 48, 47)],
)
def test_the_hit_limit(state_tokens: int, num_tokens: int, limit: int):
    assert state_hit_limit(state_tokens, num_tokens, BLOCK) == limit
