"""Greedy sampling in one Triton launch: the argmax of each row of float logits, lowest index on ties.

torch's argmax over a [R, 151,936] row costs two launches at a few rows (a memset of its reduction's
semaphores, then the reduction): 8.9 us of device time on the H200 at one row, against 2.7 for this
kernel (benchmarks/kernels/bench_argmax.py), and the draft model samples once per drafted token. Here:

  _argmax_kernel  grid (R, NC)  program (r, c) reduces chunk c of row r (BLOCK entries) to its max and
                  the lowest index holding it, stores that pair, then counts itself in on row r's
                  counter (a release/acquire atomic after a block barrier); the program that arrives
                  last reduces the NC pairs in chunk order, writes the row's token into `out` (any
                  stride: a column of the draft buffer) and sets the counter back to zero.

Semantics are torch.argmax's: the lowest index of the maximum; NaN counts as larger than every number
(the first NaN wins); a row of -inf gives 0. sampler.greedy_sample runs it where use_kernel says so
(torch.argmax under CUDA-graph capture, on CPU and for non-float32 logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from thinkspec.layers.pdl import launch_args, release_next, wait_prior
from thinkspec.sampling.rejection_common import check_tokens_out
from thinkspec.sampling.rejection_triton import counters

BLOCK = 4096  # vocabulary entries per program: 38 programs per Qwen3 row
NUM_WARPS = 4
_INT32_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _chunk_argmax(x, offs):
    """(value, index) of the max of x [N] at indices offs [N], lowest index on ties; NaN is the max."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, offs, _INT32_MAX), 0)
    x = tl.where(nan, float("-inf"), x)
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, offs, _INT32_MAX), 0)
    has_nan = first_nan < _INT32_MAX
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, i)


@triton.jit
def _argmax_kernel(
    x_ptr,  # [R, V] float32, last dim contiguous
    stride_x,
    out_ptr,  # [R] int64 at stride_out
    stride_out,
    pval_ptr,  # [R, NC] float32 scratch: each chunk's max (NaN when it holds one)
    pidx_ptr,  # [R, NC] int32 scratch: where it is
    count_ptr,  # [R] int32 arrival counters, zero between launches
    V,
    NC,
    BLOCK: tl.constexpr,
    NC_P2: tl.constexpr,  # next power of two >= NC
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + offs, mask=offs < V, other=float("-inf"))
    release_next(PDL)
    m, i = _chunk_argmax(x, offs)
    if NC == 1:
        tl.store(out_ptr + r * stride_out, i.to(tl.int64))
        return
    tl.store(pval_ptr + r * NC + c, m)
    tl.store(pidx_ptr + r * NC + c, i)
    # Last-block pattern (as the acceptance kernels): every thread's stores come before this
    # program's release; the program that takes the count to NC sees all NC pairs.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu") == NC - 1:
        tl.atomic_xchg(count_ptr + r, 0, sem="relaxed", scope="gpu")
        cs = tl.arange(0, NC_P2)
        ok = cs < NC
        pm = tl.load(pval_ptr + r * NC + cs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(pidx_ptr + r * NC + cs, mask=ok, other=_INT32_MAX, cache_modifier=".cg")
        # the chunks' pairs reduce as entries do: a NaN chunk carries its first NaN's index, and the
        # lowest index among the chunks holding the max is the row's lowest
        _, i = _chunk_argmax(pm, pi)
        tl.store(out_ptr + r * stride_out, i.to(tl.int64))


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[>= n] float32 and int32 chunk partials, kept per device (launches on one stream in order)."""
    have = _SCRATCH.get(device)
    if have is None or have[0].numel() < n:
        n = max(n, 4096)
        values = torch.empty(n, dtype=torch.float32, device=device)
        have = values, torch.empty(n, dtype=torch.int32, device=device)
        _SCRATCH[device] = have
    return have


def use_kernel(logits: torch.Tensor) -> bool:
    """Whether greedy sampling runs the Triton kernel on these logits (CUDA, float32 [R, V] with V > 0,
    not capturing)."""
    if logits.device.type != "cuda" or logits.dtype != torch.float32 or logits.dim() != 2:
        return False
    return logits.shape[1] > 0 and not torch.cuda.is_current_stream_capturing()


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """logits [R, V] float -> [R] int64 by _argmax_kernel (CUDA, or CPU under TRITON_INTERPRET=1), into
    `out` ([R] int64, any stride) when given; block: vocabulary entries per program (a power of two)."""
    check_tokens_out(logits, out)
    rows, v = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if v == 0:
        raise ValueError("argmax of rows of no logits")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    nc = triton.cdiv(v, block)
    pval, pidx = _scratch(rows * nc, logits.device)
    _argmax_kernel[(rows, nc)](
        logits, logits.stride(0), out, out.stride(0), pval, pidx, counters(rows, logits.device), v, nc,
        BLOCK=block, NC_P2=max(2, triton.next_power_of_2(nc)), num_warps=NUM_WARPS,
        **launch_args(logits.device),
    )  # fmt: skip
    return out

