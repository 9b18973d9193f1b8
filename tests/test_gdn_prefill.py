"""The Gated DeltaNet prefill kernel a prefix_bidir checkpoint is served on.

The config hook follows vLLM 0.33.0's own resolution, seen through a GPU faked
at vLLM's ``Platform`` (``testing.platforms``): FlashInfer's on Hopper and
Blackwell where the checkpoint's GDN heads are 128, Triton/FLA where they are
not (with the reason), the user's ``--gdn-prefill-backend`` first, and vLLM's
choice on ROCm. Every process reads the kernel the hook wrote.
"""

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_d3.testing.platforms import fake_cdna3, fake_gpu

#: GDN heads of 64, which FlashInfer's SM90 kernel does not take.
HEADS_64 = {"text_config": {"linear_key_head_dim": 64, "linear_value_head_dim": 64}}


def served_kernel(path: str, **kwargs) -> str:
    config = EngineArgs(model=path, max_model_len=4096, **kwargs)
    return config.create_engine_config().additional_config["gdn_prefill_backend"]


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("Hopper", "flashinfer"),
        ("Blackwell", "flashinfer"),
        ("Ampere/Ada", "triton"),
        ("another CUDA GPU", "triton"),
    ],
)
def test_vllm_choice_serves_where_it_runs_the_checkpoint(
    make_checkpoint, monkeypatch, hook_log, family, expected
):
    fake_gpu(monkeypatch, family)
    assert served_kernel(make_checkpoint(weights=False)) == expected
    assert f"Gated DeltaNet prefill on {expected} (vLLM's choice on this GPU" in (
        "\n".join(hook_log)
    )


def test_heads_flashinfer_does_not_take_get_triton_with_the_reason(
    make_checkpoint, monkeypatch, hook_log
):
    fake_gpu(monkeypatch, "Hopper")
    path = make_checkpoint(weights=False)
    assert served_kernel(path, hf_overrides=HEADS_64) == "triton"
    assert (
        "Gated DeltaNet prefill on triton (vLLM's choice on this GPU, FlashInfer, "
        "takes head dim 128 only, and this checkpoint's are [64, 64]"
    ) in "\n".join(hook_log)


@pytest.mark.parametrize("family", ["Hopper", "Ampere/Ada"])
def test_the_users_kernel_wins(make_checkpoint, monkeypatch, hook_log, family):
    fake_gpu(monkeypatch, family)
    path = make_checkpoint(weights=False)
    assert served_kernel(path, gdn_prefill_backend="triton") == "triton"
    assert "--gdn-prefill-backend triton was chosen" in "\n".join(hook_log)


def test_flashinfer_asked_for_heads_it_does_not_take_stops_start_up(
    make_checkpoint, monkeypatch
):
    fake_gpu(monkeypatch, "Hopper")
    with pytest.raises(ValueError, match="--gdn-prefill-backend flashinfer cannot"):
        served_kernel(
            make_checkpoint(weights=False),
            gdn_prefill_backend="flashinfer",
            hf_overrides=HEADS_64,
        )


@pytest.mark.parametrize(
    ("flydsl", "expected"), [(True, "aiter_flydsl"), (False, "triton")]
)
def test_rocm_gets_vllm_choice(
    make_checkpoint, monkeypatch, hook_log, flydsl, expected
):
    fake_cdna3(monkeypatch, flydsl)
    # FlyDSL takes bf16 models only.
    path = make_checkpoint(weights=False)
    assert served_kernel(path, dtype="bfloat16") == expected
    assert f"Gated DeltaNet prefill on {expected} (vLLM's choice" in (
        "\n".join(hook_log)
    )


def test_other_modes_keep_vllm_resolution(make_checkpoint, monkeypatch):
    fake_gpu(monkeypatch, "Hopper")
    path = make_checkpoint(attention_mode="causal", weights=False)
    config = EngineArgs(model=path, max_model_len=4096).create_engine_config()
    assert "gdn_prefill_backend" not in config.additional_config
