"""Qwen3 dense models: per-head RMSNorm on queries and keys, bias per `attention_bias` (off in
released checkpoints)."""

from __future__ import annotations

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DecoderConfig, tp: TPLayout | None = None) -> None:
        bias = cfg.attention_bias
        super().__init__(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, tp=tp)
