"""Quality gates of the bundled toy reasoner, measured with the thinkspec engine.

Side by side on the same fresh problems, greedy: the target without speculation, strict
draft-model speculative decoding, and relaxed settings. Per mode: answer accuracy, mean output
tokens, mean acceptance length (overall / thinking / answer), relaxed-only share, tokens/s.

    python benchmarks/toy/toy_quality.py --num-problems 500 --out toy_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinkspec import LLM
from thinkspec.bench.bench import run_cell
from thinkspec.bench.datasets import BenchItem, default_max_tokens, load_dataset
from thinkspec.model_names import ASSETS_DIR

TOY = ASSETS_DIR / "toy-reasoner"


def run_mode(llm: LLM, items: list[BenchItem], max_tokens: int) -> dict:
    cell = run_cell(llm, items, "mode", {}, temperature=0.0, max_tokens=max_tokens)
    row = cell.summary()
    row["correct"] = cell.correct
    if cell.spec is not None:
        drafts = cell.spec["by_phase"]["thinking"]["num_draft_tokens"]
        row["thinking_share_of_drafts"] = drafts / max(1, cell.spec["num_draft_tokens"])
        row["metrics"] = cell.spec
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-problems", type=int, default=500)
    p.add_argument("--seed", type=int, default=20261201, help="problem seed (fresh: not the training seeds)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--drafts", default="draft", help="comma-separated draft folders under the toy assets")
    p.add_argument("--relax", default="0.3:3,0.1:8", help="relaxed settings as ratio:top_k, comma-separated")
    p.add_argument("--level", choices=("easy", "hard"), default="easy", help="toy problem difficulty")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the level's budget")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--no-baseline", action="store_true", help="skip the no-speculation run")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    items = load_dataset("toy", args.num_problems, seed=args.seed, level=args.level)
    args.max_tokens = args.max_tokens or default_max_tokens("toy", args.level)
    common = dict(device=args.device, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192)
    modes: list[tuple[str, dict | None]] = [] if args.no_baseline else [("no_spec", None)]
    for draft in args.drafts.split(","):
        base = {"model": str(TOY / draft), "num_speculative_tokens": args.k, "reasoning_parser": "qwen3"}
        modes.append((f"{draft}/strict", base))
        for setting in args.relax.split(","):
            ratio, top_k = setting.split(":")
            cfg = {**base, "relaxed_thinking": True, "relax_ratio": float(ratio), "relax_top_k": int(top_k)}
            modes.append((f"{draft}/relaxed r={ratio} k={top_k}", cfg))
    rows: dict[str, dict] = {}
    result = {
        "num_problems": args.num_problems, "seed": args.seed, "level": args.level, "k": args.k, "modes": rows
    }  # fmt: skip
    for name, cfg in modes:
        llm = LLM(TOY / "target", speculative_config=cfg, **common)
        rows[name] = run_mode(llm, items, args.max_tokens)
        if args.out:  # after every mode, so a cut-short run keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"toy reasoner, {args.num_problems} {args.level} problems (seed {args.seed}), greedy, k={args.k}")
    header = ["mode", "acc", "AL", "AL think", "AL ans", "relaxed", "tok/s", "len"]
    print(f"{header[0]:<28} " + " ".join(f"{h:>8}" for h in header[1:]))
    for name, r in rows.items():
        cells = [f"{r['accuracy']:.3f}"]
        for key in ("mean_acceptance_length", "thinking_acceptance_length", "answer_acceptance_length",
                    "relaxed_share"):  # fmt: skip
            cells.append(f"{r[key]:.2f}" if key in r else "-")
        cells += [f"{r['tokens_per_s']:.0f}", f"{r['mean_output_tokens']:.1f}"]
        print(f"{name:<28} " + " ".join(f"{c:>8}" for c in cells))


if __name__ == "__main__":
    main()
