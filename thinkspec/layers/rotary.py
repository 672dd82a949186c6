"""Rotary position embedding (non-interleaved, "rotate half" layout) with rope scaling.

Supported `rope_type`s: default, linear, llama3, yarn (static, as in transformers). cos/sin
are precomputed in float32 for every position below `max_positions` and cast to the
activation dtype when applied, matching the Hugging Face reference in float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for the given rope scaling dict (or None)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope_theta, rope_scaling)
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def attention_factor(rope_scaling: dict | None) -> float:
    """Scale applied to cos/sin; only YaRN uses one (its "mscale")."""
    if rope_scaling is None or rope_scaling.get("rope_type") != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    # interpolate low frequencies by `factor`, keep high ones, linear ramp between (YaRN, static form)
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)
    ).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        probe = torch.empty(0)
        # Built on the meta device (the loader), the cache is computed by reset_cache once the model
        # is materialised: meta rotary math costs seconds of one-time imports in a fresh process.
        cache = probe.new_empty(max_positions, 2, head_dim // 2) if probe.is_meta else self._build(None)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _build(self, device: torch.device | None) -> torch.Tensor:
        # [max_positions, 2, head_dim // 2] float32: cos then sin (device None = current default)
        inv_freq = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = t[:, None] * inv_freq[None, :]
        scale = attention_factor(self.rope_scaling)
        return torch.stack((freqs.cos() * scale, freqs.sin() * scale), dim=1)

    def reset_cache(self, device: torch.device | str) -> None:
        """Recompute the cache on `device` (after the model was materialised from the meta device)."""
        self.cos_sin_cache = self._build(torch.device(device))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64, each < max_positions; q: [T, Hq, D]; k: [T, Hkv, D] -> rotated q, k
        cos_sin = self.cos_sin_cache[positions]
        cos = cos_sin[:, 0, None, :].to(q.dtype)  # [T, 1, D/2]
        sin = cos_sin[:, 1, None, :].to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.rope_theta}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D/2] same dtype as x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
