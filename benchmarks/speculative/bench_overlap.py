"""Drafting ahead during the verify: how much of the draft's forwards a second CUDA stream hides.

A speculative round runs k one-token draft forwards, then the verify (one target forward of k + 1
tokens per sequence). Drafting ahead (the post-verify half of PEARL, Liu et al. 2024) would let the
draft go on from its last token on a second stream while the target verifies, guessing that every
draft and its own next token (the target's bonus) will be accepted: when they are, the next round's
k drafts are ready and its forwards cost nothing on the critical path; otherwise they are thrown away
and drafted again. This measures the two things that decide whether it pays on one GPU, at Qwen3-8B /
0.6B shapes with dummy bf16 weights and CUDA graphs as the engine captures them (each runner its own
graph pool, so the two replays share no memory):

  serial      the verify, then k draft forwards, one stream (today's round, less its bookkeeping)
  overlapped  the verify on one stream and k + 1 draft forwards (the bonus guess and k drafts) on
              another, joined at the end
  verify      the verify alone;  drafts  the k draft forwards alone
  extra       overlapped - verify: what drafting ahead adds to the verify

A round drafted ahead succeeds with probability p = c^(k+1) under a constant conditional acceptance
rate c (--rate; default: the rate that gives bench_adaptive's thinking profile, AL 4.6 at K = 8).
Steady state, a round costs `overlapped` and, after a failed one, the k draft forwards on top:
  expected = overlapped + (1 - p) * drafts;  gain = serial / expected  (> 1: drafting ahead pays).
Each cell is timed as --reps calls back to back (one sync at the end), --repeats times round-robin
after two warm calls at the same shapes; medians with min-max. A watchdog (--watchdog seconds) ends
the process with every thread's stack instead of letting a stuck device call run on: at batch 16,
k = 4 the overlapped cell stalled in two calls on the H200 (the draft stream's input copy never
completed; not diagnosed; the engine itself runs one stream), hence the default of batch 1. Writes
JSON (--out, after every cell) and prints a table last.

    python benchmarks/bench_overlap.py --batch-sizes 1 --ks 1,2,4 --out overlap.json   # H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

CELLS = ("serial", "overlapped", "verify", "drafts")


def thinking_rate() -> float:
    """bench_adaptive's thinking profile as one conditional rate c (AL 4.6 over K = 8 drafts)."""
    from benchmarks.speculative.bench_adaptive import PROFILES, constant_rate_shares

    return constant_rate_shares(PROFILES["good"][0], 8)[0]


def expected_gain(ms: dict[str, float], k: int, rate: float) -> dict[str, float]:
    """From cell medians (ms: serial, overlapped, drafts): the success probability of drafting ahead,
    its expected round (ms) and serial / expected."""
    p = rate ** (k + 1)
    expected = ms["overlapped"] + (1 - p) * ms["drafts"]
    return {"p_ahead": p, "expected_ms": expected, "gain": ms["serial"] / expected}


def run_cell(models, batch: int, k: int, reps: int, repeats: int, log) -> dict:
    """Time the four cells at one batch size and draft length (CUDA)."""
    import torch

    from thinkspec.engine.block_manager import BlockManager
    from thinkspec.engine.cuda_graph import GraphSpec
    from thinkspec.engine.model_runner import ModelRunner
    from thinkspec.engine.sequence import Sequence
    from thinkspec.sampling_params import SamplingParams

    (target, tinfo), (draft, dinfo) = models
    dev, block, prompt = torch.device("cuda"), 16, 128
    total = prompt + 2 * (k + 2)
    width = -(-(total + k) // block)
    widths = tuple(sorted({1, 2, k + 1}))
    blocks = batch * width

    def runner(model, info, query_widths: tuple[int, ...]) -> ModelRunner:
        graphs = GraphSpec(query_widths, (batch,), total + k, width, None)  # None: its own graph pool
        return ModelRunner.for_model(
            model, info, num_blocks=blocks, block_size=block, device=dev, graphs=graphs
        )

    runners = [runner(target, tinfo, widths), runner(draft, dinfo, (1, 2))]
    bm = BlockManager(blocks, block, enable_prefix_caching=False)
    seqs = []
    for b in range(batch):
        seq = Sequence(str(b), list(range(1, prompt + 1)), SamplingParams(temperature=0), has_draft=True)
        bm.allocate(seq, total)
        seqs.append(seq)
    starts = [prompt] * batch
    window = [k + 1] * batch

    def verify() -> None:
        runners[0].execute_model(seqs, window, window, [[0] * (k + 1)] * batch, start_positions=starts)

    def draft_forwards(n: int) -> None:
        for i in range(n):
            pos = [s + i for s in starts]
            runners[1].execute_model(seqs, [1] * batch, [1] * batch, [[0]] * batch, start_positions=pos)

    side = torch.cuda.Stream()

    def serial() -> None:
        verify()
        draft_forwards(k)

    def overlapped() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        verify()
        with torch.cuda.stream(side):
            draft_forwards(k + 1)
        main.wait_stream(side)

    fns = {"serial": serial, "overlapped": overlapped, "verify": verify, "drafts": lambda: draft_forwards(k)}
    for name, fn in fns.items():  # captures happen here, at the timed shapes
        fn()
        fn()
        torch.cuda.synchronize()
        log(f"batch {batch} k {k}: {name} warm")
    times: dict[str, list[float]] = {c: [] for c in CELLS}
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / reps)
    for r in runners:
        r.release()
    torch.cuda.empty_cache()
    return {
        c: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for c, v in times.items()
    }


def positive_ints(text: str, name: str, parser: argparse.ArgumentParser, hi: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{name} must be comma-separated integers, got {text!r}")
    top = "" if hi is None else f" and <= {hi}"
    if any(v < 1 or (hi is not None and v > hi) for v in values):
        parser.error(f"{name} must be >= 1{top}, got {text!r}")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--ks", default="1,2,4", help="draft lengths k (1..8)")
    p.add_argument("--rate", type=float, default=None, help="conditional acceptance rate c in (0, 1]")
    p.add_argument("--reps", type=int, default=20, help="calls per timed sample (back to back)")
    p.add_argument("--repeats", type=int, default=5, help="samples per cell, round-robin")
    p.add_argument("--watchdog", type=float, default=300.0, help="seconds before the process is ended")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    batches = positive_ints(args.batch_sizes, "--batch-sizes", p)
    ks = positive_ints(args.ks, "--ks", p, hi=8)
    if args.rate is not None and not 0 < args.rate <= 1:
        p.error(f"--rate must be in (0, 1], got {args.rate}")
    if args.reps < 1 or args.repeats < 1 or args.watchdog <= 0:
        p.error("--reps and --repeats must be >= 1 and --watchdog > 0")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_overlap needs a CUDA device (two streams, CUDA graphs)")
    import faulthandler

    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    from benchmarks.common import QWEN3_0_6B, QWEN3_8B, write_config
    from thinkspec.engine.model_runner import use_triton_kernels
    from thinkspec.models.loader import load_model

    rate = args.rate if args.rate is not None else thinking_rate()
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = []
        for name, shape in (("target", QWEN3_8B), ("draft", QWEN3_0_6B)):
            folder = write_config(Path(tmp) / name, shape, 151936)
            model, info = load_model(folder, "bfloat16", torch.device("cuda"), load_format="dummy")
            use_triton_kernels(model)
            models.append((model, info))
        for batch in batches:
            for k in ks:
                cells = run_cell(models, batch, k, args.reps, args.repeats, log)
                ms = {c: cells[c]["median_ms"] for c in CELLS}
                rows.append({"batch": batch, "k": k, "rate": rate, **cells, **expected_gain(ms, k, rate)})
                result = {"device": torch.cuda.get_device_name(), "target": "Qwen3-8B shape",
                          "draft": "Qwen3-0.6B shape", "dtype": "bfloat16", "reps": args.reps,
                          "repeats": args.repeats, "rows": rows}  # fmt: skip
                if args.out:  # after every cell: a watchdog exit keeps what was measured
                    Path(args.out).write_text(json.dumps(result, indent=2))
    runs = f"{args.repeats} x {args.reps}"
    print(f"drafting ahead on a second stream, c = {rate:.3f} (ms, medians of {runs} calls)")
    print(f"{'batch':>5} {'k':>2} {'serial':>8} {'overlap':>8} {'verify':>8} {'drafts':>8} {'extra':>7} "
          f"{'p':>5} {'expected':>8} {'gain':>6}")  # fmt: skip
    for r in rows:
        ms = {c: r[c]["median_ms"] for c in CELLS}
        cols = " ".join(f"{ms[c]:>8.3f}" for c in CELLS)
        print(f"{r['batch']:>5} {r['k']:>2} {cols} {ms['overlapped'] - ms['verify']:>7.3f} "
              f"{r['p_ahead']:>5.2f} {r['expected_ms']:>8.3f} {r['gain']:>6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
