"""`thinkspec demo`: the bundled toy reasoner answering fresh problems, strict vs relaxed speculation."""

from __future__ import annotations

import argparse
import time

from thinkspec.llm import LLM
from thinkspec.sampling_params import SamplingParams
from thinkspec.toy.assets import DEMO_RELAX_RATIO, DEMO_RELAX_TOP_K, resolve_model_path
from thinkspec.toy.task import chat_prompt, generate_samples, grade


def run_demo(args: argparse.Namespace) -> int:
    ratio = DEMO_RELAX_RATIO if args.relax_ratio is None else args.relax_ratio
    top_k = DEMO_RELAX_TOP_K if args.relax_top_k is None else args.relax_top_k
    target = resolve_model_path("toy-reasoner")
    draft = resolve_model_path("toy-reasoner-draft")
    samples = generate_samples(args.num_problems, seed=args.seed)
    prompts = [chat_prompt(s.problem.question) for s in samples]
    base = {
        "model": draft,
        "num_speculative_tokens": args.num_speculative_tokens,
        "reasoning_parser": "qwen3",
    }
    modes = {
        "strict": base,
        f"relaxed (ratio {ratio}, top-k {top_k})": {
            **base,
            "relaxed_thinking": True,
            "relax_ratio": ratio,
            "relax_top_k": top_k,
        },
    }
    params = SamplingParams(temperature=0, max_tokens=512)
    rows = []
    example = None
    for name, spec in modes.items():
        llm = LLM(target, device=args.device, speculative_config=spec, max_num_seqs=64)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        correct = sum(grade(o.outputs[0].text, s.problem) for o, s in zip(outs, samples))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        m = llm.last_spec_metrics
        assert m is not None
        rows.append(
            (
                name,
                correct,
                m.mean_acceptance_length(),
                m.mean_acceptance_length("thinking"),
                tokens / seconds,
            )
        )
        if example is None:
            example = (samples[0], outs[0], name)
    device = llm.llm_engine.device
    print(f"\nthinkspec demo: toy reasoner pair on {device}, {len(prompts)} fresh problems per mode, "
          f"k={args.num_speculative_tokens}, greedy")  # fmt: skip
    print(f"{'mode':<34} {'accuracy':>9} {'accept len':>10} {'in thinking':>11} {'tokens/s':>9}")
    for name, correct, al, al_think, tps in rows:
        acc = f"{correct}/{len(prompts)}"
        print(f"{name:<34} {acc:>9} {al:>10.2f} {al_think:>11.2f} {tps:>9.0f}")
    assert example is not None
    sample, out, name = example
    completion = out.outputs[0]
    print(f"\nexample ({name}):\nQ: {sample.problem.question}")
    print(f"--- reasoning_content ---\n{(completion.reasoning_content or '').strip()}")
    print(f"--- content ---\n{(completion.content or '').strip()}")
    print(f"(expected answer: {sample.problem.answer})")
    return 0
