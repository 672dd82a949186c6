"""Tensor parallelism on one host: all-reduce latency, and decode step time against the per-GPU
weight-read floor, with dummy bf16 weights.

Parts (--parts, default all):
  allreduce  per-call latency of a bf16 all-reduce over --tp GPUs at decode message sizes: NCCL eager,
             NCCL replayed in a CUDA graph, torch symmetric-memory one-shot (eager and in a graph,
             when this torch has it); plus the broadcast rank 0 makes per step (header + packed
             inputs, int64). Run in --tp spawned processes before any engine starts.
  plain      --target (Llama-3-70B shape by default) at TP=--tp, batch --batch-sizes: ms per decode
             step, and its ratio to the floor (bytes of rank 0's weights / --bandwidth).
  spec       the same target with a Llama-3-8B-shaped draft, k=4, synthetic acceptance at mean
             acceptance lengths --acceptance-lengths, batch --spec-batch-sizes, for each draft mode of
             --draft-modes: "tp" (the draft split like the target) and "replicated" (the whole draft
             on rank 0, draft_tensor_parallel_size=1). Reports ms per output token of a sequence.
  qwen3      Qwen3-8B shape at batch 1: TP=1 against TP=--tp, the two engines alive together and
             timed interleaved; reports the speed-up.

Every timed configuration is warmed at exactly its batch size and lengths first (CUDA graphs are
captured then), timed --repeats times (interleaved across batch sizes / engines), and reported as
median with min-max. Only one tensor-parallel engine can live in a process, so plain and the two
draft modes run one after the other. Writes JSON (--out) and prints a table last.

    python benchmarks/engine/bench_tp.py --tp 2 --out tp.json                        # nvidia-h200-x2
    python benchmarks/engine/bench_tp.py --tp 4 --parts allreduce,plain --batch-sizes 1,16
    python benchmarks/engine/bench_tp.py --tp 8 --target llama3-405b --parts allreduce,plain,spec \\
        --batch-sizes 1 --spec-batch-sizes 1 --acceptance-lengths 3 --draft-modes tp
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import (
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA3_405B,
    LLAMA_VOCAB,
    QWEN3_8B,
    QWEN_VOCAB,
    SMALL_LLAMA,
    decode_seconds,
    rate_for_acceptance_length,
    time_thinkspec,
    write_config,
    write_json,
)
from thinkspec import LLM
from thinkspec.bench.synthetic import install_synthetic_acceptance

TARGETS = {"llama3-70b": LLAMA3_70B, "llama3-405b": LLAMA3_405B}
K = 4


# ---- all-reduce latency (spawned ranks) ---------------------------------------------------------


def _time_calls(fn, iters: int) -> float:
    """Microseconds per call of fn over iters calls (after 10 warm-up calls)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _in_graph(op, calls: int = 20):
    """A function replaying a CUDA graph of `calls` op() calls; per-call time = its time / calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op()  # warm-up outside the capture (NCCL / symmetric memory set up their state)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            op()
    return graph.replay, calls


def _symmetric_one_shot(numel: int, group_name: str):
    """op() running torch's symmetric-memory one-shot all-reduce on a bf16 buffer of numel, or the
    reason it is unavailable (str)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buf = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group_name)
        buf.normal_()

        def op():
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)

        op()
        return op
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"unavailable: {type(e).__name__}: {e}"


def _allreduce_rows(sizes_bytes: list[int], iters: int) -> list[dict]:
    import torch.distributed as dist

    rows = []
    group = dist.group.WORLD.group_name
    for nbytes in sizes_bytes:
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")

        def nccl(x=x):
            dist.all_reduce(x)

        row = {"bytes": nbytes, "nccl_eager_us": _time_calls(nccl, iters)}
        replay, calls = _in_graph(nccl)
        row["nccl_graph_us"] = _time_calls(replay, max(1, iters // calls)) / calls
        op = _symmetric_one_shot(nbytes // 2, group)
        if isinstance(op, str):
            row["symm_mem"] = op
        else:
            row["symm_one_shot_eager_us"] = _time_calls(op, iters)
            try:
                replay, calls = _in_graph(op)
                row["symm_one_shot_graph_us"] = _time_calls(replay, max(1, iters // calls)) / calls
            except Exception as e:  # noqa: BLE001
                row["symm_one_shot_graph"] = f"capture failed: {type(e).__name__}: {e}"
        rows.append(row)
    return rows


def _broadcast_rows(iters: int) -> list[dict]:
    """Rank 0's per-step broadcasts: the 12-int64 header, then packed inputs of decode batches."""
    import torch.distributed as dist

    rows = []
    for batch in (1, 16, 64):
        header = torch.zeros(12, dtype=torch.int64, device="cuda")
        packed = torch.zeros(4 * batch + 2 * batch + 1 + batch * 64, dtype=torch.int64, device="cuda")

        def step(header=header, packed=packed):
            dist.broadcast(header, src=0)
            header.tolist() if dist.get_rank() else None  # a worker reads the header on the host
            dist.broadcast(packed, src=0)

        rows.append(
            {
                "batch": batch,
                "packed_bytes": packed.numel() * 8,
                "header_and_inputs_us": _time_calls(step, iters),
            }
        )
    return rows


def allreduce_worker(rank: int, size: int, init_method: str, sizes: list[int], iters: int, results) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=size, device_id=torch.device("cuda", rank)
    )
    try:
        rows, bcast = _allreduce_rows(sizes, iters), _broadcast_rows(iters)
        if rank == 0:
            results.put({"allreduce": rows, "broadcast": bcast})
    finally:
        dist.destroy_process_group()


def measure_allreduce(tp: int, iters: int) -> dict:
    import torch.multiprocessing as mp

    from thinkspec.distributed.workers import free_port

    sizes = [8 * 1024, 16 * 1024, 32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=allreduce_worker, args=(r, tp, init, sizes, iters, results)) for r in range(tp)
    ]
    for p in procs:
        p.start()
    out = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return out


# ---- engine timings -------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def time_batches(llm: LLM, prompts: list[list[int]], batches: list[int], args) -> dict[int, dict]:
    """ms per output token of a sequence at each batch size: warmed at each, then interleaved repeats."""
    for b in batches:
        time_thinkspec(llm, prompts[:b], args.output_len)  # two warm-up runs at exactly this shape
    ms: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):
        for b in batches:
            ms[b].append(decode_seconds(llm, prompts[:b], args.output_len) / (args.output_len - 1) * 1e3)
    return {b: summary(v) for b, v in ms.items()}


def rank0_weight_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in llm.llm_engine.model.parameters())


def engine_kwargs(args, max_batch: int) -> dict:
    cpu = args.device == "cpu"
    return dict(
        device=args.device, dtype="float32" if cpu else "bfloat16", load_format="dummy",
        skip_tokenizer_init=True,
        max_num_seqs=max_batch, max_model_len=args.prompt_len + args.output_len + 2 * K + 8,
        gpu_memory_utilization=0.92,
    )  # fmt: skip


def run_plain(args, target: Path, prompts: list[list[int]], result: dict, save: Callable[[], None]) -> None:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(str(target), tensor_parallel_size=args.tp, **engine_kwargs(args, max(batches)))
    try:
        floor_ms = rank0_weight_bytes(llm) / args.bandwidth * 1e3
        result["floor_ms_per_step"] = floor_ms
        for b, s in time_batches(llm, prompts, batches, args).items():
            row = {
                "part": "plain",
                "tp": args.tp,
                "batch": b,
                "ms_per_step": s,
                "x_floor": s["median"] / floor_ms,
            }
            result["rows"].append(row)
            save()  # before the engine's shutdown: a hang there keeps the rows
            print(f"  plain TP={args.tp} batch {b}: {s['median']:.2f} ms/step ({row['x_floor']:.2f}x floor)")
    finally:
        llm.shutdown()


def run_spec(
    args, target: Path, draft: Path, prompts: list[list[int]], result: dict, save: Callable[[], None]
) -> None:
    batches = [int(b) for b in args.spec_batch_sizes.split(",")]
    lengths = [float(x) for x in args.acceptance_lengths.split(",")]
    for mode in args.draft_modes.split(","):
        if mode not in ("tp", "replicated"):
            raise SystemExit(f"--draft-modes: {mode!r} is neither 'tp' nor 'replicated'")
        spec = {"model": str(draft), "num_speculative_tokens": K}
        llm = LLM(
            str(target), tensor_parallel_size=args.tp,
            draft_tensor_parallel_size=args.tp if mode == "tp" else 1,
            speculative_config=spec, **engine_kwargs(args, max(batches)),
        )  # fmt: skip
        try:
            result.setdefault("floor_ms_per_step", rank0_weight_bytes(llm) / args.bandwidth * 1e3)
            for length in lengths:  # the synthetic rate lives on rank 0 only: one engine serves every AL
                install_synthetic_acceptance(llm, rate=rate_for_acceptance_length(length, K))
                for b, s in time_batches(llm, prompts, batches, args).items():
                    row = {"part": "spec", "tp": args.tp, "draft": mode, "acceptance_length": length,
                           "measured_acceptance_length": llm.last_spec_metrics.mean_acceptance_length(),
                           "batch": b, "ms_per_token": s, "tok_per_s_per_seq": 1e3 / s["median"]}  # fmt: skip
                    if result.get("floor_ms_per_step"):
                        row["x_floor"] = s["median"] / result["floor_ms_per_step"]
                    result["rows"].append(row)
                    save()  # before the engine's shutdown: a hang there keeps the rows
                    print(f"  spec {mode} AL {length:g} batch {b}: {s['median']:.2f} ms/token")
        finally:
            llm.shutdown()


def run_qwen3(args, qwen: Path, prompts: list[list[int]], result: dict, save: Callable[[], None]) -> None:
    """TP=1 and TP=tp engines alive together (fixed KV pools), timed interleaved at batch 1."""
    kw = engine_kwargs(args, 1)
    kw.pop("gpu_memory_utilization")
    kv = 4 * 2**30 if args.device == "cuda" else 64 * 2**20
    one = LLM(str(qwen), kv_cache_memory=kv, **kw)
    split = LLM(str(qwen), tensor_parallel_size=args.tp, kv_cache_memory=kv, **kw)
    try:
        for llm in (one, split):
            time_thinkspec(llm, prompts[:1], args.output_len)
        ms: dict[int, list[float]] = {1: [], args.tp: []}
        for _ in range(args.repeats):
            for size, llm in ((1, one), (args.tp, split)):
                ms[size].append(
                    decode_seconds(llm, prompts[:1], args.output_len) / (args.output_len - 1) * 1e3
                )
        s1, s2 = summary(ms[1]), summary(ms[args.tp])
        row = {"part": "qwen3", "tp": args.tp, "batch": 1, "tp1_ms_per_step": s1,
               f"tp{args.tp}_ms_per_step": s2,
               "speedup": s1["median"] / s2["median"]}  # fmt: skip
        result["rows"].append(row)
        save()  # before the engine's shutdown: a hang there keeps the rows
        print(
            f"  Qwen3-8B batch 1: TP=1 {s1['median']:.2f} ms, TP={args.tp} {s2['median']:.2f} ms, "
            f"x{row['speedup']:.2f}"
        )
    finally:
        split.shutdown()
        del one


# ---- main -------------------------------------------------------------------------------------------


def print_table(result: dict) -> None:
    print(
        f"tensor parallelism, {result['target']} TP={result['tp']}, "
        f"floor {result.get('floor_ms_per_step') or 0:.2f} ms/step"
    )
    for r in result.get("allreduce", {}).get("allreduce", []):
        sym = r.get("symm_one_shot_graph_us", r.get("symm_one_shot_eager_us", r.get("symm_mem")))
        sym = f"{sym:.1f}" if isinstance(sym, float) else str(sym)[:40]
        print(f"  all-reduce {r['bytes'] // 1024:>5} KiB: NCCL eager {r['nccl_eager_us']:.1f} us, graph "
              f"{r['nccl_graph_us']:.1f} us, symmetric one-shot {sym}")  # fmt: skip
    for r in result.get("allreduce", {}).get("broadcast", []):
        print(f"  step broadcast batch {r['batch']}: {r['header_and_inputs_us']:.1f} us")
    for r in result["rows"]:
        if r["part"] == "plain":
            s = r["ms_per_step"]
            print(
                f"  plain  batch {r['batch']:>3}: {s['median']:.2f} ms/step [{s['min']:.2f}-{s['max']:.2f}] "
                f"x{r['x_floor']:.2f} floor"
            )
        elif r["part"] == "spec":
            s = r["ms_per_token"]
            print(
                f"  spec   {r['draft']:<10} AL {r['acceptance_length']:g} batch {r['batch']:>3}: "
                f"{s['median']:.2f} ms/token [{s['min']:.2f}-{s['max']:.2f}] "
                f"({r['tok_per_s_per_seq']:.1f} tok/s per sequence)"
            )
        else:
            print(f"  Qwen3-8B batch 1: speed-up TP={r.get('tp', '')} over TP=1 x{r['speedup']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--parts", default="allreduce,plain,spec,qwen3")
    p.add_argument("--target", default="llama3-70b", choices=sorted(TARGETS))
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--spec-batch-sizes", default="1,16")
    p.add_argument("--acceptance-lengths", default="3,4")
    p.add_argument("--draft-modes", default="tp,replicated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=200, help="calls per all-reduce timing")
    p.add_argument("--bandwidth", type=float, default=4.21e12, help="bytes/s for the weight-read floor")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test with --device cpu)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # A run stopped by gpu_check's timeout (SIGTERM) prints where every thread was: a hang is located.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    parts = set(args.parts.split(","))
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    result: dict = {"device": device, "tp": args.tp, "target": "small" if args.small else args.target,
                    "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": []}  # fmt: skip

    def save() -> None:
        if args.out:
            write_json(args.out, result)

    if "allreduce" in parts:
        result["allreduce"] = measure_allreduce(args.tp, args.iters)
        save()
    with tempfile.TemporaryDirectory() as tmp:
        vocab = 1024 if args.small else LLAMA_VOCAB
        shape = SMALL_LLAMA if args.small else TARGETS[args.target]
        target = write_config(Path(tmp) / "target", shape, vocab)
        draft = write_config(Path(tmp) / "draft", SMALL_LLAMA if args.small else LLAMA3_8B, vocab)
        qwen = write_config(
            Path(tmp) / "qwen3", SMALL_LLAMA if args.small else QWEN3_8B, vocab if args.small else QWEN_VOCAB
        )
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, min(vocab, 32000), (64, args.prompt_len), generator=gen).tolist()
        if "plain" in parts:
            run_plain(args, target, prompts, result, save)
            save()
        if "spec" in parts:
            run_spec(args, target, draft, prompts, result, save)
            save()
        if "qwen3" in parts:
            run_qwen3(args, qwen, prompts, result, save)
            save()
    print_table(result)


if __name__ == "__main__":
    main()
