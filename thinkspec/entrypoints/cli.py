"""The `thinkspec` command: demo, generate, serve, bench, sweep.

Engine flags are spelled as vLLM spells them so a vLLM command line carries over.
Subcommand bodies import their heavy modules lazily; `thinkspec --help` needs only the stdlib.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from thinkspec.engine_args import add_engine_args, json_arg, resolve_model_arg
from thinkspec.toy.assets import DEMO_RELAX_RATIO, DEMO_RELAX_TOP_K

# What `thinkspec serve` imports beyond the core dependencies.
SERVER_MODULES = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic"}


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default unless its help already does or there is none worth showing
    (None, False, empty): engine flags default to None and name their default in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
        if "default" in text or unset:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are short (one usage line, then the error) and whose unknown
    flags are reported by the subcommand's parser with the closest known flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            parser = self._subparsers_by_name().get(command, self) if command else self
            parser.error(unrecognized_message(parser, extra))
        return parsed

    def _subparsers_by_name(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice is not None:  # a misspelled subcommand or choice
            close = difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def unrecognized_message(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """'unrecognized arguments: ...', with "did you mean" for each unknown flag close to a known one."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for word in extra:
        flag = word.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0]} (for {flag})?")
    return "; ".join([f"unrecognized arguments: {' '.join(extra)}", *hints])


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        default="toy",
        help="'toy' (the bundled task), a JSONL file with prompt and answer fields, or 'rg:TASK' "
        "(reasoning-gym, when installed) (default: %(default)s)",
    )
    p.add_argument(
        "--level",
        choices=("easy", "hard"),
        default="easy",
        help="difficulty of the toy problems: easy (2-4 numbers, totals up to 4 digits) or hard (more "
        "steps, larger numbers; see the toy reasoner's model card) (default: %(default)s)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="(default: %(default)s)")
    p.add_argument("--dataset-seed", type=int, default=20261201, help="problem generator seed (toy, rg)")
    p.add_argument(
        "--sampling-seed", type=int, default=0, help="request i samples with seed SAMPLING_SEED + i"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output token budget per request (default: the toy level's, which fits every answer: "
        "512 for easy; 512 for other datasets)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`thinkspec demo`: the bundled pair, strict vs relaxed."""
    demo = sub.add_parser(
        "demo",
        usage="%(prog)s [options]",
        help="answer fresh toy problems plainly and with strict and relaxed speculation on the bundled pair",
        description="Loads the bundled toy reasoner pair, answers a few fresh arithmetic problems with "
        "plain decoding, strict and relaxed speculative decoding, and prints accuracy, acceptance "
        "length and tokens/s per mode (progress on stderr).",
    )
    demo.add_argument("--num-problems", type=int, default=16, help="problems per mode (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=1234, help="problem generator seed (default: %(default)s)")
    demo.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    demo.add_argument("--num-speculative-tokens", type=int, default=4, help="draft length k")
    demo.add_argument(
        "--relax-ratio", type=float, default=None,
        help=f"relaxed mode's relax_ratio (default: {DEMO_RELAX_RATIO})",
    )  # fmt: skip
    demo.add_argument(
        "--relax-top-k", type=int, default=None,
        help=f"relaxed mode's relax_top_k (default: {DEMO_RELAX_TOP_K})",
    )  # fmt: skip


def _add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`thinkspec generate`: engine flags plus prompts and sampling settings."""
    gen = sub.add_parser(
        "generate",
        usage="%(prog)s [MODEL] [options]",
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
        "--chat-template-kwargs", type=json_arg, default=None, help="JSON passed to the chat template"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--max-tokens", type=int, default=256, help="output token budget per prompt")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`thinkspec serve`: engine flags plus the HTTP server's."""
    serve = sub.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]",
        help="run the OpenAI-compatible HTTP server",
        description="Serves /v1/chat/completions, /v1/completions and /v1/models (behind --api-key when "
        "given), /health and /metrics, on FastAPI + uvicorn (pip install 'thinkspec[server]'). "
        "See docs/SERVER.md.",
    )
    add_engine_args(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default: %(default)s, loopback only, unlike vLLM's every-interface default; "
        "0.0.0.0 listens on every interface)",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer API_KEY' on every /v1 route, /tokenize and /detokenize "
        "(401 otherwise); repeat for several keys. Default: $THINKSPEC_API_KEY, else $VLLM_API_KEY, "
        "else no key",
    )
    serve.add_argument(
        "--reasoning-field",
        default="both",
        choices=["both", "reasoning", "reasoning_content"],
        help="the key of reasoning text in chat messages and stream deltas (default: %(default)s)",
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
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds requests in flight may finish after SIGTERM/SIGINT; what is left then gets 503 "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated browser origins allowed by CORS, or '*' (default: none, no CORS)",
    )


def _add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`thinkspec bench`: engine and dataset flags for one setting."""
    bench = sub.add_parser(
        "bench",
        usage="%(prog)s [MODEL] [options]",
        help="measure one configuration on a dataset: accuracy, acceptance, speed",
        description="Runs a dataset through one engine configuration and reports accuracy with a 95% "
        "confidence interval, mean output length, truncation rate, acceptance length (overall, "
        "thinking, answer), per-position acceptance, relaxed-only share, tokens/s and latency.",
    )
    add_engine_args(bench)
    _add_dataset_args(bench)
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    bench.add_argument("--output-json", default=None, help="write the results here")
    _add_timing_args(bench)


def _add_timing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="timed runs of each cell, round-robin over the cells, after an untimed warm-up at the same "
        "batch and length (default: %(default)s); tok/s is their median",
    )  # fmt: skip


def _add_sweep_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`thinkspec sweep`: engine and dataset flags plus the grid, calibration and resume."""
    sweep = sub.add_parser(
        "sweep",
        usage="%(prog)s [MODEL] [options]",
        help="grid over relax_ratio x relax_top_k with no-spec and strict baselines, report and calibration",
        description="Runs the same prompts and seeds under no speculation, strict speculation and every "
        "relaxed setting of the grid, compares each cell's accuracy with strict (paired bootstrap CI, "
        "McNemar), and writes sweep.json, sweep.csv, pareto.png and report.md. See docs/SWEEP.md.",
    )
    add_engine_args(sweep)
    _add_dataset_args(sweep)
    sweep.add_argument("--relax-ratios", default="0.1,0.3,0.5", help="comma-separated (default: %(default)s)")
    sweep.add_argument("--relax-top-ks", default="2,4", help="comma-separated (default: %(default)s)")
    sweep.add_argument("--relax-deltas", default="", help="comma-separated; empty = relax_delta unset")
    sweep.add_argument(
        "--extra-settings", default="",
        help="cells beside the ratio x top-k x delta grid: comma-separated ratio:top_k[:delta] "
        "(e.g. 0.1:8:0.2), lenient:lambda or typical:threshold:alpha",
    )  # fmt: skip
    sweep.add_argument(
        "--relax-lambdas", default="",
        help="lenient cells (relax_rule lenient), comma-separated lambdas in (0, 1], e.g. 0.9,0.7,0.5",
    )  # fmt: skip
    sweep.add_argument(
        "--typical-settings", default="",
        help="typical cells, comma-separated posterior_threshold:posterior_alpha pairs, e.g. 0.09:0.3",
    )  # fmt: skip
    sweep.add_argument("--temperatures", default="0", help="comma-separated (default: %(default)s)")
    sweep.add_argument("--output-dir", default="sweep-out", help="where the results and report go")
    sweep.add_argument("--skip-no-spec", action="store_true", help="leave out the no-speculation baseline")
    _add_timing_args(sweep)
    sweep.add_argument(
        "--batch-sizes", default="all",
        help="comma-separated caps on the requests in flight, each its own set of cells, 'all' = every "
        "request at once (default: %(default)s), e.g. 1,16,64,all",
    )  # fmt: skip
    sweep.add_argument(
        "--accuracy-budget",
        type=float,
        default=None,
        help="pick the fastest setting whose accuracy drop against strict stays within this (e.g. 0.01) "
        "at 95%% confidence, and print its speculative config JSON",
    )
    sweep.add_argument(
        "--calibrate-by",
        default="tokens_per_s",
        choices=["tokens_per_s", "acceptance_length"],
        help="what 'fastest' means; acceptance_length is steadier where timing is noisy (CPU)",
    )
    sweep.add_argument(
        "--hf-baseline-prompts",
        type=int,
        default=0,
        help="also run HF transformers generate and assisted generation (batch 1, greedy) on this many "
        "of the prompts (default: %(default)s = off)",
    )
    sweep.add_argument(
        "--resume",
        action="store_true",
        help="keep the cells already in OUTPUT_DIR (sweep.partial.json of an interrupted run, else "
        "sweep.json) and run only the missing ones, e.g. a second temperature",
    )
    sweep.add_argument("--no-plot", action="store_true", help="skip pareto.png (no matplotlib needed)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="thinkspec",
        description="Speculative decoding for reasoning models with relaxed acceptance while thinking.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo_parser(sub)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    _add_sweep_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "demo":
        try:
            resolve_model_arg(args)
        except ValueError as e:
            parser.error(str(e))
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
    if args.command == "bench":
        from thinkspec.bench.bench import run_bench_command

        return run_bench_command(args)
    if args.command == "sweep":
        from thinkspec.bench.sweep import run_sweep_command

        return run_sweep_command(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
