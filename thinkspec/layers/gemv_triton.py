"""Skinny matmul for decode steps: y = x @ W.T (+ b) for a few rows of x, as one Triton launch.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the weights
once. cuBLAS reaches the HBM rate on the large projections but not on the small ones (q/k/v, o,
down at the Qwen3-8B shape, where a kernel's ramp and tail are a large share of the read; sizes
and times in docs/BENCHMARKS.md, "Figures behind code choices"),
and it splits K with a separate reduction launch. This kernel streams each weight
row block once, in one launch, with the whole K of an output block in one program, so no
cross-program reduction is needed:

  grid (cdiv(N, BLOCK_N),): program j owns outputs n in [j*BLOCK_N, (j+1)*BLOCK_N) for every row of
  x; it walks K in BLOCK_K steps, accumulating products in float32 [BLOCK_M, BLOCK_N, BLOCK_K]
  registers, and reduces over K once at the end.

Numerics: products and sums in float32, the result rounded once to the output dtype (as cuBLAS
does, up to summation order). The grid depends only on shapes, so launches are CUDA-graph
capturable. On CPU this runs under TRITON_INTERPRET=1 (tests); `F.linear` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinkspec.layers.pdl import launch_args, release_next, wait_prior

MAX_ROWS = 4  # the most rows one launch takes (layers/linear.py sends up to GEMV_MAX_ROWS)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], last dim contiguous
    stride_x,
    w_ptr,  # [N, K], last dim contiguous
    stride_w,
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N], last dim contiguous
    stride_y,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_base = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    wait_prior(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_base + k0, mask=col_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_base + k0, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            w = tl.load(
                w_base + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first"
            )
            x = tl.load(x_base + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    release_next(PDL)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemv_config(num_rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [num_rows, k] x [n, k].T product.

    Best summed time over the Qwen3-8B and 0.6B projections on the H200 at 1 and 2 rows
    (bench_gemv); num_stages makes no difference (nothing in the loop feeds a dot to pipeline)."""
    block_k = min(512, triton.next_power_of_2(k))
    if num_rows <= 2:
        return 4, block_k, 2, 1
    return 2, block_k, 4, 1


def product_operands(
    name: str,
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N] or None
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(x, weight with contiguous last dims, y [M, N] in x's dtype, done): the checks and the empty
    cases a skinny product kernel shares; done is True when y already holds the result (no rows, no
    columns, or K = 0). ValueError for shapes the kernel does not take."""
    m, k = x.shape
    n = weight.shape[0]
    if m > max_rows or weight.shape[1] != k:
        shapes = f"{tuple(x.shape)} x {tuple(weight.shape)}"
        raise ValueError(f"{name} takes [M <= {max_rows}, K] x [N, K], got {shapes}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return x, weight, y, True
    if k == 0:
        y = y.zero_() if bias is None else y.copy_(bias.expand(m, n))
        return x, weight, y, True
    return x, weight, y, False


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> [M, N] in x's dtype.

    config: (BLOCK_N, BLOCK_K, num_warps, num_stages), default gemv_config (benchmarks pass others)."""
    x, weight, y, done = product_operands("gemv", x, weight, bias, MAX_ROWS)
    if done:
        return y
    (m, k), n = x.shape, weight.shape[0]
    block_n, block_k, warps, stages = config or gemv_config(m, n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else weight, y, y.stride(0),
        m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages, **launch_args(x.device),
    )  # fmt: skip
    return y
