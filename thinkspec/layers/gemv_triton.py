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

With glu the weight holds gate rows then up rows, a program keeps both sums of its outputs, and
it writes SiLU(gate) * up (MergedLinear.silu_and_mul: one launch instead of the product and
fused_triton.silu_and_mul). An `out` buffer of another float dtype (the float32 logits) takes the
sums rounded once to it.

Numerics: products and sums in float32, the result rounded once to the output dtype (as cuBLAS
does, up to summation order). The grid depends only on shapes, so launches are CUDA-graph
capturable. On CPU this runs under TRITON_INTERPRET=1 (tests); `F.linear` is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from thinkspec.layers.fused_triton import silu_mul
from thinkspec.layers.pdl import early_release, launch_args, release_next, wait_prior

MAX_ROWS = 4  # the most rows one launch takes (layers/linear.py sends up to GEMV_MAX_ROWS)
SMALL_N = 1024  # outputs up to which a long-K product takes its own launch shape (gemv_config)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], last dim contiguous
    stride_x,
    w_ptr,  # [N, K] (GLU: [2N, K], gate rows then up rows), last dim contiguous
    stride_w,
    b_ptr,  # [N] (GLU: [2N]) (HAS_BIAS)
    y_ptr,  # [M, N], last dim contiguous
    stride_y,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    GLU: tl.constexpr,  # y = SiLU(x @ W[:N].T + b[:N]) * (x @ W[N:].T + b[N:])
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    EARLY: tl.constexpr,  # pdl.EARLY_RELEASE
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    up_base = w_base + N.to(tl.int64) * stride_w  # GLU: the up rows, N rows further
    x_base = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K) if GLU else (1, 1, 1), dtype=tl.float32)
    k_start = 0
    if EARLY:  # pdl.EARLY_RELEASE: the first weight tile is read before the wait, the next kernel let in
        first_k = (ks < K)[None, :]  # names apart from the loop's, whose carried types differ
        first_w = tl.load(w_base, mask=col_ok[:, None] & first_k, other=0.0, eviction_policy="evict_first")
        if GLU:
            first_up = tl.load(
                up_base, mask=col_ok[:, None] & first_k, other=0.0, eviction_policy="evict_first"
            )
        wait_prior(PDL)
        release_next(PDL)
        first_x = tl.load(x_base, mask=row_ok[:, None] & first_k, other=0.0).to(tl.float32)[:, None, :]
        acc += first_x * first_w.to(tl.float32)[None, :, :]
        if GLU:
            acc_up += first_x * first_up.to(tl.float32)[None, :, :]
        k_start = BLOCK_K
    else:
        wait_prior(PDL)
    for k0 in range(k_start, K, BLOCK_K):
        if EVEN_K:
            w_mask = col_ok[:, None]
            x_mask = row_ok[:, None]
        else:
            k_ok = (k0 + ks) < K
            w_mask = col_ok[:, None] & k_ok[None, :]
            x_mask = row_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_base + k0, mask=x_mask, other=0.0).to(tl.float32)[:, None, :]
        acc += x * w.to(tl.float32)[None, :, :]
        if GLU:
            w_up = tl.load(up_base + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up += x * w_up.to(tl.float32)[None, :, :]
    if not EARLY:
        release_next(PDL)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        up = tl.sum(acc_up, axis=2)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = silu_mul(y, up, x_ptr.dtype.element_ty)
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemv_config(num_rows: int, n: int, k: int, glu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [num_rows, k] x [n, k].T product (glu: n
    outputs from 2n weight rows).

    Best summed time over the Qwen3-8B and 0.6B projections on the H200 at 1 and 2 rows
    (bench_gemv); num_stages makes no difference (nothing in the loop feeds a dot to pipeline).
    Few outputs over long rows (n <= SMALL_N, k >= 2048: the 0.6B's o and down) leave n / 4 programs,
    about two per SM, each walking K one 512 tile at a time: too few loads in flight to stream the
    weight. There 2 outputs and 2048-wide K tiles per program, with 4 warps: 1024-wide tiles measured
    23-29% faster than the default (o 3.0 against 4.0 us, down 3.8 against 5.3 at 1 row), 2048-wide
    ones faster again (at 2 rows o 2.75 against 3.32 us, down 3.87 against 4.29; the 0.6B step 0.77
    against 0.79 ms at 1 row, 0.88 against 0.91 at 2; docs/BENCHMARKS.md, "Figures behind code
    choices").
    With glu a program reads gate and up rows: half the outputs, the same weight rows per program
    (and registers: two accumulators of the full size spill at 2 rows)."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n, warps = (4, 2) if num_rows <= 2 else (2, 4)
    if num_rows <= 2 and n <= SMALL_N and k >= 2048 and not glu:
        block_n, block_k, warps = 2, 2048, 4
    return block_n // 2 if glu else block_n, block_k, warps, 1


def product_operands(
    name: str,
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] (glu: [2 * N, K], gate rows then up rows)
    bias: torch.Tensor | None,  # [N] (glu: [2 * N]) or None
    max_rows: int,
    glu: bool = False,
    out: torch.Tensor | None = None,  # [M, N] of any float dtype, or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(x, weight with contiguous last dims, y, done): the checks and the empty cases a skinny product
    kernel shares. y is `out`, or a new [M, N] in x's dtype; done is True when y already holds the
    result (no rows, no columns, or K = 0). ValueError for shapes the kernel does not take."""
    m, k = x.shape
    rows = weight.shape[0]
    if m > max_rows or weight.shape[1] != k or (glu and rows % 2):
        shapes = f"{tuple(x.shape)} x {tuple(weight.shape)}"
        even = " with N even (gate rows, then up rows)" if glu else ""
        raise ValueError(f"{name} takes [M <= {max_rows}, K] x [N, K]{even}, got {shapes}")
    n = rows // 2 if glu else rows
    if out is not None and (out.shape != (m, n) or out.stride(1) != 1 or not out.is_floating_point()):
        want = f"a float [{m}, {n}] with a contiguous last dim"
        raise ValueError(f"{name}: out must be {want}, got {out.dtype} {tuple(out.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return x, weight, y, True
    if k == 0:
        if bias is None:
            return x, weight, y.zero_(), True  # SiLU(0) * 0 = 0 too
        z = bias.to(x.dtype).expand(m, rows)
        return x, weight, y.copy_(F.silu(z[:, :n]) * z[:, n:] if glu else z), True
    return x, weight, y, False


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    glu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> x @ weight.T + bias [M, N] in x's
    dtype, or in `out` ([M, N], any float dtype: the float32 sums rounded once to it).

    glu: weight [2 * N, K] holds gate rows then up rows (bias [2 * N]), and the result is
    SiLU(gate) * up [M, N] with the sums and roundings of the product followed by
    fused_triton.silu_and_mul at the same launch shape (see fused_triton.silu_mul), in one launch.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages), default gemv_config (benchmarks pass others)."""
    x, weight, y, done = product_operands("gemv", x, weight, bias, MAX_ROWS, glu, out)
    if done:
        return y
    (m, k), n = x.shape, y.shape[1]
    block_n, block_k, warps, stages = config or gemv_config(m, n, k, glu)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else weight, y, y.stride(0),
        m, n, k,
        HAS_BIAS=bias is not None, GLU=glu, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, EARLY=early_release(m), num_warps=warps, num_stages=stages,
        **launch_args(x.device),
    )  # fmt: skip
    return y
