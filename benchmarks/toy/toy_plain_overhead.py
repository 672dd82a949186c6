"""What a speculating engine's plain steps cost on the host-bound toy pair, part by part.

On the bundled toy pair a decode step is mostly host time, and adaptive_k decodes plainly there
(every fixed k is slower than plain decoding). Whatever adaptive_k adds to a plain step shows at
once. This benchmark times the same greedy generate call in engines that differ by one thing each:

  plain                   the target alone
  plain-parser            the target with the qwen3 reasoning parser (the phase tracking of outputs)
  adaptive                target + draft, adaptive_k (K = --k-max), relaxed thinking, as bench_adaptive --toy
  adaptive-no-probe       the same, its probes out of plain decoding off (PLAIN_PROBE_PERIOD while it runs)
  adaptive-fresh-pass     the same, every plain step taking the chooser's per-row pass (no streak of plain
                          steps reusing the last choice: DraftPlanner.reuse_streaks off)
  adaptive-no-bookkeeping the same engine with the chooser's work on its plain decode steps replaced by
                          "plain": no choice, no step timing, no draft-length counts; a step with a
                          prefill still goes through the chooser and the speculator, which runs the draft
                          model's prompt forward (needs async scheduling, which takes the engine's own
                          plain step)
  adaptive-plain-only     the same, but every step the engine's own plain step, prefills included: the
                          draft model never runs (what adaptive-no-bookkeeping measured before it sent
                          prefills through the speculator)
  adaptive-no-speculator  the same engine build (graphs, KV pool, draft loaded) with its speculator
                          removed: plain steps of the engine that adaptive_k built

Cells run round-robin after --warmups runs each at the timed batch sizes; median tok/s (min-max) over
--repeats, its ratio to plain, and how many speculative steps each run of a speculating cell made.
Writes JSON (--out) and prints a table last.

    python3 benchmarks/toy/toy_plain_overhead.py --batch-sizes 1,16,64 --out toy-plain-overhead.json   # H200
    python3 benchmarks/toy/toy_plain_overhead.py --device cpu --batch-sizes 1 --max-tokens 8 --repeats 1 \\
        --engine-args '{"async_scheduling": true}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import toy_adaptive_config, write_json
from thinkspec import LLM, SamplingParams
from thinkspec.bench.bench import format_prompts
from thinkspec.bench.datasets import load_dataset
from thinkspec.model_names import resolve_model_name
from thinkspec.spec_decode import draft_length
from thinkspec.spec_decode.planner import decode_rows

MODES = (
    "plain",
    "plain-parser",
    "adaptive",
    "adaptive-no-probe",
    "adaptive-fresh-pass",
    "adaptive-no-bookkeeping",
    "adaptive-plain-only",
    "adaptive-no-speculator",
)


def build(mode: str, args) -> LLM:
    """The engine of one mode (see the module docstring)."""
    kw: dict[str, Any] = dict(device=args.device, max_num_seqs=max(args.batch_sizes))
    if torch.device(args.device).type == "cuda":
        kw["kv_cache_memory"] = 8 << 30
    kw.update(json.loads(args.engine_args))
    target = resolve_model_name("toy-reasoner")
    if mode.startswith("plain"):
        if mode == "plain-parser":
            kw["reasoning_parser"] = "qwen3"
        return LLM(target, **kw)
    llm = LLM(target, speculative_config=toy_adaptive_config(args.k_max), **kw)
    engine = llm.llm_engine
    if mode == "adaptive-fresh-pass":
        engine.speculator.planner.reuse_streaks = False
    elif mode in ("adaptive-no-bookkeeping", "adaptive-plain-only"):
        if not engine.async_scheduling:
            raise SystemExit(f"{mode} needs async scheduling (CUDA, or --engine-args)")
        _stub_plain_steps(engine.speculator.planner, prefills_too=mode == "adaptive-plain-only")
    elif mode == "adaptive-no-speculator":
        engine.speculator, engine._adaptive = None, False
    return llm


def _stub_plain_steps(spec, prefills_too: bool) -> None:
    """Replace the speculator's choice by "plain" for every step whose rows all decode (every step with
    prefills_too): no choice, no step timing, no draft-length counts there."""
    plan, record_plan = spec.plan, spec.record_plan
    stubbed = [False]

    def stub_plan(seqs, num_new, sample_mask) -> bool:
        decoding = len(decode_rows(seqs, num_new, sample_mask)) == len(seqs)  # the engine's own rule
        stubbed[0] = prefills_too or decoding
        return True if stubbed[0] else plan(seqs, num_new, sample_mask)

    spec.plan = stub_plan
    spec.record_plan = lambda: None if stubbed[0] else record_plan()
    spec.forget_last_step = lambda: None


def timed(llm: LLM, mode: str, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    """(tok/s, speculative steps) of one generate call."""
    spec = llm.llm_engine.speculator
    metrics = spec.metrics if spec is not None else None

    def drafts() -> int:
        return 0 if metrics is None else sum(metrics.phase(p).num_drafts for p in ("thinking", "answer"))

    before, period = drafts(), draft_length.PLAIN_PROBE_PERIOD
    if mode == "adaptive-no-probe":
        draft_length.PLAIN_PROBE_PERIOD = 1 << 62
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        draft_length.PLAIN_PROBE_PERIOD = period
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, drafts() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--engine-args", default="{}", help="extra LLM(...) keyword arguments as JSON")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "plain" not in modes:
        ap.error(f"--modes: 'plain' (the anchor) and any of {', '.join(MODES)} needed, got {args.modes!r}")
    engines = {m: build(m, args) for m in modes}
    prompts = format_prompts(engines["plain"], load_dataset("toy", max(args.batch_sizes), seed=7))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for b in args.batch_sizes:
        for m in modes:  # warm-up at the timed batch size: graphs, compiles, the chooser's learning
            for _ in range(args.warmups):
                timed(engines[m], m, prompts[:b], params)
        reps: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
        for _ in tqdm(range(args.repeats), desc=f"batch {b}"):
            for m in modes:
                reps[m].append(timed(engines[m], m, prompts[:b], params))
        plain = statistics.median(r[0] for r in reps["plain"])
        for m in modes:
            tps = [r[0] for r in reps[m]]
            median = statistics.median(tps)
            rows.append({
                "batch": b, "mode": m, "tok_per_s": median, "min": min(tps), "max": max(tps),
                "over_plain": median / plain, "reps": tps, "drafts_per_run": [r[1] for r in reps[m]],
            })  # fmt: skip
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    report = {"device": device, "max_tokens": args.max_tokens, "k_max": args.k_max, "repeats": args.repeats,
              "warmups": args.warmups, "engine_args": json.loads(args.engine_args), "rows": rows}  # fmt: skip
    if args.out:
        write_json(args.out, report)
    print(f"toy pair, greedy, max_tokens {args.max_tokens}: median tok/s (min-max) over {args.repeats} runs")
    for r in rows:
        print(f"batch {r['batch']:>3}  {r['mode']:<24} {r['tok_per_s']:9.0f} ({r['min']:.0f}-{r['max']:.0f})"
              f"  x{r['over_plain']:.3f} plain  speculative steps per run {r['drafts_per_run']}")  # fmt: skip


if __name__ == "__main__":
    main()
