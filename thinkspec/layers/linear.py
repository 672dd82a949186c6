"""Linear layers of the decoder.

`Linear` is nn.Linear that, once `gemv` is switched on (the engine does so with the other fused
kernels), runs one- and two-row products of weights up to GEMV_MAX_WEIGHT elements as the Triton GEMV
of gemv_triton.py: at batch 1 cuBLAS reads those weights measurably below the HBM rate, while on
larger weights (gate/up, lm_head) it reaches it (benchmarks/kernels/bench_gemv.py, docs/BENCHMARKS.md).
With `skinny_gemm` on as well, products of 3..64 rows go to the Triton tensor-core GEMM of
gemm_skinny_triton.py, but only for the (rows bucket, N, K) that its SKINNY_GEMM_TABLE lists (the
shapes where bench_skinny_gemm measured it faster than cuBLAS); everything else stays on F.linear.
`RowParallelLinear.add_rms_norm` (o_proj, down_proj) hands the residual add and RMSNorm that follow the
product to the skinny GEMM, which runs them in its split-K sum launch.
`MergedLinear` runs several projections sharing one input as a single matmul: checkpoints store
them separately (q_proj/k_proj/v_proj, gate_proj/up_proj); the loader copies each one into its
row range with `load_shard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout, all_reduce
from thinkspec.layers.norm import RMSNorm

GEMV_MAX_ROWS = 2  # from 4 rows on cuBLAS's tensor-core kernels win (bench_gemv)
GEMV_MAX_WEIGHT = 64 * 1024**2  # elements; Qwen3-8B's gate/up (100M) and lm_head stay on cuBLAS
_HALF = (torch.bfloat16, torch.float16)  # the skinny GEMM's operand types


# (dim, start, length) of a checkpoint tensor that a parameter holds; None = all of it
CheckpointSlice = tuple[int, int, int] | None


class Linear(nn.Linear):
    gemv = False  # True: the Triton GEMV for the products described above (CUDA or TRITON_INTERPRET)
    skinny_gemm = False  # True: the skinny Triton GEMM where SKINNY_GEMM_TABLE says it wins

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        """The part of checkpoint tensor `leaf` ("weight" [out, in] / "bias" [out]; of projection
        `shard` in a merged layer) that this layer holds; None = all of it."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return self.product(x, self.bias)

    def product(
        self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None, glu: bool = False
    ) -> torch.Tensor:
        # x: [..., in] -> x @ weight.T + bias [..., out]; glu: SiLU of the first half of those columns
        # times the second half [..., out / 2] (a Triton kernel must take it: see MergedLinear.silu_and_mul);
        # out: a float [rows, out] buffer (any float dtype) the result is written into, or None
        kernel = self.triton_kernel(x, glu)
        if kernel == "gemv":
            from thinkspec.layers.gemv_triton import gemv

            return gemv(x, self.weight, bias, glu=glu, out=out)
        if kernel == "skinny":
            from thinkspec.layers.gemm_skinny_triton import skinny_gemm

            return skinny_gemm(x, self.weight, bias, glu=glu, out=out)
        if glu:
            shapes = f"{tuple(x.shape)} x {tuple(self.weight.shape)}"
            raise ValueError(f"no Triton kernel takes the SiLU product {shapes}")
        if out is None:
            return F.linear(x, self.weight, bias)
        if bias is None and x.is_cuda and out.dtype != x.dtype and x.dim() == 2:
            # cuBLAS writes the float32 sums straight into out: no product in x's dtype, no cast-copy
            return torch.mm(x, self.weight.t(), out_dtype=out.dtype, out=out)
        return out.copy_(F.linear(x, self.weight, bias))

    def triton_kernel(self, x: torch.Tensor, glu: bool = False) -> str | None:
        """Which kernel computes this layer's product of x [..., in]: "gemv", "skinny" or None (F.linear)
        (glu: the gate/up product with SiLU(gate) * up fused; its outputs are half the rows)."""
        if x.dim() != 2:
            return None
        rows, n = x.shape[0], self.out_features // 2 if glu else self.out_features
        if self.gemv and rows <= GEMV_MAX_ROWS and self.weight.numel() <= GEMV_MAX_WEIGHT:
            return "gemv"
        if self.skinny_gemm and x.dtype in _HALF and x.dtype == self.weight.dtype:
            from thinkspec.layers import gemm_skinny_triton as gs

            if gs.skinny_gemm_wins(rows, n, self.in_features, glu):
                return "skinny"
        return None


class ColumnParallelLinear(Linear):
    """Output features [row_start, row_start + out_features) of a checkpoint projection of
    `full_out` features (rows past full_out are padding the loader leaves at zero)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, row_start: int, full_out: int
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.row_start = row_start
        self.full_out = full_out

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        if self.row_start == 0 and self.out_features == self.full_out:
            return None
        return 0, self.row_start, self.out_features


class RowParallelLinear(Linear):
    """Input features split over the ranks: x [..., in/size] @ this rank's weight columns, summed over
    the ranks by one all-reduce, then the (whole, replicated) bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, tp: TPLayout) -> None:
        super().__init__(tp.split(in_features, "in_features"), out_features, bias=bias)
        self.tp = tp

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        if self.tp.size == 1 or leaf == "bias":
            return None
        return 1, self.tp.rank * self.in_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in / size] -> [..., out], identical on every rank
        if self.tp.size == 1:
            return self.product(x, self.bias)
        y = all_reduce(self.product(x, None))  # the partial products carry no bias
        return y if self.bias is None else y + self.bias

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, in / size], residual: [T, out] -> (norm(s), s) with s = self(x) + residual, as
        # norm(self(x), residual) computes them; on the skinny GEMM (one rank, the fused norm kernel)
        # the add and the norm run in the launch that sums its split-K partials
        one_dtype = residual.dtype == x.dtype == norm.weight.dtype
        if self.tp.size == 1 and norm.fused and one_dtype and self.triton_kernel(x) == "skinny":
            from thinkspec.layers.gemm_skinny_triton import skinny_gemm_rms_norm

            return skinny_gemm_rms_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps)
        return norm(self(x), residual)  # type: ignore[return-value]


class MergedLinear(Linear):
    """shard_starts: each projection's first row in its checkpoint tensor, when this rank holds a
    slice of each (tensor parallelism); None when the layer holds whole projections."""

    fuse_silu = True  # silu_and_mul: SiLU * up inside the product where a kernel takes it (benchmarks: off)

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        shard_starts: dict[str, int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_starts = dict(shard_starts) if shard_starts is not None else None
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def shard_view(self, param_name: str, shard: str) -> torch.Tensor:
        # rows of `weight` [out, in] or `bias` [out] that hold projection `shard`
        param = getattr(self, param_name)
        return param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        if self.shard_starts is None or shard is None:
            return None
        return 0, self.shard_starts[shard], self.shard_sizes[shard]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # y: [..., out] -> one view per shard, in declaration order
        return y.split(list(self.shard_sizes.values()), dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> SiLU(gate) * up [T, out / 2] for a layer of two equal shards (gate, up), in
        # Triton kernels: fused into the product where the GEMV or SKINNY_GLU_TABLE takes the shape
        # (one launch instead of two, with the unfused pair's sums and roundings), else the product
        # then fused_triton.silu_and_mul
        if len(self.shard_sizes) != 2 or len(set(self.shard_sizes.values())) != 1:
            raise ValueError(f"silu_and_mul needs two equal shards (gate, up), got {self.shard_sizes}")
        if self.fuse_silu and self.triton_kernel(x, glu=True) is not None:
            return self.product(x, self.bias, glu=True)
        from thinkspec.layers.fused_triton import silu_and_mul

        return silu_and_mul(self.product(x, self.bias))
