"""Quality gates of the bundled toy reasoner, measured with the thinkspec engine.

Side by side on the same fresh problems, greedy: the target without speculation, strict
draft-model speculative decoding, and relaxed settings. Per mode: answer accuracy, mean output
tokens, mean acceptance length (overall / thinking / answer), relaxed-only share, tokens/s.

    python benchmarks/toy_quality.py --num-problems 500 --out toy_quality.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from thinkspec import LLM, SamplingParams
from thinkspec.toy.assets import ASSETS_DIR
from thinkspec.toy.task import chat_prompt, generate_samples, grade

TOY = ASSETS_DIR / "toy-reasoner"


def run_mode(llm: LLM, prompts: list[str], problems: list, max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    seconds = time.perf_counter() - t0
    correct = [grade(o.outputs[0].text, p) for o, p in zip(outs, problems)]
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {
        "accuracy": sum(correct) / len(correct),
        "num_correct": sum(correct),
        "mean_output_tokens": n_tokens / len(outs),
        "truncated": sum(o.outputs[0].finish_reason == "length" for o in outs),
        "seconds": seconds,
        "tokens_per_s": n_tokens / seconds,
        "correct": correct,
    }
    m = llm.last_spec_metrics
    if m is not None:
        row.update(
            mean_acceptance_length=m.mean_acceptance_length(),
            thinking_acceptance_length=m.mean_acceptance_length("thinking"),
            answer_acceptance_length=m.mean_acceptance_length("answer"),
            draft_acceptance_rate=m.draft_acceptance_rate(),
            relaxed_share=m.relaxed_share(),
            thinking_share_of_drafts=m.phase("thinking").num_draft_tokens / max(1, m.total.num_draft_tokens),
            metrics=m.to_dict(),
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-problems", type=int, default=500)
    p.add_argument("--seed", type=int, default=20261201, help="problem seed (fresh: not the training seeds)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--drafts", default="draft", help="comma-separated draft folders under the toy assets")
    p.add_argument("--relax", default="0.3:3,0.1:8", help="relaxed settings as ratio:top_k, comma-separated")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--no-baseline", action="store_true", help="skip the no-speculation run")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    samples = generate_samples(args.num_problems, seed=args.seed)
    prompts = [chat_prompt(s.problem.question) for s in samples]
    problems = [s.problem for s in samples]
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
    result = {"num_problems": args.num_problems, "seed": args.seed, "k": args.k, "modes": rows}
    for name, cfg in modes:
        llm = LLM(TOY / "target", speculative_config=cfg, **common)
        rows[name] = run_mode(llm, prompts, problems, args.max_tokens)
        if args.out:  # after every mode, so a cut-short run keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"toy reasoner, {args.num_problems} problems (seed {args.seed}), greedy, k={args.k}")
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
