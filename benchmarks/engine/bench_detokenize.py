"""Incremental detokenization per token, side by side on one CPU: the window decode (two Rust decodes
of a few tokens) against one tokenizers.decoders.DecodeStream step (thinkspec.engine.detokenizer).

The text is toy task samples tokenized by the given tokenizer (the toy reasoner's by default); both
paths must produce the same text. Each figure is the best of --repeats runs, interleaved.

Usage: python benchmarks/engine/bench_detokenize.py [--tokenizer PATH] [--num-tokens 20000] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from thinkspec.engine.detokenizer import (
    IncrementalDetokenizer,
    detokenize_incrementally,
    initial_detokenize_offsets,
)

PROMPT_TOKENS = 100


def window_path(tok, prompt: list[int], output: list[int]) -> str:
    ids, acc = list(prompt), []
    prefix, read = initial_detokenize_offsets(len(prompt))
    for t in output:
        ids.append(t)
        delta, prefix, read = detokenize_incrementally(tok, ids, prefix, read, True)
        acc.append(delta)
    return "".join(acc)


def stream_path(tok, prompt: list[int], output: list[int]) -> str:
    ids, acc = list(prompt), []
    detok = IncrementalDetokenizer(tok, prompt, True)
    assert detok.stream is not None, "this tokenizer does not take the DecodeStream path"
    for t in output:
        ids.append(t)
        acc.append(detok.step(ids))
    return "".join(acc)


def run(tokenizer: str, num_tokens: int, repeats: int) -> dict[str, float]:
    """Microseconds per output token of each path (best of `repeats`)."""
    from transformers import AutoTokenizer

    from thinkspec.model_names import resolve_model_name
    from thinkspec.toy.task import generate_samples

    tok = AutoTokenizer.from_pretrained(resolve_model_name(tokenizer))
    ids: list[int] = []
    seed = 0
    while len(ids) < PROMPT_TOKENS + num_tokens:
        text = " ".join(s.text for s in generate_samples(100, seed=seed))
        ids += tok.encode(text, add_special_tokens=False)
        seed += 1
    prompt, output = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : PROMPT_TOKENS + num_tokens]
    paths: dict[str, Callable[..., str]] = {"window": window_path, "stream": stream_path}
    texts = {name: f(tok, prompt, output) for name, f in paths.items()}
    assert texts["window"] == texts["stream"], "the two paths disagree"
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, f in paths.items():
            start = time.perf_counter()
            f(tok, prompt, output)
            best[name] = min(best[name], time.perf_counter() - start)
    return {f"{name}_us_per_token": 1e6 * s / num_tokens for name, s in best.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="toy-reasoner", help="a tokenizer folder, or toy-reasoner")
    p.add_argument("--num-tokens", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    result = run(args.tokenizer, args.num_tokens, args.repeats)
    result["speedup"] = result["window_us_per_token"] / result["stream_us_per_token"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
