"""The projection (thinkspec/bench/projection.py) against the engine, in one run at real shapes.

Qwen3-8B-shaped target and Qwen3-0.6B-shaped draft, dummy bf16 weights. For each chosen sweep cell
the engine replays the cell's measured acceptance (per phase and draft position, and its thinking
share) through a synthetic profile (thinkspec.bench.synthetic), at each batch size, with --batch-size
requests of --prompt-len random tokens and --output-len output tokens (EOS ignored, greedy). Next to
it, in the same run:
  - the step costs of bench_spec_round.py at each batch size (plain step, draft step, verify),
  - the projection from those costs and the same profile: steady state (a server keeping b requests
    in flight) and finite batch (b requests started together, as measured here),
  - plain decoding, measured and projected.
All engines are resident and warm at the timed shapes before timing; the cells are timed round-robin
--repeats times; a timed run that captures or compiles raises. Reports the median measured tok/s
with its min-max and measured / projected. Writes JSON (--out) and prints a table last.

    python3 benchmarks/speculative/validate_projection.py --sweep docs/sweep-toy-h200/sweep.json \\
        --cells "T=0 strict,T=0 r=0.3 k=8" --out validation.json                 # H200
    python3 benchmarks/speculative/validate_projection.py --sweep sweep.json --small --device cpu \\
        --batch-sizes 1,2 --output-len 24 --repeats 1                              # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import (
    QWEN3_0_6B,
    QWEN3_8B,
    SMALL_DRAFT,
    SMALL_TARGET,
    decode_seconds,
    write_config,
    write_json,
)
from thinkspec import LLM
from thinkspec.bench.projection import (
    AcceptanceProfile,
    StepCosts,
    costs_from_spec_round,
    profiles_from_sweep,
    project,
    simulate_batch,
)
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.bench.warmth import build_counts, capture_graphs, check_no_builds


def measure_costs(args: Namespace, batches: list[int]) -> list[StepCosts]:
    """bench_spec_round.py's parts at each batch size, run in its own process (its models are freed
    when it exits): [StepCosts], one per batch."""
    script = Path(__file__).with_name("bench_spec_round.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "spec_round.json"
        cmd = [sys.executable, str(script), "--batch-sizes", ",".join(map(str, batches)), "--k", str(args.k),
               "--rate", "0.7", "--prompt-len", str(args.prompt_len), "--rounds", "20", "--warmup", "3",
               "--reps", "10", "--device", args.device, "--out", str(out)]  # fmt: skip
        if args.small:
            cmd.append("--small")
        subprocess.run(cmd, check=True)
        return costs_from_spec_round(json.loads(out.read_text()))


def synthetic_profile(p: AcceptanceProfile, output_len: int) -> dict:
    """The synthetic acceptance profile (install_synthetic_acceptance) replaying `p` over output_len
    tokens."""

    def shares(rates: tuple[float, ...]) -> list[float]:
        out, low = [], 1.0
        for a in rates:  # non-increasing, as the profile must be (counts make it so up to rounding)
            low = min(low, max(0.0, float(a)))
            out.append(low)
        return out

    return {
        "thinking": shares(p.thinking_rates),
        "answer": shares(p.answer_rates),
        "thinking_tokens": round(p.thinking_share * output_len),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="sweep.json of `thinkspec sweep` (its k must be --k)")
    p.add_argument("--cells", default="T=0 strict,T=0 r=0.3 k=8", help="comma-separated sweep cell names")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=8 << 30, help="bytes per engine")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    names = [c.strip() for c in args.cells.split(",") if c.strip()]
    profiles = {q.name: q for q in profiles_from_sweep(json.loads(Path(args.sweep).read_text()), args.k)}
    missing = [n for n in names if n not in profiles]
    if missing:
        raise SystemExit(f"cells {missing} are not speculative cells of the sweep: {sorted(profiles)}")
    vocab = 1024 if args.small else 151936
    L = args.output_len
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "small" if args.small else "Qwen3-8B (draft Qwen3-0.6B)",
        "sweep": args.sweep, "prompt_len": args.prompt_len, "output_len": L, "k": args.k,
        "repeats": args.repeats, "rows": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tdir = write_config(Path(tmp) / "target", SMALL_TARGET if args.small else QWEN3_8B, vocab)
        ddir = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        costs = measure_costs(args, batches)
        result["costs"] = [{"batch": c.batch, "plain_ms": c.plain_ms, "draft_ms": c.draft_ms,
                            "verify_ms": c.verify_ms, "round_ms": c.round_ms} for c in costs]  # fmt: skip
        for c in costs:
            print(f"  costs batch {c.batch}: plain {c.plain_ms:.2f} ms, draft {c.draft_ms:.2f} ms, "
                  f"verify {c.verify_ms:.2f} ms, round {c.round_ms:.2f} ms", flush=True)  # fmt: skip
        common = dict(
            device=args.device, dtype="float32" if device.type == "cpu" else "bfloat16", load_format="dummy",
            skip_tokenizer_init=True, max_num_seqs=max(batches), kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.prompt_len + L + 2 * args.k + 8,
        )  # fmt: skip
        engines = {"no speculation": LLM(tdir, **common)}
        for n in names:
            spec = {"model": str(ddir), "num_speculative_tokens": args.k}
            engines[n] = LLM(tdir, speculative_config=spec, **common)
            install_synthetic_acceptance(engines[n], profile=synthetic_profile(profiles[n], L))
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), generator=gen).tolist()
        for llm in engines.values():  # warm at every timed shape (twice: the second hits the prefix cache)
            capture_graphs(llm, max(batches))
            for b in batches:
                decode_seconds(llm, prompts[:b], L)
                decode_seconds(llm, prompts[:b], L)
        times: dict[tuple[str, int], list[float]] = {(e, b): [] for e in engines for b in batches}
        for r in range(args.repeats):
            for b in batches:
                for name, llm in engines.items():
                    before = build_counts(llm)
                    seconds = decode_seconds(llm, prompts[:b], L)
                    check_no_builds(before, build_counts(llm), f"{name} batch {b} (repetition {r + 1})")
                    times[(name, b)].append(b * (L - 1) / seconds)
                    print(f"  rep {r + 1} {name} batch {b}: {times[(name, b)][-1]:.1f} tok/s", flush=True)
        del engines
    projected = project([profiles[n] for n in names], costs)
    steady = {(row["cell"], row["batch"]): row["tokens_per_s"] for row in projected}
    for (name, b), reps in times.items():
        if name == "no speculation":
            finite = steady[(name, b)]  # every row ends together
        else:
            q = profiles[name]
            finite = simulate_batch(q, costs, b, L, round(q.thinking_share * L))
        med = statistics.median(reps)
        result["rows"].append({
            "cell": name, "batch": b, "measured_tok_per_s": med, "measured_min": min(reps),
            "measured_max": max(reps), "reps": reps, "projected_steady": steady[(name, b)],
            "projected_finite_batch": finite, "measured_over_projected": med / finite,
            "measured_over_steady": med / steady[(name, b)],
        })  # fmt: skip
    if args.out:
        write_json(args.out, result)
    print(f"projection vs engine, {result['shape']}, k={args.k}, {L} output tokens, {args.repeats} repeats")
    print(f"{'cell':<22} {'batch':>5} {'measured':>10} {'min-max':>17} {'projected':>10} {'meas/proj':>9} "
          f"{'steady':>10} {'meas/steady':>11}")  # fmt: skip
    for r in result["rows"]:
        print(f"{r['cell']:<22} {r['batch']:>5} {r['measured_tok_per_s']:>10.1f} "
              f"{r['measured_min']:>8.1f}-{r['measured_max']:<8.1f} {r['projected_finite_batch']:>10.1f} "
              f"{r['measured_over_projected']:>9.3f} {r['projected_steady']:>10.1f} "
              f"{r['measured_over_steady']:>11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
