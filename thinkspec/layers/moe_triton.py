"""The fused mixture-of-experts block in Triton (layers/moe.py has the torch reference), five launches
after the router's product:

  _route_kernel        per token: softmax of the router logits in float32, top-k by falling
                       probability (ties to the lower expert id, as torch.topk), renormalised when
                       norm_topk_prob is set
  _align_kernel        one program per expert: counts every expert's (token, slot) pairs, lays the
                       experts out one after another, each padded to a whole number of BLOCK_M-row
                       blocks, and writes its own pairs (in pair order) into its rows; padding rows hold
                       the sentinel T * K. `block_end[e]` is the end of expert e's blocks.
  _expert_gemm_kernel  (GATE_UP) a grouped GEMM over the blocks: each block's rows of x times its
                       expert's gate and up rows, SiLU(gate) * up fused -> h [T * K, I] by pair;
                       (not GATE_UP) h's rows times the expert's down rows, scaled by the pair's routing
                       weight -> y [T * K, H] by pair
  _combine_kernel      each token's k slots of y summed in float32 (0 for a CUDA graph's padding rows)

Decode (T <= DECODE_MAX_ROWS): BLOCK_M is T rounded up to a power of two, so each selected expert is
one block (a token picks an expert once): its weights are read once per column tile, whatever number
of the batch's tokens chose it, and there are no padding blocks, only padding rows in a block, which
cost no weight reads. The tile product is then a broadcast multiply-add (tl.dot needs 16 rows).
Larger T: BLOCK_M = 16 or 64 rows and tl.dot.

Roundings follow moe_reference: the gate and up products, SiLU(gate) and h are rounded to the model
dtype where the torch path stores them; the routing weight is rounded to the model dtype before it
scales the down product, and each pair's output is rounded before the slots' float32 sum. Sums run in
float32 (fp32 operands with IEEE products, so float32 agrees to the order of the sums).

Grids depend only on (T, top_k, experts), never on a device value, and no value is read on the host:
every launch can be captured in a CUDA graph, at fixed shapes per batch bucket. On CPU the kernels
run under TRITON_INTERPRET=1 (tests only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DECODE_MAX_ROWS = 8  # up to here the decode form (one block per selected expert, no tl.dot)


def _interpreting() -> bool:
    # the interpreter's tl.dot is wrong on bfloat16 operands; widen them to float32 there
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] model dtype, rows contiguous
    stride_l,
    weights_ptr,  # [T, TOP_K] float32 out
    ids_ptr,  # [T, TOP_K] int32 out
    num_experts,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,  # TOP_K rounded up to a power of two
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < num_experts
    x = tl.load(logits_ptr + t * stride_l + cols, mask=ok, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, e / tl.sum(e, axis=0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # the lowest id among ties
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(cols == idx, -2.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, top_i, mask=slots < TOP_K)


@triton.jit
def _align_kernel(
    ids_ptr,  # [N] int32 expert of each pair (N = T * TOP_K)
    sorted_ptr,  # [capacity] int32 out: pair ids by expert, padding rows already hold N
    block_end_ptr,  # [E] int32 out: end (exclusive) of each expert's blocks
    valid_ptr,  # [1] int32 rows before it are real, the rest padding (HAS_VALID)
    counter_ptr,  # [1] int32 += the number of experts with pairs (COUNT)
    num_pairs,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_VALID: tl.constexpr,
    COUNT: tl.constexpr,
):
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    limit = num_pairs
    if HAS_VALID:  # padding rows' pairs go to no expert
        limit = tl.minimum(tl.load(valid_ptr) * TOP_K, num_pairs)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < limit, other=-1)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(experts < e, blocks, 0), axis=0)
    own_blocks = tl.sum(tl.where(experts == e, blocks, 0), axis=0)
    tl.store(block_end_ptr + e, first_block + own_blocks)
    if COUNT:
        tl.atomic_add(counter_ptr, (own_blocks > 0).to(tl.int32))
    row = first_block * BLOCK_M
    for c in range(0, num_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < limit, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + row + pos, offs, mask=hit > 0)
        row += tl.sum(hit, axis=0)
    pad = row + tl.arange(0, BLOCK_M)  # the rest of its last block: fewer than BLOCK_M padding rows
    tl.store(sorted_ptr + pad, num_pairs, mask=pad < (first_block + own_blocks) * BLOCK_M)


@triton.jit
def _combine_kernel(
    y_ptr,  # [T * TOP_K, H] model dtype, each pair's weighted expert output (rows contiguous)
    out_ptr,  # [T, H] model dtype out
    valid_ptr,  # [1] int32 rows before it are real (HAS_VALID); padding rows get 0
    hidden,
    TOP_K: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    read = ok
    if HAS_VALID:
        read = ok & ((cols * 0 + t) < tl.load(valid_ptr))  # a vector: the interpreter takes no scalar mask
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * hidden + cols, mask=read, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tile_product(a, w, acc, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T in float32."""
    if USE_DOT:
        if DOT_F32:
            return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(w), acc)
    else:
        prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=2)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # GATE_UP: x [T, K_DIM]; else h [N, K_DIM]; rows contiguous
    stride_a,
    w_ptr,  # GATE_UP: gate_up [E, 2 * N_DIM, K_DIM]; else down [E, N_DIM, K_DIM]; last dim contiguous
    stride_we,
    stride_wn,
    out_ptr,  # GATE_UP: h [N, N_DIM]; else y [N, N_DIM]; model dtype, rows contiguous
    stride_o,
    sorted_ptr,  # [capacity] int32 pair ids by expert (sentinel N on padding rows)
    block_end_ptr,  # [E] int32
    weights_ptr,  # [N] float32 routing weight of each pair (not GATE_UP)
    num_pairs,
    num_experts,
    N_DIM,
    K_DIM,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(block_end_ptr + experts, mask=experts < num_experts, other=2**30)
    if b >= tl.max(tl.where(experts < num_experts, ends, 0), axis=0):
        return  # past the last expert's blocks: the grid is sized for the worst case
    e = tl.sum((ends <= b).to(tl.int32), axis=0).to(tl.int64)
    pairs = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // TOP_K) if GATE_UP else pairs
    a_rows = tl.where(valid, a_rows, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N_DIM
    w_base = w_ptr + e * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K_DIM
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=w_mask, other=0.0)
        acc = _tile_product(a, w, acc, USE_DOT, DOT_F32)
        if GATE_UP:
            up_rows = (N_DIM + n[:, None]).to(tl.int64)
            w_up = tl.load(w_base + up_rows * stride_wn + k[None, :], mask=w_mask, other=0.0)
            acc_up = _tile_product(a, w_up, acc_up, USE_DOT, DOT_F32)
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:  # F.silu(gate) * up with the torch path's roundings
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = silu * acc_up.to(dtype).to(tl.float32)
    else:  # the routing weight in the model dtype, as the reference scales by it
        scale = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
        result = acc.to(dtype).to(tl.float32) * scale[:, None]
    o_rows = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(
        out_ptr + o_rows[:, None] * stride_o + n[None, :],
        result.to(dtype),
        mask=valid[:, None] & n_ok[None, :],
    )


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int32), as moe.route."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits,
            logits.stride(0),
            weights,
            ids,
            e,
            TOP_K=top_k,
            NORM=norm_topk_prob,
            BLOCK_E=_pow2(e),
            BLOCK_K=_pow2(top_k),
        )
    return weights, ids


def block_rows(num_tokens: int) -> int:
    """BLOCK_M for T tokens: T rounded up to a power of two in the decode form, else 16 or 64."""
    if num_tokens <= DECODE_MAX_ROWS:
        return _pow2(num_tokens)
    return 16 if num_tokens <= 256 else 64


def align_by_expert(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    num_valid: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """ids: [T, K] int32 -> (sorted pair ids [capacity] int32 with padding rows = T * K, block_end [E]
    int32, the grid's block count): each expert's pairs in pair order, padded to whole blocks.
    num_valid: [1] int32 on the device, rows from it on are padding and go to no expert (None: all
    rows real); counter: [1] int32, += the number of experts given pairs (None: not counted)."""
    pairs = ids.numel()
    # every expert's last block may be partly padding; at most min(E, pairs) experts have pairs
    max_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    if block_m >= ids.shape[0]:  # decode form: one block per selected expert
        max_blocks = min(num_experts, pairs)
    # rows past the last expert's blocks are left unwritten: no GEMM program reads them
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_end = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block_e = _pow2(num_experts)
    chunk = max(16, min(_pow2(pairs), 16384 // block_e))
    unused = block_end  # stands in for an absent pointer (its constexpr flag is off)
    _align_kernel[(num_experts,)](
        ids.reshape(-1), sorted_ids, block_end, unused if num_valid is None else num_valid,
        unused if counter is None else counter, pairs, num_experts, TOP_K=ids.shape[1], BLOCK_M=block_m,
        BLOCK_E=block_e, CHUNK=chunk, HAS_VALID=num_valid is not None, COUNT=counter is not None,
    )  # fmt: skip
    return sorted_ids, block_end, max_blocks


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    num_valid: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; logits: [T, E] router logits -> [T, H] in x's
    dtype, what route + moe_reference compute (module docstring for the launches). num_valid: [1] int32
    on the device, the real rows (a CUDA graph's padding rows after them read no expert and get 0);
    counter: [1] int32 on the device, += the number of experts this call reads (benchmarks)."""
    t, hidden = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    if gate_up.shape != (e, 2 * inter, hidden) or down.shape != (e, hidden, inter) or logits.shape != (t, e):
        shapes = f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
        raise ValueError(f"fused_moe: mismatched shapes {shapes}, logits {tuple(logits.shape)}")
    weights, ids = route_topk(logits, top_k, norm_topk_prob)
    if t == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = block_rows(t)
    sorted_ids, block_end, max_blocks = align_by_expert(ids, e, block_m, num_valid, counter)
    pairs = t * top_k
    use_dot = block_m >= 16
    dot_f32 = x.dtype == torch.float32 or _interpreting()
    block_n = 64 if use_dot else 32
    common = dict(
        TOP_K=top_k, USE_DOT=use_dot, DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=64 if use_dot else 32, BLOCK_E=_pow2(e),
    )  # fmt: skip
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _expert_gemm_kernel[(max_blocks, triton.cdiv(inter, block_n))](
        x, x.stride(0), gate_up, gate_up.stride(0), gate_up.stride(1), h, h.stride(0),
        sorted_ids, block_end, weights, pairs, e, inter, hidden, GATE_UP=True, **common,
    )  # fmt: skip
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # padding rows' pairs: unwritten
    _expert_gemm_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        h, h.stride(0), down, down.stride(0), down.stride(1), y, y.stride(0),
        sorted_ids, block_end, weights, pairs, e, hidden, inter, GATE_UP=False, **common,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_h = min(1024, _pow2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](
        y, out, block_end if num_valid is None else num_valid, hidden, TOP_K=top_k,
        HAS_VALID=num_valid is not None, BLOCK_H=block_h,
    )  # fmt: skip
    return out
