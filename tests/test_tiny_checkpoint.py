"""Tests of the tiny D3 package factory, on CPU: its tokenizer, chat template,
weights and readout through transformers, and vLLM 0.33.0's own (plugin-free)
D3 config contract."""

from __future__ import annotations

import itertools
import json
import os
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_d3.testing import tiny_checkpoint
from vllm_d3.testing.tiny_checkpoint import write_tiny_checkpoint
from vllm_d3.testing.tiny_checkpoint.__main__ import main

SYSTEM = "You are a decision engine."
ASSISTANT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("d3") / "tiny", attention_mode="causal"
    )


@pytest.fixture(scope="module")
def tokenizer(package: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package)


@pytest.fixture(scope="module")
def model(package: Path):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    return Qwen3_5Model.from_pretrained(package, dtype=torch.float16).eval()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def d3_user_turn(codes: list[str], state: str, options: list[str]) -> str:
    return "\n".join(
        [
            "State:",
            state,
            "",
            "Question:",
            "Which team should handle this ticket?",
            "",
            "Options:",
            *(f"{code}: {text}" for code, text in zip(codes, options, strict=False)),
            "",
            "Reply with only the code of the best option.",
        ]
    )


def render(tokenizer, content) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def code_probabilities(
    package: Path, model, tokenizer, state: str, mask: str = "causal"
) -> torch.Tensor:
    """P(option) over four options at the checkpoint's temperature, with the
    full-attention layers causal, or bidirectional over the state ("prefix")."""
    decision = read_json(package / "decision_config.json")
    options = ["billing", "shipping", "technical support", "sales"]
    text = render(tokenizer, d3_user_turn(decision["codes"], state, options))
    ids = tokenizer.encode(text, add_special_tokens=False)
    state_end = len(
        tokenizer.encode(
            text[: text.index(state) + len(state)], add_special_tokens=False
        )
    )
    allowed = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    if mask == "prefix":
        allowed[:state_end, :state_end] = True
    with torch.no_grad():
        hidden = model(
            input_ids=torch.tensor([ids]),
            attention_mask={
                "full_attention": allowed[None, None],
                "linear_attention": None,
            },
        ).last_hidden_state[0, -1]
    readout = load_file(package / "readout.safetensors")["weight"]
    logits = readout[:4] @ hidden.float()
    return torch.softmax(logits / decision["temperature"], dim=-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


def test_package_files(package: Path) -> None:
    names = {p.name for p in package.iterdir()}
    assert names == {
        "config.json",
        "decision_config.json",
        "readout.safetensors",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "MODEL_MANIFEST.json",
    }
    manifest = read_json(package / "MODEL_MANIFEST.json")
    assert set(manifest["files_sha256"]) == names - {"MODEL_MANIFEST.json"}
    assert manifest["modalities"] == ["text"]


def test_config_shape(package: Path, tokenizer) -> None:
    config = read_json(package / "config.json")
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5Model"]
    assert config["model_type"] == "qwen3_5"
    assert text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (text["hidden_size"], text["head_dim"]) == (256, 256)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (2, 1)
    assert text["attn_output_gate"] is True
    rope = text["rope_parameters"]
    assert sum(rope["mrope_section"]) == text["head_dim"] * 0.25 / 2
    assert rope["mrope_interleaved"] is True
    assert text["vocab_size"] == len(tokenizer)
    for key, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert config[key] == tokenizer.convert_tokens_to_ids(token)
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]


def test_codes_are_single_tokens_after_the_assistant_prefix(
    package: Path, tokenizer
) -> None:
    letters = string.ascii_uppercase
    candidates = [*letters, *(a + b for a, b in itertools.product(letters, letters))]
    prefix = tokenizer.encode(ASSISTANT, add_special_tokens=False)
    kept: list[str] = []
    ids: list[int] = []
    for code in candidates:
        alone = tokenizer.encode(code, add_special_tokens=False)
        after = tokenizer.encode(ASSISTANT + code, add_special_tokens=False)
        if len(alone) == 1 and after == prefix + alone and alone[0] not in ids:
            kept.append(code)
            ids.append(alone[0])
    decision = read_json(package / "decision_config.json")
    assert decision["codes"] == kept[:255]
    assert decision["token_ids"] == ids[:255]
    # The rule has something to skip: two-letter codes ending in Q are split.
    assert "AQ" not in decision["codes"]
    assert len(tokenizer.encode("AQ", add_special_tokens=False)) == 2


def test_merges_cross_whitespace(package: Path, tokenizer) -> None:
    for text in ["\n\n", " \n", "  ", "\n\n\n", "    "]:
        assert len(tokenizer.encode(text, add_special_tokens=False)) == 1, repr(text)
    vocab = read_json(package / "tokenizer.json")["model"]["vocab"]
    # Byte-level symbols: Ġ is a space, Ċ a newline.
    assert any(len(t) > 1 and t[0] == "Ġ" and t[1:].isalpha() for t in vocab)
    assert any(t.count("Ċ") > 1 for t in vocab)


def test_tokenizer_json_agrees_with_autotokenizer(package: Path, tokenizer) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(package / "tokenizer.json"))
    decision = read_json(package / "decision_config.json")
    text = render(
        tokenizer,
        d3_user_turn(decision["codes"], '{"a": 1, "b": "今天"}  \n\n', ["x", "y"]),
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template(tokenizer) -> None:
    assert render(tokenizer, "the text") == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\nthe text<|im_end|>\n{ASSISTANT}"
    )
    media = [
        {"type": "text", "text": "the text"},
        {"type": "image"},
        {"type": "video"},
        {"type": "image"},
    ]
    assert render(tokenizer, media) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE}{VIDEO}{IMAGE}the text<|im_end|>\n{ASSISTANT}"
    )
    thinking = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True
    )
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")


def test_weight_names_are_those_save_pretrained_writes(
    package: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    reference = Qwen3_5Model(AutoConfig.from_pretrained(package))
    reference.save_pretrained(tmp_path)
    with (
        safe_open(tmp_path / "model.safetensors", "pt") as expected,
        safe_open(package / "model.safetensors", "pt") as written,
    ):
        assert sorted(written.keys()) == sorted(expected.keys())
        for name in expected.keys():  # noqa: SIM118 (safe_open is no dict)
            assert written.get_slice(name).get_shape() == (
                expected.get_slice(name).get_shape()
            )
            assert written.get_slice(name).get_dtype() == "F16"
        assert any(name.startswith("visual.") for name in written.keys())  # noqa: SIM118


def test_large_backbones_are_sharded(
    tmp_path: Path, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    monkeypatch.setattr(tiny_checkpoint, "MAX_SHARD_BYTES", 4 * 1024**2)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", attention_mode="causal")
    index = read_json(sharded / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert sorted(p.name for p in sharded.glob("model*.safetensors")) == shards
    loaded = Qwen3_5Model.from_pretrained(sharded, dtype=torch.float16).state_dict()
    single = load_file(package / "model.safetensors")
    assert loaded.keys() == single.keys()
    assert all(torch.equal(loaded[name], single[name]) for name in single)


def test_readout(package: Path) -> None:
    with safe_open(package / "readout.safetensors", "pt") as f:
        assert list(f.keys()) == ["weight"]
        readout = f.get_tensor("weight")
    assert readout.dtype == torch.float32
    assert readout.shape == (255, 256)


def test_readout_is_decisive_and_reads_the_context(
    package: Path, model, tokenizer
) -> None:
    states = [
        "The customer says the parcel arrived with a broken lid.",
        "Invoice 1042 was paid twice by mistake.",
        "I cannot log in since the update.",
    ]
    causal = [code_probabilities(package, model, tokenizer, s) for s in states]
    prefix = [
        code_probabilities(package, model, tokenizer, s, "prefix") for s in states
    ]
    # Far from uniform (0.25 each).
    assert all(p.max() > 0.4 for p in causal)
    # The state changes the answer, and so does the attention mask.
    assert (
        max(total_variation(p, q) for p, q in itertools.combinations(causal, 2)) > 0.2
    )
    assert max(total_variation(p, q) for p, q in zip(causal, prefix, strict=True)) > 0.1


def test_vision_tower_runs_and_images_matter(package: Path, model) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(package)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    text = render(
        processor.tokenizer, [{"type": "image"}, {"type": "text", "text": "x"}]
    )
    last = []
    for color in [(200, 30, 30), (20, 40, 220)]:
        inputs = processor(
            text=[text], images=[Image.new("RGB", (64, 48), color)], return_tensors="pt"
        )
        # Resized up to 65,536 pixels at least: 14 x 20 patches, merged 2 x 2.
        assert inputs["image_grid_thw"].tolist() == [[1, 14, 20]]
        image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert (inputs["input_ids"] == image_token).sum() == 70
        with torch.no_grad():
            last.append(model(**inputs).last_hidden_state[0, -1].float())
    assert not torch.allclose(last[0], last[1], atol=1e-2)


def test_decision_config_fields_and_overrides(tmp_path: Path) -> None:
    package = write_tiny_checkpoint(
        tmp_path / "p",
        validated_length=8192,
        temperature=1.25,
        decision_overrides={"prompt_layout": "header-v1", "pooling": "mean"},
        weights=False,
    )
    decision = read_json(package / "decision_config.json")
    assert decision["format_version"] == 1
    assert decision["format_id"] == "d3-code-readout-v1"
    assert decision["attention_mode"] == "prefix_bidir"
    assert decision["temperature"] == 1.25
    assert decision["validated_length"] == 8192
    assert decision["prompt_layout"] == "header-v1"
    assert decision["pooling"] == "mean"
    assert decision["max_length"] is None
    assert decision["readout_dtype"] == "float32"
    assert len(decision["codes"]) == len(set(decision["token_ids"])) == 255
    assert not (package / "model.safetensors").exists()
    plain = read_json(
        write_tiny_checkpoint(tmp_path / "q", weights=False) / "decision_config.json"
    )
    assert "validated_length" not in plain


def test_same_seed_same_bytes(tmp_path: Path, package: Path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", attention_mode="causal")
    other = write_tiny_checkpoint(tmp_path / "other", attention_mode="causal", seed=1)
    for path in package.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    assert (other / "tokenizer.json").read_bytes() == (
        package / "tokenizer.json"
    ).read_bytes()
    for name in ["model.safetensors", "readout.safetensors"]:
        assert (other / name).read_bytes() != (package / name).read_bytes()


def test_refuses_a_non_empty_directory_and_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "stale").write_text("x")
    with pytest.raises(FileExistsError):
        write_tiny_checkpoint(tmp_path, weights=False)
    with pytest.raises(ValueError, match="attention_mode"):
        write_tiny_checkpoint(tmp_path / "a", attention_mode="bidir")
    with pytest.raises(ValueError, match="temperature"):
        write_tiny_checkpoint(tmp_path / "b", temperature=0.0)


def test_d3_turbo_shape(tmp_path: Path) -> None:
    package = write_tiny_checkpoint(
        tmp_path / "turbo", shape="d3-turbo", vision=True, weights=False
    )
    config = read_json(package / "config.json")
    text, vision = config["text_config"], config["vision_config"]
    assert len(text["layer_types"]) == 64
    assert text["layer_types"].count("full_attention") == 16
    assert (text["hidden_size"], text["intermediate_size"]) == (5120, 17408)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (24, 4)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (16, 48)
    assert text["vocab_size"] == 248320
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (
        27,
        1152,
        5120,
    )
    manifest = read_json(package / "MODEL_MANIFEST.json")
    # The loaded parameter count published for d3 (Qwen3.5-27B + readout).
    assert manifest["parameters"]["loaded"] == 26_086_635_760
    assert manifest["modalities"] == ["text", "image", "video"]
    assert not (package / "model.safetensors").exists()
    with safe_open(package / "readout.safetensors", "pt") as f:
        assert f.get_slice("weight").get_shape() == [255, 5120]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    args = [str(out), "--attention-mode", "noncausal_full_attention", "--no-weights"]
    args += ["--decision-field", 'temperature_by_questions={"max_questions": [1, 4]}']
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    decision = read_json(out / "decision_config.json")
    assert decision["attention_mode"] == "noncausal_full_attention"
    assert decision["temperature_by_questions"] == {"max_questions": [1, 4]}
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--decision-field", "x=not json"])


_UNMODIFIED_VLLM_PROBE = textwrap.dedent(
    """
    import json, sys
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.multimodal.processing.processor import TimingContext
    from vllm.tokenizers import get_tokenizer

    result = {}
    for mode, path in json.loads(sys.argv[1]).items():
        try:
            config = ModelConfig(model=path, runner="pooling", max_model_len=4096)
        except Exception as e:
            result[mode] = {"error": str(e)}
            continue
        result[mode] = {
            "architecture": config.architecture,
            "is_causal": [config.hf_config.is_causal, config.hf_text_config.is_causal],
            "labels": len(config.hf_config.id2label),
        }
        if mode == "causal":
            tokenizer = get_tokenizer(path)
            user = [{"type": "image"}, {"type": "text", "text": "T"}]
            prompt = tokenizer.apply_chat_template(
                [{"role": "system", "content": "S"}, {"role": "user", "content": user}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            processor = MULTIMODAL_REGISTRY.create_processor(config)
            image = Image.new("RGB", (64, 48))
            items = processor.info.parse_mm_data({"image": [image]})
            inputs = ProcessorInputs(
                prompt=tokenizer.encode(prompt, add_special_tokens=False),
                mm_data_items=items,
            )
            out = processor.apply(inputs, timing_ctx=TimingContext(enabled=False))
            result["chat"] = prompt
            result["image_tokens"] = out["prompt_token_ids"].count(
                config.hf_config.image_token_id
            )
    result["plugin_imported"] = "vllm_d3" in sys.modules
    print("RESULT " + json.dumps(result))
    """
)


def test_unmodified_vllm_config_contract(tmp_path: Path) -> None:
    """vLLM 0.33.0 without plugins: causal and noncausal packages resolve to
    its D3 class with the right causality; prefix_bidir is refused."""
    paths = {
        mode: str(
            write_tiny_checkpoint(tmp_path / mode, attention_mode=mode, weights=False)
        )
        for mode in ["causal", "noncausal_full_attention", "prefix_bidir"]
    }
    env = {**os.environ, "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _UNMODIFIED_VLLM_PROBE, json.dumps(paths)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["plugin_imported"] is False
    for mode, is_causal in [("causal", True), ("noncausal_full_attention", False)]:
        assert result[mode] == {
            "architecture": "D3ForSequenceClassification",
            "is_causal": [is_causal, is_causal],
            "labels": 255,
        }
    assert (
        "unsupported decision_config.json attention_mode 'prefix_bidir'"
        in result["prefix_bidir"]["error"]
    )
    assert result["chat"] == (
        f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n{IMAGE}T<|im_end|>\n"
        f"{ASSISTANT}"
    )
    # As through transformers: 14 x 20 patches, merged 2 x 2.
    assert result["image_tokens"] == 70
