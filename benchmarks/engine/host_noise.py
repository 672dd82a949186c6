"""How steady is the host CPU? Fixed pure-Python work, timed in chunks, unpinned and pinned to one core.

The toy sweep at hundreds of requests in flight is host-bound (the device is busy a few percent of the
time), so its tok/s follows the speed of one CPU core. This measures that speed directly: the same
chunk of interpreter work (dict, list and int operations, as the scheduler does) is repeated for
--seconds, and each chunk's wall and thread CPU time is recorded. Reported per mode:
  chunk_ms          median, p10, p90, min and max of the chunk times
  window_spread     max/min of the work rate over consecutive windows of --window seconds (a sweep
                    cell's repetition lasts about 1-6 s): the spread a host-bound timing inherits
  steal_s           the VM's steal time over the run (/proc/stat; 0 where the hypervisor reports none)
Writes JSON (--out) and prints a short table last.

    python benchmarks/engine/host_noise.py --seconds 30 --out host_noise.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path


def chunk(n: int) -> int:
    """A fixed amount of interpreter work (about a millisecond per 2,000 at CPython speed)."""
    table: dict[int, list[int]] = {}
    total = 0
    for i in range(n):
        row = table.setdefault(i & 255, [])
        row.append(i)
        if len(row) > 8:
            total += sum(row)
            row.clear()
        total += max(i & 7, len(table))
    return total


def steal_seconds() -> float:
    """Cumulative steal time of all CPUs (s), 0.0 where /proc/stat has no such field."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


def run(seconds: float, size: int, window: float) -> dict:
    """Chunk times (ms) for `seconds` of repeated work, and the spread of the rate over windows."""
    walls: list[float] = []
    cpus: list[float] = []
    ends: list[float] = []
    steal0 = steal_seconds()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        chunk(size)
        t1, c1 = time.perf_counter(), time.thread_time()
        walls.append((t1 - t0) * 1e3)
        cpus.append((c1 - c0) * 1e3)
        ends.append(t1 - start)
    rates: list[float] = []
    edge, count = window, 0
    for end in ends:
        if end > edge:
            rates.append(count / window)
            edge, count = edge + window, 0
        count += 1
    q = statistics.quantiles(walls, n=10)
    return {
        "chunks": len(walls),
        "chunk_ms": {"median": statistics.median(walls), "p10": q[0], "p90": q[-1], "min": min(walls),
                     "max": max(walls)},
        "cpu_over_wall": sum(cpus) / sum(walls),
        "window_rates": rates,
        "window_spread": max(rates) / min(rates) if rates and min(rates) > 0 else None,
        "steal_s": steal_seconds() - steal0,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="per mode")
    ap.add_argument("--size", type=int, default=20000, help="loop iterations per chunk")
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--core", type=int, default=None, help="core for the pinned mode (default: the last)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1] if args.core is None else args.core
    report: dict = {"cpus": len(cores), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    with contextlib.suppress(OSError, StopIteration):
        report["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )  # fmt: skip
    chunk(args.size)  # warm the interpreter's caches
    report["unpinned"] = run(args.seconds, args.size, args.window)
    os.sched_setaffinity(0, {core})
    report["pinned"] = run(args.seconds, args.size, args.window)
    report["pinned"]["core"] = core
    os.sched_setaffinity(0, cores)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"host noise: {report.get('cpu_model', '?')}, {len(cores)} cpus, {args.seconds:.0f} s per mode")
    print(f"{'mode':>9} {'chunks':>7} {'median ms':>9} {'p10':>7} {'p90':>7} {'min':>7} {'max':>7} "
          f"{'win max/min':>11} {'cpu/wall':>8} {'steal s':>7}")  # fmt: skip
    for mode in ("unpinned", "pinned"):
        r, c = report[mode], report[mode]["chunk_ms"]
        spread = f"{r['window_spread']:.2f}" if r["window_spread"] else "-"
        print(f"{mode:>9} {r['chunks']:>7} {c['median']:>9.2f} {c['p10']:>7.2f} {c['p90']:>7.2f} "
              f"{c['min']:>7.2f} {c['max']:>7.2f} {spread:>11} {r['cpu_over_wall']:>8.2f} "
              f"{r['steal_s']:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
