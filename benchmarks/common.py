"""What the benchmark scripts share: model shapes, dummy-checkpoint configs, timing helpers, JSON output.

Scripts run from the repository root as files (`python3 benchmarks/engine/bench_throughput.py ...`);
each puts the root on sys.path before importing this module, so neither an install nor PYTHONPATH is
needed. No script imports another script: what two of them need lives here.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from thinkspec import LLM, SamplingParams
from thinkspec.model_names import resolve_model_name

# ---- model shapes (config.json fields; the loader builds dummy bf16 weights from them) ----------------

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
)  # fmt: skip
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip
SMALL_TARGET = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
)  # fmt: skip
SMALL_DRAFT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
)  # fmt: skip
QWEN_VOCAB = 151936

LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0, max_position_embeddings=8192,
    head_dim=128, tie_word_embeddings=False, eos_token_id=128001,
)  # fmt: skip
LLAMA3_70B = dict(
    LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8,
)  # fmt: skip
LLAMA3_405B = dict(
    LLAMA, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
    num_key_value_heads=8,
)  # fmt: skip
LLAMA3_8B = dict(
    LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8,
)  # fmt: skip
SMALL_LLAMA = dict(
    LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32,
)  # fmt: skip
LLAMA_VOCAB = 128256


def write_config(folder: Path, shape: dict, vocab_size: int) -> Path:
    """A checkpoint folder holding only config.json (Qwen3 unless `shape` says otherwise), for
    load_format="dummy"; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 151645,
        **shape,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def toy_adaptive_config(k_max: int) -> dict[str, Any]:
    """speculative_config of the toy pair's adaptive engine: the bundled draft, adaptive_k up to k_max,
    relaxed thinking (ratio 0.3, top-k 8) as bench_adaptive --toy runs it."""
    return {
        "model": str(resolve_model_name("toy-reasoner-draft")), "num_speculative_tokens": k_max,
        "adaptive_k": True, "reasoning_parser": "qwen3", "relaxed_thinking": True, "relax_ratio": 0.3,
        "relax_top_k": 8,
    }  # fmt: skip


def write_json(path: str | Path, data: Any, indent: int = 1) -> None:
    """data as indented JSON at path, its folder created (a script's --out)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=indent))


# ---- timing ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(folder: Path, dtype: torch.dtype, device: torch.device):
    """HF transformers' model for the config in folder, random weights, in eval mode."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    # Built on the device: random init of billions of parameters on the host takes minutes.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def time_hf(model, prompts: torch.Tensor, output_len: int, static: bool, device: torch.device) -> float:
    """Seconds to generate output_len tokens for the batch, minus the time of a 1-token run (prefill)."""

    def run(n: int) -> float:
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if static:
            kwargs["cache_implementation"] = "static"
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
        sync(device)
        return time.perf_counter() - t0

    if static:
        # transformers compiles the forward for a static cache, once per cache length (prompt +
        # max_new_tokens): warm up both lengths timed below so no compilation is timed.
        run(output_len)
        run(1)
    else:
        run(2)
    return run(output_len) - run(1)


def rate_for_acceptance_length(length: float, k: int) -> float:
    """Per-draft acceptance probability r with sum_{i=0..k} r^i = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def time_thinkspec(
    llm: LLM, prompts: list[list[int]], output_len: int, warm_up: bool = True
) -> tuple[float, float | None, dict]:
    """(decode seconds for output_len tokens: from the batch's first token to its last, mean acceptance
    length or None, step-time summary). Every prompt is prefilled in one forward (main sizes
    max_num_batched_tokens for it), so the first tokens come together.

    The summary is over the engine steps of the timed full-length run (wall time of each
    LLMEngine.step call, ms): median, max, and the steps over twice the median with their excess.
    warm_up=False: the engine already ran these prompts at this length (a repetition).
    """
    engine = llm.llm_engine
    step_ms: list[float] = []

    def timed_step(*args, _step=engine.step, **kwargs):
        t0 = time.perf_counter()
        out = _step(*args, **kwargs)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def run(n: int) -> float:
        """Seconds from the batch's first token to its last (the requests' own timestamps): the
        prefill, eager and host-bound, is left out without subtracting a second, 1-token run."""
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)

    # Warm-up, twice at full length: the first run captures the CUDA graphs; the repeated prompts
    # then hit the prefix cache, whose shorter prefill compiles its own kernel variants in the
    # second run, not in a timed one.
    if warm_up:
        run(output_len)
        run(output_len)
    engine.step = timed_step
    try:
        full = run(output_len)
    finally:
        del engine.step  # back to the class's method
    m = llm.last_spec_metrics  # of the full run
    med = statistics.median(step_ms)
    slow = [t for t in step_ms if t > 2 * med]
    steps = {
        "count": len(step_ms), "median_ms": med, "max_ms": max(step_ms),
        "slow_steps": len(slow), "slow_excess_ms": sum(slow) - med * len(slow),
    }  # fmt: skip
    return full, (m.mean_acceptance_length() if m is not None else None), steps


def decode_seconds(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Seconds of output_len tokens minus a 1-token run (the prefill and the first token)."""

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    return run(output_len) - run(1)


def capture_graph(fn, keep: bool = False) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(), run once on a side stream first (lazy set-up, cuBLAS workspaces) and
    replayed once after capture; with keep, kept for editing instead (torch's keep_graph=True: its
    raw_cuda_graph() may change until instantiate() or the first replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(g):
        fn()
    if not keep:
        g.replay()
    return g


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 20, batches: int = 5) -> list[float]:
    """Microseconds of one replay of g, from each of `batches` runs of `reps` replays, sorted."""
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)


def graph_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph of fn()."""
    times = replay_us(capture_graph(fn), reps)
    return times[len(times) // 2]


# ---- kernel timing against the HBM (the acceptance kernel and its launch-shape sweep) -------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_us(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median time of fn in microseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3


def back_to_back_us(fn: Callable[[], object], n: int) -> float:
    """Mean time per call in microseconds of n calls issued back to back (best of 3 runs), as a
    round issues them: no L2 flush in between, so no dirty flush lines to write back either."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / n)
    return best


@triton.jit
def _read_max_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"))
    tl.store(out_ptr + tl.program_id(0), tl.max(x.to(tl.float32), 0))


def read_max(logits: torch.Tensor) -> torch.Tensor:
    """A plain streaming read of the logits (max of 8,192-entry tiles), the cost of reading them
    once with a simple kernel. [R, V] -> [R * V / 8192] float32."""
    flat = logits.view(-1)
    out = torch.empty(triton.cdiv(flat.numel(), 8192), dtype=torch.float32, device=logits.device)
    _read_max_kernel[(out.numel(),)](flat, out, flat.numel(), BLOCK=8192, num_warps=8)
    return out


def copy_bandwidth(warmup: int, rep: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), warmup, rep)
    return 2 * n / (us * 1e-6)


def graphed(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """One CUDA graph per input buffer, replayed in rotation."""
    graphs = []
    for call in calls:
        call()  # compiles and warms up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        graphs.append(g)
    cycle = itertools.cycle(graphs)
    return lambda: next(cycle).replay()
