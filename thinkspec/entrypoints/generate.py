"""`thinkspec generate`: run prompts through LLM.generate / LLM.chat and print reasoning and answer apart."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thinkspec.engine_args import engine_kwargs
from thinkspec.outputs import RequestOutput

if TYPE_CHECKING:
    from thinkspec.spec_decode.metrics import SpecDecodeMetrics


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        prompts.extend(line for line in lines if line.strip())
    return prompts


def _record(prompt: str, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    spec = out.metrics.spec_decode if out.metrics is not None else None
    if spec is not None and hasattr(spec, "to_dict"):
        spec = spec.to_dict()
    return {
        "prompt": prompt,
        "text": c.text,
        "reasoning_content": c.reasoning_content,
        "content": c.content,
        "finish_reason": c.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(c.token_ids),
        "spec_decode": spec,
        "error": out.error,
    }


def _print_text(index: int, record: dict[str, Any], split: bool) -> None:
    print(f"=== [{index}] {record['prompt']!r}")
    if record["error"] is not None:
        print(f"error: {record['error']}")
        return
    if split:
        print("--- reasoning")
        print(record["reasoning_content"] or "")
        print("--- answer")
        print(record["content"] or "")
    else:
        print(record["text"])
    print(
        f"--- finish_reason={record['finish_reason']} prompt_tokens={record['num_prompt_tokens']} "
        f"output_tokens={record['num_output_tokens']}"
    )


def format_spec_stats(metrics: SpecDecodeMetrics) -> str:
    """The speculative-decoding statistics of one call as one compact block (three lines)."""
    t, think, answer = metrics.total, metrics.thinking, metrics.answer
    per_pos = " ".join(f"{r:.2f}" for r in t.acceptance_rate_per_pos) or "-"
    return (
        f"speculative decoding: {t.num_drafts} verify rounds, {t.num_draft_tokens} drafted, "
        f"{t.num_accepted_tokens} accepted ({t.num_relaxed_accepted_tokens} relaxed-only), "
        f"{t.num_emitted_tokens} emitted\n"
        f"  mean acceptance length {t.mean_acceptance_length:.2f} (thinking "
        f"{think.mean_acceptance_length:.2f}, answer {answer.mean_acceptance_length:.2f}); "
        f"draft acceptance rate {t.draft_acceptance_rate:.3f}\n"
        f"  acceptance rate per draft position: {per_pos}"
    )


def build_llm(args: argparse.Namespace) -> Any:
    """An LLM from the engine flags; ValueError for flags this engine cannot honour."""
    from thinkspec.llm import LLM

    return LLM(**engine_kwargs(args))


def run_generate(args: argparse.Namespace) -> int:
    from thinkspec.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    if not prompts:
        print("thinkspec generate: error: give at least one --prompt or a --prompts-file", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
        )
        llm = build_llm(args)
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(
                conversations, params, chat_template_kwargs=args.chat_template_kwargs, use_tqdm=False
            )
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, OSError) as e:
        print(f"thinkspec generate: error: {e}", file=sys.stderr)
        return 2
    split = llm.llm_engine.reasoning is not None
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        record = _record(prompt, out)
        if args.json:
            print(json.dumps(record, ensure_ascii=False))
        else:
            _print_text(i, record, split)
    if llm.last_spec_metrics is not None and not llm.engine_args.disable_log_stats:
        sys.stdout.flush()  # the block follows the outputs on a terminal that shows both streams
        print(format_spec_stats(llm.last_spec_metrics), file=sys.stderr)
    return 1 if any(out.error is not None for out in outputs) else 0
