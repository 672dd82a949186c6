"""Llama models (also DeepSeek-R1-Distill-Llama): biases per `attention_bias` / `mlp_bias`, no q/k
norm; llama3 rope scaling comes through the config."""

from __future__ import annotations

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DecoderConfig, tp: TPLayout | None = None) -> None:
        bias = cfg.attention_bias
        super().__init__(cfg, qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=cfg.mlp_bias, tp=tp)
