"""The products of one verify forward on cuBLAS, as one CUDA graph: replay time against the kernels' own.

Builds Qwen3-8B's qkv, o, gate_up and down weights for every layer (bf16, distinct per layer so that
they do not sit in L2), captures F.linear over --rows rows for the layers one after another (the order
of a forward), and reports the median replay time against the sum of the kernels' device times
(torch.profiler over --profiled replays). The difference is what the boundaries between the launches
cost: as torch launches them, cuBLAS kernels start only once the kernel before them has finished (no
programmatic dependent launch), unlike the engine's Triton kernels (layers/pdl.py). At 320 rows
(batch 64 x k + 1 = 5) the products are the verify's; docs/BENCHMARKS.md sets the figures against its
8.5 ms bound.

Two questions about PDL follow (graph_edges.py rewrites the captured graph's edges):
  - whether cuBLAS's kernels wait on a programmatic edge (--race-trials): a Triton kernel releases the
    next one at once, spins, then writes row 0 of x; the product of x that follows on a programmatic
    edge either waits (row 0 of the result right) or reads row 0 before it is written (stale). Two
    Triton consumers that copy row 0, one waiting and one not, show the test can tell them apart;
  - what the chain costs when each product may start as soon as every program of the one before has
    exited (its product-to-product edges made programmatic; the products share no inputs or outputs,
    and their results are only timed, not checked): replayed alternately with the chain as captured.

    python benchmarks/bench_cublas_chain.py --rows 320 --out chain.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import capture_graph, replay_us
from benchmarks.kernels.graph_edges import edges, make_programmatic, node_name

# (name, N, K) of the products of one Qwen3-8B layer, in forward order
LAYER = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
FILL_BLOCK = 1024


@triton.jit
def _slow_fill(x_ptr, spins, a, b, BLOCK: tl.constexpr):
    """x[program's BLOCK entries] = 1 after `spins` dependent multiply-adds (a = b = 0.5 at run time, so
    the value stays 1 but the loop cannot be folded); releases the next kernel before it starts."""
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32) + 1.0
    for _ in range(spins):
        acc = acc * a + b
    tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty))


@triton.jit
def _copy(x_ptr, y_ptr, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[program's BLOCK entries] = x[the same], after griddepcontrol.wait when WAIT."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def memset(t: torch.Tensor) -> None:
    """Zero t's bytes with the driver's memset on the current stream (a memset node under capture)."""
    fn = ctypes.CDLL("libcuda.so.1").cuMemsetD8Async
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    rc = fn(t.data_ptr(), 0, t.numel() * t.element_size(), torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"cuMemsetD8Async failed with CUresult {rc}")


def race(consumer: str, m: int, n: int, k: int, trials: int, spins: int) -> dict:
    """Stale reads of row 0 in `trials` replays of [fill row 0 of x [m, k]] -> consumer on a programmatic
    edge; consumer is "copy" (no wait), "copy+wait", "memset+copy" (a memset node of a scratch buffer
    before the copy, as cuBLAS puts one before some products: the copy then has a full edge from the
    memset beside the programmatic one), or "linear" (F.linear(x, w [n, k]), i.e. cuBLAS)."""
    dev = torch.device("cuda")
    x = torch.zeros(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    out: dict[str, torch.Tensor] = {}
    row = torch.empty(k, device=dev, dtype=torch.bfloat16)
    scratch = torch.empty(1 << 16, device=dev, dtype=torch.uint8)

    def fn() -> None:
        _slow_fill[(k // FILL_BLOCK,)](x, spins, 0.5, 0.5, BLOCK=FILL_BLOCK)
        if consumer == "linear":
            out["y"] = F.linear(x, w)
            return
        if consumer == "memset+copy":
            memset(scratch)
        _copy[(k // FILL_BLOCK,)](x, row, WAIT=consumer == "copy+wait", BLOCK=FILL_BLOCK)

    g = capture_graph(fn, keep=True)
    rewired = make_programmatic(g.raw_cuda_graph(), lambda name: "_slow_fill" in name, through_memsets=True)
    graph_edges = [(node_name(a), node_name(b), d) for a, b, d in edges(g.raw_cuda_graph())]
    kernels = sorted({b for _, b, _ in graph_edges} - {"_slow_fill", "<memset>"})
    g.instantiate()
    stale = 0
    for _ in range(trials):
        x.zero_()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        if consumer == "linear":
            ref = F.linear(x[:1], w)[0].float()
            stale += int(not torch.allclose(out["y"][0].float(), ref, atol=1e-2, rtol=1e-2))
        else:
            stale += int(not torch.equal(row, x[0]))
    return dict(consumer=consumer, n=n, k=k, kernels=kernels, rewired=rewired, edges=graph_edges,
                trials=trials, stale=stale)  # fmt: skip


def inconclusive(cases: list[dict]) -> str | None:
    """Why race()'s results (the copy, copy+wait and memset+copy controls first) decide nothing, or None:
    a control that did not behave, or a case whose edge could not be made programmatic."""
    copy, copy_wait, memset_copy = (r["stale"] for r in cases[:3])
    if not copy or copy_wait or not memset_copy:
        return ("the copies without wait must read stale and the one with wait must not (stale: copy "
                f"{copy}, copy+wait {copy_wait}, memset+copy {memset_copy}); raise --spins")  # fmt: skip
    unrewired = [f"{r['consumer']} {r['n']} x {r['k']}" for r in cases if not r["rewired"]]
    if unrewired:  # no programmatic edge into the consumer: nothing was tested
        return f"no edge made programmatic for {', '.join(unrewired)}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=320)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=9, help="timed batches of --replays replays (median)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--profiled", type=int, default=3, help="replays under torch.profiler for the kernel sum")
    ap.add_argument("--flops", type=float, default=790e12, help="bf16 tensor-core rate of the compute floor")
    ap.add_argument("--race-trials", type=int, default=5, help="replays of each race test (0 skips them)")
    ap.add_argument("--spins", type=int, default=50_000, help="the fill's loop (about 0.3 ms on an H200)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, m = torch.device("cuda"), args.rows
    weights = [  # per layer, in LAYER's order: [N, K]
        [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _, n, k in LAYER]
        for _ in range(args.layers)
    ]
    xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in {k for _, _, k in LAYER}}

    def chain() -> None:  # each product x [m, K] @ W.T -> [m, N]; outputs dropped, as only time counts
        for layer in weights:
            for (_, _, k), w in zip(LAYER, layer):
                F.linear(xs[k], w)

    graph = capture_graph(chain, keep=True)
    overlapped = capture_graph(chain, keep=True)  # product-to-product edges programmatic (memsets' stay)
    rewired = make_programmatic(overlapped.raw_cuda_graph(), lambda name: name.startswith("nvjet"))
    for g in (graph, overlapped):
        g.instantiate()
        for _ in range(5):
            g.replay()
    times, overlapped_times = [], []  # ms per replay, one batch of --replays each, alternating
    for _ in range(args.repeats):
        times += [us / 1e3 for us in replay_us(graph, args.replays, 1)]
        overlapped_times += [us / 1e3 for us in replay_us(overlapped, args.replays, 1)]
    times.sort()
    overlapped_times.sort()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profiled):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kernel: dict[str, float] = {}
    for e in kernels:
        by_kernel[e.name] = by_kernel.get(e.name, 0.0) + e.device_time / args.profiled
    kernels_ms = sum(by_kernel.values()) / 1e3
    replay_ms = times[len(times) // 2]
    flop = sum(2 * m * n * k for _, n, k in LAYER) * args.layers
    result = dict(
        device=torch.cuda.get_device_name(dev), rows=m, layers=args.layers, replay_ms=replay_ms,
        replay_min_max_ms=[times[0], times[-1]], kernels_ms=kernels_ms, boundaries_ms=replay_ms - kernels_ms,
        launches=len(kernels) / args.profiled, flop_floor_ms=flop / args.flops * 1e3,
        tflops_replay=flop / replay_ms / 1e9, tflops_kernels=flop / kernels_ms / 1e9, by_kernel_us=by_kernel,
        programmatic_edges=rewired, programmatic_replay_ms=overlapped_times[len(overlapped_times) // 2],
        programmatic_min_max_ms=[overlapped_times[0], overlapped_times[-1]],
    )  # fmt: skip
    print(f"{m} rows x {args.layers} layers: replay {replay_ms:.3f} ms ({times[0]:.3f}-{times[-1]:.3f}), "
          f"kernels {kernels_ms:.3f} ms over {result['launches']:.0f} launches, boundaries "
          f"{result['boundaries_ms']:.3f} ms; compute floor {result['flop_floor_ms']:.3f} ms")  # fmt: skip
    over = overlapped_times
    print(f"with {rewired} product-to-product edges programmatic: replay {over[len(over) // 2]:.3f} ms "
          f"({over[0]:.3f}-{over[-1]:.3f})")  # fmt: skip
    if args.race_trials:
        cases = [("copy", 0, 4096), ("copy+wait", 0, 4096), ("memset+copy", 0, 4096)]
        cases += [("linear", n, k) for _, n, k in LAYER]
        result["race"] = [race(c, m, n, k, args.race_trials, args.spins) for c, n, k in cases]
        for r in result["race"]:
            print(
                f"race {r['consumer']:11} {r['n']:>5} x {r['k']:<5} stale {r['stale']} / {r['trials']}  "
                f"({', '.join(r['kernels'])}; {r['rewired']} edge(s) programmatic)"
            )
        why = inconclusive(result["race"])
        if why:
            result["race_inconclusive"] = why
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "race_inconclusive" in result:
        raise SystemExit(f"race test inconclusive: {result['race_inconclusive']}")


if __name__ == "__main__":
    main()
