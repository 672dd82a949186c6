"""Checkpoint loading: ModelInfo, dtypes, hub ids, and clear errors for bad folders."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import (
    ENDOFTEXT_ID,
    IM_END_ID,
    LLAMA3_ROPE,
    TOKENIZER_SIZE,
    build_tokenizer,
    make_tiny_checkpoint,
    tiny_checkpoint,
)
from safetensors.torch import load_file, save_file

from thinkspec.models import load_model
from thinkspec.models.config import DecoderConfig
from thinkspec.models.loader import resolve_dtype


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A private copy of a tiny Qwen3 checkpoint that the test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen3", tied=False), dst)
    return dst


def test_model_info() -> None:
    path = tiny_checkpoint("qwen3", tied=False)
    model, info = load_model(str(path))
    assert info.architecture == "Qwen3ForCausalLM"
    assert (info.num_layers, info.num_attention_heads, info.num_kv_heads) == (2, 4, 2)
    assert (info.head_dim, info.hidden_size, info.vocab_size) == (32, 64, TOKENIZER_SIZE)
    assert info.max_position_embeddings == 512
    assert info.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]  # generation_config first, deduplicated
    assert (info.temperature, info.top_p, info.top_k) == (0.6, 0.95, 20)
    assert info.tie_word_embeddings is False and info.path == path.resolve()
    assert info.dtype == torch.float32  # "auto" on CPU
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_tied_embeddings_share_storage() -> None:
    model, info = load_model(tiny_checkpoint("qwen2", tied=True))
    assert info.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(("name", "expected"), [("bf16", torch.bfloat16), ("float16", torch.float16),
                                                (torch.float32, torch.float32)])  # fmt: skip
def test_explicit_dtype_kept_on_cpu(name: str | torch.dtype, expected: torch.dtype) -> None:
    model, info = load_model(tiny_checkpoint("llama", tied=False), dtype=name)
    assert info.dtype == expected
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_auto_dtype_reads_config() -> None:
    path = tiny_checkpoint("qwen3", tied=True, dtype=torch.bfloat16)
    _, info = load_model(path)
    assert info.dtype == torch.float32  # CPU "auto" is float32 whatever the checkpoint says
    assert resolve_dtype("auto", "bfloat16", torch.device("meta")) == torch.bfloat16
    assert resolve_dtype("auto", None, torch.device("meta")) == torch.float32
    half, _ = load_model(path, dtype="bfloat16")
    full, _ = load_model(path, dtype="float32")
    # the stored bf16 values are exact in float32
    for (name, a), (_, b) in zip(half.named_parameters(), full.named_parameters()):
        assert torch.equal(a.float(), b), name


def test_bad_dtype_and_device() -> None:
    path = tiny_checkpoint("qwen3", tied=False)
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; supported: auto, float32"):
        load_model(path, dtype="int8")
    with pytest.raises(ValueError, match="dtype=torch.float64 is not supported"):
        load_model(path, dtype=torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(path, device="cuda")


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found in checkpoint folder"):
        load_model(ckpt)


def test_corrupt_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(ckpt)


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*expected model.safetensors"):
        load_model(ckpt)


def test_missing_shard(tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoint("llama", tied=False, sharded=True), tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"weight shard {victim} listed in"):
        load_model(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(ckpt: Path, damage: str) -> None:
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        load_model(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.layers.0.self_attn.q_norm.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 2 tensor\(s\): model.layers.0.self_attn.q_norm.weight, "
                                         r"model.layers.1.self_attn.k_proj.weight"):  # fmt: skip
        load_model(ckpt)


def test_untied_checkpoint_without_lm_head(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): lm_head.weight"):
        load_model(ckpt)


def test_shape_mismatch(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.up_proj.weight' .* shape \(3, 64\), expected \(128, 64\)"
    ):
        load_model(ckpt)


def test_unexpected_tensor_warns(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(
        16
    )  # old checkpoints: ignored silently
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="'model.extra.weight' has no counterpart") as record:
        load_model(ckpt)
    assert len(record) == 1


def test_unsupported_architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    supported = (
        r"\['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen2MoeForCausalLM', 'Qwen3ForCausalLM', "
        r"'Qwen3MoeForCausalLM'\]"
    )
    with pytest.raises(
        ValueError, match=r"unsupported architecture \['MistralForCausalLM'\]; supported: " + supported
    ):
        load_model(ckpt)


def test_architecture_from_model_type(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["architectures"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_model(ckpt)[1].architecture == "Qwen3ForCausalLM"


def test_not_a_folder_and_missing_path(tmp_path: Path) -> None:
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file; expected a checkpoint folder"):
        load_model(f)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_hub_id_download(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = pytest.importorskip("huggingface_hub")
    local = tiny_checkpoint("qwen3", tied=False)
    seen = {}

    def fake_download(repo_id: str, allow_patterns: list[str], **kwargs) -> str:
        seen["repo_id"], seen["patterns"] = repo_id, allow_patterns
        return str(local)

    monkeypatch.setattr(hub, "snapshot_download", fake_download)
    _, info = load_model("someone/tiny-qwen3")
    assert seen["repo_id"] == "someone/tiny-qwen3" and "*.safetensors" in seen["patterns"]
    assert info.path == local

    def offline(repo_id: str, allow_patterns: list[str], **kwargs) -> str:
        raise OSError("no network")

    monkeypatch.setattr(hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="could not be fetched from the Hugging Face hub: no network"):
        load_model("someone/tiny-qwen3")


def test_hub_id_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(FileNotFoundError, match="huggingface_hub is not installed"):
        load_model("someone/tiny-qwen3")


def base_config(**overrides) -> dict:
    cfg = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    cfg.update(overrides)
    return cfg


def test_config_rope_formats_agree() -> None:
    legacy = {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}
    old = DecoderConfig.from_dict(base_config(rope_theta=5e5, rope_scaling=legacy), "LlamaForCausalLM")
    new = DecoderConfig.from_dict(
        base_config(rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}), "LlamaForCausalLM"
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == LLAMA3_ROPE
    plain = DecoderConfig.from_dict(base_config(rope_scaling={"rope_type": "default"}), "LlamaForCausalLM")
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0 and plain.head_dim == 4
    short = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    implied = DecoderConfig.from_dict(base_config(rope_scaling=short), "LlamaForCausalLM")
    assert implied.rope_scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": None}, "required field 'hidden_size' is missing"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        ({"head_dim": 5}, "head_dim=5 must be even"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; supported: \\['silu'\\]"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            "rope_type='longrope' is not supported; supported: ",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn"}},
            "type 'yarn' needs field 'factor'",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs field 'low_freq_factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor=0.0 must be > 0"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_dict(base_config(**overrides), "LlamaForCausalLM")


def test_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tiny_checkpoint("qwen3", tied=False)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == TOKENIZER_SIZE and tok.eos_token_id == ENDOFTEXT_ID
    text = "héllo <think>2+2</think> ok<|im_end|>"
    ids = tok.encode(text)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"]) == [259, 260, IM_END_ID]
    assert 259 in ids and 260 in ids and IM_END_ID in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "héllo <think>2+2</think> ok"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    closed = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert len(build_tokenizer()) == TOKENIZER_SIZE
    no_tok = make_tiny_checkpoint(tmp_path / "bare", "llama", tied=True, tokenizer=False, vocab_size=100)
    assert not (no_tok / "tokenizer.json").exists()
    assert load_model(no_tok)[1].vocab_size == 100


def _weights_only(src: Path, dst: Path) -> Path:
    """`dst` with src's config and weights and no tokenizer files, as save_pretrained leaves a model."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def test_folder_without_tokenizer_runs_token_ids(tmp_path: Path) -> None:
    """transformers 5 loads a folder with no tokenizer files as a one-token tokenizer (4.x raises);
    either way the engine runs token-id prompts with the model's whole vocabulary."""
    from thinkspec import LLM, SamplingParams

    src = tiny_checkpoint("qwen3", tied=True)
    folder = _weights_only(src, tmp_path / "weights_only")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [234, 12, 5]
    expected = LLM(src, device="cpu").generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(folder, device="cpu")
    assert llm.get_tokenizer() is None
    out = llm.generate([prompt, {"prompt_token_ids": [250, 1]}, "text"], params, use_tqdm=False)
    assert out[0].error is None and out[1].error is None
    assert len(expected) == 6 and out[0].outputs[0].token_ids == expected
    assert len(out[1].outputs[0].token_ids) == 6
    assert out[2].outputs[0].finish_reason == "error"
    assert "text prompts need a tokenizer" in out[2].error and str(folder.resolve()) in out[2].error
    with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="reasoning_parser needs a tokenizer"):
        LLM(folder, device="cpu", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="chat_template needs a tokenizer, there is none"):
        LLM(folder, device="cpu", chat_template="{{ messages }}")
    explicit = LLM(folder, device="cpu", skip_tokenizer_init=True)
    assert explicit.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_tokenizer_used_only_when_it_fits(tmp_path: Path) -> None:
    from thinkspec import LLM
    from thinkspec.models.loader import load_tokenizer

    src = tiny_checkpoint("qwen3", tied=True)
    tok, why = load_tokenizer(str(src), TOKENIZER_SIZE, explicit=False)
    assert tok is not None and len(tok) == TOKENIZER_SIZE and why == ""
    # A model with fewer logits than the tokenizer has tokens: the tokenizer is not used.
    tok, why = load_tokenizer(str(src), TOKENIZER_SIZE - 1, explicit=False)
    assert tok is None and f"{TOKENIZER_SIZE} tokens" in why
    small = make_tiny_checkpoint(tmp_path / "small", "qwen3", tied=True, tokenizer=False, vocab_size=200)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, small / name)
    assert LLM(small, device="cpu").get_tokenizer() is None
    with pytest.raises(ValueError, match="tokenizer=.* does not fit the model"):
        LLM(small, device="cpu", tokenizer=str(src))
    broken = _weights_only(src, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json", encoding="utf-8")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}', encoding="utf-8")
    tok, why = load_tokenizer(str(broken), TOKENIZER_SIZE, explicit=False)
    assert tok is None and "no tokenizer that loads" in why
    with pytest.raises(ValueError, match="could not be loaded"):
        load_tokenizer(str(broken), TOKENIZER_SIZE, explicit=True)
