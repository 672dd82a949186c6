"""Fused Triton kernels for the decoder's small element-wise ops, one launch each:

  rms_norm        RMSNorm, optionally fused with the residual add before it (vLLM's fused_add_rms_norm)
  qk_norm_rope    per-head RMSNorm of q and k (Qwen3's q_norm/k_norm, optional) + neox rotary, q and k
                  in one launch, cos/sin gathered by position inside the kernel
  silu_and_mul    SiLU(gate) * up from the merged gate_up projection

Each one computes what the torch code path computes (RMSNorm.forward in norm.py, RotaryEmbedding in
rotary.py, `F.silu(gate) * up` in decoder.py), with the same rounding order: statistics in float32,
every intermediate the torch path stores in the model dtype rounded to it at the same point (a bf16
product of two bf16 values is exact in float32, so rounding it once reproduces the torch op). What
can differ is the order of the float32 sum in the mean of squares (and rsqrt/exp to an ulp), so
float32 results agree to a few ulps and bf16 results to one bf16 rounding. Kernels are compiled with
`enable_fp_fusion=False` so that a*b - c*d is not contracted into an FMA the torch path does not use.

Grids depend only on tensor shapes (host ints) and no device value is read on the host, so every
wrapper is CUDA-graph capturable. T = 0 launches nothing. On CPU they run under TRITON_INTERPRET=1
(tests only); the torch path is the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinkspec.layers.pdl import early_release, launch_args, prefetch, release_next, wait_prior

FP_COMPILE = {"enable_fp_fusion": False}  # no FMA contraction the torch path does not do


def rms_norm_warps(block: int) -> int:
    """num_warps of a one-row-per-program RMSNorm over `block` columns (the reduction's order follows it)."""
    return min(max(block // 512, 1), 16)


@triton.jit
def rms_norm_row(x, w, w_ptr, cols, mask, n_cols, eps, PREFETCH: tl.constexpr):
    """One row's RMSNorm in RMSNorm.forward's roundings: x [BLOCK] in the model dtype (zero past n_cols),
    w [BLOCK] the weight when PREFETCH (read before the PDL wait), else read here from w_ptr + cols
    after the statistics -> `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)` [BLOCK] float32, for the
    caller's store to round once. Shared by every kernel that ends in the norm, so all reduce alike."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)  # `x.to(dtype)`
    if not PREFETCH:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * y.to(tl.float32)  # `self.weight * x`


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N], last dim contiguous
    stride_x,
    res_ptr,  # [T, N] residual in (HAS_RESIDUAL), last dim contiguous
    stride_res,
    out_ptr,  # [T, N] normed out
    stride_out,
    res_out_ptr,  # [T, N] x + residual out (HAS_RESIDUAL)
    stride_res_out,
    w_ptr,  # [N]
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,  # pdl.EARLY_RELEASE: the next kernel is let in right after the wait
    PREFETCH: tl.constexpr,  # pdl.PREFETCH: the norm's weight read before the wait
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = cols  # without PREFETCH rms_norm_row reads the weight itself
    if PREFETCH:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_prior(PDL)
    if EARLY:
        release_next(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # `x + residual`
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    out = rms_norm_row(x, w, w_ptr, cols, mask, n_cols, eps, PREFETCH)
    if not EARLY:
        release_next(PDL)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, as RMSNorm.forward, optionally after the residual add.

    x: [..., N] (rows may be strided, the last dim contiguous); weight: [N]; residual: None or the
    same shape as x. Without a residual returns normed [..., N]; with one returns (normed, x +
    residual), the sum in torch's promoted dtype of x and residual (the model dtype), and normed =
    weight * (s.float() * rsqrt(mean(s.float()**2) + eps)).to(s.dtype) with s the sum (or x), in the
    promoted dtype of weight and s. New contiguous tensors; the inputs are not written.
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = x.reshape(-1, n)
    if residual is None:
        res2, res_out = x2, x2  # unused by the kernel
        s_dtype = x.dtype
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        res2 = residual.reshape(-1, n)
        s_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=s_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, s_dtype), device=x.device)
    rows = x2.shape[0]
    if rows:
        if x2.stride(-1) != 1 or res2.stride(-1) != 1 or weight.stride(0) != 1:
            raise ValueError("rms_norm needs the last dim of x, residual and weight contiguous")
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, x2.stride(0), res2, res2.stride(0), out, out.stride(0), res_out, res_out.stride(0),
            weight, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, EARLY=early_release(rows), PREFETCH=prefetch(),
            num_warps=rms_norm_warps(block), **FP_COMPILE, **launch_args(x.device),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _norm_rope_heads(
    x_ptr,  # [T, H, D] input (q or k), last dim contiguous
    stride_xt,
    stride_xh,
    o_ptr,  # [T, H, D] output
    stride_ot,
    stride_oh,
    w1,  # [1, BLOCK_HALF] float32: the norm weight's first half (HAS_NORM)
    w2,  # [1, BLOCK_HALF] float32: its second half
    t,  # token (int64)
    h0,  # first head of this program
    num_heads,
    cos,  # [1, BLOCK_HALF] float32
    sin,
    eps,
    c_ptr,  # STORE_C: this token's slot in a paged cache [num_blocks, block_size, H, D] (row base)
    stride_ch,
    c_heads,  # STORE_C: heads to write there: num_heads, or 0 when the token has no slot
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_C: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh + j
    x1 = tl.load(src, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF] first half of each head
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    o_ty = o_ptr.dtype.element_ty
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:  # RMSNorm over the head: fp32 stats, `.to(dtype)`, then `weight * x` rounded to o_ty
        var = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / HEAD_DIM
        rstd = tl.math.rsqrt(var + eps)[:, None]
        a1 = (w1 * (a1 * rstd).to(x1.dtype).to(tl.float32)).to(o_ty).to(tl.float32)
        a2 = (w2 * (a2 * rstd).to(x2.dtype).to(tl.float32)).to(o_ty).to(tl.float32)
    # rotate half: cat(x1*cos - x2*sin, x2*cos + x1*sin), each product and sum rounded to o_ty
    c = cos.to(o_ty).to(tl.float32)
    s = sin.to(o_ty).to(tl.float32)
    o1 = (a1 * c).to(o_ty).to(tl.float32) - (a2 * s).to(o_ty).to(tl.float32)
    o2 = (a2 * c).to(o_ty).to(tl.float32) + (a1 * s).to(o_ty).to(tl.float32)
    dst = o_ptr + t * stride_ot + h * stride_oh + j
    tl.store(dst, o1.to(o_ty), mask=mask)
    tl.store(dst + HALF, o2.to(o_ty), mask=mask)
    if STORE_C:
        c_ty = c_ptr.dtype.element_ty
        cdst = c_ptr + h * stride_ch + j
        c_mask = (h < c_heads) & (j < HALF)
        tl.store(cdst, o1.to(o_ty).to(c_ty), mask=c_mask)
        tl.store(cdst + HALF, o2.to(o_ty).to(c_ty), mask=c_mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    stride_qt,
    stride_qh,
    k_ptr,  # [T, Hkv, D], last dim contiguous
    stride_kt,
    stride_kh,
    q_out_ptr,  # [T, Hq, D]
    stride_qot,
    stride_qoh,
    k_out_ptr,  # [T, Hkv, D]
    stride_kot,
    stride_koh,
    q_w_ptr,  # [D] (HAS_NORM)
    k_w_ptr,  # [D] (HAS_NORM)
    pos_ptr,  # [T] int64
    cache_ptr,  # [max_positions, 2, D/2] float32: cos then sin
    stride_cp,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    eps,
    v_ptr,  # STORE_KV: [T, Hkv, D], last dim contiguous
    stride_vt,
    stride_vh,
    k_cache_ptr,  # STORE_KV: [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache_ptr,  # STORE_KV: same layout and strides as k_cache
    stride_kvb,
    stride_kvs,
    stride_kvh,
    slot_ptr,  # STORE_KV: [T] int64 KV slot of each token, -1 = none
    block_size,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    PREFETCH: tl.constexpr,  # pdl.PREFETCH: positions, slots, the rotary table and the norm weights
    PDL: tl.constexpr,  # read before the wait
):
    if not PREFETCH:
        wait_prior(PDL)
    # grid (T, cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H)): one token x BLOCK_H heads of q, then of k;
    # with STORE_KV the k programs also write the rotated k and the token's v into the paged caches
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HEAD_DIM // 2
    cos = tl.load(cache_ptr + pos * stride_cp + j, mask=j_ok, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cp + stride_cs + j, mask=j_ok, other=0.0)[None, :]
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    is_q = g < q_blocks
    w1, w2 = cos, sin  # placeholders without a norm
    if HAS_NORM:  # this program's heads' norm weight (q's or k's), as two halves
        w_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
        w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HEAD_DIM // 2 + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    slot = 0
    if STORE_KV:
        slot = tl.load(slot_ptr + t)
    if PREFETCH:
        wait_prior(PDL)
    release_next(PDL)  # each program's remaining work is a few loads and its stores
    if is_q:
        _norm_rope_heads(
            q_ptr, stride_qt, stride_qh, q_out_ptr, stride_qot, stride_qoh, w1, w2, t, g * BLOCK_H,
            num_q_heads, cos, sin, eps, q_out_ptr, 0, 0, HAS_NORM, HEAD_DIM, BLOCK_H, BLOCK_HALF, False,
        )  # fmt: skip
    else:
        h0 = (g - q_blocks) * BLOCK_H
        c_row = 0
        c_heads = 0
        if STORE_KV:
            c_heads = tl.where(slot >= 0, num_kv_heads, 0)  # slot -1: nothing stored
            slot = tl.maximum(slot, 0)
            c_row = (slot // block_size) * stride_kvb + (slot % block_size) * stride_kvs
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            dd = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            v_mask = (h < c_heads) & (dd < HEAD_DIM)
            vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + dd, mask=v_mask)
            tl.store(
                v_cache_ptr + c_row + h * stride_kvh + dd, vv.to(v_cache_ptr.dtype.element_ty), mask=v_mask
            )
        _norm_rope_heads(
            k_ptr, stride_kt, stride_kh, k_out_ptr, stride_kot, stride_koh, w1, w2, t, h0, num_kv_heads,
            cos, sin, eps, k_cache_ptr + c_row, stride_kvh, c_heads, HAS_NORM, HEAD_DIM, BLOCK_H, BLOCK_HALF,
            STORE_KV,
        )  # fmt: skip


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when q_weight/k_weight are given) then neox rotary, on q and k in one launch.

    kv_store: (v, k_cache, v_cache, slot_mapping) to also write each token's rotated k and its v
    into the paged caches at its slot, as attention's KV store would (saves that launch): v
    [T, Hkv, D] last dim contiguous; caches [num_blocks, block_size, Hkv, D] sharing strides, last
    dim contiguous; slot_mapping [T] int64, -1 = not written.

    positions: [T] int64, each < max_positions; q: [T, Hq, D], k: [T, Hkv, D], each with its last dim
    contiguous (views into the merged qkv output are fine); cos_sin_cache: [max_positions, 2, D/2]
    float32 (RotaryEmbedding.cos_sin_cache: cos then sin); q_weight, k_weight: [D] or both None.
    Returns new contiguous (q, k) [T, H, D], equal to `rotary(positions, q_norm(q), k_norm(k))`:
    dtype q's (promoted with the norm weight's when normed).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (t, hkv, d) or positions.shape != (t,):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree"
        )
    if d % 2 or cos_sin_cache.shape[1:] != (2, d // 2):
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not fit head_dim {d}")
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("pass both q_weight and k_weight, or neither")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype}, {k.dtype}")
    out_dtype = q.dtype
    if has_norm:
        if q_weight.shape != (d,) or k_weight.shape != (d,) or q_weight.dtype != k_weight.dtype:
            raise ValueError(f"q/k norm weights must both be [{d}] of one dtype")
        out_dtype = torch.promote_types(q_weight.dtype, q.dtype)
    q_out = torch.empty((t, hq, d), dtype=out_dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=out_dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs the last dim of q, k and cos_sin_cache contiguous")
    block_h = 1 if t < 64 else 4  # small steps: one head per program, for more programs
    block_half = triton.next_power_of_2(d // 2)
    w_q = q_weight if has_norm else q  # unused pointers when there is no norm
    w_k = k_weight if has_norm else k
    if kv_store is None:
        v, k_cache, v_cache, slots = k, k_out, k_out, positions  # unused pointers
        cache_strides, block_size = (0, 0, 0), 1
    else:
        v, k_cache, v_cache, slots = kv_store
        if v.shape != k.shape or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"kv_store: v {tuple(v.shape)} or caches {tuple(k_cache.shape)} do not fit k {tuple(k.shape)}"
            )
        if (
            slots.shape != (t,)
            or v.stride(-1) != 1
            or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1
        ):
            raise ValueError(
                "kv_store: slot_mapping must be [T]; v and the caches need a contiguous last dim, "
                "the caches equal strides"
            )
        cache_strides, block_size = k_cache.stride()[:3], k_cache.shape[1]
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _qk_norm_rope_kernel[grid](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1),
        q_out, q_out.stride(0), q_out.stride(1), k_out, k_out.stride(0), k_out.stride(1),
        w_q, w_k, positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        hq, hkv, eps, v, v.stride(0), v.stride(1), k_cache, v_cache, *cache_strides, slots, block_size,
        HAS_NORM=has_norm, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_HALF=block_half, STORE_KV=kv_store is not None,
        PREFETCH=prefetch(), num_warps=min(max(block_h * block_half // 128, 1), 4), **FP_COMPILE,
        **launch_args(q.device),
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """SiLU(gate) * up in float32 with the unfused path's roundings: gate and up as the projection
    stores them (rounded to DTYPE), SiLU rounded to DTYPE (`F.silu`), the product left for the
    caller's store to round. Shared by silu_and_mul and the products that fuse it (gemv_triton.py,
    gemm_skinny_triton.py), so fused and unfused results round alike (bit for bit under the
    interpreter; on the H200 over 99.9% of outputs equal at the same launch shape, the rest a
    rounding apart)."""
    g = gate.to(DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE)
    return act.to(tl.float32) * up.to(DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2*I]: gate then up, last dim contiguous
    stride_x,
    out_ptr,  # [T, I]
    stride_out,
    n_cols,  # I
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    out = silu_mul(gate, up, gate.dtype)
    release_next(PDL)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from the merged gate_up output.

    x: [T, 2*I] (gate in the first I columns, up in the last I; rows may be strided, the last dim
    contiguous) -> new contiguous [T, I] of x's dtype, equal to `F.silu(gate) * up`.
    """
    rows, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"gate_up width {two_i} is odd")
    n = two_i // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs the last dim of x contiguous")
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        x, x.stride(0), out, out.stride(0), n, BLOCK=block, num_warps=4, **FP_COMPILE, **launch_args(x.device)
    )
    return out
