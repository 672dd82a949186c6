"""Linear layers of the decoder.

`Linear` is nn.Linear that, once `gemv` is switched on (the engine does so with the other fused
kernels), runs one- and two-row products of weights up to GEMV_MAX_WEIGHT elements as the Triton GEMV
of gemv_triton.py: at batch 1 cuBLAS reads those weights measurably below the HBM rate, while on
larger weights (gate/up, lm_head) it reaches it (benchmarks/bench_gemv.py, docs/BENCHMARKS.md).
`MergedLinear` runs several projections sharing one input as a single matmul: checkpoints store
them separately (q_proj/k_proj/v_proj, gate_proj/up_proj); the loader copies each one into its
row range with `load_shard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_MAX_ROWS = 2  # from 4 rows on cuBLAS's tensor-core kernels win (bench_gemv)
GEMV_MAX_WEIGHT = 64 * 1024**2  # elements; Qwen3-8B's gate/up (100M) and lm_head stay on cuBLAS


class Linear(nn.Linear):
    gemv = False  # True: the Triton GEMV for the products described above (CUDA or TRITON_INTERPRET)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        skinny = x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
        if self.gemv and skinny and self.weight.numel() <= GEMV_MAX_WEIGHT:
            from thinkspec.layers.gemv_triton import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
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
