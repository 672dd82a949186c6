"""adaptive_k against plain decoding and every fixed draft length, in one run at real shapes.

Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, dummy bf16 weights, --batch-size requests of
--prompt-len random tokens and --output-len output tokens (greedy, EOS ignored). Acceptance is
synthetic (SpeculativeConfig.synthetic_acceptance_profile), one constant conditional rate per
phase chosen so that a round drafting all K = --k-max positions has the acceptance length asked:

  good  thinking AL 4.6, answer AL 2.5, the first 90% of each request's tokens thinking
  bad   AL 1.5 in both phases

Cells, per profile and batch size: plain decoding (an engine without speculation, as a user who
leaves it off gets it), fixed k (--fixed-ks; --bad-fixed-ks for the bad draft) and adaptive_k.
Fixed k and adaptive run in one speculating engine with num_speculative_tokens = K and
adaptive_k on: a fixed k is ForcedDraftLength.fixed(K, k) installed in place of the chooser (the
same windows, graphs and kernels as an engine built for that k; --check-k builds such an engine
for one k so the two can be compared). Each profile keeps its own chooser, sharing the engine's
cost model. Everything is warm before timing: every CUDA graph captured, the cost model measured,
each cell run once at each batch size (the chooser learns there); a timed run that captures or
compiles raises. Cells are timed round-robin, --repeats times, the order rotated each repetition;
median tok/s with its min-max. The acceptance criteria reported per batch size:

  adaptive / max(plain, best fixed k)  >= 0.95   (good profile)
  adaptive / plain                     >= 0.98   (bad profile); >= 1.9 at batch 1 (good profile)

Writes JSON (--out; rewritten after every repetition, so a run cut short keeps what it measured)
and prints a table last.

    python3 benchmarks/bench_adaptive.py --out adaptive.json                                   # H200
    python3 benchmarks/bench_adaptive.py --small --device cpu --batch-sizes 1,2 --output-len 24 \\
        --repeats 1 --fixed-ks 1,2 --k-max 2                                                   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_spec_round import QWEN3_0_6B, QWEN3_8B, SMALL_DRAFT, SMALL_TARGET, write_config

from thinkspec import LLM, SamplingParams
from thinkspec.bench.warmth import build_counts, capture_graphs, check_no_builds, quiet_heap
from thinkspec.spec_decode.draft_length import AdaptiveDraftLength, ForcedDraftLength
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.step_costs import StepCostModel

DROPPED: list[str] = []  # timed runs that built something, run again
PROFILES = {"good": (4.6, 2.5, 0.9), "bad": (1.5, 1.5, 0.9)}  # thinking AL, answer AL, thinking share


def constant_rate_shares(al: float, k: int) -> list[float]:
    """[k] shares a_i = c^(i+1) of rounds accepting draft i, c such that 1 + sum a_i = al."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if sum(c ** (i + 1) for i in range(k)) < al - 1 else (lo, c)
    return [round(lo ** (i + 1), 6) for i in range(k)]


def synthetic_profile(name: str, k: int, output_len: int) -> dict:
    thinking_al, answer_al, share = PROFILES[name]
    return {
        "thinking": constant_rate_shares(thinking_al, k),
        "answer": constant_rate_shares(answer_al, k),
        "thinking_tokens": round(share * output_len),
    }


def use(llm: LLM, profile: dict, chooser) -> None:
    """Point the speculating engine at a profile and a draft-length policy (benchmark only)."""
    spec = llm.llm_engine.speculator
    spec.config.synthetic_acceptance_profile = profile
    spec._synthetic_table = None  # rebuilt from the profile on the next step
    spec.draft_length = chooser


def timed_run(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, SpecDecodeMetrics | None]:
    """(decode tok/s of output_len tokens minus a 1-token run (prefill + first token), the long run's
    speculative metrics)."""

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    with quiet_heap():
        seconds = run(output_len)
        metrics = llm.last_spec_metrics
        seconds -= run(1)
    return len(prompts) * (output_len - 1) / seconds, metrics


def build_cells(args) -> list[tuple[str, str, str, int | None]]:
    """(cell name, profile, engine, k) with k None = adaptive (plain: the plain engine)."""
    cells = [("plain", "", "plain", None)]
    for prof, ks in (("good", args.fixed_ks), ("bad", args.bad_fixed_ks)):
        cells += [(f"{prof} k={k}", prof, "spec", k) for k in ks]
        cells.append((f"{prof} adaptive", prof, "spec", None))
    if args.check_k:
        cells.append((f"good k={args.check_k} own engine", "good", "check", args.check_k))
    return cells


def build_engines(args, tdir: Path, ddir: Path, common: dict) -> dict[str, LLM]:
    engines = {"plain": LLM(tdir, **common)}
    good = synthetic_profile("good", args.k_max, args.output_len)
    spec = {"model": str(ddir), "num_speculative_tokens": args.k_max, "adaptive_k": True,
            "synthetic_acceptance_profile": good}  # fmt: skip
    engines["spec"] = LLM(tdir, speculative_config=spec, **common)
    if args.check_k:
        good = synthetic_profile("good", args.check_k, args.output_len)
        own = {
            "model": str(ddir),
            "num_speculative_tokens": args.check_k,
            "synthetic_acceptance_profile": good,
        }
        engines["check"] = LLM(tdir, speculative_config=own, **common)
    return engines


def prepare(cell, engines: dict[str, LLM], choosers: dict[str, AdaptiveDraftLength], args) -> LLM:
    """The cell's engine, set up for it."""
    _, prof, engine, k = cell
    llm = engines[engine]
    if engine == "spec":
        chooser = choosers[prof] if k is None else ForcedDraftLength.fixed(args.k_max, k)
        use(llm, synthetic_profile(prof, args.k_max, args.output_len), chooser)
    return llm


def summarise(rows: list[dict], batches: list[int]) -> list[dict]:
    """Per batch size: the criteria's ratios from the median figures."""
    med = {(r["cell"], r["batch"]): r["tok_per_s"] for r in rows}
    out = []
    for b in batches:
        plain = med.get(("plain", b))
        good_fixed = {
            c: v for (c, bb), v in med.items() if bb == b and c.startswith("good k=") and "own" not in c
        }
        best = max(good_fixed.items(), key=lambda kv: kv[1], default=(None, None))
        good, bad = med.get(("good adaptive", b)), med.get(("bad adaptive", b))
        row = {"batch": b, "plain": plain, "best_fixed": best[0], "best_fixed_tok_per_s": best[1],
               "good_adaptive": good, "bad_adaptive": bad}  # fmt: skip
        if plain and good and best[1]:
            row["good_adaptive_over_best"] = good / max(plain, best[1])
            row["good_adaptive_over_plain"] = good / plain
        if plain and bad:
            row["bad_adaptive_over_plain"] = bad / plain
        out.append(row)
    return out


def rows_of(times: dict, hists: dict, batches: list[int], cells) -> list[dict]:
    rows = []
    for cell in cells:
        for b in batches:
            reps = times[(cell[0], b)]
            if not reps:
                continue
            med = statistics.median(reps)
            row = {"cell": cell[0], "profile": cell[1], "k": cell[3], "batch": b, "tok_per_s": med,
                   "min": min(reps), "max": max(reps), "reps": reps}  # fmt: skip
            if (cell[0], b) in hists:
                row["draft_length_histogram"] = hists[(cell[0], b)]
            rows.append(row)
    return rows


def print_table(result: dict) -> None:
    print(f"adaptive_k, {result['shape']}, K={result['k_max']}, {result['output_len']} output tokens, "
          f"{result['repeats']} repeats (median tok/s, min-max)")  # fmt: skip
    for r in result["rows"]:
        print(
            f"  {r['cell']:<24} batch {r['batch']:>4} {r['tok_per_s']:>10.1f}  {r['min']:.1f}-{r['max']:.1f}"
        )
    print(f"{'batch':>5} {'plain':>9} {'best fixed':>16} {'adaptive':>9} {'ad/best':>8} {'ad/plain':>8} "
          f"{'bad ad':>9} {'bad/plain':>9}")  # fmt: skip
    for s in result["summary"]:
        v = {key: "-" if s.get(key) is None else format(s[key], ".3f" if "over" in key else ".0f")
             for key in s if key not in ("batch", "best_fixed")}  # fmt: skip
        best = f"{s['best_fixed'] or '-'} {v['best_fixed_tok_per_s']}"
        print(f"{s['batch']:>5} {v['plain']:>9} {best:>16} {v['good_adaptive']:>9} "
              f"{v.get('good_adaptive_over_best', '-'):>8} {v.get('good_adaptive_over_plain', '-'):>8} "
              f"{v['bad_adaptive']:>9} {v.get('bad_adaptive_over_plain', '-'):>9}")  # fmt: skip
    print(
        "criteria: ad/best >= 0.95 (every batch), bad/plain >= 0.98 (every batch), ad/plain >= 1.9 (batch 1)"
    )


def timed_sample(
    llm: LLM, prompts: list[list[int]], args, what: str
) -> tuple[float, SpecDecodeMetrics | None]:
    """timed_run that never counts a build: a run that captured or compiled (a draft length the
    warm-up did not reach at this batch, say) is reported, dropped and run again, now warm."""
    for attempt in range(3):
        before = build_counts(llm)
        out = timed_run(llm, prompts, args.output_len)
        try:
            check_no_builds(before, build_counts(llm), what)
            return out
        except RuntimeError as e:
            if attempt == 2:
                raise
            print(f"  dropped: {e}", flush=True)
            DROPPED.append(str(e))
    raise AssertionError("unreachable")


def cost_model_table(costs: StepCostModel, max_batch: int) -> dict:
    """The adaptive engine's cost model as measured and learned: per bucket, verify ms at k = 0..K,
    the draft step ms, and the learned overhead by longest window (None = not measured)."""
    out = {}
    for row, bucket in enumerate(costs.buckets):
        if bucket > costs.bucket(max_batch):
            break
        overhead = [None if x != x else round(float(x), 3) for x in costs.overhead[row]]  # x != x: NaN
        entry: dict = {"overhead_ms": overhead}
        if bucket in costs.costs:
            entry["verify_ms"] = [round(c.verify_ms, 3) for c in costs.costs[bucket]]
            entry["draft_ms"] = round(costs.costs[bucket][0].draft_ms, 3)
        if len(entry) > 1 or any(x is not None for x in overhead):
            out[str(bucket)] = entry
    return out


def measure(args, engines, choosers, cells, batches, prompts, result) -> None:
    """Warm every cell at every batch size, then the timed round-robin repetitions."""
    for llm in engines.values():
        capture_graphs(llm, max(batches))
    for b in batches:
        for cell in cells:
            timed_run(prepare(cell, engines, choosers, args), prompts[:b], args.output_len)
    times: dict = {(c[0], b): [] for c in cells for b in batches}
    hists: dict = {}
    for r in range(args.repeats):
        for b in batches:
            order = cells[r % len(cells) :] + cells[: r % len(cells)]
            for cell in order:
                tok_s, metrics = timed_sample(prepare(cell, engines, choosers, args), prompts[:b], args,
                                              f"{cell[0]} batch {b} (repetition {r + 1})")  # fmt: skip
                times[(cell[0], b)].append(tok_s)
                if metrics is not None and cell[3] is None:
                    hists[(cell[0], b)] = {
                        p: metrics.phase(p).draft_length_histogram for p in ("thinking", "answer")
                    }
                print(f"  rep {r + 1} {cell[0]} batch {b}: {tok_s:.1f} tok/s", flush=True)
        result["rows"] = rows_of(times, hists, batches, cells)
        result["summary"] = summarise(result["rows"], batches)
        result["repeats_done"] = r + 1
        result["dropped_runs"] = DROPPED
        result["cost_model"] = cost_model_table(choosers["good"].costs, max(batches))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,4,16,64,128")
    p.add_argument("--k-max", type=int, default=8, help="num_speculative_tokens of the adaptive engine (K)")
    p.add_argument("--fixed-ks", default="1,2,3,4,5,6,7,8", help="fixed draft lengths, good profile")
    p.add_argument("--bad-fixed-ks", default="1", help="fixed draft lengths, bad draft ('' for none)")
    p.add_argument(
        "--check-k", type=int, default=0, help="also time an engine built for this fixed k (0: no)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=16 << 30, help="bytes per engine")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.fixed_ks = [int(k) for k in args.fixed_ks.split(",") if k.strip()]
    args.bad_fixed_ks = [int(k) for k in args.bad_fixed_ks.split(",") if k.strip()]
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    vocab = 1024 if args.small else 151936
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "small" if args.small else "Qwen3-8B (draft Qwen3-0.6B)", "prompt_len": args.prompt_len,
        "output_len": args.output_len, "k_max": args.k_max, "repeats": args.repeats,
        "profiles": {n: synthetic_profile(n, args.k_max, args.output_len) for n in PROFILES},
        "rows": [], "summary": [],
    }  # fmt: skip
    cells = build_cells(args)
    with tempfile.TemporaryDirectory() as tmp:
        tdir = write_config(Path(tmp) / "target", SMALL_TARGET if args.small else QWEN3_8B, vocab)
        ddir = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        common = dict(
            device=args.device, dtype="float32" if device.type == "cpu" else "bfloat16", load_format="dummy",
            skip_tokenizer_init=True, max_num_seqs=max(batches), kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.prompt_len + args.output_len + 2 * args.k_max + 8,
        )  # fmt: skip
        engines = build_engines(args, tdir, ddir, common)
        adaptive = engines["spec"].llm_engine.speculator.draft_length
        assert isinstance(adaptive, AdaptiveDraftLength)
        choosers = {prof: AdaptiveDraftLength(args.k_max, adaptive.costs) for prof in PROFILES}
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), generator=gen).tolist()
        measure(args, engines, choosers, cells, batches, prompts, result)
        del engines
    print_table(result)


if __name__ == "__main__":
    main()
