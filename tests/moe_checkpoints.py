"""Tiny random-weight Qwen3-MoE / Qwen2-MoE checkpoints for tests, saved by transformers.

Import from tests as `from moe_checkpoints import moe_checkpoint` (pytest puts tests/ on sys.path).
`moe_checkpoint(...)` is cached per process by its arguments, like checkpoints.tiny_checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from checkpoints import ENDOFTEXT_ID, IM_END_ID, build_tokenizer, fill_random

_CACHE: dict[str, Path] = {}


def make_moe_checkpoint(
    path: Path,
    arch: str = "qwen3_moe",
    *,
    num_experts: int = 8,
    top_k: int = 2,
    num_layers: int = 3,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    hidden_size: int = 64,
    moe_intermediate_size: int = 32,
    intermediate_size: int = 96,
    shared_expert_intermediate_size: int = 48,
    seed: int = 0,
    init_std: float = 0.25,
) -> Path:
    """Save a random-weight `arch` ("qwen3_moe" | "qwen2_moe") model with the byte tokenizer to `path`."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=261, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=ENDOFTEXT_ID, pad_token_id=ENDOFTEXT_ID,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(head_dim=32, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            shared_expert_intermediate_size=shared_expert_intermediate_size, **common
        )
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(f"arch={arch!r}; expected 'qwen3_moe' or 'qwen2_moe'")
    torch.manual_seed(seed)
    model = cls(config)
    fill_random(model, seed, init_std)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID
    )
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def moe_checkpoint(arch: str = "qwen3_moe", **kwargs: Any) -> Path:
    """`make_moe_checkpoint` cached per process by its arguments (in one temporary folder)."""
    key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
    if key not in _CACHE:
        root = Path(tempfile.mkdtemp(prefix="thinkspec-moe-"))
        import atexit

        atexit.register(shutil.rmtree, root, True)
        _CACHE[key] = make_moe_checkpoint(root / "ckpt", arch, **kwargs)
    return _CACHE[key]
