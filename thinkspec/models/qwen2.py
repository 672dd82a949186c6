"""Qwen2 / Qwen2.5 models (also DeepSeek-R1-Distill-Qwen and QwQ): bias on q/k/v only, no q/k norm."""

from __future__ import annotations

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DecoderConfig, tp: TPLayout | None = None) -> None:
        super().__init__(cfg, qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, tp=tp)
