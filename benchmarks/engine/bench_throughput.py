"""Decode throughput side by side: HF transformers (eager, static cache) and thinkspec, same weights.

Qwen3-8B-shaped random bf16 weights (--shape 0.6b: the Qwen3-0.6B draft's shape, whose plain step
is the draft's step; --small: tiny shapes), prompts of --prompt-len random tokens,
--output-len generated tokens (EOS ignored), greedy, at each batch size. thinkspec runs plain
(with async scheduling, its CUDA default, and as `thinkspec_sync` without) and, with a
Qwen3-0.6B-shaped draft under synthetic acceptance, speculative decoding at the mean acceptance
lengths of --acceptance-lengths (k=4). Reports tok/s (output tokens over the decode time), ms per
step and, for plain decoding, the ratio of the step time to the weight-read floor (bytes of the
weights / --bandwidth). thinkspec's decode time runs from the batch's first token to its last (one
forward prefills every prompt); HF's is a full run's minus a 1-token run's. Writes JSON (--out)
and prints a table last.

    python benchmarks/engine/bench_throughput.py --out throughput.json                  # H200
    python benchmarks/engine/bench_throughput.py --small --device cpu --batch-sizes 1,4 # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import (
    QWEN3_0_6B,
    QWEN3_8B,
    SMALL_DRAFT,
    SMALL_TARGET,
    hf_model,
    rate_for_acceptance_length,
    time_hf,
    time_thinkspec,
    write_config,
    write_json,
)
from thinkspec import LLM
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.layers import gemv_triton, pdl
from thinkspec.layers.attention import Attention
from thinkspec.layers.linear import Linear, MergedLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--acceptance-lengths", default="2,3,4")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--bandwidth", type=float, default=4.21e12, help="bytes/s for the weight-read floor")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--shape", choices=("8b", "0.6b"), default="8b", help="the plain engines' model shape")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per plain cell, round-robin over engines"
    )
    p.add_argument(
        "--compare", default="",
        help="more plain engines, timed beside the default one: 'cublas' (every product on cuBLAS, "
        "thinkspec_cublas), 'attn64' (64-key attention tiles everywhere, thinkspec_attn64), 'combine' "
        "(split-KV partials merged by a separate launch, thinkspec_combine), 'nopdl' (no programmatic "
        "dependent launch, thinkspec_nopdl), 'noglu' (gate_up product and SiLU * up as two launches, "
        "thinkspec_noglu), 'gemv512' (the GEMV's 512-wide K tiles for every shape, thinkspec_gemv512), "
        "'noearly' (pdl.EARLY_RELEASE off: at one and two rows kernels no longer let the next one in right "
        "after their wait, nor the GEMV read its first weight tile before it, thinkspec_noearly); "
        "'noprefetch' (pdl.PREFETCH off: attention, the q/k norm + rotary and RMSNorm read nothing before "
        "their wait, thinkspec_noprefetch); comma-separated",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype_name = "float32" if device.type == "cpu" else "bfloat16"
    vocab = 1024 if args.small else 151936
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows: list[dict] = []
    steps = args.output_len - 1
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "small" if args.small else f"Qwen3-{args.shape.upper()} (draft Qwen3-0.6B)",
        "dtype": dtype_name,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "weight_bytes": None,
        "floor_ms_per_step": None,
        "rows": rows,
    }

    def record(row: dict) -> None:
        # Each row is printed and saved as it completes, so a run cut short keeps what it measured.
        row["tok_per_s"] = row["batch"] * steps / row["seconds"]
        row["ms_per_step"] = row["seconds"] / steps * 1e3  # per output token of one sequence
        rows.append(row)
        print(f"  {row['engine']} batch {row['batch']}: {row['tok_per_s']:.1f} tok/s", flush=True)
        if args.out:
            write_json(args.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        shape = QWEN3_0_6B if args.shape == "0.6b" else QWEN3_8B
        tdir = write_config(Path(tmp) / "target", SMALL_TARGET if args.small else shape, vocab)
        ddir = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        gen = torch.Generator().manual_seed(0)
        all_prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), generator=gen)
        common = dict(
            device=args.device, dtype=dtype_name, load_format="dummy", skip_tokenizer_init=True,
            max_num_seqs=max(batches), max_model_len=args.prompt_len + args.output_len + 2 * args.k + 8,
            max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),  # one prefill forward
        )  # fmt: skip
        if not args.skip_hf:
            model = hf_model(tdir, dtype, device)
            for b in batches:
                prompts = all_prompts[:b].to(device)
                for name, static in (("hf_eager", False), ("hf_static", True)):
                    seconds = time_hf(model, prompts, args.output_len, static, device)
                    record({"engine": name, "batch": b, "seconds": seconds})
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        variants = [v for v in args.compare.split(",") if v]
        allowed = ("cublas", "attn64", "combine", "nopdl", "noglu", "gemv512", "noearly", "noprefetch")
        unknown = sorted(set(variants) - set(allowed))
        if unknown:
            raise SystemExit(f"--compare: unknown variants {unknown} (allowed: {', '.join(allowed)})")
        if variants and device.type == "cuda":
            common["kv_cache_memory"] = 12 << 30  # room for up to three 8B engines
        llm = LLM(tdir, **common)
        weight_bytes = sum(t.numel() * t.element_size() for t in llm.llm_engine.model.parameters())
        result["weight_bytes"] = weight_bytes
        result["floor_ms_per_step"] = weight_bytes / args.bandwidth * 1e3
        use_pdl = pdl.ENABLED  # process-wide and read at launch: set before each engine runs (and captures)
        early, prefetch = pdl.EARLY_RELEASE, pdl.PREFETCH  # the same
        small_n = gemv_triton.SMALL_N  # the same: gemv_config reads it per launch (0: no few-outputs rule)
        plain = [("thinkspec", llm, True), ("thinkspec_sync", llm, False)]
        for variant in variants:  # changed before their first run captures their graphs
            other = LLM(tdir, **common)
            backend = None  # one backend shared by every layer, as the engine sets it up
            if variant in ("attn64", "combine") and device.type == "cuda":
                from thinkspec.layers.attention_triton import TritonAttentionBackend

                backend = TritonAttentionBackend(block_n=64 if variant == "attn64" else None,
                                                 fused_combine=variant != "combine")  # fmt: skip
            for m in other.llm_engine.model.modules():
                if variant == "cublas" and isinstance(m, Linear):
                    m.skinny_gemm = False
                if variant == "noglu" and isinstance(m, MergedLinear):
                    m.fuse_silu = False
                if backend is not None and isinstance(m, Attention):
                    m.backend = backend
            plain.append((f"thinkspec_{variant}", other, True))
            del other
        for b in batches:
            prompts = all_prompts[:b].tolist()
            reps: dict[str, list[tuple[float, dict]]] = {name: [] for name, _, _ in plain}
            for rep in range(args.repeats):  # round-robin, so drift hits every engine alike
                for name, engine, overlap in plain:
                    pdl.ENABLED = use_pdl and name != "thinkspec_nopdl"
                    pdl.EARLY_RELEASE = early and name != "thinkspec_noearly"
                    pdl.PREFETCH = prefetch and name != "thinkspec_noprefetch"
                    gemv_triton.SMALL_N = 0 if name == "thinkspec_gemv512" else small_n
                    engine.llm_engine.async_scheduling = overlap and device.type == "cuda"
                    reps[name].append(time_thinkspec(engine, prompts, args.output_len, warm_up=rep == 0)[::2])
            for name, times in reps.items():
                seconds = [t for t, _ in times]
                med = statistics.median(seconds)
                step_times = times[min(range(len(seconds)), key=lambda i: abs(seconds[i] - med))][1]
                record(
                    {"engine": name, "batch": b, "seconds": med, "seconds_reps": seconds, "steps": step_times}
                )
        pdl.ENABLED, gemv_triton.SMALL_N, pdl.EARLY_RELEASE, pdl.PREFETCH = use_pdl, small_n, early, prefetch
        del llm, plain
        for length in [float(x) for x in args.acceptance_lengths.split(",") if x]:
            rate = rate_for_acceptance_length(length, args.k)
            spec = {"model": str(ddir), "num_speculative_tokens": args.k}
            llm = LLM(tdir, speculative_config=spec, **common)
            install_synthetic_acceptance(llm, rate=rate)
            for b in batches:
                seconds, al, step_times = time_thinkspec(llm, all_prompts[:b].tolist(), args.output_len)
                record(
                    {"engine": f"thinkspec_spec_al{length:g}", "batch": b, "seconds": seconds,
                     "acceptance_length": al, "synthetic_rate": rate, "steps": step_times}
                )  # fmt: skip
            del llm
    floor_ms = result["floor_ms_per_step"]
    for r in rows:
        r["x_floor"] = r["ms_per_step"] / floor_ms
    if args.out:
        write_json(args.out, result)
    print(f"decode throughput, {result['shape']}, {dtype_name}, floor {floor_ms:.2f} ms/step")
    print(f"{'engine':<22} {'batch':>5} {'tok/s':>10} {'ms/step':>9} {'x floor':>8} {'AL':>5}  engine steps")
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") else "-"
        st = r.get("steps")
        steps = (
            f"  median {st['median_ms']:.2f} ms, {st['slow_steps']} slow (+{st['slow_excess_ms']:.0f} ms)"
            if st
            else ""
        )
        reps = r.get("seconds_reps") or []
        spread = (
            f"  spread {min(reps) / r['seconds']:.3f}-{max(reps) / r['seconds']:.3f}" if len(reps) > 1 else ""
        )
        print(f"{r['engine']:<22} {r['batch']:>5} {r['tok_per_s']:>10.1f} {r['ms_per_step']:>9.2f} "
              f"{r['x_floor']:>8.2f} {al:>5}{steps}{spread}")  # fmt: skip


if __name__ == "__main__":
    main()
