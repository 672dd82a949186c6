"""The dense pre-norm decoder shared by Qwen3, Qwen2 and Llama.

The three architectures differ only in which projections carry a bias and whether queries and
keys get a per-head RMSNorm; the subclasses in qwen3.py, qwen2.py and llama.py pick those.
Input is a packed ragged batch: T tokens from any number of sequences, with the attention
layout in the forward context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from thinkspec.layers.attention import Attention
from thinkspec.layers.linear import MergedLinear
from thinkspec.layers.norm import RMSNorm
from thinkspec.layers.rotary import RotaryEmbedding
from thinkspec.models.config import DecoderConfig


class DecoderAttention(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, rotary: RotaryEmbedding, *, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias
        )
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T] int64; x: [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        o = self.attn(q, k, v)  # [T, Hq, D]
        return self.o_proj(o.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, *, bias: bool) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        mlp_bias: bool,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, rotary, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DecoderMLP(cfg, bias=mlp_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T] int64; x: [T, hidden] -> [T, hidden]
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, **layout: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary_emb, **layout) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    """Base of the three architectures. Parameter names follow the Hugging Face checkpoints,
    except the merged projections (`qkv_proj`, `gate_up_proj`), listed in `packed_modules`."""

    # checkpoint projection name -> (merged module name, shard)
    packed_modules: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self, cfg: DecoderConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, mlp_bias=mlp_bias)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 (packed ragged batch) -> hidden [T, hidden] model dtype
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] model dtype (rows already selected) -> [N, vocab] float32
        return self.lm_head(hidden).float()
