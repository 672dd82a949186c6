"""The products of one verify forward on cuBLAS, as one CUDA graph: replay time against the kernels' own.

Builds Qwen3-8B's qkv, o, gate_up and down weights for every layer (bf16, distinct per layer so that
they do not sit in L2), captures F.linear over --rows rows for the layers one after another (the order
of a forward), and reports the median replay time against the sum of the kernels' device times
(torch.profiler over --profiled replays). The difference is what the boundaries between the launches
cost: as torch launches them, cuBLAS kernels start only once the kernel before them has finished (no
programmatic dependent launch), unlike the engine's Triton kernels (layers/pdl.py). At 320 rows
(batch 64 x k + 1 = 5) the products are the verify's; docs/BENCHMARKS.md sets the figures against its
8.5 ms bound.

    python benchmarks/bench_cublas_chain.py --rows 320 --out chain.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemv import capture_graph, replay_us
from torch.profiler import ProfilerActivity, profile

# (name, N, K) of the products of one Qwen3-8B layer, in forward order
LAYER = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=320)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=9, help="timed batches of --replays replays (median)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--profiled", type=int, default=3, help="replays under torch.profiler for the kernel sum")
    ap.add_argument("--flops", type=float, default=790e12, help="bf16 tensor-core rate of the compute floor")
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

    graph = capture_graph(chain)
    for _ in range(5):
        graph.replay()
    times = [us / 1e3 for us in replay_us(graph, args.replays, args.repeats)]  # ms, sorted
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
    )  # fmt: skip
    print(f"{m} rows x {args.layers} layers: replay {replay_ms:.3f} ms ({times[0]:.3f}-{times[-1]:.3f}), "
          f"kernels {kernels_ms:.3f} ms over {result['launches']:.0f} launches, boundaries "
          f"{result['boundaries_ms']:.3f} ms; compute floor {result['flop_floor_ms']:.3f} ms")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
