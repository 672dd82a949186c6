"""Where an engine run of the toy reasoner spends its time: host (cProfile) and device (torch.profiler).

Runs --num-problems toy problems through `LLM.generate` (strict draft-model speculation unless
--no-spec) once under cProfile and prints the top functions by own time and by cumulative time,
then a shorter run under torch.profiler and prints the top operators by device time, with the
wall time of each run so the host share is visible.

    python benchmarks/profile_toy.py --device cuda --num-problems 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from thinkspec import LLM, SamplingParams
from thinkspec.bench.bench import format_prompts
from thinkspec.bench.datasets import load_dataset
from thinkspec.toy.assets import ASSETS_DIR

TOY = ASSETS_DIR / "toy-reasoner"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-problems", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--engine-args", default="{}", help="extra LLM(...) keyword arguments as JSON")
    args = ap.parse_args()
    spec = None if args.no_spec else {
        "model": str(TOY / args.draft), "num_speculative_tokens": 4, "reasoning_parser": "qwen3",
    }  # fmt: skip
    llm = LLM(
        TOY / "target",
        speculative_config=spec,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
        **json.loads(args.engine_args),
    )
    items = load_dataset("toy", args.num_problems, seed=7)
    prompts = format_prompts(llm, items)
    params = SamplingParams(temperature=0.0, max_tokens=512)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up: compiles, allocator, graphs

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"cProfile run: {len(prompts)} problems, {n_tok} tokens, {wall:.2f} s, {n_tok / wall:.0f} tok/s")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"---- top {args.top} by {key}")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-6000:])

    if torch.cuda.is_available():
        sub = prompts[: max(8, len(prompts) // 4)]
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as tp:
            llm.generate(sub, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ka = tp.key_averages()
        dev_total = sum(e.self_device_time_total for e in ka) / 1e6
        print(
            f"torch.profiler run: {len(sub)} problems, wall {wall:.2f} s (profiled), "
            f"device busy {dev_total:.2f} s"
        )
        print(ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
