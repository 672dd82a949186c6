"""A chain of dependent one-row products, as a batch-1 forward is: one launch per product (the engine's
GEMV) against one persistent kernel that passes a grid barrier between products.

The draft's batch-1 forward is about 200 dependent launches of 2-6 us against 0.29 ms of weights to
read (docs/BENCHMARKS.md, twenty-fourth session). A persistent kernel would replace each launch
boundary by a grid barrier, and could read a product's weights while waiting at the barrier before
it. This measures what that buys on a pure chain, before anything is built on it:

  y[s+1] = W[s] @ y[s], s = 0 .. L-1, W[s] [H, H] bf16 (L distinct weights, more bytes than L2),
  y [L+1, H] bf16 (y[0] given).
  launches    L launches of gemv_triton.gemv at its launch shape, with PDL (its first weight tile
              read before the wait, the next launch let in right after it), one CUDA graph.
  persistent  one launch of P programs, P = the SM count (all resident): program p owns rows
              [p*R, (p+1)*R) of every product. Per product: wait at the grid barrier until every
              program has written y[s] (a gpu-scope acquire on one arrival counter), read y[s] from
              L2, write its rows of y[s+1], arrive (block barrier, then a gpu-scope release), then
              issue the loads of its rows of W[s+1], which fill while it waits at the next barrier.
  barrier     the persistent kernel with its weights never read (1/H everywhere, in registers): what
              the barrier, y's round trip and the arithmetic cost per product.
  *_volatile  the same two with every thread polling the counter with volatile loads and one acquire
              fence after, instead of one thread polling with acquire loads and a block barrier per
              poll to share what it read.

Every variant's y is checked product by product against torch (y[s+1] ~ W[s] @ y[s] from its own
y[s]); each is timed over --repeats launches of the whole chain (the launches variant: graph replays),
alternating, median us per product with its min-max; floor = H*H*2 bytes / --bandwidth. Writes JSON
(--out) and prints a table last.

    python benchmarks/bench_persistent_chain.py --hidden 1024,2048 --out chain.json    # H200
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from thinkspec.layers.gemv_triton import gemv

# The persistent variants: name -> (weights read, how the barrier polls).
PERSISTENT = {
    "persistent": (True, "atomic"), "barrier": (False, "atomic"),
    "persistent_volatile": (True, "volatile"), "barrier_volatile": (False, "volatile"),
}  # fmt: skip
NAMES = ("launches", *PERSISTENT)


@triton.jit
def _fence_acquire():
    """fence.acq_rel.gpu: later loads see what the releases observed by the volatile polls published."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)  # fmt: skip


@triton.jit
def _chain_kernel(
    w_ptr,  # [L, H, H] bf16, contiguous
    y_ptr,  # [L + 1, H] bf16, contiguous; row 0 given, rows 1..L written
    counter_ptr,  # [1] int32, zero before the launch: arrivals so far
    L,
    H: tl.constexpr,
    R: tl.constexpr,  # output rows per program (programs x R >= H)
    LOAD_W: tl.constexpr,  # False: the barrier variant (W = 1/H everywhere, never read)
    POLL: tl.constexpr,  # "atomic": one thread polls with acquire loads, broadcast through shared memory;
    # "volatile": every thread polls with volatile loads, then one acquire fence
):
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = p * R + tl.arange(0, R)  # [R]
    ks = tl.arange(0, H)  # [H]
    row_ok = rows < H
    w_rows = rows.to(tl.int64)[:, None] * H + ks[None, :]  # [R, H] offsets within one W[s]
    w_mask = row_ok[:, None]  # [R, 1]: a program past the last row reads nothing
    if LOAD_W:
        w = tl.load(w_ptr + w_rows, mask=w_mask, other=0.0)
    else:
        w = tl.full([R, H], 1.0 / H, tl.bfloat16)  # every output the mean of y: stays in range
    for s in range(L):
        if s > 0:  # every program has written y[s] and arrived
            if POLL == "atomic":
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
                while seen < programs * s:
                    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            else:
                seen = tl.load(counter_ptr, volatile=True)
                while seen < programs * s:
                    seen = tl.load(counter_ptr, volatile=True)
                _fence_acquire()
        y = tl.load(y_ptr + s * H + ks, cache_modifier=".cg").to(tl.float32)  # [H] from L2
        out = tl.sum(w.to(tl.float32) * y[None, :], axis=1)  # [R]
        tl.store(y_ptr + (s + 1) * H + rows, out.to(tl.bfloat16), mask=row_ok)
        tl.debug_barrier()  # every thread's rows stored before the release
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        if LOAD_W:  # the next product's weight rows: in flight while this program waits at the barrier
            nxt = (s + 1).to(tl.int64) * H * H
            w = tl.load(w_ptr + nxt + w_rows, mask=w_mask & (s + 1 < L), other=0.0)


def persistent_chain(
    w: torch.Tensor, y: torch.Tensor, counter: torch.Tensor, programs: int, load_w: bool, poll: str = "atomic"
) -> None:
    """w [L, H, H] bf16, y [L+1, H] bf16 (row 0 the input), counter [1] int32: the chain in one launch."""
    num, h = w.shape[0], w.shape[1]
    counter.zero_()
    rows = triton.next_power_of_2(triton.cdiv(h, programs))
    _chain_kernel[(programs,)](w, y, counter, num, H=h, R=rows, LOAD_W=load_w, POLL=poll, num_warps=8)


def launch_chain(w: torch.Tensor, y: torch.Tensor) -> None:
    """The same chain as L GEMV launches: y[s+1] = gemv(y[s], W[s])."""
    for s in range(w.shape[0]):
        gemv(y[s : s + 1], w[s], out=y[s + 1 : s + 2])


def check_chain(w: torch.Tensor, y: torch.Tensor, tol: float = 2e-2) -> float:
    """Largest relative error of y[s+1] against W[s] @ y[s] (float32, from the chain's own y[s]) over
    the products; raises SystemExit above tol. w [L, H, H], y [L+1, H]."""
    ref = torch.bmm(w.float(), y[:-1].float().unsqueeze(-1)).squeeze(-1)  # [L, H]
    err = ((y[1:].float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)).max().item()
    if not err <= tol:
        raise SystemExit(f"chain result off by {err:.3g} (relative) against torch")
    return err


def time_us(fn) -> float:
    """Device microseconds of one call of fn (CUDA events around it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=ints, default=[1024, 2048], help="H: each product is [H, H] x [H]")
    ap.add_argument("--products", type=int, default=64, help="L, products in the chain")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the floor")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.products < 2 or args.repeats < 1:
        ap.error("--products must be >= 2 and --repeats >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench_persistent_chain needs a CUDA GPU (the persistent kernel spins on a barrier)")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for h in args.hidden:
        w = (torch.randn(args.products, h, h, device=device, generator=gen) / h**0.5).to(torch.bfloat16)
        mean = torch.full((args.products, h, h), 1.0 / h, device=device, dtype=torch.bfloat16)
        x0 = torch.randn(h, device=device, generator=gen).to(torch.bfloat16)
        ys = {name: torch.zeros(args.products + 1, h, device=device, dtype=torch.bfloat16) for name in NAMES}
        for y in ys.values():
            y[0] = x0
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        graph = torch.cuda.CUDAGraph()
        launch_chain(w, ys["launches"])  # compiles
        with torch.cuda.graph(graph):
            launch_chain(w, ys["launches"])
        runs = {"launches": graph.replay}
        weights = {"launches": w}
        for name, (load_w, poll) in PERSISTENT.items():
            weights[name] = w if load_w else mean
            args_of = (weights[name], ys[name], counter, sms, load_w, poll)
            runs[name] = lambda a=args_of: persistent_chain(*a)
        errors = {}
        for name, fn in runs.items():  # warm (compiles), then check
            fn()
            torch.cuda.synchronize()
            errors[name] = check_chain(weights[name], ys[name])
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):  # alternating
            for name, fn in runs.items():
                times[name].append(time_us(fn))
        floor = h * h * 2 / args.bandwidth * 1e6
        row = {"hidden": h, "products": args.products, "programs": sms, "floor_us": floor,
               "max_rel_error": errors}  # fmt: skip
        for name, ts in times.items():
            per = [t / args.products for t in ts]
            row[name] = {"us_per_product": statistics.median(per), "min": min(per), "max": max(per)}
        rows.append(row)
        del w, mean
    result = {"device": torch.cuda.get_device_name(device), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'H':>6} {'floor':>7} " + " ".join(f"{n:>19}" for n in NAMES) + "   (us per product)")
    for r in rows:
        cells = [f"{r[n]['us_per_product']:7.2f} ({r[n]['min']:.2f}-{r[n]['max']:.2f})" for n in NAMES]
        print(f"{r['hidden']:>6} {r['floor_us']:7.2f} " + " ".join(f"{c:>19}" for c in cells))


if __name__ == "__main__":
    main()
