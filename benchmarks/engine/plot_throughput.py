"""Plot a bench_throughput.py result: decode tok/s per engine against batch size (left), and the
batch-1 step of each engine against the weight-read floor and the 1.2x target (right).

    python benchmarks/engine/plot_throughput.py benchmarks/results/<run>.json --out docs/throughput-h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {
    "hf_eager": "HF eager",
    "hf_static": "HF static cache",
    "thinkspec": "thinkspec",
    "thinkspec_sync": "thinkspec, sync scheduling",
}


def label(engine: str) -> str:
    if engine.startswith("thinkspec_spec_al"):
        return f"thinkspec speculative, AL {engine.removeprefix('thinkspec_spec_al')}"
    return LABELS.get(engine, engine)


def plot(result: dict, path: str | Path) -> None:
    """Write the two-panel PNG for one result of bench_throughput.py (its JSON, loaded)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))  # in run order
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for engine in engines:
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["batch"])
        style = "--" if engine.startswith("hf_") else "-"
        left.plot([r["batch"] for r in mine], [r["tok_per_s"] for r in mine], style, marker="o",
                  label=label(engine))  # fmt: skip
    batches = sorted({r["batch"] for r in rows})
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    left.minorticks_off()
    left.set_yscale("log")
    left.set_xlabel("batch size")
    left.set_ylabel("decode tokens/s (all sequences)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    first = [r for r in rows if r["batch"] == 1]
    names = [label(r["engine"]) for r in first]
    ms = [r["ms_per_step"] for r in first]
    bars = right.barh(names, ms, color=["0.6" if r["engine"].startswith("hf_") else "C0" for r in first])
    right.bar_label(bars, labels=[f"{v:.2f}" for v in ms], fontsize=8, padding=2)
    right.set_xscale("log")
    ticks = [t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if t <= 2 * max(ms)]
    right.set_xticks(ticks, [str(t) for t in ticks])
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_xlim(left=1)
    right.invert_yaxis()
    right.set_xlabel("batch-1 ms per output token (log)")
    floor = result.get("floor_ms_per_step")
    if floor:
        right.axvline(floor, color="k", lw=1, label=f"weight-read floor {floor:.2f} ms")
        right.axvline(1.2 * floor, color="C3", lw=1, ls=":", label="1.2x floor (target)")
        right.legend(fontsize=8, loc="lower right")
    right.grid(True, axis="x", which="both", alpha=0.3)
    fig.suptitle(
        f"decode throughput, {result['shape']}, {result['dtype']}, {result['device']}, "
        f"prompt {result['prompt_len']}, output {result['output_len']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="JSON written by bench_throughput.py --out")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    plot(json.loads(Path(args.result).read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
