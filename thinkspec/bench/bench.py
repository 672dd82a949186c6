"""One benchmark cell: a dataset through one engine setting, graded and timed.

`run_cell` sends every item in one `LLM.generate` call (the engine batches them), so tokens/s
is the batch throughput of that setting and latency the per-request end-to-end time.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from thinkspec.bench.datasets import BenchItem
from thinkspec.bench.results import CellResult
from thinkspec.bench.warmth import build_counts, capture_graphs, check_no_builds, quiet_heap
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
    max_in_flight: int | None = None,
    **overrides: Any,
) -> CellResult:
    """Generate for all items with `overrides` (relaxed_thinking, relax_ratio, ...) and grade them;
    max_in_flight caps the requests in the engine at once (None: all at once)."""
    prompts = format_prompts(llm, items) if prompts is None else prompts
    params = sampling_params_for(len(items), temperature, max_tokens, seed, **overrides)
    t0 = time.perf_counter()
    if max_in_flight is None:
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    else:
        outs = generate_bounded(llm, prompts, params, max_in_flight)
    seconds = time.perf_counter() - t0
    return grade_outputs(
        outs, items, name, setting, seconds, speculating=llm.llm_engine.speculator is not None
    )


def generate_bounded(
    llm: LLM, prompts: Sequence[str], params: Sequence[SamplingParams], max_in_flight: int
) -> list[RequestOutput]:
    """As LLM.generate, with at most max_in_flight requests in the engine: a new one enters as one
    finishes. Outputs in prompt order; each request's latency counts from when it entered."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    engine = llm.llm_engine
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    while len(ids) < min(max_in_flight, len(prompts)):
        ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            if out.finished:
                done[out.request_id] = out
                if len(ids) < len(prompts):
                    ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
    return [done[i] for i in ids]


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
        extra={
            "output_digest": output_digest(outs),
            "preemptions": sum(o.metrics.num_preemptions for o in outs if o.metrics is not None),
        },
    )


def output_digest(outs: Sequence[RequestOutput]) -> str:
    """A fingerprint of every request's output token ids (equal runs give equal digests)."""
    h = hashlib.sha256()
    for o in outs:
        h.update(len(o.outputs[0].token_ids).to_bytes(4, "little"))
        for t in o.outputs[0].token_ids:
            h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:16]


# One timed cell: (the engine it runs on, a function that runs it once and grades it).
TimedCell = tuple[LLM, Callable[[], CellResult]]


def run_round_robin(
    cells: Sequence[TimedCell],
    repeats: int,
    on_result: Callable[[int, CellResult], None] | None = None,
    use_tqdm: bool = True,
) -> list[CellResult]:
    """Time every cell `repeats` times, round-robin (drift hits all cells alike); the engines must be
    warm at the cells' shapes: a timed run that captures or compiles anything raises.

    Returns each cell's first run with tokens_per_s_reps holding every repetition's tok/s. Greedy
    cells must give identical outputs in every repetition (RuntimeError otherwise).
    """
    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results: list[CellResult | None] = [None] * len(cells)
    bar = tqdm(total=repeats * len(cells), desc="timed runs", disable=not use_tqdm, dynamic_ncols=True)
    try:
        for r in range(repeats):
            for i, (llm, run) in enumerate(cells):
                before = build_counts(llm)
                with quiet_heap() as run_stats:
                    cell = run()
                cell.extra.update({f"{k}_reps": [v] for k, v in run_stats.items()})
                check_no_builds(before, build_counts(llm), f"cell {cell.name!r} (repetition {r + 1})")
                results[i] = _keep_repetition(results[i], cell, r)
                if on_result is not None:
                    on_result(i, results[i])
                bar.update(1)
    finally:
        bar.close()
    return [c for c in results if c is not None]


def _keep_repetition(first: CellResult | None, cell: CellResult, r: int) -> CellResult:
    """Fold repetition r of a cell into its first run."""
    if first is None:
        cell.tokens_per_s_reps = [cell.tokens_per_s]
        return cell
    if cell.setting.get("temperature") == 0 and cell.extra["output_digest"] != first.extra["output_digest"]:
        raise RuntimeError(
            f"cell {cell.name!r}: greedy outputs of repetition {r + 1} differ from the first: the engine is "
            "not deterministic"
        )
    first.tokens_per_s_reps.append(sum(cell.output_tokens) / max(cell.seconds, 1e-9))
    for key, value in cell.extra.items():
        if key.endswith("_reps"):  # the run's own statistics (quiet_heap), one per repetition
            first.extra.setdefault(key, []).extend(value)
    return first


def run_bench_command(args: Any) -> int:
    """`thinkspec bench`: one engine configuration on a dataset; a table on stdout, JSON on request."""
    from thinkspec.bench.datasets import default_max_tokens, load_dataset
    from thinkspec.bench.report import format_table, write_json
    from thinkspec.engine_args import engine_kwargs

    try:
        if args.max_tokens is None:
            args.max_tokens = default_max_tokens(args.dataset, args.level)
        sampling_params_for(1, args.temperature, args.max_tokens, args.sampling_seed)  # fail before loading
        items = load_dataset(args.dataset, args.num_prompts, args.dataset_seed, args.level)
        llm = LLM(**engine_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"thinkspec bench: error: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"thinkspec bench: error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    spec = llm.llm_engine.speculator is not None
    setting = {"mode": "spec" if spec else "no_spec", "temperature": args.temperature}
    prompts = format_prompts(llm, items)

    def run() -> CellResult:
        return run_cell(
            llm, items, setting["mode"], setting, args.temperature, args.max_tokens, args.sampling_seed,
            prompts, use_tqdm=False,
        )  # fmt: skip

    capture_graphs(llm, len(items))
    run()  # warm-up at the timed batch and length
    (cell,) = run_round_robin([(llm, run)], args.repeats, use_tqdm=not args.no_progress)
    row = cell.summary()
    print(format_table([row]))
    if "acceptance_rate_per_pos" in row:
        print("per-position acceptance: " + ", ".join(f"{x:.3f}" for x in row["acceptance_rate_per_pos"]))
    if args.output_json:
        write_json(
            {
                "config": {"dataset": args.dataset, "level": args.level, "model": args.model},
                "summary": row,
                "cell": cell.to_dict(),
            },
            args.output_json,
        )
    return 0
