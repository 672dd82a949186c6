"""One benchmark cell: a dataset through one engine setting, graded and timed.

`run_cell` sends every item in one `LLM.generate` call (the engine batches them), so tokens/s
is the batch throughput of that setting and latency the per-request end-to-end time.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from thinkspec.bench.datasets import BenchItem
from thinkspec.bench.results import CellResult
from thinkspec.llm import LLM
from thinkspec.outputs import RequestOutput
from thinkspec.sampling_params import SamplingParams
from thinkspec.spec_decode.metrics import SpecDecodeMetrics


def format_prompts(llm: LLM, items: list[BenchItem]) -> list[str]:
    """Item prompts as engine input text; chat items go through the tokenizer's chat template."""
    tokenizer = llm.get_tokenizer()
    out = []
    for item in items:
        if item.chat and getattr(tokenizer, "chat_template", None) is not None:
            msgs = [{"role": "user", "content": item.prompt}]
            out.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        else:
            out.append(item.prompt)
    return out


def sampling_params_for(
    num_items: int, temperature: float, max_tokens: int, seed: int, **overrides: Any
) -> list[SamplingParams]:
    """One SamplingParams per item; sampled runs seed item i with seed + i so every cell sees the
    same random stream per problem and cells differ only by the setting."""
    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            seed=None if temperature == 0 else seed + i,
            **overrides,
        )
        for i in range(num_items)
    ]


def run_cell(
    llm: LLM,
    items: list[BenchItem],
    name: str,
    setting: dict[str, Any],
    temperature: float = 0.0,
    max_tokens: int = 512,
    seed: int = 0,
    prompts: list[str] | None = None,
    use_tqdm: bool = True,
    **overrides: Any,
) -> CellResult:
    """Generate for all items with `overrides` (relaxed_thinking, relax_ratio, ...) and grade them."""
    prompts = format_prompts(llm, items) if prompts is None else prompts
    params = sampling_params_for(len(items), temperature, max_tokens, seed, **overrides)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - t0
    return grade_outputs(
        outs, items, name, setting, seconds, speculating=llm.llm_engine.speculator is not None
    )


def grade_outputs(
    outs: list[RequestOutput],
    items: list[BenchItem],
    name: str,
    setting: dict[str, Any],
    seconds: float,
    speculating: bool,
) -> CellResult:
    failed = [o for o in outs if o.error is not None]
    if failed:
        raise RuntimeError(f"cell {name!r}: {len(failed)} requests failed, first: {failed[0].error}")
    spec = None
    if speculating:
        total = SpecDecodeMetrics()
        for o in outs:
            if o.metrics is not None and o.metrics.spec_decode is not None:
                total.merge(o.metrics.spec_decode)
        spec = total.to_dict()
    latencies, ttfts = [], []
    for o in outs:
        if o.metrics is not None and o.metrics.e2e_latency is not None:
            latencies.append(o.metrics.e2e_latency)
        if o.metrics is not None and o.metrics.time_to_first_token is not None:
            ttfts.append(o.metrics.time_to_first_token)
    return CellResult(
        name=name,
        setting=dict(setting),
        correct=[item.grade(o.outputs[0].text) for o, item in zip(outs, items)],
        output_tokens=[len(o.outputs[0].token_ids) for o in outs],
        truncated=sum(o.outputs[0].finish_reason == "length" for o in outs),
        seconds=seconds,
        latencies=latencies,
        ttfts=ttfts,
        spec=spec,
    )


def run_bench_command(args: Any) -> int:
    """`thinkspec bench`: one engine configuration on a dataset; a table on stdout, JSON on request."""
    from thinkspec.bench.datasets import load_dataset
    from thinkspec.bench.report import format_table, write_json
    from thinkspec.engine_args import engine_kwargs

    try:
        sampling_params_for(1, args.temperature, args.max_tokens, args.sampling_seed)  # fail before loading
        items = load_dataset(args.dataset, args.num_prompts, args.dataset_seed)
        llm = LLM(**engine_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"thinkspec bench: error: {e}", file=sys.stderr)
        return 2
    spec = llm.llm_engine.speculator is not None
    setting = {"mode": "spec" if spec else "no_spec", "temperature": args.temperature}
    cell = run_cell(
        llm,
        items,
        setting["mode"],
        setting,
        args.temperature,
        args.max_tokens,
        args.sampling_seed,
        use_tqdm=not args.no_progress,
    )
    row = cell.summary()
    print(format_table([row]))
    if "acceptance_rate_per_pos" in row:
        print("per-position acceptance: " + ", ".join(f"{x:.3f}" for x in row["acceptance_rate_per_pos"]))
    if args.output_json:
        write_json(
            {
                "config": {"dataset": args.dataset, "model": args.model},
                "summary": row,
                "cell": cell.to_dict(),
            },
            args.output_json,
        )
    return 0
