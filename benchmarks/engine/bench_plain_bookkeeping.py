"""Host time of an adaptive engine's bookkeeping for one plain decode step: DraftPlanner.plan + record_plan.

The bundled toy pair's adaptive engine (target + draft, adaptive_k, relaxed thinking) with its chooser
settled on plain steps (acceptance estimates at 0, and a prohibitive learned switch cost: with no step
ever run, the cost model alone would weigh drafting against plain on timings a few percent apart),
over R synthetic decode rows whose draft is behind (as after plain steps), every other one thinking.
No forward runs: this is the host work an adaptive engine adds to each plain step, which a host-bound
pair (the toy's 0.3 ms steps) cannot hide and whose wall-clock effect the host's own unsteadiness
buries (docs/BENCHMARKS.md, "Toy pair and relaxation sweep").

Modes alternate chunk by chunk, each chunk the same plan/record pair --steps times:
  streak      a plain step over the same rows as the one before reuses the chooser's choice
  fresh-pass  DraftPlanner.reuse_streaks off: every plain step takes the chooser's per-row pass
A thinkspec without reuse_streaks (an older tree first on PYTHONPATH) runs as "fresh-pass" only.
Per batch size and mode: median microseconds per step (p10-p90) over --chunks chunks, the per-row
passes per step (_choose calls) and the rows that drafted per step (probes out of plain decoding
only). Writes JSON (--out) and prints a table last.

    python3 benchmarks/engine/bench_plain_bookkeeping.py --batch-sizes 1,16,64 --out plain-bookkeeping.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import toy_adaptive_config, write_json
from thinkspec import LLM, SamplingParams
from thinkspec.engine.sequence import Sequence
from thinkspec.model_names import resolve_model_name


def decode_rows(n: int) -> list[Sequence]:
    """n sequences mid-decode (40 output tokens), their draft 44 tokens behind, every other one thinking."""
    rows = []
    for i in range(n):
        seq = Sequence(f"row{i}", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=1 << 20))
        seq.token_ids += [5] * 40
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.thinking = i % 2 == 0
        rows.append(seq)
    return rows


def drafted_rows(spec) -> int:
    """Rows the speculator has counted with k > 0 so far (engine histogram, both phases)."""
    return sum(sum(spec.metrics.phase(p).draft_length_histogram[1:]) for p in ("thinking", "answer"))


def chunk(spec, seqs: list[Sequence], mode: str, steps: int, passes: list[int]) -> tuple[float, float, float]:
    """(us per step, per-row passes per step, drafting rows per step) of one chunk: steps plain steps'
    plan + record_plan over the decode rows seqs; passes[0] counts _choose's calls."""
    if hasattr(spec, "reuse_streaks"):
        spec.reuse_streaks = mode == "streak"
    ones, trues = [1] * len(seqs), [True] * len(seqs)
    passes[0], drafted = 0, drafted_rows(spec)
    t0 = time.perf_counter()
    for _ in range(steps):
        spec.plan(seqs, ones, trues)
        spec.record_plan()
    us = 1e6 * (time.perf_counter() - t0) / steps
    return us, passes[0] / steps, (drafted_rows(spec) - drafted) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=200, help="plan/record pairs per chunk")
    ap.add_argument("--chunks", type=int, default=30, help="timed chunks per batch size and mode")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kw = {"kv_cache_memory": 1 << 30} if torch.device(args.device).type == "cuda" else {}
    llm = LLM(resolve_model_name("toy-reasoner"), speculative_config=toy_adaptive_config(args.k_max),
              device=args.device, max_num_seqs=max(batch_sizes), **kw)  # fmt: skip
    speculator = llm.llm_engine.speculator
    spec = getattr(speculator, "planner", speculator)  # an older tree plans in the speculator
    spec.draft_length.estimates.rates[:] = 0.0  # plain steps are the best choice
    spec.draft_length.costs.switch = 1e6  # ms: no choice drafts with rows whose draft is behind (but probes)
    modes = ["streak", "fresh-pass"] if hasattr(spec, "reuse_streaks") else ["fresh-pass"]
    passes = [0]
    choose = spec._choose

    def counting(*a):
        passes[0] += 1
        return choose(*a)

    spec._choose = counting
    gc.collect()
    gc.freeze()  # the engine's objects: collections then see only what the steps allocate
    rows = []
    for b in batch_sizes:
        seqs = decode_rows(b)
        for m in modes:  # warm-up: caches, the cost model's bucket, the chooser's first search
            chunk(spec, seqs, m, args.steps, passes)
        times: dict[str, list[float]] = {m: [] for m in modes}
        per_step: dict[str, list[float]] = {m: [] for m in modes}
        drafting: dict[str, list[float]] = {m: [] for m in modes}
        for _ in tqdm(range(args.chunks), desc=f"batch {b}"):
            for m in modes:
                us, p, d = chunk(spec, seqs, m, args.steps, passes)
                times[m].append(us)
                per_step[m].append(p)
                drafting[m].append(d)
        for m in modes:
            t = np.array(times[m])
            rows.append({
                "batch": b, "mode": m, "us_per_step": statistics.median(times[m]),
                "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90)),
                "passes_per_step": statistics.mean(per_step[m]),
                "drafting_rows_per_step": statistics.mean(drafting[m]), "chunks": times[m],
            })  # fmt: skip
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    report = {"device": device, "steps_per_chunk": args.steps, "chunks": args.chunks, "k_max": args.k_max,
              "tree_has_streaks": "streak" in modes, "rows": rows}  # fmt: skip
    if args.out:
        write_json(args.out, report)
    print(f"plain-step bookkeeping (plan + record_plan), us per step: median (p10-p90), {args.chunks} chunks")
    for r in rows:
        print(f"batch {r['batch']:>3}  {r['mode']:<10} {r['us_per_step']:8.1f} ({r['p10']:.1f}-"
              f"{r['p90']:.1f})  per-row passes per step {r['passes_per_step']:.3f}  drafting rows per step "
              f"{r['drafting_rows_per_step']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
