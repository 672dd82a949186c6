"""Triton paged-attention backend: one kernel family for prefill chunks, decode and (k+1)-token verify.

Same contract as the torch reference (attention_torch.py). Launches, all with grids fixed by host
ints (T, B, meta.max_query_len, meta.max_seq_len, head counts), so a step can be CUDA-graph captured:
  1. _store_kv_kernel     grid (T,)                      writes each new token's k/v at its slot (-1 skipped).
                          Not launched with kv_stored (the fused q/k norm + rotary kernel wrote them).
  2. _paged_attn_kernel   grid (B, Q tiles, Hkv*S)       one program = BLOCK_Q queries of one sequence x all
                          query heads of one KV head (GQA: each K/V tile is loaded once per group), over
                          split s of the sequence's causal KV range, read through the block table one
                          token at a time (any block_size). Online softmax in fp32 with exp2.
  3. _combine_kernel      grid (T, Hq)                   only when S > 1 (split-KV) and the merge is not
                          fused: merges the S partial (max, sum, acc) of each row.
With fused_combine (the default) there is no third launch: each split program stores its partials,
then counts itself in on a per-(sequence, query tile, KV head) counter (a release/acquire atomic
after a block barrier), and the program that arrives last merges the S partials in split order,
writes the final rows and sets the counter back to zero for the next launch (graph replays). The
grid's S is an upper bound fixed at capture (from max_model_len); each query tile uses one split per
tile of its own keys up to S, the other split programs return at once, and a tile of keys that fits
one tile is written by its one program without the merge.
Sequences are located from query_start_loc / seq_lens inside the kernels; no device value is read on
the host. Rows past query_start_loc[-1] (padding) come out zero, written by the split-0 programs of
the first sequence's first query tile (or by the combine launch), so the output needs no zero-fill.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from thinkspec.layers.attention_torch import TorchAttentionBackend
from thinkspec.layers.forward_context import AttentionMetadata
from thinkspec.layers.pdl import launch_args, prefetch, release_next, wait_prior

_LOG2E = 1.4426950408889634
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(x - m) stays NaN-free


@triton.jit
def _rows_mask(rows_ok, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a [rows, BLOCK_D] tile: rows_ok [rows] and d < HEAD_DIM; [rows, 1] when d needs none."""
    if HEAD_DIM == BLOCK_D:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (d < HEAD_DIM)[None, :]


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D], last dim contiguous
    v_ptr,  # [T, Hkv, D], last dim contiguous
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache_ptr,  # same layout and strides as k_cache
    stride_cb,
    stride_cs,
    stride_ch,
    slot_ptr,  # [T] int64, -1 = padding
    block_size,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = _rows_mask(h < num_kv_heads, d, HEAD_DIM, BLOCK_D)
    h = h[:, None]
    d = d[None, :]
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    release_next(PDL)
    tl.store(k_cache_ptr + dst, kv.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, vv.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ptrs (any shape) in L2: a hint, no value changes, no register
    is filled."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_rows(k_cache_ptr, v_cache_ptr, rows, ok, HEAD_DIM: tl.constexpr, LINES: tl.constexpr,
                   LINE: tl.constexpr):  # fmt: skip
    """The keys and values of cache rows `rows` [BLOCK_N] (element offsets; where ok) into L2: LINES
    128-byte lines of LINE elements per row of HEAD_DIM (the kernel reads them later as it would
    without this)."""
    line = tl.arange(0, LINES) * LINE  # [LINES] element offsets of a row's lines
    want = ok[:, None] & (line < HEAD_DIM)[None, :]
    off = tl.where(want, rows[:, None] + line[None, :], 0)  # [BLOCK_N, LINES]; the rest: the base again
    _prefetch_l2(k_cache_ptr + off)
    _prefetch_l2(v_cache_ptr + off)


# Ints that change from one eager launch to the next (the block-table width follows the longest
# sequence, the token count the batch; _combine_kernel's sequence count too) are not specialised:
# Triton would build a new variant each time one turns 1 or a multiple of 16, mid-run. Captured
# graphs fix them anyway.
@triton.jit(do_not_specialize=["stride_bt", "num_tokens"])
def _paged_attn_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    stride_qt,
    stride_qh,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache_ptr,  # same layout and strides as k_cache
    stride_cb,
    stride_cs,
    stride_ch,
    block_tables_ptr,  # [B, max_blocks] int32
    stride_bt,
    query_start_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # S == 1: [T, Hq, D] q dtype (final); S > 1: [T, Hq, S, D] float32 partial acc
    stride_ot,
    stride_oh,
    stride_os,
    ml_ptr,  # S > 1: [T, Hq, S, 2] float32 partial (max, sum) in log2 units; unused when S == 1
    final_ptr,  # [T, Hq, D] q dtype: the output (S == 1: out_ptr itself; S > 1: written by the merge)
    stride_ft,
    stride_fh,
    sem_ptr,  # FUSE_COMBINE: [B * Q tiles * Hkv] int32 arrival counters, zero between launches
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_tokens,  # T, padding rows included
    HEAD_DIM: tl.constexpr,  # compile-time, so the d mask folds away or stays vectorisable for any head_dim
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (fixed per engine: one compile, shifts on powers of 2)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FUSE_COMBINE: tl.constexpr,  # S > 1: the last split program merges (no _combine_kernel launch)
    FP32_DOT: tl.constexpr,  # fp32 operands, exact products (fp32 inputs; bf16 under the interpreter)
    PREFETCH_LINES: tl.constexpr,  # pdl.PREFETCH (CUDA): 128-byte lines per K/V row to fetch early, 0 = off
    LINE: tl.constexpr,  # cache elements per 128-byte line
    PDL: tl.constexpr,
):
    if PREFETCH_LINES == 0:
        wait_prior(PDL)
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    h_kv = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # position of this step's first query

    # Causal KV range of this query tile, cut into n_split chunks of whole BLOCK_N tiles. With the fused
    # merge n_split follows this tile's own length, one split per tile up to NUM_SPLITS (the same chunks
    # as NUM_SPLITS gives, without the empty ones): the split programs past n_split return at once and
    # the merge reads n_split partials. Without it all NUM_SPLITS take part.
    kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    tiles = tl.cdiv(kv_end, BLOCK_N)
    n_split = NUM_SPLITS
    if FUSE_COMBINE:
        n_split = tl.maximum(tl.minimum(tiles, NUM_SPLITS), 1)
    tiles_per_split = tl.cdiv(tiles, n_split)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(kv_end, lo + tiles_per_split * BLOCK_N)
    n_off = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    if PREFETCH_LINES > 0:
        # Before the wait (pdl.PREFETCH): the metadata above is copied in before the forward, and the
        # first tile's keys and values before the query window were written by earlier forwards (this
        # forward writes only the window's own slots, in blocks no other sequence holds).
        first = lo + n_off
        cached = first < tl.where(q_tile * BLOCK_Q < q_len, ctx_len, 0)  # query tiles past q_len: none
        blk = tl.load(table + first // BLOCK_SIZE, mask=cached, other=0).to(tl.int64)
        rows = blk * stride_cb + (first % BLOCK_SIZE) * stride_cs + h_kv * stride_ch  # [BLOCK_N]
        _prefetch_rows(k_cache_ptr, v_cache_ptr, rows, cached, HEAD_DIM, PREFETCH_LINES, LINE)
        wait_prior(PDL)

    if (NUM_SPLITS == 1) or FUSE_COMBINE:  # noqa: SIM102 (compile-time branch around a run-time one)
        if (b == 0) & (q_tile == 0) & (split == 0):
            # Padding rows (past the last sequence's tokens) come out zero: nothing else writes them.
            g_pad = tl.arange(0, GROUP_PAD)
            zero_mask = _rows_mask(g_pad < GROUP, d, HEAD_DIM, BLOCK_D)
            q_end = tl.load(query_start_ptr + tl.num_programs(0))
            zero_dst = final_ptr + q_end.to(tl.int64) * stride_ft + d[None, :]
            zero_dst += (h_kv * GROUP + g_pad)[:, None] * stride_fh
            zeros = tl.zeros([GROUP_PAD, BLOCK_D], final_ptr.dtype.element_ty)
            for _ in range(q_end, num_tokens):
                tl.store(zero_dst, zeros, mask=zero_mask)
                zero_dst += stride_ft
    if q_tile * BLOCK_Q >= q_len:
        return
    if split >= n_split:  # FUSE_COMBINE: past this query tile's splits
        return

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    r = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + r // GROUP_PAD  # query index within the sequence
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    head = h_kv * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    out_mask = _rows_mask(row_ok, d, HEAD_DIM, BLOCK_D)  # [BLOCK_M, BLOCK_D] or [BLOCK_M, 1]
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0
    )  # [BLOCK_M, BLOCK_D]
    q_pos = ctx_len + qi  # [BLOCK_M] absolute position of each row's query

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n_off  # [BLOCK_N]
        pos_ok = pos < hi
        blk = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + h_kv * stride_ch  # [BLOCK_N]
        kv_mask = _rows_mask(pos_ok, d, HEAD_DIM, BLOCK_D)
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k).to(q.dtype))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N] float32, log2 units
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v.to(q.dtype)  # slots past the range load as 0 (`other`), so NaN there never reaches p @ v
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    release_next(PDL)
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif n_split == 1:  # FUSE_COMBINE, one tile of keys: the one program writes the final rows
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = final_ptr + tok[:, None] * stride_ft + head[:, None] * stride_fh + d[None, :]
        tl.store(dst, o.to(final_ptr.dtype.element_ty), mask=out_mask)
    else:
        base = tok * stride_ot + head * stride_oh + split * stride_os  # [BLOCK_M]
        tl.store(out_ptr + base[:, None] + d[None, :], acc, mask=out_mask)
        ml_row = (tok * num_heads + head) * NUM_SPLITS  # [BLOCK_M]
        tl.store(ml_ptr + (ml_row + split) * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + (ml_row + split) * 2 + 1, l_i, mask=row_ok)
        if FUSE_COMBINE:
            # Every thread's partial stores come before this program's release (block barrier, then a
            # gpu-scope acq_rel atomic); the program counted last acquires everyone's and merges.
            tl.debug_barrier()
            heads_kv = tl.num_programs(2) // NUM_SPLITS
            sem = sem_ptr + (b * tl.num_programs(1) + q_tile) * heads_kv + h_kv
            if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
                ml_rows = ml_ptr + ml_row * 2  # [BLOCK_M] each row's split-0 (max, sum)
                m_max = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
                for i in range(n_split):
                    m_s = tl.load(ml_rows + 2 * i, mask=row_ok, other=_NEG_BIG, cache_modifier=".cg")
                    m_max = tl.maximum(m_max, m_s)
                den = tl.zeros([BLOCK_M], tl.float32)
                o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                part = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :]
                for i in range(n_split):  # split order: the same sums whichever program merges
                    m_s = tl.load(ml_rows + 2 * i, mask=row_ok, other=_NEG_BIG, cache_modifier=".cg")
                    l_s = tl.load(ml_rows + 2 * i + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                    w = tl.exp2(m_s - m_max)  # empty splits: m = -1e30 -> weight 0
                    den += w * l_s
                    a = tl.load(part + i * stride_os, mask=out_mask, other=0.0, cache_modifier=".cg")
                    o += a * w[:, None]
                o = o / tl.where(den > 0, den, 1.0)[:, None]
                dst = final_ptr + tok[:, None] * stride_ft + head[:, None] * stride_fh + d[None, :]
                tl.store(dst, o.to(final_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _combine_kernel(
    acc_ptr,  # [T, Hq, S, D] float32
    ml_ptr,  # [T, Hq, S, 2] float32 (max, sum) in log2 units
    out_ptr,  # [T, Hq, D] q dtype
    stride_ot,
    stride_oh,
    query_start_ptr,  # [B+1] int32
    num_seqs,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    if t >= tl.load(query_start_ptr + num_seqs):  # padding row
        tl.store(
            out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
            tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )
        return

    row = t.to(tl.int64) * num_heads + h
    m = tl.load(ml_ptr + (row * NUM_SPLITS + s) * 2)  # [S]
    l_s = tl.load(ml_ptr + (row * NUM_SPLITS + s) * 2 + 1)
    acc_off = (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :]
    acc = tl.load(acc_ptr + acc_off, mask=_rows_mask(s >= 0, d, HEAD_DIM, BLOCK_D), other=0.0)  # [S, BLOCK_D]
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits: m = -1e30 -> weight 0
    den = tl.sum(w * l_s, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    release_next(PDL)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _interpreting() -> bool:
    # The interpreter's tl.dot gives wrong results on bfloat16 operands; it takes the fp32 path there.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonAttentionBackend:
    """Paged attention in Triton kernels; the AttentionBackend protocol of attention.py.

    block_n: keys per tile (a power of two >= 16), or None to choose it from the launch shape
    (choose_block_n). num_splits: split-KV factor (a power of two), or
    None to choose it from the launch shape: split only when (sequences x query tiles x KV heads)
    leaves the GPU under-filled, into splits of at least min_split_len / 2 keys of the longest context
    (a program's time grows with the tiles it walks one after another, so small batches split early).
    The chosen split follows meta.max_seq_len; set num_splits to keep one launch shape for a captured
    CUDA graph. target_programs (default 2 x SM count) is the grid size splitting aims for; 4 x
    measured faster for plain decode at 8k-32k keys but not yet across the engine (docs/BENCHMARKS.md).
    num_warps / num_stages: launch options of the attention kernel (None: Triton's defaults).
    fused_combine: with S > 1, the attention kernel's last split program merges the partials (see the
    module docstring) instead of a separate _combine_kernel launch.
    """

    def __init__(
        self,
        block_n: int | None = None,
        num_splits: int | None = None,
        max_splits: int = 32,
        min_split_len: int = 64,
        target_programs: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        fused_combine: bool = True,
    ) -> None:
        if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
            raise ValueError(f"block_n must be None or a power of two >= 16, got {block_n!r}")
        if num_splits is not None and (
            not isinstance(num_splits, int) or num_splits < 1 or num_splits & (num_splits - 1)
        ):
            raise ValueError(f"num_splits must be None or a power of two >= 1, got {num_splits!r}")
        if not isinstance(max_splits, int) or max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two >= 1, got {max_splits!r}")
        if not isinstance(min_split_len, int) or min_split_len < 1:
            raise ValueError(f"min_split_len must be an integer >= 1, got {min_split_len!r}")
        if target_programs is not None and (not isinstance(target_programs, int) or target_programs < 1):
            raise ValueError(f"target_programs must be None or an integer >= 1, got {target_programs!r}")
        if num_warps is not None and (
            not isinstance(num_warps, int) or num_warps < 1 or num_warps & (num_warps - 1)
        ):
            raise ValueError(f"num_warps must be None or a power of two >= 1, got {num_warps!r}")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"num_stages must be None or an integer >= 1, got {num_stages!r}")
        self.launch = {"num_warps": num_warps, "num_stages": num_stages}
        self.launch = {k: v for k, v in self.launch.items() if v is not None}  # None: Triton's default
        self.block_n = block_n
        self.num_splits = num_splits
        self.max_splits = max_splits
        self.min_split_len = min_split_len
        self.target_programs = target_programs
        self.fused_combine = bool(fused_combine)
        # Arrival counters of the fused merge, zero between launches. Buffers are never freed: a
        # captured CUDA graph keeps using the one it was captured with.
        self._counters: list[torch.Tensor] = []
        self.fallback = TorchAttentionBackend()

    def _target_programs(self, device: torch.device) -> int:
        if self.target_programs is not None:
            return self.target_programs
        if device.type == "cuda":
            return 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return 16

    def choose_block_n(
        self, programs: int, max_query_len: int, block_m: int, dtype: torch.dtype, device: torch.device
    ) -> int:
        """Keys per tile from host ints only (launch programs without splitting, rows per program).
        Measured on the H200 (docs/BENCHMARKS.md, "Keys per tile"): 128-key tiles beat 64 for 16-bit
        caches at 8-64 sequences, by up to 24% at 2k-8k keys, except for a decode grid (one query per
        sequence) that already has target_programs programs, where they lose up to 19%. Fewer
        programs (batch 1-4) were measured with 64 and keep it; so do fp32 caches and prefill tiles
        of 64 rows (shared memory and registers)."""
        if self.block_n is not None:
            return self.block_n
        if dtype not in (torch.bfloat16, torch.float16) or block_m > 32 or programs < 64:
            return 64
        if max_query_len == 1 and programs >= self._target_programs(device):
            return 64
        return 128

    def counters(self, num: int, device: torch.device) -> torch.Tensor:
        """[>= num] int32 zeros for the fused merge's arrival counters (allocated once, then reused)."""
        for c in self._counters:
            if c.device == device and c.numel() >= num:
                return c
        self._counters.append(torch.zeros(max(num, 4096), dtype=torch.int32, device=device))
        return self._counters[-1]

    def choose_splits(self, programs: int, max_seq_len: int, device: torch.device) -> int:
        """Split-KV factor from host ints only (launch programs without splitting, longest context)."""
        if self.num_splits is not None:
            return self.num_splits
        want = self._target_programs(device) // max(1, programs)
        by_len = _pow2(-(-max_seq_len // self.min_split_len))  # splits of >= min_split_len / 2 keys
        n = min(want, by_len, self.max_splits)
        return 1 if n < 2 else 1 << (n.bit_length() - 1)  # round down to a power of two

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] or empty
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D] q dtype; padding rows are zero
        if k_cache.numel() == 0:  # no pool yet (profiling run): whole prompts only, reference path
            return self.fallback.forward(q, k, v, k_cache, v_cache, meta, scale, kv_stored)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(f"num query heads {num_heads} is not a multiple of num kv heads {num_kv_heads}")
        if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"kv cache shape {tuple(k_cache.shape)} does not match {num_kv_heads} kv heads x {head_dim}"
            )
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        block_size = k_cache.shape[1]
        block_d = max(16, _pow2(head_dim))
        if num_tokens == 0 or meta.num_seqs == 0:
            return torch.zeros_like(q)
        out = torch.empty_like(q)  # the kernels write every row, padding rows as zeros
        pdl = launch_args(q.device)

        if not kv_stored:
            _store_kv_kernel[(num_tokens,)](
                k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                meta.slot_mapping, block_size, num_kv_heads, HEAD_DIM=head_dim,
                BLOCK_H=_pow2(num_kv_heads), BLOCK_D=block_d, **pdl,
            )  # fmt: skip

        num_seqs = meta.num_seqs
        max_q = max(1, meta.max_query_len)
        group = num_heads // num_kv_heads
        group_pad = _pow2(group)
        # Rows per program: >= 16 for tl.dot, up to 64 for long queries (prefill).
        block_m = max(16, group_pad, min(64, _pow2(max_q * group_pad)))
        block_q = block_m // group_pad
        q_tiles = math.ceil(max_q / block_q)
        programs = num_seqs * q_tiles * num_kv_heads
        block_n = self.choose_block_n(programs, max_q, block_m, q.dtype, q.device)
        splits = self.choose_splits(programs, meta.max_seq_len, q.device)
        fused = self.fused_combine and splits > 1
        if splits == 1:
            dst, ml, counters = out, out, out
            strides = (out.stride(0), out.stride(1), 0)
        else:
            dst = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
            strides = (dst.stride(0), dst.stride(1), dst.stride(2))
            counters = self.counters(programs, q.device) if fused else ml
        fp32_dot = q.dtype == torch.float32 or (_interpreting() and q.dtype == torch.bfloat16)
        line = max(1, 128 // k_cache.element_size())
        lines = max(1, block_d // line)
        _paged_attn_kernel[(num_seqs, q_tiles, num_kv_heads * splits)](
            q, q.stride(0), q.stride(1),
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables, meta.block_tables.stride(0), meta.query_start_loc, meta.seq_lens,
            dst, *strides, ml, out, out.stride(0), out.stride(1), counters, scale * _LOG2E, num_heads,
            num_tokens, HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
            BLOCK_D=block_d, NUM_SPLITS=splits, FUSE_COMBINE=fused, FP32_DOT=fp32_dot,
            PREFETCH_LINES=lines if prefetch() and q.is_cuda and not _interpreting() else 0, LINE=line,
            **self.launch, **pdl,
        )  # fmt: skip
        if splits > 1 and not fused:
            _combine_kernel[(num_tokens, num_heads)](
                dst, ml, out, out.stride(0), out.stride(1), meta.query_start_loc, num_seqs, num_heads,
                HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_D=block_d, **pdl,
            )  # fmt: skip
        return out
