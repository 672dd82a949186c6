"""Qwen2-MoE models (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (bias on q/k/v), the experts'
block with its gated shared expert (layers/moe.py) in the sparse layers."""

from __future__ import annotations

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DecoderConfig, tp: TPLayout | None = None) -> None:
        super().__init__(cfg, qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, tp=tp)
