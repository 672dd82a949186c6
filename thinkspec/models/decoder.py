"""The dense pre-norm decoder shared by Qwen3, Qwen2 and Llama.

Mixture-of-experts models (qwen3_moe.py, qwen2_moe.py) are the same decoder with the experts'
block (layers/moe.py) in place of the MLP in the layers their config makes sparse.
The three dense architectures differ only in which projections carry a bias and whether queries and
keys get a per-head RMSNorm; the subclasses in qwen3.py, qwen2.py and llama.py pick those.
Input is a packed ragged batch: T tokens from any number of sequences, with the attention
layout in the forward context.

Two code paths compute the same values: the torch ops (the reference, and the CPU path) and fused
Triton kernels (layers/fused_triton.py: residual add + RMSNorm, q/k norm + rotary, SiLU * up), chosen
for the whole model by `DecoderForCausalLM.set_fused_kernels`; the engine turns the kernels on with
the Triton attention backend. Layers pass (hidden, residual) along as vLLM does, so that each
residual add happens inside the norm that follows it; a layer ends with the next layer's input norm,
so that where the product before a norm splits K on the skinny GEMM, the add and the norm run in its
sum launch (one launch fewer per norm).

Tensor parallelism (built for a TPLayout of `size` ranks): each rank holds num_heads / size query
heads and their KV heads (qkv_proj column-parallel), intermediate / size MLP features (gate_up_proj
column-parallel), and a vocabulary shard of the embedding and lm_head; o_proj and down_proj are
row-parallel (one all-reduce each), and compute_logits gathers the vocabulary shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout, all_gather_last_dim
from thinkspec.layers.attention import Attention
from thinkspec.layers.embedding import VocabParallelEmbedding
from thinkspec.layers.forward_context import get_forward_context
from thinkspec.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from thinkspec.layers.moe import SparseMoeBlock
from thinkspec.layers.norm import RMSNorm
from thinkspec.layers.rotary import RotaryEmbedding
from thinkspec.models.config import DecoderConfig


def set_fused_kernels(module: nn.Module, enabled: bool) -> None:
    """Run the norms, residual adds, q/k norm + rotary and SiLU * up of every decoder layer inside
    `module` as fused Triton kernels (enabled; CUDA, or TRITON_INTERPRET=1) or as torch ops (the
    default, any device). Both compute the same values (see fused_triton.py). Also switches the
    single-row products of the smaller linear layers to the Triton GEMV, and the 3..64-row products
    that SKINNY_GEMM_TABLE lists to the skinny Triton GEMM (layers/linear.py); both equal F.linear up
    to the order of their float32 sums."""
    if enabled:
        import thinkspec.layers.fused_triton  # noqa: F401 (fail here, not mid-forward, without triton)
    for m in module.modules():
        if isinstance(m, (RMSNorm, DecoderAttention, DecoderMLP, SparseMoeBlock)):
            m.fused = enabled
        elif isinstance(m, Linear):
            m.gemv = enabled
            m.skinny_gemm = enabled


class DecoderAttention(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPLayout,
    ) -> None:
        super().__init__()
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")  # this rank's
        first_kv, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        self.head_dim = d = cfg.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        starts = {"q": tp.rank * q_size, "k": first_kv * d, "v": first_kv * d} if tp.size > 1 else None
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias, shard_starts=starts
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=o_bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.fused = False  # True: q/k norm + rotary in one Triton kernel

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64; x: [T, hidden] -> o_proj's output [T, hidden]; with residual and norm
        # ([T, hidden], the norm after the residual add): (norm(s), s), s = that output + residual
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kv_stored = False
        if self.fused:
            from thinkspec.layers.fused_triton import qk_norm_rope

            has_qk_norm = self.q_norm is not None
            # The same launch writes k/v into this layer's cache, once the pool exists.
            kv_stored = self.attn.k_cache.numel() > 0
            store = None
            if kv_stored:
                store = (v, self.attn.k_cache, self.attn.v_cache, get_forward_context().slot_mapping)
            q, k = qk_norm_rope(
                positions, q, k, self.rotary[0].cos_sin_cache,
                self.q_norm.weight if has_qk_norm else None, self.k_norm.weight if has_qk_norm else None,
                self.q_norm.eps if has_qk_norm else 0.0, store,
            )  # fmt: skip
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary[0](positions, q, k)
        o = self.attn(q, k, v, kv_stored).flatten(1)  # [T, Hq * D]
        if norm is None:
            return self.o_proj(o)
        return self.o_proj.add_rms_norm(o, residual, norm)


class DecoderMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, *, bias: bool, tp: TPLayout) -> None:
        super().__init__()
        size = tp.split(cfg.intermediate_size, "intermediate_size")  # this rank's features
        starts = {"gate": tp.rank * size, "up": tp.rank * size} if tp.size > 1 else None
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate": size, "up": size}, bias=bias, shard_starts=starts
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias, tp=tp)
        self.fused = False  # True: SiLU(gate) * up in one Triton kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden] -> down_proj's output [T, hidden]; with residual and norm: (norm(s), s), s =
        # that output + residual (as DecoderAttention.forward)
        if self.fused:
            h = self.gate_up_proj.silu_and_mul(x)
        else:
            gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, intermediate] each
            h = F.silu(gate) * up
        if norm is None:
            return self.down_proj(h)
        return self.down_proj.add_rms_norm(h, residual, norm)


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
        tp: TPLayout,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(
            cfg, rotary, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, tp=tp
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: DecoderMLP | SparseMoeBlock = DecoderMLP(cfg, bias=mlp_bias, tp=tp)
        if cfg.moe is not None and cfg.is_sparse_layer(index):  # mixture-of-experts (layers/moe.py)
            moe = cfg.moe
            self.mlp = SparseMoeBlock(
                cfg.hidden_size, num_experts=moe.num_experts, top_k=moe.num_experts_per_tok,
                intermediate=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                shared_intermediate=moe.shared_expert_intermediate_size, tp=tp,
            )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64; x: [T, hidden], this layer's input already through input_layernorm;
        # residual: [T, hidden], the stream before it. Returns (next_norm(s), s) with s the stream
        # after this layer; next_norm is the next layer's input_layernorm (the final norm after the
        # last layer), so that each residual add and norm can run in the launch of the product before
        # it (RowParallelLinear.add_rms_norm).
        x, residual = self.self_attn(positions, x, residual, self.post_attention_layernorm)
        return self.mlp(x, residual, next_norm)  # type: ignore[return-value]


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, *, tp: TPLayout, **layout: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary_emb, tp=tp, index=i, **layout) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        residual = self.embed_tokens(input_ids)
        x = self.layers[0].input_layernorm(residual) if len(self.layers) else self.norm(residual)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, residual = layer(positions, x, residual, next_norm)
        return x


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
        self,
        cfg: DecoderConfig,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        mlp_bias: bool,
        tp: TPLayout | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPLayout()
        self.model = DecoderModel(
            cfg, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, mlp_bias=mlp_bias, tp=tp
        )
        start, rows = tp.vocab_shard(cfg.vocab_size)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, rows, bias=False, row_start=start, full_out=cfg.vocab_size
        )
        self.tie_weights()

    def set_fused_kernels(self, enabled: bool) -> None:
        """Fused Triton kernels (True) or torch ops (False, the default) for the whole model."""
        set_fused_kernels(self, enabled)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 (packed ragged batch) -> hidden [T, hidden] model dtype
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [N, hidden] model dtype (rows already selected) -> [N, vocab] float32, on every rank;
        # out: [N, vocab] float32 to write them into (a CUDA graph's static buffer), or None. With one
        # rank the product's float32 sums are written straight into it (on CUDA not rounded to the
        # model dtype first; the cast-copy of 194 MB at 320 rows is gone)
        if self.tp.size > 1:
            logits = self.lm_head(hidden)  # [N, vocab / size] this rank's shard
            logits = all_gather_last_dim(logits, self.tp.size)[:, : self.config.vocab_size]
            return logits.float() if out is None else out.copy_(logits)
        if out is None:
            rows, vocab = hidden.shape[0], self.lm_head.out_features
            out = torch.empty(rows, vocab, dtype=torch.float32, device=hidden.device)
        return self.lm_head.product(hidden, None, out=out)
