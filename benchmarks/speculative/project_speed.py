"""Projected tok/s of a sweep's settings on a real-shaped model pair (thinkspec/bench/projection.py).

  python3 benchmarks/speculative/project_speed.py --sweep docs/sweep-toy-h200/sweep.json \\
      --costs spec_round.json [--out projection.json] [--plot projection.png]

--costs is the JSON of benchmarks/speculative/bench_spec_round.py (e.g. --batch-sizes 1,4,16,64,128
at the Qwen3-8B / Qwen3-0.6B shapes) or of benchmarks/speculative/validate_projection.py (the step
costs it measured); its k must be the sweep's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinkspec.bench.projection import costs_from_spec_round, profiles_from_sweep, project


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="sweep.json of `thinkspec sweep`")
    p.add_argument(
        "--costs", required=True,
        help="JSON of benchmarks/speculative/bench_spec_round.py or .../validate_projection.py",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG of projected tok/s against batch size")
    args = p.parse_args()
    sweep = json.loads(Path(args.sweep).read_text())
    costs = costs_from_spec_round(json.loads(Path(args.costs).read_text()))
    k = costs[0].k
    sweep_k = sweep["config"]["speculative_config"].get("num_speculative_tokens")
    if sweep_k is not None and sweep_k != k:
        raise SystemExit(f"the sweep used k={sweep_k}, the cost table k={k}")
    rows = project(profiles_from_sweep(sweep, k), costs)
    print(f"{'batch':>5}  {'cell':<26} {'tok/s':>10} {'vs plain':>9}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['cell']:<26} {r['tokens_per_s']:>10.1f} {r['vs_plain']:>8.2f}x")
    if args.out:
        report = {"sweep": args.sweep, "costs": args.costs, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cell in dict.fromkeys(r["cell"] for r in rows):
        pts = [(r["batch"], r["vs_plain"]) for r in rows if r["cell"] == cell]
        ax.plot(*zip(*pts), marker="o", label=cell)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("projected tok/s / no speculation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
