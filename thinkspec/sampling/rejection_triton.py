"""Fused Triton kernels for `rejection_sample` (same contract as the torch reference in rejection.py).

Launches, all with grids fixed by (B, K, V) so a round can be CUDA-graph captured (no host sync):
  1. _row_stats_kernel    grid (B*(K+1), NC)  one vocabulary chunk per program, streamed: chunk max,
                          its lowest index, #{v : x[v] > x[d]} and, when the row needs it (sampled
                          request or relax_delta set), sum exp(x - chunk max). x[d] is read by index.
  2. _accept_request      reduces the NC partials of each row, runs the accept/first-reject logic
                          and writes every output; greedy requests are done. Run by the request's last
                          stats program to finish (FUSE_ACCEPT), or as _accept_kernel, grid (B,).
  3. _race_kernel         grid (B, NC)        sampled requests only: exponential race over the
                          emitting row, argmax_v r(v) / E_v with E_v ~ Exp(1) from a counter-based
                          RNG, r = max(0, p - q) (residual) or p (bonus); no normalised copy is made.
  4. _race_reduce_kernel  grid (B,)           picks the race winner across tiles.
Launches 3-4 are skipped when the caller promises `all_greedy=True`.
The lenient and typical rules (a batch with `relax_rule` set) compile with RULES=True: the stats pass
also sums exp(x - max) * x for the entropy, and the accept step picks each row's rule. Without
`relax_rule` every RULES branch is a constexpr False, so the default rule's launches run the code
they ran before the rules existed (no extra loads, stores or arithmetic); the race is shared, since
every rule's residual is max(0, p - q).

Randomness is keyed by (seed of the request, seed_offset, row, token) through Philox, so a request's
result depends only on its own inputs and seed; without `seeds` one seed per request is drawn from
`generator`. Under CUDA-graph replay, keep `seed_offset` fixed and advance `seeds` in place.
Values are not checked unless `validate=True` (that check syncs); NaN or +inf in a used row then
gives unspecified tokens instead of an error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinkspec.sampling.rejection_common import AcceptanceBatch, RejectionResult, check_values

# Vocabulary tile per program: large enough to keep many loads in flight per program, small enough
# that B*(K+1) rows x V/TILE tiles fill every SM several times over.
MAX_TILE = 8192
NUM_WARPS = 8
# The stats pass streams chunks of a row per program (see _stats_split). Each lane reads VEC
# neighbours per step; the greedy loops issue 3.7 (strict) and 6.6 (relaxable) instructions per bf16
# entry (benchmarks/kernels/kernel_loop_cost.py), so they are bound by memory, not issue. The shape is the
# one with the lowest worst-case time over bf16/fp32 x 320/1280 rows in benchmarks/kernels/tune_acceptance.py
# on the H200 (docs/BENCHMARKS.md).
STATS_TILE = 1024
STATS_VEC = 4
STATS_WARPS = 8
# Registers per thread the stats launch is held to (tests/test_kernels_compile.py checks that at
# most a value or two spills, outside the loops). It fixes how many programs fit on an SM at once,
# so the grid can be one full wave: a second, partial wave of long programs costs about as much as
# the first (docs/BENCHMARKS.md, "Figures behind code choices").
STATS_MAXNREG = 48
# The stats launch also runs the accept logic (last-block pattern) instead of a second launch.
FUSE_ACCEPT = True
_INT32_MAX: tl.constexpr = tl.constexpr(2147483647)  # globals read by kernels must be constexpr
NC_BLOCK: tl.constexpr = tl.constexpr(16)  # chunk partials the accept step reduces per step


@triton.jit
def _scaled(x, temp):
    # x / temp for sampled rows (temp != 0), as float32. IEEE division (plain `/` is approximate on
    # GPU), so x matches the reference bit for bit.
    x = x.to(tl.float32)
    if temp != 0.0:
        x = tl.math.div_rn(x, temp)
    return x


@triton.jit
def _stats_loop(base, start, end, offs2, xd, temp, TILE: tl.constexpr, LANES: tl.constexpr,
                WITH_SUM: tl.constexpr, WITH_CNT: tl.constexpr, WITH_ENT: tl.constexpr):  # fmt: skip
    # Streams x = logits[start:end] (/ temp when WITH_SUM) in [LANES, VEC] steps. Per lane: running
    # max, the step offset that first reached it (-1: none yet), #{x > xd}, the online sum-exp and
    # (WITH_ENT, for the typical rule's entropy) the online sum of exp(x - max) * x.
    acc_m = tl.full([LANES], float("-inf"), tl.float32)
    acc_t = tl.full([LANES], -1, tl.int32)
    acc_c = tl.zeros([LANES], tl.int32)
    acc_s = tl.zeros([LANES], tl.float32)
    acc_x = tl.zeros([LANES], tl.float32)
    for t in range(start, end, TILE):
        offs = t + offs2
        x = tl.load(base + offs, mask=offs < end, other=float("-inf"))
        if WITH_SUM:
            x = _scaled(x, temp)
            m_v = tl.max(x, 1)  # [LANES]
        else:
            # Unscaled greedy rows: max and compare are exact in the logits' own dtype (x[d] is one
            # of them), so bf16 / fp16 rows run on packed two-entry instructions.
            m_v = tl.max(x, 1).to(tl.float32)
        acc_t = tl.where(m_v > acc_m, t, acc_t)  # strict: a lane keeps the first step with its max
        new_m = tl.maximum(acc_m, m_v)
        if WITH_SUM:
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            acc_s = acc_s * tl.exp(acc_m - safe) + tl.sum(tl.exp(x - safe[:, None]), 1)
            if WITH_ENT:
                ex = tl.exp(x - safe[:, None]) * tl.where(x == float("-inf"), 0.0, x)  # 0 * -inf: NaN
                acc_x = acc_x * tl.exp(acc_m - safe) + tl.sum(ex, 1)
        acc_m = new_m
        if WITH_CNT:
            acc_c += tl.sum((x > xd.to(x.dtype)).to(tl.int32), 1)
    return acc_m, acc_t, acc_c, acc_s, acc_x


# K (the step's draft length) and NC (chunks per row, from the row count) vary between launches as
# the draft length and the batch do; not specialising them keeps one build per launch shape class
# instead of a new one whenever either turns 1 or a multiple of 16 mid-run.
@triton.jit(do_not_specialize=["seed_offset", "K", "NC"])
def _row_stats_kernel(
    logits_ptr,  # [B, K+1, V] float, last dim contiguous
    stride_lb,
    stride_lr,
    draft_ptr,  # [B, K] int64
    mask_ptr,  # [B, K] uint8 (relax_mask): the count is only needed where relaxation may apply
    temp_ptr,  # [B] float32
    delta_ptr,  # [B] float32, NaN = unset
    pmax_ptr,  # [B*(K+1), NC] float32 out: chunk max of x
    pidx_ptr,  # [B*(K+1), NC] int32 out: lowest index of the chunk max
    pcnt_ptr,  # [B*(K+1), NC] int32 out: #{v in chunk : x[v] > x[d]} (0 on the bonus row and where
    #            relax_mask is false and the row is greedy: the count is unused there)
    psum_ptr,  # [B*(K+1), NC] float32 out: sum exp(x - chunk max), 1 when not needed
    psx_ptr,  # [B*(K+1), NC] float32 out when RULES: sum exp(x - chunk max) * x (sampled rows)
    ndraft_ptr,  # from here on: the _accept_request arguments, used when FUSE
    ratio_ptr,
    topk_ptr,
    q_ptr,
    seed_ptr,
    seed_offset,
    out_ptr,
    nacc_ptr,
    flag_ptr,
    emit_lse_ptr,
    count_ptr,  # [>= B] int32, zero on entry and left zero: finished programs per request
    V,
    K,
    NC,
    CHUNK,  # vocabulary entries per program, a multiple of TILE
    TILE: tl.constexpr,
    VEC: tl.constexpr,  # neighbouring entries per lane and step (a power of two dividing TILE)
    FUSE: tl.constexpr,  # the request's last program to finish runs _accept_request (no 2nd launch)
    HAS_Q: tl.constexpr,
    K1_P2: tl.constexpr,
    RULES: tl.constexpr,  # some request uses the lenient or typical rule (rule_ptr.. are read)
    rule_ptr,
    lam_ptr,
    eps_ptr,
    alpha_ptr,
):
    # One program streams one chunk of one row in TILE-wide steps (_stats_loop), finds the lowest
    # index of each lane's max, and reduces across lanes once.
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // (K + 1)
    i = row - b * (K + 1)
    temp = tl.load(temp_ptr + b)
    delta = tl.load(delta_ptr + b)
    base = logits_ptr + b.to(tl.int64) * stride_lb + i.to(tl.int64) * stride_lr
    has_draft = i < K
    relax = tl.load(mask_ptr + b.to(tl.int64) * K + i, mask=has_draft, other=0) != 0
    need_sum = (temp != 0.0) | (delta == delta)

    # A tile is [LANES, VEC]: each lane reads VEC neighbours (one vector load) and keeps running
    # stats over them. For the index of the max a lane only records which step first showed its
    # max; that vector is read again once at the end, so the loop does no per-entry index work.
    LANES: tl.constexpr = TILE // VEC
    offs2 = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [LANES, VEC]
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    if need_sum | relax:  # x[d] is needed: read it (two dependent loads) only here
        d = tl.load(draft_ptr + b.to(tl.int64) * K + i, mask=has_draft, other=0)
        d = tl.minimum(tl.maximum(d, 0), V - 1)
        xd = tl.where(has_draft, _scaled(tl.load(base + d), temp), float("inf"))
        if need_sum:  # sampled row or delta set: scaled logits and the online sum-exp
            acc_m, acc_t, acc_c, acc_s, acc_x = _stats_loop(
                base, start, end, offs2, xd, temp, TILE, LANES, True, True, RULES
            )
        else:  # greedy relaxable position: max, where it is, and the rank count of the draft
            acc_m, acc_t, acc_c, acc_s, acc_x = _stats_loop(
                base, start, end, offs2, xd, temp, TILE, LANES, False, True, False
            )
    else:  # greedy strict position (or the bonus row): max and where it is
        acc_m, acc_t, acc_c, acc_s, acc_x = _stats_loop(
            base, start, end, offs2, 0.0, temp, TILE, LANES, False, False, False
        )
    offs = acc_t[:, None] + offs2  # the step that first showed each lane's max
    x = _scaled(tl.load(base + offs, mask=(offs < end) & (acc_t >= 0)[:, None], other=float("-inf")), temp)
    acc_i = tl.min(tl.where((x == acc_m[:, None]) & (acc_t >= 0)[:, None], offs, _INT32_MAX), 1)

    m = tl.max(acc_m, 0)
    idx = tl.min(tl.where(acc_m == m, acc_i, _INT32_MAX), 0)
    cnt = tl.sum(acc_c, 0)
    s = temp * 0.0 + 1.0  # fp32 scalar; 1 keeps the unused log-sum-exp finite
    sx = temp * 0.0
    if need_sum:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(acc_s * tl.exp(acc_m - m_safe), 0)
        if RULES:
            sx = tl.sum(acc_x * tl.exp(acc_m - m_safe), 0)
    out = row.to(tl.int64) * NC + c
    if RULES:
        tl.store(psx_ptr + out, sx)
    tl.store(pmax_ptr + out, m)
    tl.store(pidx_ptr + out, idx)
    tl.store(pcnt_ptr + out, cnt)
    tl.store(psum_ptr + out, s)
    if FUSE:
        # Last-block pattern: every program's partials are stored before its acq_rel increment, so
        # the program that takes the count to (K+1)*NC sees them all; it resets the count for the
        # next launch (or graph replay).
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + b, 1, sem="acq_rel")
        if done == (K + 1) * NC - 1:
            tl.atomic_xchg(count_ptr + b, 0, sem="relaxed")
            _accept_request(
                b.to(tl.int64), logits_ptr, stride_lb, stride_lr, draft_ptr, ndraft_ptr, mask_ptr, temp_ptr,
                ratio_ptr, topk_ptr, delta_ptr, q_ptr, seed_ptr, seed_offset, pmax_ptr, pidx_ptr, pcnt_ptr,
                psum_ptr, out_ptr, nacc_ptr, flag_ptr, emit_lse_ptr, V, K, NC, HAS_Q, K1_P2,
                RULES, rule_ptr, lam_ptr, eps_ptr, alpha_ptr, psx_ptr,
            )  # fmt: skip


@triton.jit
def _accept_request(
    b,  # request index (int64 scalar)
    logits_ptr,  # [B, K+1, V] float
    stride_lb,
    stride_lr,
    draft_ptr,  # [B, K] int64
    ndraft_ptr,  # [B] int64
    mask_ptr,  # [B, K] uint8 (relax_mask)
    temp_ptr,  # [B] float32
    ratio_ptr,  # [B] float32
    topk_ptr,  # [B] int64
    delta_ptr,  # [B] float32
    q_ptr,  # [B, K, V] float (draft_probs), unused unless HAS_Q
    seed_ptr,  # [B] int64
    seed_offset,
    pmax_ptr,  # [B*(K+1), NC] float32
    pidx_ptr,  # [B*(K+1), NC] int32
    pcnt_ptr,  # [B*(K+1), NC] int32
    psum_ptr,  # [B*(K+1), NC] float32
    out_ptr,  # [B, K+1] int64 out
    nacc_ptr,  # [B] int64 out
    flag_ptr,  # [B, K] uint8 out (relaxed_accepted)
    emit_lse_ptr,  # [B] float32 out: log-sum-exp of the emitting row, for the race
    V,
    K,
    NC,
    HAS_Q: tl.constexpr,
    K1_P2: tl.constexpr,
    RULES: tl.constexpr,  # read the per-request rule and its parameters (else every row is topk_ratio)
    rule_ptr,  # [B] int64: RULE_TOPK_RATIO / RULE_LENIENT / RULE_TYPICAL
    lam_ptr,  # [B] float32 lambda (lenient)
    eps_ptr,  # [B] float32 posterior_threshold (typical)
    alpha_ptr,  # [B] float32 posterior_alpha (typical)
    psx_ptr,  # [B*(K+1), NC] float32: sum exp(x - chunk max) * x
):
    # All K+1 rows of the request at once (no serial chain of loads): [K1_P2] per-row vectors.
    n = tl.load(ndraft_ptr + b)
    temp = tl.load(temp_ptr + b)
    ratio = tl.load(ratio_ptr + b)
    topk = tl.load(topk_ptr + b)
    delta = tl.load(delta_ptr + b)
    seed = tl.load(seed_ptr + b)
    offs_k = tl.arange(0, K1_P2)
    is_row = offs_k < K + 1
    is_pos = offs_k < K

    # Reduce the chunk partials of every row, [K1_P2, NC] -> [K1_P2], NC_BLOCK chunks at a time (a
    # fixed block keeps the registers of the fused stats kernel independent of NC).
    m = tl.full([K1_P2], float("-inf"), tl.float32)
    g = tl.full([K1_P2], _INT32_MAX, tl.int32)  # lowest index among chunks holding the max
    cnt = tl.zeros([K1_P2], tl.int32)
    ssum = tl.zeros([K1_P2], tl.float32)  # sum exp(x - m)
    sxsum = tl.zeros([K1_P2], tl.float32)  # sum exp(x - m) * x (RULES only)
    for c0 in range(0, NC, NC_BLOCK):
        offs_c = c0 + tl.arange(0, NC_BLOCK)
        part = (b * (K + 1) + offs_k)[:, None] * NC + offs_c[None, :]
        pmask = is_row[:, None] & (offs_c < NC)[None, :]
        pm = tl.load(pmax_ptr + part, mask=pmask, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(pidx_ptr + part, mask=pmask, other=_INT32_MAX, cache_modifier=".cg")
        pc = tl.load(pcnt_ptr + part, mask=pmask, other=0, cache_modifier=".cg")
        ps = tl.load(psum_ptr + part, mask=pmask, other=0.0, cache_modifier=".cg")
        bm = tl.max(pm, 1)
        bg = tl.min(tl.where(pm == bm[:, None], pi, _INT32_MAX), 1)
        g = tl.where(bm > m, bg, tl.where(bm == m, tl.minimum(g, bg), g))
        new_m = tl.maximum(m, bm)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        blk = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - safe[:, None])), 1)
        ssum = ssum * tl.exp(m - safe) + blk
        if RULES:
            px = tl.load(psx_ptr + part, mask=pmask, other=0.0, cache_modifier=".cg")
            bx = tl.sum(tl.where(pm == float("-inf"), 0.0, px * tl.exp(pm - safe[:, None])), 1)
            sxsum = sxsum * tl.exp(m - safe) + bx
        m = new_m
        cnt += tl.sum(pc, 1)
    lse = m + tl.log(ssum)

    d_raw = tl.load(draft_ptr + b * K + offs_k, mask=is_pos, other=0)
    d = tl.minimum(tl.maximum(d_raw, 0), V - 1)
    # Per-request scalars broadcast to [K1_P2] before mixing with per-row booleans.
    zero = tl.zeros([K1_P2], tl.float32)
    greedy_v = (zero + temp) == 0.0
    delta_v = zero + delta
    relax_on = tl.load(mask_ptr + b * K + offs_k, mask=is_pos, other=0) != 0
    # x[d] decides only relaxable or sampled positions; strict greedy ones skip this dependent load.
    xd_mask = is_pos & (relax_on | ~greedy_v)
    xd = tl.load(logits_ptr + b * stride_lb + offs_k * stride_lr + d, mask=xd_mask, other=float("-inf"))
    xd = _scaled(xd, temp)
    pd = tl.exp(xd - lse)
    pmax = tl.exp(m - lse)
    relaxed = (
        relax_on
        & (xd > float("-inf"))
        & (cnt.to(tl.int64) < topk)
        & (tl.exp(xd - m) >= ratio)
        & ((delta_v != delta_v) | (pmax - pd <= delta_v))
    )
    strict = d == g
    if HAS_Q:
        qd = tl.load(q_ptr + (b * K + offs_k) * V + d, mask=is_pos, other=1.0).to(tl.float32)
    else:
        qd = 1.0
    # Uniforms at counter (row, token V) of the request's stream; tokens use counters < V.
    u = tl.rand(seed, (seed_offset.to(tl.int64) * (K + 1) + offs_k) * (V + 1) + V)
    lossless = u * qd < pd
    if RULES:
        # Lenient: u * lambda * q(d) < p(d); typical: p(d) > min(eps, alpha * exp(-H(p))), H = lse -
        # E_p[x]. Neither relaxes a greedy row; relaxed_accepted marks what lossless would reject.
        rule = tl.load(rule_ptr + b)
        entropy = lse - sxsum / ssum
        tau = tl.minimum(zero + tl.load(eps_ptr + b), tl.load(alpha_ptr + b) * tl.exp(-entropy))
        lenient = u * tl.load(lam_ptr + b) * qd < pd
        rule_ok = relax_on & ~greedy_v & tl.where(rule == 1, lenient, (rule == 2) & (pd > tau))
        relaxed = tl.where(rule == 0, relaxed, rule_ok)
    acc = tl.where(greedy_v, strict | relaxed, relaxed | lossless) & (offs_k < n) & is_pos
    # num_accepted = length of the leading run of accepts (acc is false from position n on).
    j = tl.min(tl.where(acc, K1_P2, offs_k), 0).to(tl.int64)
    in_run = offs_k < j
    relaxed_only = tl.where(greedy_v, d != g, pd < qd)
    if RULES:
        relaxed_only = tl.where(tl.load(rule_ptr + b) == 0, relaxed_only, ~lossless)
    # Emitting row j: correction (j < n) or bonus (j == n); sampled requests get theirs from the race.
    g_j = tl.sum(tl.where(offs_k == j, g, 0), 0)
    lse_j = tl.sum(tl.where(offs_k == j, lse, 0.0), 0)
    out = tl.where(in_run, d_raw, -1)
    out = tl.where(offs_k == j, g_j.to(tl.int64), out)
    flags = (in_run & relaxed & relaxed_only).to(tl.int8)
    tl.store(out_ptr + b * (K + 1) + offs_k, out, mask=is_row)
    tl.store(flag_ptr + b * K + offs_k, flags, mask=is_pos)
    tl.store(nacc_ptr + b, j)
    tl.store(emit_lse_ptr + b, lse_j)


@triton.jit(do_not_specialize=["seed_offset", "K", "NC"])
def _accept_kernel(
    logits_ptr, stride_lb, stride_lr, draft_ptr, ndraft_ptr, mask_ptr, temp_ptr, ratio_ptr, topk_ptr,
    delta_ptr, q_ptr, seed_ptr, seed_offset, pmax_ptr, pidx_ptr, pcnt_ptr, psum_ptr, out_ptr, nacc_ptr,
    flag_ptr, emit_lse_ptr, V, K, NC,
    HAS_Q: tl.constexpr, K1_P2: tl.constexpr, RULES: tl.constexpr, rule_ptr, lam_ptr, eps_ptr, alpha_ptr,
    psx_ptr,
):  # fmt: skip
    # grid (B,): the same arguments as _accept_request
    _accept_request(
        tl.program_id(0).to(tl.int64), logits_ptr, stride_lb, stride_lr, draft_ptr, ndraft_ptr, mask_ptr,
        temp_ptr, ratio_ptr, topk_ptr, delta_ptr, q_ptr, seed_ptr, seed_offset, pmax_ptr, pidx_ptr, pcnt_ptr,
        psum_ptr, out_ptr, nacc_ptr, flag_ptr, emit_lse_ptr, V, K, NC, HAS_Q, K1_P2,
        RULES, rule_ptr, lam_ptr, eps_ptr, alpha_ptr, psx_ptr,
    )  # fmt: skip


@triton.jit(do_not_specialize=["seed_offset", "K", "NC"])
def _race_kernel(
    logits_ptr,  # [B, K+1, V] float
    stride_lb,
    stride_lr,
    draft_ptr,  # [B, K] int64
    ndraft_ptr,  # [B] int64
    temp_ptr,  # [B] float32
    q_ptr,  # [B, K, V] float, unused unless HAS_Q
    seed_ptr,  # [B] int64
    seed_offset,
    nacc_ptr,  # [B] int64
    emit_lse_ptr,  # [B] float32
    rbest_ptr,  # [B, NC] float32 out: best residual score in the tile
    ridx_ptr,  # [B, NC] int32 out
    pbest_ptr,  # [B, NC] float32 out: best score under p (fallback when the residual is empty)
    pidx_ptr,  # [B, NC] int32 out
    V,
    K,
    NC,
    HAS_Q: tl.constexpr,
    TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + b)
    if temp > 0.0:
        j = tl.load(nacc_ptr + b)
        rejected = j < tl.load(ndraft_ptr + b)
        lse = tl.load(emit_lse_ptr + b)
        seed = tl.load(seed_ptr + b)
        jd = tl.maximum(tl.minimum(j, K - 1), 0)  # draft slot of row j; unused on the bonus row
        offs = c * TILE + tl.arange(0, TILE)
        msk = offs < V
        x = tl.load(logits_ptr + b * stride_lb + j * stride_lr + offs, mask=msk, other=float("-inf"))
        p = tl.exp(tl.math.div_rn(x.to(tl.float32), temp) - lse)
        if HAS_Q:
            qmask = offs < tl.where(rejected, V, 0)  # the bonus row has q = 0
            q = tl.load(q_ptr + (b * K + jd) * V + offs, mask=qmask, other=0.0).to(tl.float32)
        else:
            d = tl.load(draft_ptr + b * K + jd, mask=rejected, other=-1)
            q = tl.where((offs == d) & rejected, 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)
        u = tl.rand(seed, (seed_offset.to(tl.int64) * (K + 1) + j) * (V + 1) + offs)
        e = tl.maximum(-tl.log(u), 1e-30)
        sr = tl.where(msk, r / e, -1.0)
        sp = tl.where(msk, p / e, -1.0)
        br = tl.max(sr, 0)
        bp = tl.max(sp, 0)
        out = b * NC + c
        tl.store(rbest_ptr + out, br)
        tl.store(ridx_ptr + out, tl.min(tl.where(sr == br, offs, _INT32_MAX), 0))
        tl.store(pbest_ptr + out, bp)
        tl.store(pidx_ptr + out, tl.min(tl.where(sp == bp, offs, _INT32_MAX), 0))


@triton.jit(do_not_specialize=["K", "NC"])
def _race_reduce_kernel(
    temp_ptr,  # [B] float32
    nacc_ptr,  # [B] int64
    rbest_ptr,
    ridx_ptr,
    pbest_ptr,
    pidx_ptr,
    out_ptr,  # [B, K+1] int64, the emitted slot is overwritten
    K,
    NC,
    NC_P2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + b)
    if temp > 0.0:
        offs = tl.arange(0, NC_P2)
        cm = offs < NC
        sr = tl.load(rbest_ptr + b * NC + offs, mask=cm, other=-2.0)
        ir = tl.load(ridx_ptr + b * NC + offs, mask=cm, other=_INT32_MAX)
        sp = tl.load(pbest_ptr + b * NC + offs, mask=cm, other=-2.0)
        ip = tl.load(pidx_ptr + b * NC + offs, mask=cm, other=_INT32_MAX)
        br = tl.max(sr, 0)
        bp = tl.max(sp, 0)
        tok_r = tl.min(tl.where(sr == br, ir, _INT32_MAX), 0)
        tok_p = tl.min(tl.where(sp == bp, ip, _INT32_MAX), 0)
        # An all-zero residual only happens when p == q up to rounding; p is then the answer.
        tok = tl.where(br > 0.0, tok_r, tok_p)
        j = tl.load(nacc_ptr + b)
        tl.store(out_ptr + b * (K + 1) + j, tok.to(tl.int64))


def _tile(v: int) -> int:
    return min(MAX_TILE, max(16, triton.next_power_of_2(v)))


def _resident_programs(device: torch.device) -> int:
    """Stats programs resident on the whole GPU at once: SMs x min(block limit, warp slots, the
    register file / (STATS_MAXNREG, rounded up to 8, x threads per program))."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    warps_by_regs = 65536 // (triton.cdiv(STATS_MAXNREG, 8) * 8 * 32)
    return sms * max(1, min(32, 64 // STATS_WARPS, warps_by_regs // STATS_WARPS))


def _stats_split(rows: int, v: int, device: torch.device) -> tuple[int, int, int]:
    """(tile, chunks per row, chunk length) for the stats pass: as many chunks per row as keep all
    rows x chunks programs in one wave (one chunk per row when the rows alone fill it), each
    streaming a long chunk; fixed by the shape, so graph capture holds."""
    tile = min(STATS_TILE, max(16, triton.next_power_of_2(v)))
    nc = max(1, min(triton.cdiv(v, tile), _resident_programs(device) // rows))
    chunk = triton.cdiv(triton.cdiv(v, nc), tile) * tile
    return tile, triton.cdiv(v, chunk), chunk


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def counters(n: int, device: torch.device) -> torch.Tensor:
    """[>= n] int32 zeros for a last-block launch's per-row counts (the fused acceptance launch, the
    greedy argmax), kept per device; each launch leaves them zero.
    Under CUDA-graph capture a miss allocates a zeroed buffer for that graph alone (the zeroing is
    captured with it) instead of caching memory from the graph's pool."""
    bufs = _COUNTERS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def rejection_sample_triton(
    batch: AcceptanceBatch, generator: torch.Generator | None = None, *, validate: bool = False
) -> RejectionResult:
    """Kernel version of `rejection_sample_reference`; inputs as documented on `AcceptanceBatch`.

    Accepts bf16, fp16 and fp32 logits (computed in fp32). `batch.all_greedy=True` promises every
    temperature is 0 and skips the sampling launches. With `validate=True` the values are checked
    as the reference checks them (one sync); otherwise they are trusted.
    """
    if validate:
        check_values(batch)
    b, k, v = batch.dims
    all_greedy, seed_offset = batch.all_greedy, batch.seed_offset
    target_logits, draft_probs = batch.target_logits, batch.draft_probs
    dev = target_logits.device
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    drafts = batch.draft_token_ids.to(torch.int64).contiguous()
    ndraft = batch.num_draft_tokens.to(torch.int64).contiguous()
    mask = batch.relax_mask.contiguous().view(torch.uint8)
    temp = batch.temperature.to(torch.float32).contiguous()
    ratio = batch.relax_ratio.to(torch.float32).contiguous()
    top_k = batch.relax_top_k.to(torch.int64).contiguous()
    delta = batch.relax_delta.to(torch.float32).contiguous()
    q = draft_probs.contiguous() if draft_probs is not None else logits  # dummy pointer when absent
    seeds = batch.seeds
    if seeds is None:
        if all_greedy:
            seeds = ndraft  # any [B] int64: greedy decisions draw no randomness
        else:
            seeds = torch.randint(0, 2**62, (b,), dtype=torch.int64, device=dev, generator=generator)
    seeds = seeds.contiguous()

    tile = _tile(v)
    rows = b * (k + 1)
    stats_tile, nc, chunk = _stats_split(rows, v, dev)
    pmax = torch.empty(rows * nc, dtype=torch.float32, device=dev)
    pidx = torch.empty(rows * nc, dtype=torch.int32, device=dev)
    pcnt = torch.empty(rows * nc, dtype=torch.int32, device=dev)
    psum = torch.empty(rows * nc, dtype=torch.float32, device=dev)
    out = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    nacc = torch.empty(b, dtype=torch.int64, device=dev)
    flags = torch.empty(b, k, dtype=torch.uint8, device=dev)
    emit_lse = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return RejectionResult(out, nacc, flags.view(torch.bool))
    s_b, s_r = logits.stride(0), logits.stride(1)

    has_q = draft_probs is not None
    rules = batch.relax_rule is not None
    if rules:  # the lenient / typical rows' inputs and the entropy partials
        rule = batch.relax_rule.to(torch.int64).contiguous()  # type: ignore[union-attr]
        lam, eps, alpha = (
            t.to(torch.float32).contiguous()  # type: ignore[union-attr]
            for t in (batch.relax_lambda, batch.posterior_threshold, batch.posterior_alpha)
        )
        psx = torch.empty(rows * nc, dtype=torch.float32, device=dev)
    else:  # never read: RULES=False compiles the topk_ratio kernels alone
        rule, lam, eps, alpha, psx = ndraft, temp, temp, temp, psum
    fuse = FUSE_ACCEPT
    count = counters(b, dev) if fuse else nacc  # nacc: an unused pointer
    _row_stats_kernel[(rows, nc)](
        logits, s_b, s_r, drafts, mask, temp, delta, pmax, pidx, pcnt, psum, psx,
        ndraft, ratio, top_k, q, seeds, seed_offset, out, nacc, flags, emit_lse, count, v, k, nc, chunk,
        TILE=stats_tile, VEC=min(STATS_VEC, stats_tile), FUSE=fuse, HAS_Q=has_q,
        K1_P2=_p2(k + 1), RULES=rules, rule_ptr=rule, lam_ptr=lam, eps_ptr=eps, alpha_ptr=alpha,
        num_warps=STATS_WARPS, **({"maxnreg": STATS_MAXNREG} if dev.type == "cuda" else {}),
    )  # fmt: skip
    if not fuse:
        _accept_kernel[(b,)](
            logits, s_b, s_r, drafts, ndraft, mask, temp, ratio, top_k, delta, q, seeds, seed_offset,
            pmax, pidx, pcnt, psum, out, nacc, flags, emit_lse, v, k, nc,
            HAS_Q=has_q, K1_P2=_p2(k + 1), RULES=rules, rule_ptr=rule, lam_ptr=lam, eps_ptr=eps,
            alpha_ptr=alpha, psx_ptr=psx, num_warps=2,
        )  # fmt: skip
    if not all_greedy:
        nc = triton.cdiv(v, tile)  # the race runs one tile per program
        rbest = torch.empty(b * nc, dtype=torch.float32, device=dev)
        ridx = torch.empty(b * nc, dtype=torch.int32, device=dev)
        pbest = torch.empty(b * nc, dtype=torch.float32, device=dev)
        pbidx = torch.empty(b * nc, dtype=torch.int32, device=dev)
        _race_kernel[(b, nc)](
            logits, s_b, s_r, drafts, ndraft, temp, q, seeds, seed_offset, nacc, emit_lse,
            rbest, ridx, pbest, pbidx, v, k, nc,
            HAS_Q=has_q, TILE=tile, num_warps=NUM_WARPS,
        )  # fmt: skip
        _race_reduce_kernel[(b,)](
            temp, nacc, rbest, ridx, pbest, pbidx, out, k, nc, NC_P2=_p2(nc), num_warps=1
        )
    return RejectionResult(output_token_ids=out, num_accepted=nacc, relaxed_accepted=flags.view(torch.bool))
