"""Qwen3-MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm), the
experts' block (layers/moe.py) in the layers that `decoder_sparse_step` and `mlp_only_layers` make
sparse, the dense MLP of `intermediate_size` in the others."""

from __future__ import annotations

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DecoderConfig, tp: TPLayout | None = None) -> None:
        bias = cfg.attention_bias
        super().__init__(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, tp=tp)
