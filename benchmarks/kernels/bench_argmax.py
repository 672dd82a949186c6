"""Greedy sampling: torch.argmax against the one-launch Triton argmax (sampling/argmax_triton.py).

Both are called the way the engine calls them, eagerly after a forward: each round queues a GPU sleep,
then --calls calls of one method back to back between two CUDA events, so the host has queued them all
before the device starts and the events time the device alone. Methods alternate round by round;
microseconds per call, median (min-max) over --rounds. Each result is checked against torch first.
Writes JSON (--out) and prints a table last.

    python benchmarks/kernels/bench_argmax.py --rows 1,2,16,64,128 --out argmax.json
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_argmax.py --device cpu --vocab 500 --rows 1,3 \\
        --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thinkspec.sampling.argmax_triton import argmax_triton


def time_calls(fn, calls: int, device: torch.device) -> float:
    """Microseconds per call of fn over `calls` calls queued behind a sleep (CUDA), or wall time (CPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda._sleep(20_000_000)  # about 10 ms: the host queues every call before the device gets there
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,16,64,128")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, args.vocab, device=device, generator=g)
        out = torch.empty(rows, dtype=torch.int64, device=device)
        methods = {"torch": lambda x=x: x.argmax(dim=-1), "triton": lambda x=x, o=out: argmax_triton(x, o)}
        if not torch.equal(argmax_triton(x, out), x.argmax(dim=-1)):
            raise SystemExit(f"triton argmax differs from torch at {rows} rows")
        for fn in methods.values():  # builds, caches and allocator warm
            time_calls(fn, 2, device)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                times[name].append(time_calls(fn, args.calls, device))
        cell = {"rows": rows, "vocab": args.vocab}
        for name, ts in times.items():
            cell[name] = {"median_us": statistics.median(ts), "min_us": min(ts), "max_us": max(ts)}
        cell["triton_over_torch"] = cell["triton"]["median_us"] / cell["torch"]["median_us"]
        results.append(cell)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "rounds": args.rounds, "calls": args.calls, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"greedy argmax, {name}, vocab {args.vocab}: us per call, median (min-max) of {args.rounds} rounds")
    print("rows | torch.argmax | triton | triton / torch")
    for c in results:
        t, k = c["torch"], c["triton"]
        cells = [f"{m['median_us']:.2f} ({m['min_us']:.2f}-{m['max_us']:.2f})" for m in (t, k)]
        print(f"{c['rows']} | {cells[0]} | {cells[1]} | {c['triton_over_torch']:.3f}")


if __name__ == "__main__":
    main()
