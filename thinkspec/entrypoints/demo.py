"""`thinkspec demo`: the bundled toy reasoner answering fresh problems with plain decoding, strict
and relaxed speculation, with a progress bar per mode (stderr) and a table of what each gets."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from thinkspec.llm import LLM
from thinkspec.outputs import RequestOutput
from thinkspec.sampling_params import SamplingParams
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.toy.assets import DEMO_RELAX_RATIO, DEMO_RELAX_TOP_K
from thinkspec.toy.task import chat_prompt, generate_samples, grade

PLAIN = "plain decoding (no speculation)"


@dataclass(slots=True)
class ModeRow:
    name: str
    correct: int
    tokens_per_s: float
    metrics: SpecDecodeMetrics | None  # None for plain decoding


def demo_modes(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """Mode name -> speculative_config (None: plain decoding)."""
    ratio = DEMO_RELAX_RATIO if args.relax_ratio is None else args.relax_ratio
    top_k = DEMO_RELAX_TOP_K if args.relax_top_k is None else args.relax_top_k
    base = {
        "model": "toy-reasoner-draft",
        "num_speculative_tokens": args.num_speculative_tokens,
        "reasoning_parser": "qwen3",
    }
    relaxed = {**base, "relaxed_thinking": True, "relax_ratio": ratio, "relax_top_k": top_k}
    return {PLAIN: None, "strict": base, f"relaxed (ratio {ratio}, top-k {top_k})": relaxed}


def _generate(llm: LLM, prompts: list[str], params: SamplingParams, bar: Any) -> list[RequestOutput]:
    """llm.generate's loop, with `bar` advanced per finished request and refreshed (elapsed time,
    engine steps) while the batch runs, since the requests of one batch finish near its end."""
    engine = llm.llm_engine
    order = [engine.add_request(p, params, engine.next_request_id()) for p in prompts]
    results: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        finished = engine.step(finished_only=True)
        steps += 1
        for out in finished:
            results[out.request_id] = out
        bar.set_postfix_str(f"{steps} steps", refresh=False)
        bar.update(len(finished))
    return [results[r] for r in order]


def _run_mode(
    name: str, spec: dict[str, Any] | None, args: argparse.Namespace, prompts: list[str], label: str
) -> tuple[LLM, list[RequestOutput], float]:
    """Load, warm up (one short untimed request) and run one mode; (llm, outputs, seconds)."""
    from tqdm.auto import tqdm

    params = SamplingParams(temperature=0, max_tokens=512)
    with tqdm(total=len(prompts) + 2, desc=f"{label} {name}", file=sys.stderr) as bar:
        bar.set_postfix_str("loading")
        llm = LLM("toy-reasoner", device=args.device, speculative_config=spec, max_num_seqs=64)
        bar.update()
        bar.set_postfix_str("warming up")
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        bar.update()
        t0 = time.perf_counter()
        outs = _generate(llm, prompts, params, bar)
        seconds = time.perf_counter() - t0
    return llm, outs, seconds


def _merged_metrics(outs: list[RequestOutput]) -> SpecDecodeMetrics:
    total = SpecDecodeMetrics()
    for out in outs:
        if out.metrics is not None and out.metrics.spec_decode is not None:
            total.merge(out.metrics.spec_decode)
    return total


def _print_table(rows: list[ModeRow], num_prompts: int) -> None:
    head = ('accuracy', 'accept len', 'in thinking', 'tokens/s', 'vs plain')
    print(f"{'mode':<34} {head[0]:>9} {head[1]:>10} {head[2]:>11} {head[3]:>9} {head[4]:>8}")
    plain = rows[0].tokens_per_s
    for row in rows:
        acc = f"{row.correct}/{num_prompts}"
        m = row.metrics
        al = "-" if m is None else f"{m.mean_acceptance_length():.2f}"
        al_think = "-" if m is None else f"{m.mean_acceptance_length('thinking'):.2f}"
        speedup = f"{row.tokens_per_s / plain:.2f}x"
        print(f"{row.name:<34} {acc:>9} {al:>10} {al_think:>11} {row.tokens_per_s:>9.0f} {speedup:>8}")


def run_demo(args: argparse.Namespace) -> int:
    import torch

    samples = generate_samples(args.num_problems, seed=args.seed)
    prompts = [chat_prompt(s.problem.question) for s in samples]
    modes = demo_modes(args)
    rows: list[ModeRow] = []
    example = None
    for i, (name, spec) in enumerate(modes.items(), 1):
        llm, outs, seconds = _run_mode(name, spec, args, prompts, f"[{i}/{len(modes)}]")
        correct = sum(grade(o.outputs[0].text, s.problem) for o, s in zip(outs, samples))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(ModeRow(name, correct, tokens / seconds, None if spec is None else _merged_metrics(outs)))
        if spec is not None and example is None:
            example = (samples[0], outs[0], name)
    device = llm.llm_engine.device
    threads = torch.get_num_threads()
    where = f"{device} ({threads} thread{'s' * (threads > 1)})" if device.type == "cpu" else str(device)
    print(f"\nthinkspec demo: toy reasoner pair on {where}, {len(prompts)} fresh problems per mode, "
          f"k={args.num_speculative_tokens}, greedy")  # fmt: skip
    _print_table(rows, len(prompts))
    assert example is not None
    sample, out, name = example
    completion = out.outputs[0]
    print(f"\nexample ({name}):\nQ: {sample.problem.question}")
    print(f"--- reasoning_content ---\n{(completion.reasoning_content or '').strip()}")
    print(f"--- content ---\n{(completion.content or '').strip()}")
    print(f"(expected answer: {sample.problem.answer})")
    return 0
