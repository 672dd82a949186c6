"""Skinny tensor-core matmul for decode steps: y = x @ W.T (+ b) for 3..64 rows of x.

At batch 4..64 a decode step's products still cost about one read of the weights: the rows of x
are few, so the tensor cores idle while W streams in from HBM. This kernel is built to stream W
at the HBM rate and nothing else:

  grid (cdiv(N, BLOCK_N), SPLIT_K): program (j, s) owns outputs n in [j*BLOCK_N, (j+1)*BLOCK_N) for
  every row of x and the s-th of SPLIT_K equal slices of K (whole BLOCK_K steps). Each K step loads
  one [BLOCK_N, BLOCK_K] tile of W (read once, evicted first) and the [BLOCK_M, BLOCK_K] tile of x
  (rows padded to BLOCK_M >= 16 for tl.dot; x is small and stays in L2), and accumulates
  W_tile @ x_tile.T into float32 [BLOCK_N, BLOCK_M]. W is the dot's left operand ("swap AB"), so the
  MMA's wide dimension is spent on the weight's rows and the narrow one on the batch; num_stages
  keeps that many W tiles in flight.

  On Hopper (and under the interpreter) the tiles come through tensor descriptors (TMA: the copy
  engine fetches a whole tile into shared memory; no per-element addresses, no masks, zeros past the
  tensor's edges), whenever both operands' addresses and row strides are multiples of 16 bytes;
  otherwise through pointer loads. TMA measured on the H200 engine: the batch-16 / 64 steps 4.68 /
  5.37 ms against 4.74 / 5.43, the batch-1 k = 6 speculative step's device time 9.78 against 10.00 ms
  (docs/BENCHMARKS.md, "Figures behind code choices").

  SPLIT_K > 1 (when N / BLOCK_N programs alone would leave SMs idle, as at N = 4096) writes float32
  partials [SPLIT_K, M, N], and a second small launch sums them in a fixed order, adds the bias and
  rounds once: no atomics, so the result does not depend on timing.
  `skinny_gemm_rms_norm` sums them with the residual add and RMSNorm that follow o_proj and down_proj
  instead (one program per row, one launch fewer), with the values of the sum launch followed by
  fused_triton.rms_norm, bit for bit.

With glu (SKINNY_GLU_TABLE) the weight holds gate rows then up rows: each K step loads both tiles
of a program's outputs, K is never split, and the epilogue writes SiLU(gate) * up.

Numerics: products and sums in float32, the result rounded once to x's dtype (or out's), as cuBLAS
does, up to summation order. Shapes alone decide the grid and the partials' size, so launches are
CUDA-graph capturable (no host syncs, no data-dependent allocation). On CPU this runs under
TRITON_INTERPRET=1 (tests); `F.linear` is the reference.

Which (rows, N, K) go to this kernel rather than cuBLAS is decided by measurement only:
`SKINNY_GEMM_TABLE` below, filled from benchmarks/kernels/bench_skinny_gemm.py (see its docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinkspec.layers.fused_triton import FP_COMPILE, rms_norm, rms_norm_row, rms_norm_warps, silu_mul
from thinkspec.layers.gemv_triton import product_operands
from thinkspec.layers.pdl import hopper_or_newer, launch_args, prefetch, release_next, wait_prior

TMA = True  # read at launch: W and x tiles through tensor descriptors where the operands allow it
MIN_ROWS = 3  # fewer rows go to the GEMV (layers/gemv_triton.py) or cuBLAS
MAX_ROWS = 64
ROW_BUCKETS = (4, 8, 16, 32, 64)  # the row counts bench_skinny_gemm measures; rows round up to one

# Launch config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
Config = tuple[int, int, int, int, int]

# The measured winners: (rows bucket, N, K) -> the launch config that beat cuBLAS there on the H200.
# `Linear` (layers/linear.py) sends a product to this kernel only when its (bucket, N, K) is a key;
# everything else stays on cuBLAS. Empty until measured: fill it from bench_skinny_gemm's JSON with
#   python benchmarks/kernels/bench_skinny_gemm.py --table-from skinny.json
# which prints the entries (cells where the best launch shape beat cuBLAS by --min-gain).
# Measured 2026-12-01 on the H200: Qwen3-8B's projections at 16, 32 and 64 rows
# (benchmarks/results/2026-12-01-skinny-gemm-h200.json) and at 4 and 8 rows (a batch-1 verify of
# k + 1 tokens; ...-skinny-gemm-h200-rows-4-8.json); other shapes stay on cuBLAS. Entries marked (TMA)
# were re-measured 2026-12-03 with the tiles through tensor descriptors
# (benchmarks/results/2026-12-03-skinny-tma-h200.json; the 8-row ones in ...-skinny-tma-vs-pointer-h200.json);
# lm_head at 32 and 64 rows, 5% under cuBLAS with TMA, in ...-skinny-tma-lm-head-h200.json.
# o at 8 rows and down at 16 split K although unsplit shapes measured 0-0.2 us faster alone: split, the
# residual add + RMSNorm after them run in the sum launch (skinny_gemm_rms_norm), and the batch-1 k = 6
# verify took 4.545 against 4.621 ms, the batch-16 step 4.593 against 4.623 (docs/BENCHMARKS.md,
# "Figures behind code choices"). (q/k/v split the same way with its partials summed in the q/k norm + rotary
# kernel measured slower: batch 64 5.336 against 5.241 ms; not kept.)
SKINNY_GEMM_TABLE: dict[tuple[int, int, int], Config] = {
    (4, 4096, 4096): (64, 128, 2, 4, 5),  # o: 11.1 vs cuBLAS 12.6 us
    (4, 4096, 12288): (64, 128, 2, 4, 5),  # down: 26.1 vs cuBLAS 30.2 us
    (4, 6144, 4096): (64, 128, 1, 4, 5),  # qkv: 14.4 vs cuBLAS 15.5 us
    (4, 151936, 4096): (64, 128, 1, 4, 5),  # lm_head: 276.5 vs cuBLAS 290.8 us
    (8, 4096, 4096): (64, 256, 2, 4, 5),  # o: split so that the norm after it joins the sum (see above)
    (8, 4096, 12288): (64, 128, 2, 4, 5),  # down: 26.6 vs cuBLAS 28.4 us (TMA)
    (8, 6144, 4096): (64, 256, 1, 4, 4),  # qkv: 14.2 vs cuBLAS 15.0 us (TMA)
    (8, 24576, 4096): (64, 64, 1, 4, 5),  # gate_up: 47.5 vs cuBLAS 52.6 us
    (8, 151936, 4096): (128, 128, 1, 8, 4),  # lm_head: 279.4 vs cuBLAS 289.7 us
    (16, 4096, 4096): (64, 256, 2, 4, 5),  # o: 10.8 vs cuBLAS 12.8 us (TMA)
    (16, 4096, 12288): (64, 128, 2, 4, 5),  # down: the same
    (16, 6144, 4096): (64, 256, 1, 4, 4),  # qkv: 14.2 vs cuBLAS 15.8 us (TMA)
    (16, 151936, 4096): (128, 128, 1, 8, 3),  # lm_head: 280.8 vs cuBLAS 290.9 us
    (32, 4096, 4096): (64, 128, 1, 4, 5),  # o: 12.4 vs cuBLAS 13.8 us
    (32, 4096, 12288): (64, 128, 2, 4, 5),  # down: 27.3 vs cuBLAS 29.0 us (TMA)
    (32, 6144, 4096): (64, 128, 1, 4, 5),  # qkv: 15.3 vs cuBLAS 16.0 us
    (32, 151936, 4096): (128, 128, 1, 4, 5),  # lm_head: 291.4 vs cuBLAS 306.5 us (TMA, 2026-12-03)
    (64, 4096, 4096): (64, 128, 2, 4, 5),  # o: 11.8 vs cuBLAS 12.2 us (TMA)
    (64, 4096, 12288): (64, 128, 2, 4, 5),  # down: 28.1 vs cuBLAS 31.2 us (TMA)
    (64, 6144, 4096): (64, 128, 1, 4, 5),  # qkv: 15.1 vs cuBLAS 16.1 us (TMA)
    (64, 151936, 4096): (128, 64, 1, 4, 3),  # lm_head: 297.6 vs cuBLAS 313.7 us (TMA, 2026-12-03)
    # Qwen3-0.6B's (the draft's forwards at batch 3-64), measured 2026-12-04 with TMA
    # (benchmarks/results/2026-12-04-skinny-gemm-h200-draft-0.6b.json): 0.50-0.96x cuBLAS's time
    (4, 1024, 2048): (64, 128, 4, 4, 3),  # o: 4.1 vs cuBLAS 8.2 us
    (4, 1024, 3072): (64, 128, 4, 4, 5),  # down: 5.1 vs cuBLAS 7.5 us
    (4, 4096, 1024): (64, 128, 1, 4, 5),  # qkv: 4.5 vs cuBLAS 5.2 us
    (4, 6144, 1024): (64, 128, 1, 4, 5),  # gate_up: 5.2 vs cuBLAS 6.0 us
    (4, 151936, 1024): (64, 128, 1, 4, 5),  # lm_head: 75.3 vs cuBLAS 80.2 us
    (8, 1024, 2048): (64, 128, 4, 4, 5),  # o: 4.6 vs cuBLAS 5.9 us
    (8, 1024, 3072): (64, 128, 4, 4, 3),  # down: 5.2 vs cuBLAS 7.5 us
    (8, 4096, 1024): (64, 128, 1, 4, 5),  # qkv: 4.4 vs cuBLAS 5.3 us
    (8, 6144, 1024): (64, 128, 1, 4, 5),  # gate_up: 5.3 vs cuBLAS 6.2 us
    (8, 151936, 1024): (128, 128, 1, 4, 3),  # lm_head: 75.7 vs cuBLAS 80.9 us
    (16, 1024, 2048): (32, 64, 4, 4, 5),  # o: 4.6 vs cuBLAS 5.9 us
    (16, 1024, 3072): (64, 128, 4, 4, 5),  # down: 5.2 vs cuBLAS 7.8 us
    (16, 4096, 1024): (64, 128, 1, 4, 5),  # qkv: 4.6 vs cuBLAS 5.3 us
    (16, 6144, 1024): (64, 128, 1, 4, 5),  # gate_up: 5.3 vs cuBLAS 6.2 us
    (16, 151936, 1024): (128, 128, 1, 4, 3),  # lm_head: 77.2 vs cuBLAS 81.2 us
    (32, 1024, 2048): (64, 128, 4, 4, 5),  # o: 4.7 vs cuBLAS 5.9 us
    (32, 1024, 3072): (64, 128, 4, 4, 5),  # down: 5.2 vs cuBLAS 7.8 us
    (32, 4096, 1024): (64, 128, 1, 4, 5),  # qkv: 4.8 vs cuBLAS 5.3 us (best 32x256: spills, pointer loads)
    (32, 6144, 1024): (64, 128, 1, 4, 5),  # gate_up: 5.4 vs cuBLAS 6.3 us
    (32, 151936, 1024): (128, 64, 1, 4, 5),  # lm_head: 79.2 vs cuBLAS 83.2 us
    (64, 1024, 2048): (64, 128, 4, 4, 5),  # o: 4.8 vs cuBLAS 5.8 us
    (64, 1024, 3072): (64, 128, 4, 4, 5),  # down: 5.4 vs cuBLAS 8.1 us
    (64, 4096, 1024): (64, 128, 1, 4, 5),  # qkv: 4.8 vs cuBLAS 5.4 us
    (64, 6144, 1024): (64, 128, 1, 4, 5),  # gate_up: 5.5 vs cuBLAS 6.5 us
    (64, 151936, 1024): (64, 64, 1, 4, 4),  # lm_head: 84.1 vs cuBLAS 87.6 us
}

# The same for gate_up with SiLU(gate) * up in the epilogue (glu=True), keyed by (rows bucket, I, K)
# with I the outputs (half the gate_up rows), against cuBLAS's gate_up product followed by the
# silu_and_mul launch (bench_skinny_gemm --glu). SPLIT_K is always 1. Measured 2026-12-01 on the H200
# (benchmarks/results/2026-12-01-skinny-glu-h200.json): Qwen3-8B's gate_up at 4 to 64 rows.
SKINNY_GLU_TABLE: dict[tuple[int, int, int], Config] = {
    (4, 12288, 4096): (64, 128, 1, 4, 3),  # 48.2 vs cuBLAS + silu_and_mul 51.0 us
    (8, 12288, 4096): (64, 128, 1, 4, 3),  # 48.4 vs 56.6 us
    (16, 12288, 4096): (64, 128, 1, 4, 3),  # 48.7 vs 52.6 us
    (32, 12288, 4096): (128, 128, 1, 8, 3),  # 49.8 vs 53.2 us
    (64, 12288, 4096): (64, 64, 1, 4, 4),  # 51.6 vs 54.9 us
    # Qwen3-0.6B's gate_up, measured 2026-12-04 (...-skinny-glu-h200-draft-0.6b.json)
    (4, 3072, 1024): (64, 256, 1, 4, 3),  # 5.7 vs cuBLAS + silu_and_mul 6.9 us
    (8, 3072, 1024): (64, 256, 1, 4, 3),  # 5.7 vs cuBLAS + silu_and_mul 7.7 us
    (16, 3072, 1024): (64, 256, 1, 4, 3),  # 5.7 vs cuBLAS + silu_and_mul 7.8 us
    (32, 3072, 1024): (32, 256, 1, 4, 3),  # 6.5 vs cuBLAS + silu_and_mul 8.0 us
    (64, 3072, 1024): (32, 256, 1, 4, 3),  # 6.8 vs cuBLAS + silu_and_mul 8.3 us
}


def row_bucket(num_rows: int) -> int:
    """The smallest measured row count >= num_rows (MIN_ROWS <= num_rows <= MAX_ROWS)."""
    return next(b for b in ROW_BUCKETS if b >= num_rows)


def skinny_gemm_wins(num_rows: int, n: int, k: int, glu: bool = False) -> bool:
    """Whether the table (glu: SKINNY_GLU_TABLE, n the outputs) says this kernel beats cuBLAS for an
    [num_rows, k] x [n, k].T product."""
    if not MIN_ROWS <= num_rows <= MAX_ROWS:
        return False
    return (row_bucket(num_rows), n, k) in (SKINNY_GLU_TABLE if glu else SKINNY_GEMM_TABLE)


def skinny_gemm_config(num_rows: int, n: int, k: int, glu: bool = False) -> Config:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [num_rows, k] x [n, k].T product
    (glu: n outputs from 2n weight rows): the table's entry when there is one, else a shape rule
    (enough programs to fill 132 SMs twice, 64 KiB of W in flight per program; never split with glu)."""
    if MIN_ROWS <= num_rows <= MAX_ROWS:
        hit = (SKINNY_GLU_TABLE if glu else SKINNY_GEMM_TABLE).get((row_bucket(num_rows), n, k))
        if hit is not None:
            return hit
    block_n = 64 if n >= 64 * 264 else 32
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    split = 1
    while not glu and triton.cdiv(n, block_n) * split < 264 and k >= 2 * split * 2 * block_k and split < 4:
        split *= 2
    return block_n, block_k, split, 4, 4


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], last dim contiguous
    stride_x,
    w_ptr,  # [N, K] (GLU: [2N, K], gate rows then up rows), last dim contiguous
    stride_w,
    b_ptr,  # [N] (GLU: [2N]) (HAS_BIAS)
    y_ptr,  # [M, N] of any float dtype (SPLIT == False) or float32 partials [SPLIT_K, M, N] (SPLIT == True)
    stride_y,  # row stride of y / of one partial slice
    stride_ys,  # stride between partial slices (SPLIT)
    M,
    N,
    K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    GLU: tl.constexpr,  # y = SiLU(x @ W[:N].T + b[:N]) * (x @ W[N:].T + b[N:]); never with SPLIT
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    DOT_F32: tl.constexpr,  # widen the operands first (exact): the CPU interpreter's bf16 dot is wrong
    PDL: tl.constexpr,
    TMA: tl.constexpr,  # x_ptr, w_ptr are tensor descriptors of [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] tiles
    X_DTYPE: tl.constexpr,  # x's element type: GLU rounds SiLU(gate) and up to it, as the unfused pair does
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if not TMA:
        # Out-of-range columns and padding rows read valid rows (wrapped) instead of masking the
        # streaming loads; their results are never stored. (Descriptors fill them with zeros.)
        w_rows = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N)
        x_rows = rows % M
        w_base = w_ptr + w_rows.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_base = x_ptr + x_rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
        up_base = w_base + N.to(tl.int64) * stride_w  # GLU: the up rows, N rows further
    wait_prior(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M) if GLU else (1, 1), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if TMA:  # whole tiles from the copy engine, zeros past the tensor's edges: no masks
            w = w_ptr.load([pid_n * BLOCK_N, k0])
            x = x_ptr.load([0, k0])
        elif EVEN_K:
            w = tl.load(w_base + k0, eviction_policy="evict_first")
            x = tl.load(x_base + k0)
        else:
            # masked on both sides: out-of-range x could be inf/NaN, and inf * 0 is NaN
            k_ok = (k0 + ks) < k_end
            w = tl.load(w_base + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_base + k0, mask=k_ok[None, :], other=0.0)
        acc = _tile_dot(w, x, acc, DOT_F32)
        if GLU:
            if TMA:
                w_up = w_ptr.load([N + pid_n * BLOCK_N, k0])
            elif EVEN_K:
                w_up = tl.load(up_base + k0, eviction_policy="evict_first")
            else:
                w_up = tl.load(up_base + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            acc_up = _tile_dot(w_up, x, acc_up, DOT_F32)
    release_next(PDL)
    store_ok = (cols < N)[:, None] & (rows < M)[None, :]
    if SPLIT:
        out = y_ptr + pid_k * stride_ys + rows[None, :] * stride_y + cols[:, None]
        tl.store(out, acc, mask=store_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        if GLU:
            if HAS_BIAS:
                acc_up += tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
            acc = silu_mul(acc, acc_up, X_DTYPE)
        out = y_ptr + rows[None, :] * stride_y + cols[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _tile_dot(w, x, acc, DOT_F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K].T in float32."""
    if DOT_F32:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _split_k_sum_kernel(
    part_ptr,  # [SPLIT_K, M * N] float32
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M * N], contiguous
    MN,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # a fixed order: the same sum every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    release_next(PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_k_sum_rms_norm_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32, contiguous
    b_ptr,  # [N] (HAS_BIAS)
    res_ptr,  # [M, N] residual in, last dim contiguous
    stride_res,
    out_ptr,  # [M, N] normed out, contiguous
    res_out_ptr,  # [M, N] product + residual out, contiguous
    w_ptr,  # [N] norm weight
    MN,
    N,
    eps,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N: one program per row
    PREFETCH: tl.constexpr,  # pdl.PREFETCH: the norm's weight read before the wait
    PDL: tl.constexpr,
):
    # The sum of _split_k_sum_kernel, then _rms_norm_kernel's residual add and norm, in their orders.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = cols  # without PREFETCH rms_norm_row reads the weight itself
    if PREFETCH:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_prior(PDL)
    part = part_ptr + row * N + cols
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part + s * MN, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = acc.to(res_out_ptr.dtype.element_ty)  # the product, rounded once
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    x = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # `x + residual`
    tl.store(res_out_ptr + row * N + cols, x, mask=mask)
    out = rms_norm_row(x, w, w_ptr, cols, mask, N, eps, PREFETCH)
    release_next(PDL)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_SUM_BLOCK = 1024
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def use_tma(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x [M, K] and weight [N, K] (contiguous last dims) reads its tiles through
    tensor descriptors: TMA on, Hopper or newer (or the CPU interpreter, which emulates them), and both
    operands' addresses and row strides multiples of 16 bytes, as the copy engine needs."""
    if not TMA or (x.is_cuda and not hopper_or_newer(x.device)):
        return False
    size = x.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0 for t in (x, weight))


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    glu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16 or fp16), weight [N, K] (x's dtype), bias [N] or None -> x @
    weight.T + bias [M, N] in x's dtype, or in `out` ([M, N], any float dtype: rounded once to it).

    glu: weight [2 * N, K] holds gate rows then up rows (bias [2 * N]), and the result is
    SiLU(gate) * up [M, N] with the sums and roundings of the product followed by
    fused_triton.silu_and_mul at the same launch shape (see fused_triton.silu_mul; K is never split:
    SiLU needs whole sums).
    config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), default skinny_gemm_config."""
    return _skinny_product(x, weight, bias, config, glu, out, keep_partials=False)


def skinny_gemm_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K], bias [N] or None, residual [M, N], norm_weight [N] (all of x's dtype,
    bf16 or fp16) -> (RMSNorm(h + residual), h + residual), both [M, N], with h = x @ weight.T + bias:
    the values of fused_triton.rms_norm(skinny_gemm(x, weight, bias), norm_weight, eps, residual), bit
    for bit. When the launch splits K, the residual add and the norm run in the launch that sums the
    partials (one launch fewer); otherwise the two launches run as written."""
    n = weight.shape[0]
    if residual.shape != (x.shape[0], n) or norm_weight.shape != (n,):
        shapes = f"residual {tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}"
        raise ValueError(f"skinny_gemm_rms_norm needs [{x.shape[0]}, {n}] / [{n}], got {shapes}")
    if residual.dtype != x.dtype or norm_weight.dtype != x.dtype:
        dtypes = f"{x.dtype}, {residual.dtype}, {norm_weight.dtype}"
        raise ValueError(f"skinny_gemm_rms_norm takes x, residual and norm weight of one dtype, got {dtypes}")
    y = _skinny_product(x, weight, bias, config, False, None, keep_partials=True)
    if y.dim() == 2:  # K not split
        return rms_norm(y, norm_weight, eps, residual)  # type: ignore[return-value]
    split, m, n = y.shape
    if residual.stride(1) != 1:
        residual = residual.contiguous()
    normed, stream = (torch.empty(m, n, dtype=x.dtype, device=x.device) for _ in range(2))
    block = triton.next_power_of_2(n)
    _split_k_sum_rms_norm_kernel[(m,)](
        y, bias if bias is not None else norm_weight, residual, residual.stride(0), normed, stream,
        norm_weight.contiguous(), m * n, n, eps, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block,
        PREFETCH=prefetch(), num_warps=rms_norm_warps(block), **FP_COMPILE, **launch_args(x.device),
    )  # fmt: skip
    return normed, stream


def _skinny_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config | None,
    glu: bool,
    out: torch.Tensor | None,
    keep_partials: bool,
) -> torch.Tensor:
    """skinny_gemm's launches -> y [M, N]; with keep_partials, when K is split, the float32 partials
    [S, M, N] instead (no bias added: skinny_gemm_rms_norm's kernel adds it)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(
            f"skinny_gemm takes bf16 or fp16 operands of one dtype, got {x.dtype}, {weight.dtype}"
        )
    x, weight, y, done = product_operands("skinny_gemm", x, weight, bias, MAX_ROWS, glu, out)
    if done:
        return y
    (m, k), n = x.shape, y.shape[1]
    block_n, block_k, split, warps, stages = config or skinny_gemm_config(m, n, k, glu)
    steps = triton.cdiv(k, block_k)
    split = 1 if glu else max(1, min(split, steps))
    k_per_split = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    b = bias if bias is not None else weight
    grid = (triton.cdiv(n, block_n), split)
    pdl = launch_args(x.device)
    meta = dict(
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        DOT_F32=x.device.type == "cpu", TMA=use_tma(x, weight), X_DTYPE=_TL_DTYPES[x.dtype], num_warps=warps,
        num_stages=stages, **pdl,
    )  # fmt: skip
    xa, wa = x, weight  # pointers, or tensor descriptors of the tiles
    if meta["TMA"]:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x, [meta["BLOCK_M"], block_k])
        wa = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    if split == 1:
        _skinny_gemm_kernel[grid](
            xa, x.stride(0), wa, weight.stride(0), b, y, y.stride(0), 0, m, n, k, k_per_split,
            HAS_BIAS=bias is not None, SPLIT=False, GLU=glu, **meta,
        )  # fmt: skip
        return y
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[grid](
        xa, x.stride(0), wa, weight.stride(0), b, part, n, m * n, m, n, k, k_per_split,
        HAS_BIAS=False, SPLIT=True, GLU=False, **meta,
    )  # fmt: skip
    if keep_partials:
        return part
    _split_k_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](
        part, b, y, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=_SUM_BLOCK, num_warps=4, **pdl
    )
    return y
