"""Skinny matmuls of a decode step: cuBLAS (F.linear) vs the Triton GEMV, side by side.

For each projection of the Qwen3-8B target and the Qwen3-0.6B draft (bf16), and each row count
(batch), builds one weight per layer (so the weights of a step do not fit in L2, as in a real
step), captures a CUDA graph of the layers' products one after another, and reports microseconds
per product, the achieved read rate and the ratio to the HBM floor (weight bytes / --bandwidth),
for cuBLAS and for every Triton launch shape in the grid; checks each Triton result against
F.linear first. Writes JSON (--out) and prints the best shape per projection last.

    python benchmarks/kernels/bench_gemv.py --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import graph_us, write_json
from thinkspec.layers.fused_triton import silu_and_mul
from thinkspec.layers.gemv_triton import gemv, gemv_config

# (name, N, K, layers)
SHAPES = [
    ("8b.qkv", 6144, 4096, 36), ("8b.o", 4096, 4096, 36), ("8b.gate_up", 24576, 4096, 36),
    ("8b.down", 4096, 12288, 36), ("8b.lm_head", 151936, 4096, 1),
    ("0.6b.qkv", 4096, 1024, 28), ("0.6b.o", 1024, 2048, 28), ("0.6b.gate_up", 6144, 1024, 28),
    ("0.6b.down", 1024, 3072, 28), ("0.6b.lm_head", 151936, 1024, 1),
    ("8b.gate_up_glu", 24576, 4096, 36), ("0.6b.gate_up_glu", 6144, 1024, 28),
    ("llama3-8b.gate_up_glu", 28672, 4096, 32), ("llama3-70b-tp2.gate_up_glu", 28672, 8192, 8),
]  # fmt: skip
# "_glu": the gate/up product as the engine runs it at 1-2 rows, SiLU(gate) * up in the GEMV's
# epilogue (N weight rows, N / 2 outputs); the Llama-3 ones (70B: one rank's half at TP = 2, 8 of its
# 80 layers, 3.8 GB, enough to miss L2) as well: weights past GEMV_MAX_WEIGHT, which the engine keeps on
# cuBLAS then silu_and_mul (docs/BENCHMARKS.md, "Attention, GEMV and GEMM kernels")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--block-n", default="1,2,4,8")
    ap.add_argument("--block-k", default="512,1024,2048")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--bandwidth", type=float, default=4.21e12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    grid = list(
        itertools.product(ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages))
    )
    wanted = set(args.shapes.split(","))
    rows_out = []
    for name, n, k, layers in [s for s in SHAPES if s[0] in wanted]:
        glu = name.endswith("_glu")
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        floor_us = n * k * 2 / args.bandwidth * 1e6
        for m in ints(args.rows):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0]).float()
            if glu:
                ref = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2 :]
            cublas = graph_us(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws]) / layers
            # with glu, cuBLAS times the product alone, and then with the SiLU * up launch after it
            row = dict(shape=name, n=n, k=k, glu=glu, rows=m, floor_us=floor_us, cublas_us=cublas, triton={})
            if glu:
                two = lambda x=x, ws=ws: [silu_and_mul(torch.nn.functional.linear(x, w)) for w in ws]  # noqa: E731
                row["cublas_silu_us"] = graph_us(two) / layers
            for bn, bk, warps, stages in grid:
                if m * bn * bk * (1 + glu) // (32 * warps) > 128 or bk > 2 * triton.next_power_of_2(k):
                    continue  # too many accumulator registers per thread, or a block far past K
                cfg = (bn, bk, warps, stages)
                err = (gemv(x, ws[0], config=cfg, glu=glu).float() - ref).abs().max().item()
                if err > 1e-2 * ref.abs().max().item() + 1e-3:
                    raise AssertionError(f"{name} rows {m} config {cfg}: max error {err}")
                run = lambda x=x, ws=ws, cfg=cfg, glu=glu: [gemv(x, w, config=cfg, glu=glu) for w in ws]  # noqa: E731
                row["triton"][",".join(map(str, cfg))] = graph_us(run) / layers
            default = ",".join(map(str, gemv_config(m, n // 2 if glu else n, k, glu)))
            # gemv_config's shape at whatever stage count the grid has (stages change nothing here)
            same = [c for c in row["triton"] if c.split(",")[:3] == default.split(",")[:3]]
            best = min(row["triton"], key=row["triton"].get)
            row.update(best=best, best_us=row["triton"][best], default=default,
                       default_us=row["triton"][same[0]] if same else None)  # fmt: skip
            rows_out.append(row)
            silu = f"+ silu {row['cublas_silu_us']:7.1f}  " if glu else ""
            print(f"{name:<14} rows {m}  floor {floor_us:7.1f}  "
                  f"cublas {cublas:7.1f} ({cublas / floor_us:.2f}x)  {silu}"
                  f"triton best {row['best_us']:7.1f} ({row['best_us'] / floor_us:.2f}x) [{best}]  "
                  f"default {row['default_us'] or float('nan'):7.1f} [{default}]", flush=True)  # fmt: skip
        ws.clear()
        torch.cuda.empty_cache()
    if args.out:
        result = dict(device=torch.cuda.get_device_name(dev), rows=rows_out)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
