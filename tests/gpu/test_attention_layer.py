"""GPU: the dense-piece attention against ranged Triton and a PyTorch reference.

A full-attention layer at d3-turbo's head shape (24 query / 4 KV heads,
head_dim 256, bf16) is built by vLLM for a prefix_bidir checkpoint, with the
plugin's config hook, so its backend is the D3 composite
(``vllm_d3.testing.attention_layer``), once per dense-piece kernel the GPU
runs. On random queries and a random paged KV cache, the dense pieces, the
ranged Triton child and a float32 PyTorch attention whose mask is written from
the definition must agree, for single prompts, mixed and packed batches; a
prompt computed past its state (c >= s) must go to ranged Triton, one whose
computed tokens lie inside its state (a state cache hit, 0 < c < s) to the
dense pieces, over those tokens' keys read from the paged cache.
"""

import pytest

from vllm_d3.testing.attention_layer import FullAttentionLayer, Prompt
from vllm_d3.v1.attention.backends import d3_prefix_bidir
from vllm_d3.v1.attention.backends.d3_dense_kernels import (
    KERNEL_NAMES,
    kernel_unavailable,
)
from vllm_d3.v1.attention.backends.d3_kernel_check import (
    check_dense_kernel,
    check_kernels,
)

pytestmark = pytest.mark.gpu

#: bf16 inputs, fp32 softmax: |output| is about 0.1-1 here.
TOLERANCE = 2e-2
BLOCK_SIZE = 800  # vLLM's block size for d3-turbo's hybrid KV cache here

BATCHES = {
    "one token": [Prompt(1, 1)],
    "state only": [Prompt(300, 300)],
    "one state token": [Prompt(1, 200)],
    "state across blocks": [Prompt(1700, 1850)],
    # The state pass then has one query per row (its bound is kept above 1).
    "one question token per row": [Prompt(30, 31), Prompt(7, 8), Prompt(500, 501)],
    "mixed batch": [
        Prompt(300, 450),
        Prompt(1, 37),
        Prompt(1000, 1000),
        Prompt(800, 801),
        Prompt(2000, 2150),
    ],
    "partly computed, c < s": [Prompt(900, 1100, computed=400)],
    "partly computed, c >= s": [Prompt(500, 800, computed=600)],
    "mixed, some computed": [Prompt(600, 700, computed=100), Prompt(50, 900)],
    # The state read once: each question block sees the state and itself only.
    "packed": [Prompt(1700, 2150, question_ends=(1850, 1900, 2150))],
    # A state cache hit: the packed row's first state tokens are cached.
    "packed after a hit": [
        Prompt(1700, 2150, computed=800, question_ends=(1850, 1900, 2150))
    ],
    "packed beside one question": [
        Prompt(300, 450),
        Prompt(900, 1300, question_ends=(1000, 1001, 1150, 1300)),
        Prompt(20, 90, question_ends=(50, 90)),
    ],
}
#: Batches that only the dense path runs (ranged Triton cannot express them).
PACKED = {"packed", "packed after a hit", "packed beside one question"}
#: Batches with a prompt computed past its state: ranged Triton serves them.
PAST_THE_STATE = {
    n for n in BATCHES if any(p.computed >= p.state_tokens for p in BATCHES[n])
}


@pytest.fixture(scope="module", params=KERNEL_NAMES)
def layer(request, tmp_path_factory):
    from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint

    kernel = request.param
    if (reason := kernel_unavailable(kernel)) is not None:
        pytest.skip(f"{kernel}: {reason}")
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("turbo"), shape="d3-turbo", weights=False
    )
    layer = FullAttentionLayer(
        str(path),
        BLOCK_SIZE,
        max_prompt_len=4096,
        max_batch_tokens=8192,
        num_blocks=32,
        kernel=kernel,
    )
    assert layer.kernel == kernel
    return layer


@pytest.mark.parametrize("name", BATCHES)
def test_dense_pieces_match_ranged_triton_and_the_reference(layer, name):
    prompts = BATCHES[name]
    path = layer.routed_path(prompts)
    assert path == ("ranged" if name in PAST_THE_STATE else "dense")
    query = layer.random_query(prompts)
    keys_values = layer.fresh_keys_values(prompts)
    expected = layer.reference(prompts, query)
    if path == "dense":
        dense = layer.forward(query, layer.metadata(prompts, "dense"), keys_values)
        assert (dense.float() - expected.float()).abs().max() < TOLERANCE
    if name in PACKED:
        return
    ranged = layer.forward(query, layer.metadata(prompts, "ranged"), keys_values)
    assert (ranged.float() - expected.float()).abs().max() < TOLERANCE


def test_packed_questions_do_not_see_each_other(layer):
    # The same packed prompt read as one question (every query after the state
    # sees all keys) is far from the packed reference: the second question
    # would read the first, which is longer than the state.
    packed = [Prompt(200, 2150, question_ends=(1000, 2150))]
    query = layer.random_query(packed)
    expected = layer.reference(packed, query)
    one_question = [Prompt(200, 2150)]
    wrong = layer.forward(
        query,
        layer.metadata(one_question, "dense"),
        layer.fresh_keys_values(one_question),
    )
    assert (wrong.float() - expected.float()).abs().max() > 10 * TOLERANCE


def test_the_check_sees_a_wrong_mask(layer):
    # The same batch without ranges is plain causal Triton: far from
    # the prefix_bidir reference, so the comparisons above can fail.
    prompts = [Prompt(1700, 1850)]
    query = layer.random_query(prompts)
    expected = layer.reference(prompts, query)
    common = layer.common_metadata(prompts)
    common.mm_req_doc_ranges = None
    causal = layer.builder.build(0, common)
    wrong = layer.forward(query, causal, layer.fresh_keys_values(prompts))
    assert (wrong.float() - expected.float()).abs().max() > 10 * TOLERANCE


def test_the_served_layer_has_the_d3_backend(layer):
    # vLLM's selector, given the config the D3 hook made, chose the
    # composite for the full-attention kind; the reference needs nothing else.
    attention = layer.config.attention_config
    member = attention.backend_per_kind["full_attention"]
    assert member.name == d3_prefix_bidir.REGISTRY_MEMBER


def test_the_start_up_check_passes_the_kernel(layer):
    assert check_dense_kernel(layer.kernel) is None


def test_the_start_up_check_runs_in_a_process_of_its_own():
    present = [k for k in KERNEL_NAMES if kernel_unavailable(k) is None]
    assert check_kernels(present) == (present[0], [])
