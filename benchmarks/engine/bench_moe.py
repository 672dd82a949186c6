"""Mixture-of-experts decode against its floor: Qwen3-30B-A3B-shaped random bf16 weights.

The shape: 48 layers, hidden 2048, 32/4 heads, head_dim 128, 128 experts, top-8, expert FFN 768
(--small: tiny shapes). Prompts of --prompt-len random tokens, --output-len greedy tokens (EOS
ignored), at each batch size:

- thinkspec plain decode: ms per step, and its floor, the bytes of the weights the step reads over
  --bandwidth: every weight but the experts' (attention, router, norms, embeddings, lm_head) plus the
  experts the batch selects. Those are counted in the same timed run: each MoE layer's kernels add
  the number of experts they read to a device counter (SparseMoeBlock.expert_counter), and a 1-token
  run of the same prompts (the same prefill, from the prefix cache alike) is subtracted, leaving the
  decode steps' count.
- the verify step (--verify-batch, k+1 tokens a row) under speculative decoding with a
  Qwen3-0.6B-shaped draft and synthetic acceptance: the target's verify forwards alone, each timed
  between device synchronisations, against the floor of the experts each of them selected.
- HF transformers, eager and with its static cache, on the same shape (its own random weights),
  side by side (--skip-hf to leave it out).

Writes JSON (--out) and prints a table last.

    python benchmarks/engine/bench_moe.py --out moe.json                                        # GPU
    python benchmarks/engine/bench_moe.py --small --device cpu --batch-sizes 1,2 --skip-hf    # smoke test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import (
    QWEN3_0_6B,
    SMALL_DRAFT,
    hf_model,
    rate_for_acceptance_length,
    sync,
    time_hf,
    time_thinkspec,
    write_config,
    write_json,
)
from thinkspec import LLM, SamplingParams
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.layers.moe import MoEExperts, SparseMoeBlock

MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
QWEN3_30B_A3B = dict(
    MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    tie_word_embeddings=False,
)  # fmt: skip
SMALL_MOE = dict(
    MOE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    tie_word_embeddings=False,
)  # fmt: skip


def weight_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes of every weight but the experts', bytes of one expert, MoE layers) of a loaded model."""
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    expert_params = {id(p) for m in experts for p in m.parameters()}
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    one = sum(p[0].numel() * p.element_size() for p in experts[0].parameters())
    return other, one, len(experts)


def install_counter(llm: LLM) -> torch.Tensor:
    """One device counter [1] int32 that every MoE layer of the target adds its experts read to;
    installed before the first step, so the CUDA graphs captured later hold it."""
    model = llm.llm_engine.model
    counter = torch.zeros(1, dtype=torch.int32, device=next(model.parameters()).device)
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.expert_counter = counter
    return counter


def plain_row(llm: LLM, counter: torch.Tensor, prompts: list[list[int]], output_len: int) -> dict:
    """Decode seconds and the experts the decode steps read (summed over layers and steps)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for _ in range(2):  # as time_thinkspec's warm-up: graphs captured, prefix-cache variants compiled
        llm.generate(prompts, params, use_tqdm=False)
    counter.zero_()
    seconds, _, steps = time_thinkspec(llm, prompts, output_len, warm_up=False)
    full = int(counter.item())
    counter.zero_()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = int(counter.item())
    return {"seconds": seconds, "experts_read": full - prefill, "steps": steps}


def time_verify(llm: LLM, counter: torch.Tensor, prompts: list[list[int]], args: Any) -> dict:
    """The target's verify forwards (every row fed k+1 tokens) of a speculative run: median ms and
    mean experts read per forward (summed over layers)."""
    runner = llm.llm_engine.speculator.target_runner
    inner = runner.execute_model
    device = next(llm.llm_engine.model.parameters()).device
    samples: list[tuple[float, int]] = []

    def timed(seqs, num_new_tokens, *rest, **kwargs):
        verify = len(seqs) == len(prompts) and all(n == args.k + 1 for n in num_new_tokens)
        if not verify:
            return inner(seqs, num_new_tokens, *rest, **kwargs)
        sync(device)
        before, t0 = int(counter.item()), time.perf_counter()
        out = inner(seqs, num_new_tokens, *rest, **kwargs)
        sync(device)
        samples.append(((time.perf_counter() - t0) * 1e3, int(counter.item()) - before))
        return out

    runner.execute_model = timed
    install_synthetic_acceptance(llm, rate=rate_for_acceptance_length(args.verify_al, args.k))
    llm.llm_engine.async_scheduling = False  # each verify forward timed alone
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs captured
    samples.clear()
    llm.generate(prompts, params, use_tqdm=False)
    if not samples:
        raise SystemExit(
            "no verify forward of k+1 tokens a row was seen; lower --verify-al or raise --output-len"
        )
    ms = sorted(t for t, _ in samples)
    return {
        "count": len(samples),
        "ms": ms[len(ms) // 2],
        "experts_read": sum(n for _, n in samples) / len(samples),
    }


def hf_rows(folder: Path, batches: list[int], prompts: torch.Tensor, args: Any, device: torch.device):
    """(engine, batch, decode seconds) of HF transformers, eager and with its static cache."""
    model = hf_model(folder, _dtype(device), device)
    rows = []
    for b in batches:
        batch = prompts[:b].to(device)
        for name, static in (("hf_eager", False), ("hf_static", True)):
            rows.append((name, b, time_hf(model, batch, args.output_len, static, device)))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="draft tokens a verify step checks")
    p.add_argument("--verify-batch", type=int, default=1, help="batch of the verify-step timing (0: none)")
    p.add_argument("--verify-al", type=float, default=2.0, help="synthetic acceptance length of that run")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the floor (H100 SXM)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    vocab = 1024 if args.small else 151936
    batches = [int(b) for b in args.batch_sizes.split(",")]
    steps = args.output_len - 1
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "small" if args.small else "Qwen3-30B-A3B (draft Qwen3-0.6B)",
        "dtype": str(_dtype(device)).removeprefix("torch."),
        "prompt_len": args.prompt_len, "output_len": args.output_len, "bandwidth": args.bandwidth, "rows": [],
    }  # fmt: skip

    def record(row: dict) -> None:  # printed and saved as each completes: a run cut short keeps them
        row["ms_per_step"] = row["seconds"] / steps * 1e3
        result["rows"].append(row)
        print(f"  {row['engine']} batch {row['batch']}: {row['ms_per_step']:.2f} ms/step", flush=True)
        if args.out:
            write_json(args.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        tdir = write_config(Path(tmp) / "target", SMALL_MOE if args.small else QWEN3_30B_A3B, vocab)
        ddir = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), generator=gen)
        if not args.skip_hf:
            for name, b, seconds in hf_rows(tdir, batches, prompts, args, device):
                record({"engine": name, "batch": b, "seconds": seconds})
        common = dict(
            device=args.device, dtype=result["dtype"], load_format="dummy", skip_tokenizer_init=True,
            max_num_seqs=max(batches), max_model_len=args.prompt_len + args.output_len + 2 * args.k + 8,
            max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),  # one prefill forward
        )  # fmt: skip
        run_thinkspec(tdir, ddir, common, prompts, batches, args, result, record)
    summarise(result, steps, args.out)


def run_thinkspec(tdir, ddir, common, prompts, batches, args, result, record) -> None:
    llm = LLM(tdir, **common)
    other, one_expert, layers = weight_bytes(llm.llm_engine.model)
    result.update(non_expert_bytes=other, expert_bytes=one_expert, moe_layers=layers)
    counter = install_counter(llm)
    for b in batches:
        row = plain_row(llm, counter, prompts[:b].tolist(), args.output_len)
        row["experts_per_layer"] = row["experts_read"] / (args.output_len - 1) / layers
        record({"engine": "thinkspec", "batch": b, **row})
    del llm
    if args.verify_batch:
        spec = {"model": str(ddir), "num_speculative_tokens": args.k}
        llm = LLM(tdir, speculative_config=spec, **common)
        counter = install_counter(llm)
        v = time_verify(llm, counter, prompts[: args.verify_batch].tolist(), args)
        floor_ms = (other + v["experts_read"] * one_expert) / args.bandwidth * 1e3
        v.update(batch=args.verify_batch, k=args.k, floor_ms=floor_ms, x_floor=v["ms"] / floor_ms,
                 experts_per_layer=v["experts_read"] / layers)  # fmt: skip
        result["verify"] = v
        print(f"  verify batch {v['batch']} k={v['k']}: {v['ms']:.2f} ms, {v['x_floor']:.2f}x floor")
        if args.out:
            write_json(args.out, result)


def summarise(result: dict, steps: int, out: str | None) -> None:
    bw, other, one = result["bandwidth"], result["non_expert_bytes"], result["expert_bytes"]
    plain = {r["batch"]: r for r in result["rows"] if r["engine"] == "thinkspec"}
    for r in result["rows"]:  # HF's floor: that of thinkspec's plain run at the same batch
        base = plain.get(r["batch"])
        if base is not None:
            r["floor_ms"] = (other + base["experts_read"] / steps * one) / bw * 1e3
            r["x_floor"] = r["ms_per_step"] / r["floor_ms"]
    if out:
        write_json(out, result)
    print(f"MoE decode, {result['shape']}, {result['dtype']}, {result['device']}")
    print(f"{'engine':<12} {'batch':>5} {'ms/step':>9} {'floor ms':>9} {'x floor':>8} {'experts/layer':>14}")
    for r in result["rows"]:
        per_layer = f"{r['experts_per_layer']:.1f}" if "experts_per_layer" in r else "-"
        print(f"{r['engine']:<12} {r['batch']:>5} {r['ms_per_step']:>9.2f} {r.get('floor_ms', 0):>9.3f} "
              f"{r.get('x_floor', 0):>8.2f} {per_layer:>14}")  # fmt: skip
    v = result.get("verify")
    if v:
        print(f"verify batch {v['batch']} k={v['k']}: {v['ms']:.2f} ms over {v['count']} forwards, "
              f"floor {v['floor_ms']:.3f} ms ({v['experts_per_layer']:.1f} experts/layer), "
              f"{v['x_floor']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
