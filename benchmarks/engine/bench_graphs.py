"""CUDA graphs vs eager, side by side: decode ms per step, KV-pool memory against gpu_memory_utilization,
and the kernels of one batch-1 decode replay.

Qwen3-8B-shaped target (and a Qwen3-0.6B-shaped draft for `spec`, synthetic acceptance 0.7, k = 4),
random bf16 weights, 128-token prompts, greedy with EOS ignored. For each mode (plain, spec) and
each of enforce_eager True / False, one engine is built at --gpu-memory-utilization and timed at
each batch size: ms per step = (time of an n-token run - time of a 1-token run) / (n - 1), after
two full-length warm-up runs (graph captures, then the prefix-cache-hit prefill's kernel compiles).
After each engine: device memory in use (torch reserved + memory held outside torch) against
utilization x total. Last, a batch-1 decode graph is replayed under torch.profiler: kernel count
and device time by kernel.

    python benchmarks/engine/bench_graphs.py --out graphs.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import QWEN3_0_6B, QWEN3_8B, write_config, write_json
from thinkspec import LLM, SamplingParams
from thinkspec.bench.synthetic import install_synthetic_acceptance


def step_ms(llm: LLM, batch: int, n: int) -> float:
    prompts = [list(range(1 + i, 129 + i)) for i in range(batch)]

    def run(tokens: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # Warm-up, twice at full length: the first run captures the graphs this batch needs; the
    # repeated prompts then hit the prefix cache, whose shorter prefill compiles its own kernels.
    run(n)
    run(n)
    return (run(n) - run(1)) / (n - 1) * 1e3


def memory(util: float) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    used = total - free
    return dict(
        used_gib=used / 2**30, reserved_gib=reserved / 2**30, non_torch_gib=(used - reserved) / 2**30,
        target_gib=util * total / 2**30, off_target_pct=100 * (used - util * total) / (util * total),
    )  # fmt: skip


def kernel_profile(target: Path) -> dict:
    llm = LLM(target, device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=16, max_model_len=4096)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([list(range(1, 129))], params, use_tqdm=False)
    graph = llm.llm_engine.model_runner.graphs.graphs[(1, 1)]  # (batch bucket, query width): batch-1 decode
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t0) / 50 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    print(table)
    return dict(replay_ms=replay_ms, kernels=len(events), device_ms=sum(e.device_time for e in events) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="plain,spec")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    target = write_config(tmp / "target", QWEN3_8B, 151936)
    draft = write_config(tmp / "draft", QWEN3_0_6B, 151936)
    rows: list[dict] = []
    for mode in args.modes.split(","):
        for eager in (True, False):
            spec = None
            if mode == "spec":
                spec = {"model": str(draft), "num_speculative_tokens": 4}
            util = args.gpu_memory_utilization
            llm = LLM(target, device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                      max_num_seqs=16, enforce_eager=eager, gpu_memory_utilization=util,
                      speculative_config=spec)  # fmt: skip
            if spec is not None:
                install_synthetic_acceptance(llm, rate=0.7)
            for b in map(int, args.batch_sizes.split(",")):
                ms = step_ms(llm, b, args.tokens)
                rows.append(dict(mode=mode, enforce_eager=eager, batch=b, ms_per_step=ms))
                print(json.dumps(rows[-1]), flush=True)
            rows.append(dict(mode=mode, enforce_eager=eager, memory=memory(util),
                             graph_mib=llm.llm_engine.graph_memory_bytes / 2**20))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    settings = {k: v for k, v in vars(args).items() if k != "out"}  # the output path says nothing of the run
    report = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), device=torch.cuda.get_device_name(),
                  args=settings, rows=rows, decode_bs1_profile=kernel_profile(target))  # fmt: skip
    write_json(args.out, report)
    print(json.dumps(report["decode_bs1_profile"]))


if __name__ == "__main__":
    main()
