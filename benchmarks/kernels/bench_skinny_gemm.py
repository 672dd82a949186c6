"""Decode-step products at 4..64 rows: cuBLAS (F.linear) vs the skinny Triton GEMM, side by side.

For each Qwen3-8B projection (bf16; with --model 0.6b Qwen3-0.6B's, the draft's) and each row count
(batch), builds one weight per layer (so the weights of a step do not fit in L2, as in a real step),
captures a CUDA graph of the layers' products one after another (bench_gemv.graph_us), and reports
microseconds per product against the weight-read floor (weight bytes / --bandwidth) and cuBLAS, for
cuBLAS and the skinny GEMM's launch shapes; each launch shape's result is checked against F.linear
before it is timed.

The launch-shape search runs in two rounds per (projection, rows), to stay within a few minutes:
  1. every (BLOCK_N, BLOCK_K, SPLIT_K) of the grid at 4 warps and the stage count nearest to 64 KiB
     of weight tiles in flight, keeping shapes whose shared memory fits (--smem-kib) and splitting
     K only while N / BLOCK_N programs (x the previous split) leave 2 x 132 SMs short of work;
  2. the --refine best of round 1 at every (warps, stages) of the grid that fits.
Then it prints the best shape per cell with its ratios, and the per-step totals (36 layers of
qkv, o, gate_up, down + lm_head) at rows 16 and 64: cuBLAS, best Triton, and the best of both per
projection (what the dispatch table gives).

    python benchmarks/kernels/bench_skinny_gemm.py --out skinny.json
    python benchmarks/kernels/bench_skinny_gemm.py --table-from skinny.json   # SKINNY_GEMM_TABLE entries
    python benchmarks/kernels/bench_skinny_gemm.py --glu --out glu.json       # SiLU * up: SKINNY_GLU_TABLE
    python benchmarks/kernels/bench_skinny_gemm.py --glu --rows 64 --no-tma   # pointer loads instead of TMA
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_skinny_gemm.py --small   # CPU smoke (tiny shapes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import graph_us, write_json
from thinkspec.layers import gemm_skinny_triton
from thinkspec.layers.gemm_skinny_triton import ROW_BUCKETS, Config, skinny_gemm

# (name, N, K, layers)
SHAPES = [
    ("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
    ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1),
]  # fmt: skip
# --model 0.6b: Qwen3-0.6B's, the draft's (a speculative step's draft forwards run at the batch's rows)
DRAFT_SHAPES = [
    ("qkv", 4096, 1024, 28), ("o", 1024, 2048, 28), ("gate_up", 6144, 1024, 28),
    ("down", 1024, 3072, 28), ("lm_head", 151936, 1024, 1),
]  # fmt: skip
SMALL_SHAPES = [("qkv", 96, 128, 2), ("o", 64, 128, 2), ("gate_up", 160, 128, 2), ("down", 64, 256, 2),
                ("lm_head", 300, 128, 1)]  # fmt: skip
# --glu: gate_up with SiLU(gate) * up fused (N = the outputs, from 2N weight rows), against cuBLAS's
# gate_up product followed by the silu_and_mul launch
GLU_SHAPES = [("gate_up_silu", 12288, 4096, 36)]
DRAFT_GLU_SHAPES = [("gate_up_silu", 3072, 1024, 28)]
SMALL_GLU_SHAPES = [("gate_up_silu", 80, 128, 2)]
NUM_SMS = 132
IN_FLIGHT = 64 * 1024  # bytes of weight tiles in flight per program that round 1 aims for


def fits(m: int, cfg: Config, smem_bytes: int, glu: bool = False) -> bool:
    # shared memory of num_stages buffers of a W tile (glu: two) and an x tile (rows padded to >= 16)
    block_n, block_k, _, _, stages = cfg
    w_rows = (2 if glu else 1) * block_n
    return stages * (w_rows + max(16, triton.next_power_of_2(m))) * block_k * 2 <= smem_bytes


def round_one(
    m: int, n: int, k: int, grid: dict[str, list[int]], smem_bytes: int, glu: bool = False
) -> list[Config]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) shapes at 4 warps and the stages nearest IN_FLIGHT (glu: no split)."""
    out = []
    for bn, bk, split in itertools.product(grid["block_n"], grid["block_k"], grid["split"]):
        if glu and split > 1:
            continue
        programs = triton.cdiv(n, bn)
        if split > 1 and (programs * (split // 2) >= 2 * NUM_SMS or k // (split * bk) < 4):
            continue  # the SMs already have work without this split, or slices too short to pipeline
        tile = (2 if glu else 1) * bn * bk * 2
        by_window = sorted(grid["stages"], key=lambda s: abs((s - 1) * tile - IN_FLIGHT))
        stages = next((s for s in by_window if fits(m, (bn, bk, split, 4, s), smem_bytes, glu)), None)
        if stages is not None:
            out.append((bn, bk, split, 4, stages))
    return out


def round_two(
    m: int, best: list[Config], grid: dict[str, list[int]], smem_bytes: int, glu: bool = False
) -> list[Config]:
    """Every (warps, stages) of the grid for the given shapes; 8 warps only for tiles of >= 16K elements."""
    out = []
    for bn, bk, split, _, _ in best:
        for warps, stages in itertools.product(grid["warps"], grid["stages"]):
            cfg = (bn, bk, split, warps, stages)
            if (warps <= 4 or bn * bk >= 128 * 128) and fits(m, cfg, smem_bytes, glu):
                out.append(cfg)
    return out


def make_timer(device: torch.device):
    if device.type == "cuda":
        return lambda fn: graph_us(fn, reps=10)

    def wall_us(fn) -> float:  # CPU smoke: one call, wall clock (no meaning beyond "it runs")
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    return wall_us


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # a bf16 rounding of the float32 result, plus float32 sums in another order
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2**-7 + 1e-2 * ref.abs().max().item() + 1e-3
    if not (err <= bound).all():
        raise AssertionError(f"{what}: max error {err.max().item()} vs F.linear")


def bench_cell(name, n, k, m, ws, timer, grid, args) -> dict:
    # ws: the layers' weights [N, K] (--glu: [2N, K], gate rows then up rows)
    dev = ws[0].device
    layers, glu = len(ws), args.glu
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())
    if glu:
        gate, up = ref.bfloat16().chunk(2, dim=-1)
        ref = (F.silu(gate) * up).float()
    floor_us = ws[0].numel() * 2 / args.bandwidth * 1e6
    if glu:
        from thinkspec.layers.fused_triton import silu_and_mul

        cublas = timer(lambda: [silu_and_mul(F.linear(x, w)) for w in ws]) / layers
    else:
        cublas = timer(lambda: [F.linear(x, w) for w in ws]) / layers
    row = dict(shape=name, n=n, k=k, rows=m, floor_us=floor_us, cublas_us=cublas, triton={}, skipped={})

    def run(cfgs: list[Config]) -> None:
        for cfg in cfgs:
            key = ",".join(map(str, cfg))
            if key in row["triton"] or key in row["skipped"]:
                continue
            try:
                check(skinny_gemm(x, ws[0], config=cfg, glu=glu), ref, f"{name} rows {m} config {cfg}")
            except triton.runtime.errors.OutOfResources as exc:  # the estimate in fits() missed
                row["skipped"][key] = str(exc)
                continue
            us = timer(lambda cfg=cfg: [skinny_gemm(x, w, config=cfg, glu=glu) for w in ws])
            row["triton"][key] = us / layers

    smem = args.smem_kib * 1024
    run(round_one(m, n, k, grid, smem, glu))
    best = sorted(row["triton"], key=row["triton"].get)[: args.refine]
    run(round_two(m, [tuple(int(v) for v in key.split(",")) for key in best], grid, smem, glu))
    key = min(row["triton"], key=row["triton"].get)
    row.update(best=key, best_us=row["triton"][key])
    print(f"{name:<8} rows {m:>2}  floor {floor_us:7.1f}  cublas {cublas:7.1f} ({cublas / floor_us:.2f}x)  "
          f"triton {row['best_us']:7.1f} ({row['best_us'] / floor_us:.2f}x floor, "
          f"{row['best_us'] / cublas:.2f}x cublas) [{key}] of {len(row['triton'])}", flush=True)  # fmt: skip
    return row


def step_totals(rows_out: list[dict], shapes, rows: list[int], bandwidth: float) -> list[dict]:
    """Per-step products: each projection's time x its layers, summed, for every row count measured
    for all shapes."""
    totals = []
    for m in rows:
        cells = {r["shape"]: r for r in rows_out if r["rows"] == m}
        if len(cells) < len(shapes):
            continue

        def sum_of(f, cells=cells) -> float:  # ms: f(cell) us per product x layers, over the shapes
            return sum(f(cells[name]) * layers / 1e3 for name, _, _, layers in shapes)

        t = dict(
            rows=m, floor_ms=sum(n * k * 2 * layers for _, n, k, layers in shapes) / bandwidth * 1e3,
            cublas_ms=sum_of(lambda r: r["cublas_us"]), triton_ms=sum_of(lambda r: r["best_us"]),
            dispatch_ms=sum_of(lambda r: min(r["cublas_us"], r["best_us"])),
        )  # fmt: skip
        totals.append(t)
        print(f"step rows {m:>2}: floor {t['floor_ms']:.3f} ms  cublas {t['cublas_ms']:.3f} ms "
              f"({t['cublas_ms'] / t['floor_ms']:.2f}x)  best triton {t['triton_ms']:.3f} ms "
              f"({t['triton_ms'] / t['floor_ms']:.2f}x)  best of both {t['dispatch_ms']:.3f} ms "
              f"({t['dispatch_ms'] / t['floor_ms']:.2f}x)")  # fmt: skip
    return totals


def table_entries(result: dict, min_gain: float) -> dict[tuple[int, int, int], tuple[int, ...]]:
    """(rows bucket, N, K) -> config for the cells where the best launch shape beat cuBLAS by min_gain."""
    entries = {}
    for r in result["rows"]:
        if r["rows"] in ROW_BUCKETS and r["cublas_us"] >= (1 + min_gain) * r["best_us"]:
            entries[(r["rows"], r["n"], r["k"])] = tuple(int(v) for v in r["best"].split(","))
    return entries


def print_table(path: str, min_gain: float) -> None:
    result = json.loads(Path(path).read_text())
    by_key = {(r["rows"], r["n"], r["k"]): r for r in result["rows"]}
    print(
        f"# from {Path(path).name} ({result.get('device', '?')}), cells >= {min_gain:.0%} faster than cuBLAS"
    )
    table = "SKINNY_GLU_TABLE" if result.get("glu") else "SKINNY_GEMM_TABLE"
    print(f"{table}: dict[tuple[int, int, int], Config] = {{")
    for key, cfg in sorted(table_entries(result, min_gain).items()):
        r = by_key[key]
        print(f"    {key}: {cfg},  # {r['shape']}: {r['best_us']:.1f} vs cuBLAS {r['cublas_us']:.1f} us")
    print("}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--split", default="1,2,4")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--refine", type=int, default=2, help="round-1 shapes tried at every warps/stages")
    ap.add_argument("--smem-kib", type=int, default=227, help="shared memory per block (H200: 227 KiB)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--model", choices=("8b", "0.6b"), default="8b", help="Qwen3-8B's or 0.6B's projections")
    ap.add_argument("--bandwidth", type=float, default=4.21e12)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--small", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): a smoke run"
    )
    ap.add_argument(
        "--glu", action="store_true", help="gate_up with SiLU(gate) * up fused, vs cuBLAS + silu_and_mul"
    )
    ap.add_argument(
        "--no-tma", action="store_true", help="pointer loads only (no tensor descriptors), to compare the two"
    )
    ap.add_argument("--table-from", default=None, help="print SKINNY_GEMM_TABLE entries from a result JSON")
    ap.add_argument("--min-gain", type=float, default=0.03, help="--table-from: least gain over cuBLAS")
    args = ap.parse_args()
    if args.table_from:
        print_table(args.table_from, args.min_gain)
        return
    gemm_skinny_triton.TMA = not args.no_tma
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    grid = {name: ints(getattr(args, name)) for name in ("block_n", "block_k", "split", "warps", "stages")}
    if args.small:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--small runs the kernels on CPU: set TRITON_INTERPRET=1")
        dev, shapes = torch.device("cpu"), SMALL_GLU_SHAPES if args.glu else SMALL_SHAPES
        grid.update(block_k=[b for b in grid["block_k"] if b <= 128])
    else:
        dev, draft = torch.device("cuda"), args.model == "0.6b"
        glu_shapes, plain_shapes = (DRAFT_GLU_SHAPES, DRAFT_SHAPES) if draft else (GLU_SHAPES, SHAPES)
        shapes = glu_shapes if args.glu else plain_shapes
    if not args.glu:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in shapes if s[0] in wanted]
    timer = make_timer(dev)
    start = time.perf_counter()
    rows_out = []
    for name, n, k, layers in shapes:
        rows_w = 2 * n if args.glu else n
        ws = [torch.randn(rows_w, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        for m in ints(args.rows):
            rows_out.append(bench_cell(name, n, k, m, ws, timer, grid, args))
        ws.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    totals = [] if args.glu else step_totals(rows_out, shapes, [m for m in ints(args.rows) if m in (16, 64)],
                                             args.bandwidth)  # fmt: skip
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out:
        device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
        result = dict(device=device, model=args.model, bandwidth=args.bandwidth, grid=grid, glu=args.glu,
                      tma=not args.no_tma, rows=rows_out, step_totals=totals)  # fmt: skip
        result["table"] = [dict(rows=key[0], n=key[1], k=key[2], config=cfg)
                           for key, cfg in table_entries(result, args.min_gain).items()]  # fmt: skip
        write_json(args.out, result)


if __name__ == "__main__":
    main()
