"""Attention over the paged KV cache, with a swappable backend.

The `Attention` module owns no weights: it receives rotated q/k/v, and its backend writes the
new k/v into this layer's cache and attends each sequence's queries over its paged context as
described by the `AttentionMetadata` of the current forward (see forward_context.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from thinkspec.layers.attention_torch import PaddedTorchAttentionBackend
from thinkspec.layers.forward_context import AttentionMetadata, get_forward_context


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], or empty before allocation
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], or empty before allocation
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v at meta.slot_mapping (skipping -1), then attend causally over each sequence.
        kv_stored: the caller already wrote k/v at those slots (a fused kernel); skip the store."""
        ...


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Empty until the ModelRunner allocates the pool and assigns this layer's views.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = PaddedTorchAttentionBackend()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]; kv_stored: k/v already in this layer's cache
        meta = get_forward_context()
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, kv_stored)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
