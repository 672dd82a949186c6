"""One speculative round against its parts: k draft steps plus one verify step, measured side by side.

Qwen3-8B-shaped target and Qwen3-0.6B-shaped draft with random ("dummy") bf16 weights, synthetic
acceptance (each draft accepted with probability --rate), greedy, at several batch sizes; on CUDA
the runners are set up as the engine sets them up (Triton attention, CUDA graphs for decode, verify
and draft steps; --enforce-eager: no graphs). For each batch size it reports, from the same
sequences at the same context length:
  round_ms          Speculator.step for the whole batch (propose + verify + accept, one host copy)
  draft_step_ms     one single-token draft forward over the batch
  draft_first_ms    one two-token draft forward with logits of the last token: a steady step's forward 1
                    (its new token and the last accepted draft)
  verify_ms         one target forward scoring k+1 positions per sequence
  *_back_to_back_ms the same forwards called --reps times in a row with one sync at the end, per
                    call: the host prepares a call while the device runs the one before, as in a
                    round, so this is the device's time when the host keeps up (the figures above
                    also hold the host's preparation and the wait for the result)
  parts_ms          k * draft_step_ms + verify_ms
  decode_ms         one plain single-token target forward (no speculation), for reference
  ratio             round_ms / parts_ms (the overhead of the round's own bookkeeping)
  tokens_per_round  mean tokens emitted per sequence per round
  floors            the verify's bound, max(weight read at HBM_BYTES_PER_S, its matmul FLOPs at
                    BF16_FLOPS), and the plain step's weight-read floor
With --kernel-profile (CUDA) the verify, the plain step and both draft forwards are also replayed once under
torch.profiler, and their device time is split into GEMM, attention and other kernels, with the
ten costliest kernels.
Writes JSON (--out) and prints a table last.

    python benchmarks/speculative/bench_spec_round.py --out spec_round.json            # H200
    python benchmarks/speculative/bench_spec_round.py --small --device cpu --rounds 3  # smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import QWEN3_0_6B, QWEN3_8B, SMALL_DRAFT, SMALL_TARGET, sync, write_config, write_json
from thinkspec.bench.synthetic import check_synthetic, steer_runner
from thinkspec.config import SpeculativeConfig
from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.cuda_graph import GraphSpec, graph_batch_sizes
from thinkspec.engine.model_runner import ModelRunner, attention_layers, use_triton_kernels
from thinkspec.engine.scheduler import Scheduler, SchedulerOutput, StepOutcome
from thinkspec.engine.sequence import Sequence
from thinkspec.engine.speculator import Speculator
from thinkspec.models.loader import load_model
from thinkspec.sampling.sampler import Sampler
from thinkspec.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.21e12  # measured device copy bandwidth (docs/BENCHMARKS.md anchors)
BF16_FLOPS = 790e12  # dense bf16 tensor-core rate a tuned GEMM reaches on the H200
KERNEL_GROUPS = (
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitk", "matmul")),
    ("attention", ("attn", "attention")),
)


def floors(model: torch.nn.Module, batch: int, k: int) -> dict[str, float]:
    """Lower bounds (ms) of one verify over batch x (k+1) tokens and of one plain step, from the weights."""
    params = dict(model.named_parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    # The embedding is a lookup: it costs reads of a few rows, no FLOPs.
    matmul_params = sum(p.numel() for n, p in params.items() if "embed" not in n)
    if not any("lm_head" in n for n in params):  # tied: the lm_head product reads the embedding
        matmul_params += sum(p.numel() for n, p in params.items() if "embed" in n)
    read_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
    flop_ms = 2 * matmul_params * batch * (k + 1) / BF16_FLOPS * 1e3
    return {"verify_floor_ms": max(read_ms, flop_ms), "verify_flop_ms": flop_ms, "decode_floor_ms": read_ms}


def kernel_breakdown(fn) -> dict:
    """Device time (us) of one call of fn by kernel group, and its ten costliest kernels (CUDA only)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time
    groups = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"other": 0.0}
    for name, us in per_kernel.items():
        low = name.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(key in low for key in keys)), "other")
        groups[group] += us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return {"device_us": sum(per_kernel.values()), "groups_us": groups,
            "top_kernels_us": [{"name": n[:120], "us": us} for n, us in top]}  # fmt: skip


def timed(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of fn() over reps calls (after one warm-up), synchronised around each."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back(fn, device: torch.device, reps: int) -> float:
    """Milliseconds per call of fn() over reps calls in a row (after one warm-up), one sync at the end."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / reps


def commit(scheduler: Scheduler, sched: SchedulerOutput, outcomes: list[StepOutcome]) -> int:
    """Apply a step's outcomes as the engine does; returns the tokens emitted."""
    for seq, outcome in zip(sched.seqs, outcomes):
        scheduler.commit(seq, outcome)
    return sum(len(o.token_ids) for o in outcomes)


def run_batch(args, target, tinfo, draft, dinfo, draft_dir: Path, batch: int, device: torch.device) -> dict:
    k, block = args.k, 16
    total_tokens = args.prompt_len + (args.rounds + args.warmup + 4) * (k + 1) + k
    num_blocks = batch * math.ceil(total_tokens / block)
    graphs: list[GraphSpec | None] = [None, None]
    if device.type == "cuda" and not args.enforce_eager:  # as the engine runs them (engine.py)
        pool = torch.cuda.graph_pool_handle()
        buckets = graph_batch_sizes(batch)
        blocks = -(-(total_tokens + k) // block)
        graphs = [
            GraphSpec(tuple(sorted({1, 2, k + 1})), buckets, total_tokens + k, blocks, pool),
            GraphSpec((1, 2), buckets, total_tokens + k, blocks, pool),
        ]
    runners = [
        ModelRunner.for_model(m, i, num_blocks=num_blocks, block_size=block, device=device, graphs=g)
        for (m, i), g in zip(((target, tinfo), (draft, dinfo)), graphs)
    ]
    bm = BlockManager(num_blocks, block, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(batch)
    seqs = []
    for b in range(batch):
        prompt = torch.randint(0, tinfo.vocab_size, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        seq = Sequence(str(b), prompt, params, has_draft=True)
        bm.allocate(seq, total_tokens)
        seqs.append(seq)
    cfg = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=k)
    spec = Speculator(
        cfg, target_runner=runners[0], draft_runner=runners[1], reasoning=None,
        sampler=Sampler(0, device), vocab_size=tinfo.vocab_size, max_model_len=total_tokens + k, seed=0,
    )  # fmt: skip
    steer_runner(runners[0], *check_synthetic(args.rate, None, k), seed=0)  # acceptance at --rate
    scheduler = Scheduler(
        bm, max_num_seqs=batch, max_num_batched_tokens=batch * args.prompt_len, max_model_len=total_tokens + k
    )
    prefill = SchedulerOutput(seqs=seqs, num_new_tokens=[args.prompt_len] * batch)
    commit(scheduler, prefill, spec.step(prefill))
    decode = SchedulerOutput(seqs=seqs, num_new_tokens=[1] * batch)
    for _ in range(args.warmup):
        commit(scheduler, decode, spec.step(decode))
    round_times, emitted = [], 0
    for _ in range(args.rounds):
        sync(device)
        t0 = time.perf_counter()
        result = spec.step(decode)
        sync(device)
        round_times.append((time.perf_counter() - t0) * 1e3)
        emitted += commit(scheduler, decode, result)

    # The parts, at the context the rounds reached; they write only slots past the committed tokens.
    target_runner, draft_runner = runners
    starts = [s.num_tokens - 1 for s in seqs]
    ones, one, window, wide = [1] * batch, [[0]] * batch, [k + 1] * batch, [[0] * (k + 1)] * batch
    parts = {
        "draft": lambda: draft_runner.execute_model(seqs, ones, ones, one, start_positions=starts),
        "draft_first": lambda: draft_runner.execute_model(
            seqs, [2] * batch, ones, [[0, 0]] * batch, start_positions=starts
        ),  # fmt: skip
        "verify": lambda: target_runner.execute_model(seqs, window, window, wide, start_positions=starts),
        "decode": lambda: target_runner.execute_model(seqs, ones, ones, one, start_positions=starts),
    }
    draft_ms, first_ms, verify_ms, decode_ms = (timed(parts[p], device, args.reps) for p in parts)
    in_a_row = {f"{p}_back_to_back_ms": back_to_back(fn, device, args.reps) for p, fn in parts.items()}
    profile = {}
    if getattr(args, "kernel_profile", False) and device.type == "cuda":  # other callers pass no such flag
        profile = {f"{p}_kernels": kernel_breakdown(fn) for p, fn in parts.items()}
    round_ms = statistics.median(round_times)
    parts_ms = k * draft_ms + verify_ms
    tokens_per_round = emitted / (args.rounds * batch)
    bounds = floors(target_runner.model, batch, k)
    for r in runners:
        r.release()
    del runners, spec
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "k": k,
        "rate": args.rate,
        "context": seqs[0].num_tokens,
        "round_ms": round_ms,
        "draft_step_ms": draft_ms,
        "draft_first_ms": first_ms,
        "verify_ms": verify_ms,
        "parts_ms": parts_ms,
        "decode_ms": decode_ms,
        **in_a_row,
        "ratio": round_ms / parts_ms,
        "tokens_per_round": tokens_per_round,
        "spec_tok_per_s": batch * tokens_per_round / round_ms * 1e3,
        "plain_tok_per_s": batch / decode_ms * 1e3,
        **bounds,
        **profile,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.7, help="synthetic per-draft acceptance probability")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as LLM(enforce_eager=True))")
    p.add_argument("--kernel-profile", action="store_true", help="verify/plain by kernel (CUDA)")
    p.add_argument(
        "--attention-block-n", type=int, default=None, help="keys per attention tile (default: chosen)"
    )
    p.add_argument("--combine-launch", action="store_true", help="split-KV merge as a separate launch")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    vocab = 1024 if args.small else 151936
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        tdir = write_config(Path(tmp) / "target", SMALL_TARGET if args.small else QWEN3_8B, vocab)
        ddir = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        target, tinfo = load_model(tdir, dtype, device, load_format="dummy")
        draft, dinfo = load_model(ddir, dtype, device, load_format="dummy")
        if device.type == "cuda":
            use_triton_kernels(target)  # as the engine sets models up on CUDA
            use_triton_kernels(draft)
            if args.attention_block_n is not None or args.combine_launch:
                from thinkspec.layers.attention_triton import TritonAttentionBackend

                merge = not args.combine_launch
                fixed = TritonAttentionBackend(block_n=args.attention_block_n, fused_combine=merge)
                for layer in attention_layers(target) + attention_layers(draft):
                    layer.backend = fixed
        batches = [int(b) for b in args.batch_sizes.split(",")]
        rows = [run_batch(args, target, tinfo, draft, dinfo, ddir, b, device) for b in batches]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target": "Qwen3-8B shape" if not args.small else "small",
        "draft": "Qwen3-0.6B shape" if not args.small else "small",
        "dtype": dtype,
        "attention_backend": "triton" if device.type == "cuda" else "torch reference",
        "cuda_graphs": device.type == "cuda" and not args.enforce_eager,
        "attention_block_n": args.attention_block_n or "chosen",
        "attention_merge": "launch" if args.combine_launch else "fused",
        "rows": rows,
    }
    if args.out:
        write_json(args.out, result, indent=2)
    shapes = f"{result['target']} / {result['draft']}"
    print(f"spec round vs parts ({shapes}, {dtype}, k={args.k}, rate={args.rate})")
    print(f"{'batch':>5} {'round ms':>9} {'draft ms':>9} {'verify ms':>9} {'parts ms':>9} {'ratio':>6} "
          f"{'tok/rnd':>7} {'spec tok/s':>10} {'plain tok/s':>11} {'verify/floor':>12} "
          f"{'plain/floor':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>5} {r['round_ms']:>9.2f} {r['draft_step_ms']:>9.2f} {r['verify_ms']:>9.2f} "
              f"{r['parts_ms']:>9.2f} {r['ratio']:>6.2f} {r['tokens_per_round']:>7.2f} "
              f"{r['spec_tok_per_s']:>10.1f} {r['plain_tok_per_s']:>11.1f} "
              f"{r['verify_ms'] / r['verify_floor_ms']:>12.2f} "
              f"{r['decode_ms'] / r['decode_floor_ms']:>11.2f}")  # fmt: skip
    for r in rows:
        print(f"batch {r['batch']} back to back (ms per call): draft {r['draft_back_to_back_ms']:.2f}, "
              f"draft forward 1 (2 tokens) {r['draft_first_back_to_back_ms']:.2f}, "
              f"verify {r['verify_back_to_back_ms']:.2f}, "
              f"plain {r['decode_back_to_back_ms']:.2f}")  # fmt: skip
    for r in rows:
        for part in ("draft_kernels", "draft_first_kernels", "verify_kernels", "decode_kernels"):
            if part in r:
                groups = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in r[part]["groups_us"].items())
                print(f"batch {r['batch']} {part}: {r[part]['device_us'] / 1e3:.2f} ms device ({groups})")


if __name__ == "__main__":
    main()
