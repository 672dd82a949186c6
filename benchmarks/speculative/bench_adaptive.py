"""adaptive_k against plain decoding and every fixed draft length, in one run at real shapes.

Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, dummy bf16 weights, --batch-size requests of
--prompt-len random tokens and --output-len output tokens (greedy, EOS ignored). Acceptance is
synthetic (thinkspec.bench.synthetic, a profile), one constant conditional rate per
phase chosen so that a round drafting all K = --k-max positions has the acceptance length asked:

  good  thinking AL 4.6, answer AL 2.5, the first 90% of each request's tokens thinking
  bad   AL 1.5 in both phases

Cells, per profile and batch size: plain decoding (an engine without speculation, as a user who
leaves it off gets it), fixed k (--fixed-ks; --bad-fixed-ks for the bad draft) and adaptive_k.
--phase-ks T:A,... adds cells "k=T/A" to the good profile (the toy pair's with --toy): thinking rows
draft T tokens, answer rows A (ForcedDraftLength per group). The best of them is what a chooser
that knew the best k of each phase in advance would give; adaptive / that pair says how much of
the gap to a criterion the choice could still close. They are not fixed k cells: the criteria
compare adaptive with fixed k only.
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

Repetition r draws its acceptance with seed --acceptance-seed + r, the same in every cell. At batch 1
a run is one request of about 70 steps, so its speculating cells move by up to 10-15% from one draw to
the next: judge adaptive / plain there over ten or more repetitions (docs/BENCHMARKS.md, "Adaptive
draft length": 1.864-1.900 over the same sixty draws in three calls).

--toy measures the bundled toy pair instead (target and draft of thinkspec/assets/toy-reasoner/),
with real acceptance: relaxed thinking on (--relax RATIO:TOP_K), the qwen3 reasoning parser, as
`thinkspec sweep` runs it. A cell at batch b answers the first b problems of a fixed-seed toy
dataset (--toy-level; chat-formatted as the sweep formats them) in one generate call, max_tokens
the level's budget (or --max-tokens), at --temperature; tok/s = output tokens / wall time, as the
sweep counts it. Cells: plain, fixed k (--fixed-ks) and adaptive. Each cell's greedy outputs must
repeat exactly across repetitions (RuntimeError otherwise); adaptive's are not compared with fixed
k's, since relaxed acceptance depends on where the windows end. The criterion reported per batch:

  adaptive / best fixed k  >= 1.0   (toy pair, relaxed)

Every speculating row records its mean acceptance length per repetition (0.0: no step speculated)
and, on the toy pair, the problems answered right and its outputs' fingerprints; adaptive rows the
draft_length_histogram per phase of their last repetition, and choice_trace: every fresh choice of
that repetition with what it was made from (AdaptiveDraftLength.trace: the learned overheads and
acceptance estimates, the modelled tokens per ms of the choice and of the plain step). Every row of
the speculating engine (fixed k and adaptive) records step_times: its last repetition's timed steps
by longest window (see step_times), the samples adaptive's cost model learns its overheads from,
and step_times_by_rep, the same without the per-step sequences for every repetition.

Writes JSON (--out; rewritten after every repetition, so a run cut short keeps what it measured)
and prints a table last.

    python3 benchmarks/speculative/bench_adaptive.py --out adaptive.json                          # H200
    python3 benchmarks/speculative/bench_adaptive.py --toy --batch-sizes 1,16,64 --out toy.json   # H200
    python3 benchmarks/speculative/bench_adaptive.py --small --device cpu --batch-sizes 1,2 \\
        --output-len 24 --repeats 1 --fixed-ks 1,2 --k-max 2                                     # smoke test
    python3 benchmarks/speculative/bench_adaptive.py --toy --device cpu --batch-sizes 1,2 \\
        --max-tokens 24 --repeats 1 --fixed-ks 1,2 --k-max 2                                     # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import QWEN3_0_6B, QWEN3_8B, SMALL_DRAFT, SMALL_TARGET, write_config, write_json
from thinkspec import LLM, SamplingParams
from thinkspec.bench.bench import format_prompts, run_cell
from thinkspec.bench.datasets import BenchItem, default_max_tokens, load_dataset
from thinkspec.bench.sweep import RelaxSetting
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.bench.warmth import build_counts, capture_graphs, check_no_builds, quiet_heap
from thinkspec.model_names import resolve_model_name
from thinkspec.spec_decode.draft_length import (
    ANSWER,
    GROUPS,
    THINKING,
    THINKING_RELAXED,
    AdaptiveDraftLength,
    ForcedDraftLength,
)
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.step_costs import StepCostModel
from thinkspec.toy.task import LEVELS

DROPPED: list[str] = []  # timed runs that built something, run again
PROFILES = {"good": (4.6, 2.5, 0.9), "bad": (1.5, 1.5, 0.9)}  # thinking AL, answer AL, thinking share
TOY_DATASET_SEED = 20261201  # the sweep's default --dataset-seed
TOY_PAIR = ("toy-reasoner", "toy-reasoner-draft")
# One timed sample: (tok/s, the run's speculative metrics or None, {"digest", "correct"} on the toy pair).
Sample = tuple[float, SpecDecodeMetrics | None, dict[str, Any]]


def constant_rate_shares(al: float, k: int) -> list[float]:
    """[k] shares a_i = c^(i+1) of rounds accepting draft i, c such that 1 + sum a_i = al."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if sum(c ** (i + 1) for i in range(k)) < al - 1 else (lo, c)
    return [round(lo ** (i + 1), 6) for i in range(k)]


def synthetic_profile(name: str, k: int, output_len: int, seed: int | None = None) -> dict:
    """The profile install_synthetic_acceptance takes; seed: its draws' (None: the wrapper's
    generator)."""
    thinking_al, answer_al, share = PROFILES[name]
    return {
        "thinking": constant_rate_shares(thinking_al, k),
        "answer": constant_rate_shares(answer_al, k),
        "thinking_tokens": round(share * output_len),
        "seed": seed,
    }


def use(llm: LLM, profile: dict | None, chooser) -> None:
    """Point the speculating engine at a profile (None: real acceptance, the toy pair) and a
    draft-length policy (benchmark only)."""
    if profile is not None:
        install_synthetic_acceptance(llm, profile=profile)
    llm.llm_engine.speculator.planner.draft_length = chooser


def timed_run(llm: LLM, prompts: list[list[int]], output_len: int) -> Sample:
    """(decode tok/s: the tokens after each request's first over the time from the batch's first
    token to its last, the run's speculative metrics, {"run_ms", "first_token_ms", "first_token_spread_ms",
    "gc_pause_ms"}: the run's wall ms, when its first token came (the prefill) and how far apart the
    requests' first tokens came (0 when one forward prefilled every prompt, as build_engines sizes it),
    the collector's pauses). The prefill runs eagerly and its host time varies by tens of ms from run
    to run, which is why it is left out by these timestamps rather than by subtracting a second,
    1-token run (as before 2026-12-02: that run's own spread, 21-130 ms, entered every figure)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with quiet_heap() as heap:
        start = time.monotonic()  # the clock of RequestMetrics
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - start
    metrics = llm.last_spec_metrics
    firsts = [o.metrics.first_token_time for o in outs]
    end = max(o.metrics.finished_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    facts = {"run_ms": round(1e3 * wall, 3), "first_token_ms": round(1e3 * (min(firsts) - start), 3),
             "first_token_spread_ms": round(1e3 * (max(firsts) - min(firsts)), 3),
             "gc_pause_ms": round(1e3 * heap["gc_pause_s"], 3)}  # fmt: skip
    return tokens / (end - min(firsts)), metrics, facts


def toy_run(llm: LLM, items: list[BenchItem], texts: list[str], args) -> Sample:
    """One generate call over the items, as a sweep cell runs it: (output tokens / wall seconds, its
    speculative metrics, {"digest": fingerprint of the output ids, "correct": problems answered right})."""
    with quiet_heap():
        cell = run_cell(llm, items, "toy", {"temperature": args.temperature}, args.temperature,
                        args.max_tokens, 0, texts, use_tqdm=False)  # fmt: skip
    facts = {"digest": cell.extra["output_digest"], "correct": sum(cell.correct)}
    return sum(cell.output_tokens) / cell.seconds, llm.last_spec_metrics, facts


def primary(args) -> str:
    """The profile the fixed-k / adaptive comparison is made in."""
    return "toy" if args.toy else "good"


# k of a cell: an int (every row), (thinking k, answer k) per phase, or None (adaptive)
CellK = int | tuple[int, int] | None


def build_cells(args) -> list[tuple[str, str, str, CellK]]:
    """(cell name, profile, engine, k) with k None = adaptive (plain: the plain engine)."""
    cells: list[tuple[str, str, str, CellK]] = [("plain", "", "plain", None)]
    sets = (("toy", args.fixed_ks),) if args.toy else (("good", args.fixed_ks), ("bad", args.bad_fixed_ks))
    for prof, ks in sets:
        cells += [(f"{prof} k={k}", prof, "spec", k) for k in ks]
        if prof == primary(args):
            cells += [(f"{prof} k={t}/{a}", prof, "spec", (t, a)) for t, a in args.phase_ks]
        cells.append((f"{prof} adaptive", prof, "spec", None))
    if args.check_k:
        cells.append((f"{primary(args)} k={args.check_k} own engine", primary(args), "check", args.check_k))
    return cells


def vocab_size(args) -> int:
    return 1024 if args.small else 151936


def spec_config(args, ddir: Path, k: int, adaptive: bool) -> dict:
    """Speculative config of a K = k engine: the toy pair relaxed (spec_engine adds the synthetic draft's
    acceptance otherwise)."""
    cfg: dict[str, Any] = {"model": str(ddir), "num_speculative_tokens": k}
    if adaptive:
        cfg["adaptive_k"] = True
    if args.toy:
        ratio, top_k = args.relax
        cfg.update(reasoning_parser="qwen3", relaxed_thinking=True, relax_ratio=ratio, relax_top_k=top_k)
    return cfg


def spec_engine(args, tdir: Path, ddir: Path, k: int, adaptive: bool, common: dict[str, Any]) -> LLM:
    """A K = k engine (spec_config): the toy pair, else the good synthetic draft's acceptance."""
    llm = LLM(tdir, speculative_config=spec_config(args, ddir, k, adaptive), **common)
    if not args.toy:
        install_synthetic_acceptance(llm, profile=synthetic_profile("good", k, args.output_len))
    return llm


def build_engines(args, tmp: Path, max_batch: int) -> dict[str, LLM]:
    """The plain engine, the speculating one (K = --k-max, adaptive_k) and --check-k's own."""
    cuda = torch.device(args.device).type == "cuda"
    kv = args.kv_cache_memory if args.kv_cache_memory is not None else (16 << 30 if cuda else None)
    common: dict[str, Any] = dict(device=args.device, max_num_seqs=max_batch, kv_cache_memory=kv)
    if args.toy:  # the checkpoints' own dtype on GPU, float32 on CPU, as the sweep loads them
        tdir, ddir = (Path(resolve_model_name(name)) for name in TOY_PAIR)
    else:
        vocab = vocab_size(args)
        tdir = write_config(tmp / "target", SMALL_TARGET if args.small else QWEN3_8B, vocab)
        ddir = write_config(tmp / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        common.update(
            dtype="bfloat16" if cuda else "float32", load_format="dummy", skip_tokenizer_init=True,
            max_model_len=args.prompt_len + args.output_len + 2 * args.k_max + 8,
            # one forward prefills every prompt: all first tokens come together (see timed_run)
            max_num_batched_tokens=max(2048, max_batch * args.prompt_len),
        )  # fmt: skip
    common.update(json.loads(args.engine_args))  # e.g. '{"async_scheduling": true}'
    engines = {"plain": LLM(tdir, **common)}
    engines["spec"] = spec_engine(args, tdir, ddir, args.k_max, True, common)
    if args.check_k:
        engines["check"] = spec_engine(args, tdir, ddir, args.check_k, False, common)
    return engines


def prepare(
    cell, engines: dict[str, LLM], choosers: dict[str, AdaptiveDraftLength], args, seed: int | None
) -> LLM:
    """The cell's engine, set up for it; seed: the synthetic draws' (None: the engine's generator)."""
    _, prof, engine, k = cell
    llm = engines[engine]
    if engine == "spec":
        chooser = choosers[prof] if k is None else forced(args.k_max, k)
        use(llm, None if args.toy else synthetic_profile(prof, args.k_max, args.output_len, seed), chooser)
    return llm


def forced(k_max: int, k: int | tuple[int, int]) -> ForcedDraftLength:
    """The policy of a fixed cell: k for every row, or (thinking k, answer k) per phase."""
    if isinstance(k, int):
        return ForcedDraftLength.fixed(k_max, k)
    per_group = np.zeros(len(GROUPS), dtype=np.int64)
    per_group[[THINKING, THINKING_RELAXED]], per_group[ANSWER] = k
    return ForcedDraftLength(k_max, lambda step, counts: per_group)


def sampler(args, engines, choosers, data) -> Callable[[tuple, int, int], tuple[LLM, Callable[[], Sample]]]:
    """(cell, batch, draw) -> (its engine, set up, and a function that runs the cell once at that batch);
    data: the random prompts, or the toy problems with their prompt texts; draw: which seeded synthetic
    draws (--acceptance-seed + draw; the engine's generator when that seed is negative)."""

    def sample(cell: tuple, b: int, draw: int) -> tuple[LLM, Callable[[], Sample]]:
        seed = args.acceptance_seed + draw if args.acceptance_seed >= 0 else None
        llm = prepare(cell, engines, choosers, args, seed)
        if args.toy:
            items, texts = data
            return llm, lambda: toy_run(llm, items[:b], texts[:b], args)
        return llm, lambda: timed_run(llm, data[:b], args.output_len)

    return sample


def summarise(rows: list[dict], batches: list[int], args) -> list[dict]:
    """Per batch size: the criteria's ratios from the median figures; beside the first one, the
    median over repetitions of the same ratio within each repetition (adaptive against the cell that
    is best by median; the cells of one repetition share their acceptance draws and run back to back)."""
    med = {(r["cell"], r["batch"]): r["tok_per_s"] for r in rows}
    reps = {(r["cell"], r["batch"]): r["reps"] for r in rows}
    main = primary(args)
    out = []
    for b in batches:
        plain = med.get(("plain", b))
        ours = {
            c: v for (c, bb), v in med.items() if bb == b and c.startswith(f"{main} k=") and "own" not in c
        }
        fixed = {c: v for c, v in ours.items() if "/" not in c}
        best = max(fixed.items(), key=lambda kv: kv[1], default=(None, None))
        adaptive = med.get((f"{main} adaptive", b))
        row = {"batch": b, "plain": plain, "best_fixed": best[0], "best_fixed_tok_per_s": best[1],
               f"{main}_adaptive": adaptive}  # fmt: skip
        phase = {c: v for c, v in ours.items() if "/" in c}
        if phase:  # --phase-ks: the best per-phase pair, and adaptive and plain against it
            pair = max(phase.items(), key=lambda kv: kv[1])
            row["best_phase_ks"], row["best_phase_ks_tok_per_s"] = pair
            if adaptive:
                row["adaptive_over_best_phase_ks"] = adaptive / pair[1]
            if plain:
                row["best_phase_ks_over_plain"] = pair[1] / plain
        if args.toy:
            if adaptive and best[1]:
                row["adaptive_over_best_fixed"] = adaptive / best[1]
            if adaptive and plain:
                row["adaptive_over_plain"] = adaptive / plain
            out.append(row)
            continue
        bad = row["bad_adaptive"] = med.get(("bad adaptive", b))
        if plain and adaptive and best[1]:
            row["good_adaptive_over_best"] = adaptive / max(plain, best[1])
            row["good_adaptive_over_plain"] = adaptive / plain
            anchor = reps[("plain", b)] if plain >= best[1] else reps[(best[0], b)]
            paired = [a / o for a, o in zip(reps[(f"{main} adaptive", b)], anchor)]
            row["good_adaptive_over_best_paired"] = statistics.median(paired)
        if plain and bad:
            row["bad_adaptive_over_plain"] = bad / plain
        out.append(row)
    return out


def rows_of(stats: dict, batches: list[int], cells) -> list[dict]:
    """One row per cell and batch: median tok/s with min-max, and the facts its runs recorded."""
    rows = []
    for cell in cells:
        for b in batches:
            reps = stats["times"][(cell[0], b)]
            if not reps:
                continue
            med = statistics.median(reps)
            row = {"cell": cell[0], "profile": cell[1], "k": cell[3], "batch": b, "tok_per_s": med,
                   "min": min(reps), "max": max(reps), "reps": reps}  # fmt: skip
            row.update(stats["facts"].get((cell[0], b), {}))
            if (cell[0], b) in stats["hists"]:
                row["draft_length_histogram"] = stats["hists"][(cell[0], b)]
            if (cell[0], b) in stats.get("traces", {}):
                row["choice_trace"] = stats["traces"][(cell[0], b)]
            if (cell[0], b) in stats.get("steps", {}):  # the last repetition's in full, every one's summary
                reps = stats["steps"][(cell[0], b)]
                row["step_times"] = reps[-1]
                row["step_times_by_rep"] = [
                    {k: v for k, v in st.items() if not k.endswith("_seq")} for st in reps
                ]
            rows.append(row)
    return rows


def is_adaptive(cell) -> bool:
    return cell[2] == "spec" and cell[3] is None


def record(stats: dict, cell, b: int, sample: Sample, args, what: str) -> None:
    """Keep one timed sample; RuntimeError when the greedy outputs of a toy cell with a fixed policy
    (plain, fixed k) differ from its first run's. Adaptive's may differ and are only recorded: its
    choices follow what it learns (acceptance, measured step times) and relaxed acceptance depends on
    where the windows end."""
    tok_s, metrics, facts = sample
    key = (cell[0], b)
    stats["times"][key].append(tok_s)
    kept = stats["facts"].setdefault(key, {})
    if metrics is not None:
        als = kept.setdefault("acceptance_length_reps", [])
        als.append(round(metrics.mean_acceptance_length(), 4))
        kept["mean_acceptance_length"] = statistics.median(als)
        if is_adaptive(cell):  # the last repetition's
            stats["hists"][key] = {p: metrics.phase(p).draft_length_histogram for p in ("thinking", "answer")}
    for name in ("run_ms", "first_token_ms", "first_token_spread_ms", "gc_pause_ms"):
        if name in facts:
            kept.setdefault(f"{name}_reps", []).append(facts[name])
    if "correct" in facts:
        kept.setdefault("correct_reps", []).append(facts["correct"])
        kept["num_problems"] = b
    if "digest" in facts:
        digests = kept.setdefault("output_digest_reps", [])
        digests.append(facts["digest"])
        kept["outputs_repeat"] = len(set(digests)) == 1
        if args.temperature == 0 and not is_adaptive(cell) and not kept["outputs_repeat"]:
            raise RuntimeError(f"{what}: greedy outputs differ from the cell's first run: not deterministic")


def print_table(result: dict) -> None:
    if result.get("toy"):
        t = result["toy"]
        print(f"adaptive_k on the toy pair ({t['level']}, relax {t['relax_ratio']:g}:{t['relax_top_k']}, "
              f"T={t['temperature']:g}, max_tokens {t['max_tokens']}), K={result['k_max']}, "
              f"{result['repeats']} repeats (median tok/s, min-max, mean acceptance length)")  # fmt: skip
    else:
        print(f"adaptive_k, {result['shape']}, K={result['k_max']}, {result['output_len']} output tokens, "
              f"{result['repeats']} repeats (median tok/s, min-max)")  # fmt: skip
    for r in result["rows"]:
        al = r.get("mean_acceptance_length")
        al = "" if al is None else f"  AL {al:.2f}" if al else "  AL - (no step speculated)"
        spread = f"{r['min']:.1f}-{r['max']:.1f}"
        print(f"  {r['cell']:<24} batch {r['batch']:>4} {r['tok_per_s']:>10.1f}  {spread}{al}")
    (print_toy_summary if result.get("toy") else print_summary)(result["summary"])


def _formatted(s: dict) -> dict[str, str]:
    return {key: "-" if s.get(key) is None else format(s[key], ".3f" if "over" in key else ".0f")
            for key in s if key not in ("batch", "best_fixed", "best_phase_ks")}  # fmt: skip


def print_summary(summary: list[dict]) -> None:
    print(f"{'batch':>5} {'plain':>9} {'best fixed':>16} {'adaptive':>9} {'ad/best':>8} {'paired':>8} "
          f"{'ad/plain':>8} {'bad ad':>9} {'bad/plain':>9}")  # fmt: skip
    for s in summary:
        v = _formatted(s)
        best = f"{s['best_fixed'] or '-'} {v['best_fixed_tok_per_s']}"
        print(f"{s['batch']:>5} {v['plain']:>9} {best:>16} {v['good_adaptive']:>9} "
              f"{v.get('good_adaptive_over_best', '-'):>8} {v.get('good_adaptive_over_best_paired', '-'):>8} "
              f"{v.get('good_adaptive_over_plain', '-'):>8} "
              f"{v['bad_adaptive']:>9} {v.get('bad_adaptive_over_plain', '-'):>9}")  # fmt: skip
    print("criteria: ad/best >= 0.95 (every batch), bad/plain >= 0.98 (every batch), ad/plain >= 1.9 "
          "(batch 1)")  # fmt: skip
    print_phase_ks(summary)
    print("paired: the median over repetitions of adaptive / that anchor within one repetition")


def print_phase_ks(summary: list[dict]) -> None:
    """The best --phase-ks pair per batch, when there were such cells."""
    for s in summary:
        if s.get("best_phase_ks"):
            v = _formatted(s)
            best = f"{s['best_phase_ks']} {v['best_phase_ks_tok_per_s']} tok/s"
            print(f"batch {s['batch']}: best per-phase pair {best}, {v.get('best_phase_ks_over_plain', '-')} "
                  f"x plain; adaptive / it "
                  f"{v.get('adaptive_over_best_phase_ks', '-')}")  # fmt: skip


def print_toy_summary(summary: list[dict]) -> None:
    print(f"{'batch':>5} {'plain':>9} {'best fixed':>16} {'adaptive':>9} {'ad/best':>8} {'ad/plain':>8}")
    for s in summary:
        v = _formatted(s)
        best = f"{s['best_fixed'] or '-'} {v['best_fixed_tok_per_s']}"
        ratios = f"{v.get('adaptive_over_best_fixed', '-'):>8} {v.get('adaptive_over_plain', '-'):>8}"
        print(f"{s['batch']:>5} {v['plain']:>9} {best:>16} {v['toy_adaptive']:>9} {ratios}")
    print("criterion (toy pair, relaxed): ad/best >= 1.0 at every batch (ad/best = adaptive / best fixed k)")
    print_phase_ks(summary)


ATTEMPTS = 5


def timed_sample(llm: LLM, run: Callable[[], Sample], what: str) -> Sample:
    """run() that never counts a build: a run that captured or compiled (a draft length the warm-up
    did not reach at this batch, say) is reported, dropped and run again, now warm (up to
    ATTEMPTS runs: a draft's catch-up forward after plain steps runs eagerly, at token counts that
    vary from run to run, and may meet an attention launch shape of its own: a split count or
    query tile the warm-up did not reach)."""
    for attempt in range(ATTEMPTS):
        before = build_counts(llm)
        out = run()
        try:
            check_no_builds(before, build_counts(llm), what)
            return out
        except RuntimeError as e:
            if attempt == ATTEMPTS - 1:
                raise
            print(f"  dropped: {e}", flush=True)
            DROPPED.append(str(e))
    raise AssertionError("unreachable")


def step_times(steps: list[tuple[int, int, float, float, bool]]) -> dict:
    """A run's timed steps (the speculator's time between the starts of two steps) by longest window
    kmax: count, median, mean, 10th and 90th percentile wall ms; with a cost model also the mean
    modelled device ms and the mean and median of wall - modelled (what the learned overhead follows);
    the number of steps and their total ms; the sequence of kmax over the run with each step's wall ms
    (a run dropped for a build and run again logs both); and the steps that left plain decoding (the
    draft caught up first) apart, as "switches": their count, wall ms and modelled device ms."""
    switches = [s for s in steps if s[4]]
    out: dict = {"kmax_seq": [s[1] for s in steps], "wall_ms_seq": [round(s[2], 3) for s in steps],
                 "num_steps": len(steps), "timed_ms": round(sum(s[2] for s in steps), 2),
                 "switches": {"n": len(switches), "wall_ms": [round(s[2], 3) for s in switches],
                              "modelled_ms": [round(s[3], 3) for s in switches]}}  # fmt: skip
    steady = [s for s in steps if not s[4]]
    for k in sorted({s[1] for s in steady}):
        wall = sorted(s[2] for s in steady if s[1] == k)
        q = statistics.quantiles(wall, n=10) if len(wall) > 1 else wall * 9
        entry = {
            "n": len(wall),
            "median": round(statistics.median(wall), 3),
            "mean": round(statistics.fmean(wall), 3),
            "p10": round(q[0], 3),
            "p90": round(q[-1], 3),
        }
        modelled = [s[3] for s in steady if s[1] == k and s[3] == s[3]]  # s[3] == s[3]: not NaN
        if modelled:
            extra = [s[2] - s[3] for s in steady if s[1] == k]
            entry["modelled"] = round(statistics.fmean(modelled), 3)
            entry["extra_mean"] = round(statistics.fmean(extra), 3)
            entry["extra_median"] = round(statistics.median(extra), 3)
        out[str(k)] = entry
    return out


def cost_model_table(costs: StepCostModel, max_batch: int) -> dict:
    """The adaptive engine's cost model as measured and learned: per bucket, verify ms at k = 0..K,
    the draft step ms, both per token of context (us), and the learned overhead by longest window
    (None = not measured)."""
    out = {}
    for row, bucket in enumerate(costs.buckets):
        if bucket > costs.bucket(max_batch):
            break
        overhead = [None if x != x else round(float(x), 3) for x in costs.overhead[row]]  # x != x: NaN
        entry: dict = {"overhead_ms": overhead}
        if bucket in costs.costs:
            entry["verify_ms"] = [round(c.verify_ms, 3) for c in costs.costs[bucket]]
            entry["draft_ms"] = round(costs.costs[bucket][0].draft_ms, 3)
            # attention per token of context over the rows, microseconds
            entry["verify_ctx_us"] = [round(1e3 * c.verify_ctx_ms, 6) for c in costs.costs[bucket]]
            entry["draft_ctx_us"] = round(1e3 * costs.costs[bucket][0].draft_ctx_ms, 6)
        if len(entry) > 1 or any(x is not None for x in overhead):
            out[str(bucket)] = entry
    return out


def measure(args, engines, choosers, cells, batches, data, result) -> None:
    """Warm every cell at every batch size, then the timed round-robin repetitions."""
    sample = sampler(args, engines, choosers, data)
    for llm in engines.values():
        capture_graphs(llm, max(batches))
    for b in batches:
        for cell in cells:
            sample(cell, b, args.repeats)[1]()  # draws no timed repetition uses
    stats: dict = {"times": {(c[0], b): [] for c in cells for b in batches}, "hists": {}, "facts": {},
                   "traces": {}, "steps": {}}  # fmt: skip
    for r in range(args.repeats):
        for b in batches:
            order = cells[r % len(cells) :] + cells[: r % len(cells)]
            for cell in order:
                what = f"{cell[0]} batch {b} (repetition {r + 1})"
                chooser = choosers[cell[1]] if is_adaptive(cell) else None
                if chooser is not None:
                    chooser.trace = []  # the choices of this run (the last repetition's are kept)
                llm, run = sample(cell, b, r)  # every cell of a repetition meets the same hard tokens
                policy = llm.llm_engine.speculator.planner.draft_length if cell[2] == "spec" else None
                if policy is not None:
                    policy.steps = []  # this run's timed steps (the last repetition's are kept)
                out = timed_sample(llm, run, what)
                record(stats, cell, b, out, args, what)
                if chooser is not None:
                    stats["traces"][(cell[0], b)], chooser.trace = chooser.trace, None
                if policy is not None:
                    stats["steps"].setdefault((cell[0], b), []).append(step_times(policy.steps))
                    policy.steps = None
                print(f"  rep {r + 1} {cell[0]} batch {b}: {out[0]:.1f} tok/s", flush=True)
        result["rows"] = rows_of(stats, batches, cells)
        result["summary"] = summarise(result["rows"], batches, args)
        result["repeats_done"] = r + 1
        result["dropped_runs"] = DROPPED
        result["cost_model"] = cost_model_table(choosers[primary(args)].costs, max(batches))
        switch = choosers[primary(args)].costs.switch
        result["switch_ms"] = None if switch != switch else round(switch, 3)  # learned; NaN: none seen
        # forwards run ahead with async_scheduling (the CUDA default)
        proposer = engines["spec"].llm_engine.speculator.proposer
        result["run_ahead"] = {"run": proposer.num_run_ahead, "used": proposer.num_used_ahead}
        if args.out:
            write_json(args.out, result)


def relax_arg(text: str) -> tuple[float, int]:
    """--relax RATIO:TOP_K, checked as a sweep setting is."""
    try:
        ratio, top_k = text.split(":")
        setting = RelaxSetting(float(ratio), int(top_k))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"takes RATIO:TOP_K (e.g. 0.3:8), got {text!r}: {e}") from None
    return setting.relax_ratio, setting.relax_top_k


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,4,16,64,128")
    p.add_argument("--k-max", type=int, default=8, help="num_speculative_tokens of the adaptive engine (K)")
    p.add_argument("--fixed-ks", default="1,2,3,4,5,6,7,8", help="fixed draft lengths (good profile, toy)")
    p.add_argument("--bad-fixed-ks", default="1", help="fixed draft lengths, bad draft ('' for none)")
    p.add_argument("--phase-ks", default="", help="THINKING:ANSWER draft lengths, e.g. 4:2,5:2 (good, toy)")
    p.add_argument(
        "--check-k", type=int, default=0, help="also time an engine built for this fixed k (0: no)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--acceptance-seed", type=int, default=0,
        help="repetition r draws synthetic acceptance with seed S + r, the same for every cell (common "
        "random numbers: the cells compared meet the same hard tokens); negative: the engine's generator",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-memory", type=int, default=None,
        help="bytes per engine (default: 16 GiB on CUDA, the engine's default on CPU)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--engine-args", default="{}", help="more LLM(...) keyword arguments for every engine, as JSON"
    )
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--toy", action="store_true", help="the bundled toy pair, real acceptance, relaxed")
    p.add_argument("--toy-level", choices=sorted(LEVELS), default="easy", help="toy problems (--toy)")
    p.add_argument("--relax", type=relax_arg, default=(0.3, 8), help="RATIO:TOP_K (--toy; default 0.3:8)")
    p.add_argument("--temperature", type=float, default=0.0, help="(--toy)")
    p.add_argument("--max-tokens", type=int, default=None, help="(--toy; default: the level's budget)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not args.toy and (args.max_tokens is not None or args.temperature != 0):
        p.error("--max-tokens and --temperature apply to --toy only")
    if args.toy and args.small:
        p.error("--small sets real-shape sizes; --toy runs the bundled pair")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    args.fixed_ks = [int(k) for k in args.fixed_ks.split(",") if k.strip()]
    args.bad_fixed_ks = [int(k) for k in args.bad_fixed_ks.split(",") if k.strip()]
    raw, args.phase_ks = args.phase_ks, []
    for pair in (text for text in raw.split(",") if text.strip()):
        t, _, a = pair.partition(":")
        if not all(k.strip().isdigit() and int(k) <= args.k_max for k in (t, a)):
            p.error(
                f"--phase-ks takes THINKING:ANSWER pairs of draft lengths in [0, {args.k_max}], got {raw!r}"
            )
        args.phase_ks.append((int(t), int(a)))
    if args.toy and args.max_tokens is None:
        args.max_tokens = default_max_tokens("toy", args.toy_level)
    return args


def describe(args, engines: dict[str, LLM], device: torch.device) -> dict:
    """What the JSON records about the run, before any row."""
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(engines["plain"].llm_engine.model_info.dtype).removeprefix("torch."),
        "k_max": args.k_max, "repeats": args.repeats, "rows": [], "summary": [],
        "acceptance_seed": None if args.toy or args.acceptance_seed < 0 else args.acceptance_seed,
        "engine_args": json.loads(args.engine_args),
    }  # fmt: skip
    if args.toy:
        ratio, top_k = args.relax
        result["shape"] = "toy pair ({} / {})".format(*TOY_PAIR)
        result["toy"] = {
            "level": args.toy_level, "level_params": asdict(LEVELS[args.toy_level]),
            "dataset_seed": TOY_DATASET_SEED, "relax_ratio": ratio, "relax_top_k": top_k,
            "reasoning_parser": "qwen3", "temperature": args.temperature, "max_tokens": args.max_tokens,
        }  # fmt: skip
        return result
    result.update(
        shape="small" if args.small else "Qwen3-8B (draft Qwen3-0.6B)", prompt_len=args.prompt_len,
        output_len=args.output_len,
        profiles={n: synthetic_profile(n, args.k_max, args.output_len) for n in PROFILES},
    )  # fmt: skip
    return result


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cells = build_cells(args)
    with tempfile.TemporaryDirectory() as tmp:
        engines = build_engines(args, Path(tmp), max(batches))
        result = describe(args, engines, device)
        adaptive = engines["spec"].llm_engine.speculator.planner.draft_length
        assert isinstance(adaptive, AdaptiveDraftLength)
        profiles = ("toy",) if args.toy else tuple(PROFILES)
        choosers = {prof: AdaptiveDraftLength(args.k_max, adaptive.costs) for prof in profiles}
        if args.toy:  # the first b of these problems at batch b
            items = load_dataset("toy", max(batches), TOY_DATASET_SEED, args.toy_level)
            data: Any = (items, format_prompts(engines["plain"], items))
        else:
            gen = torch.Generator().manual_seed(0)
            data = torch.randint(0, vocab_size(args), (max(batches), args.prompt_len),
                                 generator=gen).tolist()  # fmt: skip
        measure(args, engines, choosers, cells, batches, data, result)
        del engines
    print_table(result)


if __name__ == "__main__":
    main()
