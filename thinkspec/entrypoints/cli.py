"""The `thinkspec` command: demo, generate, serve, bench, sweep.

Engine flags are spelled as vLLM spells them so a vLLM command line carries over.
Subcommand bodies import their heavy modules lazily; `thinkspec --help` needs only the stdlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_TOY = "toy-reasoner"
# What `thinkspec serve` imports beyond the core dependencies.
SERVER_MODULES = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic"}


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at char {e.pos}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """Flags that build an `LLM` / engine, named as in vLLM."""
    if model_positional:
        p.add_argument(
            "model",
            nargs="?",
            default=DEFAULT_TOY,
            help="Hugging Face checkpoint folder or hub id; 'toy-reasoner' = the bundled toy pair's target "
            "(default: %(default)s)",
        )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"],
        help="weight and activation dtype; auto = the checkpoint's dtype on GPU, float32 on CPU",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit (prompt + output)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one forward (chunked prefill)",
    )
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory the engine may use, weights and KV cache together (GPU only)",
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV-cache size in bytes (CPU)")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV blocks of shared prompt prefixes",
    )
    p.add_argument("--seed", type=int, default=None, help="engine random seed")
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="split outputs into reasoning_content and content, and find the thinking phase",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_arg,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "draft_model", "model": "PATH", '
        '"num_speculative_tokens": 4, "relaxed_thinking": true, "relax_ratio": 0.3, '
        '"relax_top_k": 3}\'',
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from parsed engine flags; unset flags keep the LLM defaults."""
    from thinkspec.toy.assets import resolve_model_path

    names = [
        "tokenizer",
        "dtype",
        "device",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "gpu_memory_utilization",
        "kv_cache_memory",
        "enable_prefix_caching",
        "seed",
        "reasoning_parser",
        "speculative_config",
    ]
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    kwargs["model"] = resolve_model_path(args.model)
    spec = kwargs.get("speculative_config")
    if spec is not None and isinstance(spec.get("model"), str):
        spec["model"] = resolve_model_path(spec["model"])
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thinkspec",
        description="Speculative decoding for reasoning models with relaxed acceptance while thinking.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="answer fresh toy problems with strict and relaxed speculative decoding on the bundled pair",
        description="Loads the bundled toy reasoner pair, answers a few fresh arithmetic problems with "
        "strict and with relaxed speculative decoding, and prints accuracy, acceptance length and "
        "tokens/s per mode.",
    )
    demo.add_argument("--num-problems", type=int, default=16, help="problems per mode (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=1234, help="problem generator seed (default: %(default)s)")
    demo.add_argument("--device", default="auto", help="cuda, cpu or auto")
    demo.add_argument("--num-speculative-tokens", type=int, default=4, help="draft length k")
    demo.add_argument("--relax-ratio", type=float, default=None, help="relaxed mode's relax_ratio")
    demo.add_argument("--relax-top-k", type=int, default=None, help="relaxed mode's relax_top_k")

    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts given on the command line or in a file",
        description="Runs prompts through the engine and prints reasoning and answer apart.",
    )
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message via the chat template"
    )
    gen.add_argument(
        "--chat-template-kwargs", type=_json_arg, default=None, help="JSON passed to the chat template"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serves /v1/chat/completions, /v1/completions and /v1/models (behind --api-key when "
        "given), /health and /metrics, on FastAPI + uvicorn (pip install 'thinkspec[server]'). "
        "See docs/SERVER.md.",
    )
    add_engine_args(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address; loopback only by default, 0.0.0.0 listens on every interface",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer API_KEY' on every /v1 route (401 otherwise); default: no key",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model name of /v1/models and responses (default: MODEL)"
    )
    serve.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask (400 above), also the default max_tokens "
        "(default: max_model_len)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger ones get 413 (default: %(default)s)",
    )

    bench = sub.add_parser(
        "bench",
        help="(not implemented yet) measure one configuration on a dataset: accuracy, acceptance, speed",
        description="NOT IMPLEMENTED YET: exits with status 2. Planned: run a dataset through one "
        "engine configuration and report accuracy with a 95%% confidence interval, acceptance lengths "
        "per phase and throughput. Today, benchmarks/toy_quality.py measures the toy reasoner.",
    )
    add_engine_args(bench)
    bench.add_argument("--dataset", default="toy", help="'toy' or a JSONL file with prompt and answer fields")
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--max-tokens", type=int, default=512)
    bench.add_argument("--output-json", default=None, help="write the results here")

    sweep = sub.add_parser(
        "sweep",
        help="(not implemented yet) grid over relax_ratio x relax_top_k with no-spec and strict baselines",
        description="NOT IMPLEMENTED YET: exits with status 2. Planned: run the same prompts under "
        "every relaxed setting and both baselines, test each cell's accuracy against strict, and "
        "write JSON, CSV, a Pareto plot and a markdown report.",
    )
    add_engine_args(sweep)
    sweep.add_argument("--dataset", default="toy")
    sweep.add_argument("--num-prompts", type=int, default=100)
    sweep.add_argument("--relax-ratios", default="0.1,0.3,0.5")
    sweep.add_argument("--relax-top-ks", default="2,4")
    sweep.add_argument("--output-dir", default="sweep-out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from thinkspec.entrypoints.demo import run_demo

        return run_demo(args)
    if args.command == "generate":
        from thinkspec.entrypoints.generate import run_generate

        return run_generate(args)
    if args.command == "serve":
        try:
            from thinkspec.entrypoints.openai.server import run_server
        except ModuleNotFoundError as e:
            if e.name not in SERVER_MODULES:
                raise
            print(
                f"thinkspec serve needs {e.name}, which is not installed: pip install 'thinkspec[server]'",
                file=sys.stderr,
            )
            return 1
        return run_server(args)
    if args.command in ("bench", "sweep"):
        print(
            f"thinkspec {args.command} is not implemented yet; benchmarks/toy_quality.py measures "
            "accuracy and acceptance of the toy reasoner in the meantime",
            file=sys.stderr,
        )
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
