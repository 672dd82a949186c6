"""The fields of a Hugging Face config.json that the decoder models need (dense, and the routing of
the mixture-of-experts ones), validated.

Reads both spellings of rotary settings: `rope_theta` + `rope_scaling` (older checkpoints)
and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thinkspec.layers.rotary import SUPPORTED_ROPE_TYPES

_ROPE_REQUIRED_KEYS = {"linear": (), "llama3": ("low_freq_factor", "high_freq_factor"), "yarn": ()}


@dataclass(slots=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE; else has "rope_type" and its parameters
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None  # the checkpoint's dtype name ("bfloat16", ...) if recorded
    eos_token_ids: list[int]
    bos_token_id: int | None
    moe: MoEConfig | None = None  # mixture-of-experts routing (Qwen3-MoE, Qwen2-MoE); None = dense

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has the experts (else the dense MLP of intermediate_size)."""
        return self.moe is not None and self.moe.is_sparse_layer(index)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> DecoderConfig:
        """Validate and normalise a parsed config.json; raises ValueError naming the bad field."""

        def need(name: str) -> Any:
            if cfg.get(name) is None:
                raise ValueError(f"config.json: required field {name!r} is missing")
            return cfg[name]

        def positive_int(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {name}={value!r} must be a positive integer")
            return value

        hidden_size = positive_int("hidden_size", need("hidden_size"))
        num_heads = positive_int("num_attention_heads", need("num_attention_heads"))
        num_kv_heads = positive_int("num_key_value_heads", cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden_size // num_heads
        positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"config.json: head_dim={head_dim} must be even for rotary embeddings")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act={act!r} is not supported; supported: ['silu']")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise ValueError(
                "config.json: use_sliding_window=True is not supported (no sliding-window attention)"
            )
        max_pos = positive_int("max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(cfg, max_pos)

        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            architecture=architecture,
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            num_hidden_layers=positive_int("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            moe=MoEConfig.from_dict(cfg, positive_int) if architecture in MOE_ARCHITECTURES else None,
        )


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(slots=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's FFN width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int  # layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...]  # ... and i is not listed here
    shared_expert_intermediate_size: int  # Qwen2-MoE's gated shared expert; 0 = none

    def is_sparse_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], positive_int: Any) -> MoEConfig:
        """The routing fields of a Qwen3-MoE / Qwen2-MoE config.json (transformers 5 writes
        num_experts as num_local_experts); ValueError naming the bad field."""
        name = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts = positive_int(name, cfg.get(name))
        top_k = positive_int("num_experts_per_tok", cfg.get("num_experts_per_tok"))
        if top_k > experts:
            raise ValueError(f"config.json: num_experts_per_tok={top_k} must be in [1, {name}={experts}]")
        layers = cfg.get("mlp_only_layers") or []
        if not isinstance(layers, list) or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise ValueError(f"config.json: mlp_only_layers={layers!r} must be a list of layer indices >= 0")
        shared = cfg.get("shared_expert_intermediate_size") or 0
        return cls(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=positive_int("moe_intermediate_size", cfg.get("moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=positive_int("decoder_sparse_step", cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(layers),
            shared_expert_intermediate_size=positive_int("shared_expert_intermediate_size", shared)
            if shared
            else 0,
        )


def _parse_rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json: per-layer-type rope_parameters are not supported")
    params.update(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling rope_type={rope_type!r} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    for key in _ROPE_REQUIRED_KEYS[rope_type]:
        if params.get(key) is None:
            raise ValueError(f"config.json: rope_scaling of type {rope_type!r} needs field {key!r}")
    if (
        rope_type == "yarn"
        and params.get("factor") is None
        and params.get("original_max_position_embeddings")
    ):
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    if params.get("factor") is None:
        raise ValueError(f"config.json: rope_scaling of type {rope_type!r} needs field 'factor'")
    if rope_type in ("llama3", "yarn"):
        original = cfg.get("original_max_position_embeddings") or max_pos
        params.setdefault("original_max_position_embeddings", original)
    if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(
            f"config.json: rope_scaling high_freq_factor={params['high_freq_factor']} must exceed "
            f"low_freq_factor={params['low_freq_factor']}"
        )
    if params["factor"] <= 0:
        raise ValueError(f"config.json: rope_scaling factor={params['factor']} must be > 0")
    return theta, {"rope_type": rope_type, **params}
