"""A linear layer that runs several projections sharing one input as a single matmul.

Checkpoints store the projections separately (q_proj/k_proj/v_proj, gate_proj/up_proj); the
loader copies each one into its row range with `load_shard`.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def shard_view(self, param_name: str, shard: str) -> torch.Tensor:
        # rows of `weight` [out, in] or `bias` [out] that hold projection `shard`
        param = getattr(self, param_name)
        return param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # y: [..., out] -> one view per shard, in declaration order
        return y.split(list(self.shard_sizes.values()), dim=-1)
