"""The `thinkspec` command: help texts, dispatch of every subcommand, a tiny `bench` run, imports without
server packages, `generate`, `serve` refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from checkpoints import tiny_checkpoint

from thinkspec.entrypoints.cli import build_parser, main

SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "prometheus_client")


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_subcommands(capsys):
    text = help_text(capsys)
    for command in ("demo", "generate", "serve", "bench", "sweep"):
        assert command in text


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "sweep"])
def test_engine_flags_spelled_as_vllm(capsys, command):
    text = help_text(capsys, command)
    for flag in (
        "--speculative-config",
        "--reasoning-parser",
        "--max-model-len",
        "--dtype",
        "--gpu-memory-utilization",
        "--async-scheduling",
    ):
        assert flag in text


def test_engine_flags_reach_the_llm_arguments():
    from thinkspec.engine_args import engine_kwargs

    def kwargs(*flags: str) -> dict:
        return engine_kwargs(build_parser().parse_args(["generate", "toy-reasoner", *flags]))

    assert "async_scheduling" not in kwargs() and "enforce_eager" not in kwargs()  # the LLM defaults
    assert kwargs("--async-scheduling")["async_scheduling"] is True
    assert kwargs("--no-async-scheduling")["async_scheduling"] is False
    assert kwargs("--enforce-eager")["enforce_eager"] is True


def test_serve_help_documents_server_flags(capsys):
    text = help_text(capsys, "serve")
    for flag in ("--host", "--port", "--api-key", "--max-tokens-limit", "--max-request-bytes"):
        assert flag in text
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None  # safe by default


def test_bad_speculative_config_json_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--speculative-config", "{not json"])
    assert exit_info.value.code == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_and_engine_loop_import_without_server_packages():
    code = (
        "import sys\n"
        "import thinkspec.entrypoints.cli, thinkspec.entrypoints.generate\n"
        "import thinkspec.entrypoints.async_engine\n"
        f"loaded = [m for m in {SERVER_PACKAGES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_without_fastapi_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    for name in list(sys.modules):
        if name.startswith("thinkspec.entrypoints.openai."):
            monkeypatch.delitem(sys.modules, name)
    assert main(["serve", "some-model"]) == 1
    err = capsys.readouterr().err
    assert "fastapi" in err and "pip install 'thinkspec[server]'" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
        (["--max-tokens-limit", "0"], "--max-tokens-limit must be >= 1"),
    ],
)
def test_serve_rejects_bad_server_flags_before_loading(capsys, flags, message):
    assert main(["serve", "/nonexistent/model", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_reports_a_missing_model(capsys):
    assert main(["serve", "/nonexistent/model", "--device", "cpu"]) == 2
    assert "thinkspec serve: error:" in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading(capsys, monkeypatch):
    import socket
    import time

    import thinkspec.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded though the port is taken")

    monkeypatch.setattr(thinkspec.llm, "build_llm_engine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "toy-reasoner", "--device", "cpu", "--port", str(port)]) == 2
        assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_serve_holds_its_port_from_before_loading(capsys, monkeypatch):
    """The port is bound before the model loads and the same socket is what uvicorn serves on."""
    import socket

    import thinkspec.llm

    seen = {}

    def probe(*args, **kwargs):
        with socket.socket() as other, pytest.raises(OSError):
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", seen["port"]))
        seen["probed"] = True
        raise ValueError("stop here")

    from thinkspec.entrypoints.openai import server

    real = server.listen_socket

    def listen(host, port):
        sock = real(host, port)
        seen["port"] = sock.getsockname()[1]
        return sock

    monkeypatch.setattr(thinkspec.llm, "build_llm_engine", probe)
    monkeypatch.setattr(server, "listen_socket", listen)
    assert main(["serve", "toy-reasoner", "--device", "cpu", "--port", "0"]) == 2
    assert seen.get("probed") and "stop here" in capsys.readouterr().err
    with socket.socket() as again:  # released after the failure
        again.bind(("127.0.0.1", seen["port"]))


def test_serve_logs_the_speculation_settings(caplog):
    import logging
    from types import SimpleNamespace

    from thinkspec.config import SpeculativeConfig
    from thinkspec.entrypoints.openai.server import _log_speculation

    spec = SpeculativeConfig.parse({"model": "toy-reasoner-draft", "num_speculative_tokens": 4})
    with caplog.at_level(logging.INFO, logger="thinkspec"):
        _log_speculation(SimpleNamespace(speculative_config=spec))
        _log_speculation(SimpleNamespace(speculative_config=None))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("speculative decoding: {") and json.loads(lines[0].split(": ", 1)[1]) == {
        "method": "draft_model", "model": "toy-reasoner-draft", "num_speculative_tokens": 4
    }
    assert lines[1] == "speculative decoding: off"


@pytest.fixture(scope="module")
def ckpt():
    return str(tiny_checkpoint("qwen3", tied=True))


def test_generate_json_matches_llm_chat(capsys, ckpt):
    from thinkspec.llm import LLM
    from thinkspec.sampling_params import SamplingParams

    prompts = ["q30", "q45"]
    argv = ["generate", ckpt, "--device", "cpu", "--reasoning-parser", "qwen3", "--chat", "--json"]
    argv += ["--max-tokens", "12", *(x for p in prompts for x in ("--prompt", p))]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(ckpt, device="cpu", reasoning_parser="qwen3")
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0, max_tokens=12)
    )
    assert [r["prompt"] for r in records] == prompts
    for record, out in zip(records, outs):
        c = out.outputs[0]
        assert (record["text"], record["reasoning_content"], record["content"]) == (
            c.text,
            c.reasoning_content,
            c.content,
        )
        assert record["num_output_tokens"] == len(c.token_ids) <= 12
        assert record["finish_reason"] == c.finish_reason and record["error"] is None
    assert any(r["reasoning_content"] for r in records)  # qwen3 output starts in reasoning


def test_generate_prints_spec_stats_unless_disabled(capsys, ckpt):
    spec = json.dumps({"model": ckpt, "num_speculative_tokens": 2})  # the target drafts for itself
    argv = ["generate", ckpt, "--device", "cpu", "--prompt", "q30 q30 q30", "--max-tokens", "8",
            "--speculative-config", spec]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    block = [line for line in captured.err.splitlines() if line.strip()]
    assert len(block) == 3, captured.err
    counts = re.match(r"speculative decoding: (\d+) verify rounds, (\d+) drafted, (\d+) accepted", block[0])
    assert counts is not None and int(counts[1]) >= 1 and int(counts[2]) >= 1, block[0]
    assert int(counts[3]) == int(counts[2])  # a draft equal to the target: every draft accepted
    assert block[1].startswith("  mean acceptance length ") and "thinking" in block[1]
    assert "speculative decoding" not in captured.out and "--- finish_reason=" in captured.out
    assert main([*argv, "--disable-log-stats"]) == 0
    captured = capsys.readouterr()
    assert "speculative decoding" not in captured.err and "--- finish_reason=" in captured.out


def test_generate_text_output_and_prompts_file(capsys, ckpt, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("q30\n\nhello\n", encoding="utf-8")
    argv = [
        "generate",
        ckpt,
        "--device",
        "cpu",
        "--reasoning-parser",
        "qwen3",
        "--prompts-file",
        str(prompts_file),
    ]
    assert main([*argv, "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== [") == 2 and "'q30'" in out and "'hello'" in out
    assert out.count("--- reasoning") == 2 and out.count("--- answer") == 2
    assert "output_tokens=6" in out


def test_generate_refusals(capsys, ckpt):
    assert main(["generate", ckpt, "--device", "cpu"]) == 2
    assert "at least one --prompt" in capsys.readouterr().err
    assert main(["generate", ckpt, "--device", "cpu", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    # a prompt longer than max_model_len fails alone, with exit status 1
    argv = ["generate", ckpt, "--device", "cpu", "--max-model-len", "32", "--max-tokens", "4"]
    assert main([*argv, "--prompt", "x" * 64, "--prompt", "ok"]) == 1
    out = capsys.readouterr().out
    assert "error:" in out and "output_tokens=" in out


RUN_FUNCTIONS = {
    "demo": ("thinkspec.entrypoints.demo", "run_demo"),
    "generate": ("thinkspec.entrypoints.generate", "run_generate"),
    "serve": ("thinkspec.entrypoints.openai.server", "run_server"),
    "bench": ("thinkspec.bench.bench", "run_bench_command"),
    "sweep": ("thinkspec.bench.sweep", "run_sweep_command"),
}


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["demo", "--num-problems", "3"], {"num_problems": 3}),
        (["generate", "m", "--prompt", "hi", "--max-tokens", "5"], {"model": "m", "max_tokens": 5}),
        (["serve", "m", "--port", "8123"], {"model": "m", "port": 8123}),
        (["bench", "m", "--num-prompts", "4", "--max-tokens", "9"], {"num_prompts": 4, "max_tokens": 9}),
        (["sweep", "m", "--relax-ratios", "0.2", "--max-tokens", "7"], {"model": "m", "max_tokens": 7}),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else "",
)
def test_each_subcommand_runs_its_own_function(monkeypatch, argv, parsed):
    # Every run function is replaced by a recorder: the command must reach its own, with its flags
    # parsed, and return what it returns.
    import importlib

    calls = []
    for command, (module, name) in RUN_FUNCTIONS.items():
        recorder = lambda args, command=command: calls.append((command, args)) or 7  # noqa: E731
        monkeypatch.setattr(importlib.import_module(module), name, recorder)
    assert main(argv) == 7
    assert [command for command, _ in calls] == [argv[0]]
    args = calls[0][1]
    assert args.command == argv[0]
    assert {key: getattr(args, key) for key in parsed} == parsed


def test_bench_runs_on_a_tiny_checkpoint(capsys, ckpt, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", ckpt, "--device", "cpu", "--num-prompts", "2", "--max-tokens", "4", "--no-progress"]
    assert main([*argv, "--output-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "acc" in table and "tok/s" in table
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_prompts"] == 2 and summary["mode"] == "no_spec"
    assert json.loads(out.read_text())["config"]["level"] == "easy"
    hard = tmp_path / "hard.json"
    assert main([*argv[:-1], "--level", "hard", "--output-json", str(hard), "--no-progress"]) == 0
    assert json.loads(hard.read_text())["config"]["level"] == "hard"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--relax-ratios", "0.1,x"], "--relax-ratios must be comma-separated numbers"),
        (["--relax-top-ks", "0"], "relax_top_k"),
        (["--accuracy-budget", "2"], "--accuracy-budget must be in [0, 1]"),
        (["--hf-baseline-prompts", "-1"], "--hf-baseline-prompts must be >= 0"),
        (["--dataset", "/nonexistent.jsonl"], "dataset must be"),
        (["--temperatures", "0,-1"], "temperature must be"),
        (["--max-tokens", "0"], "max_tokens must be"),
        (["--extra-settings", "0.1"], "--extra-settings takes ratio:top_k[:delta] items, got '0.1'"),
        (["--extra-settings", "0.1:8:x"], "--extra-settings takes ratio:top_k[:delta]"),
        (["--extra-settings", "0.1:8:2"], "relax_delta"),
        (["--level", "hard", "--dataset", "/nonexistent.jsonl"], "--level applies to the toy dataset only"),
    ],
)
def test_sweep_rejects_bad_flags_before_loading(capsys, tmp_path, flags, message):
    assert main(["sweep", "--device", "cpu", "--output-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert "thinkspec sweep: error:" in err and message in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_misspelled_flag_or_command_gets_a_suggestion(capsys):
    err = usage_error(capsys, "generate", "--prompt", "hi", "--max-tokns", "5")
    assert err.startswith("usage: thinkspec generate ")  # the subcommand's usage, not the top level's
    assert "unrecognized arguments: --max-tokns" in err and "did you mean --max-tokens" in err
    err = usage_error(capsys, "sweep", "--output-dri=x")
    assert "did you mean --output-dir" in err
    assert "did you mean 'generate'" in usage_error(capsys, "genrate")
    assert "did you mean" not in usage_error(capsys, "demo", "--zzzzzz")


def test_bad_json_error_is_short(capsys):
    err = usage_error(capsys, "generate", "--speculative-config", '{"model": x}')
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0] == "usage: thinkspec generate [MODEL] [options]"
    assert lines[1].startswith("thinkspec generate: error: argument --speculative-config: not valid JSON")


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("generate", ["--top-p", "--top-k", "--max-tokens", "--temperature"]),
        ("sweep", ["--output-dir", "--dataset-seed", "--sampling-seed", "--num-prompts"]),
        ("demo", ["--num-speculative-tokens", "--relax-ratio", "--relax-top-k", "--device", "--seed"]),
    ],
)
def test_help_shows_defaults(capsys, command, flags):
    text = help_text(capsys, command)
    entries = re.split(r"\n  (?=-)", text)  # one entry per flag, its help lines joined
    for flag in flags:
        entry = next(e for e in entries if e.startswith(flag + " "))
        assert re.search(r"\(default:\s+\S", entry), entry


def test_help_lists_own_flags_before_engine_flags(capsys):
    for command, own in (("generate", "--prompt "), ("serve", "--port "), ("bench", "--output-json "),
                         ("sweep", "--relax-ratios ")):  # fmt: skip
        text = help_text(capsys, command)
        assert text.index(own) < text.index("\nengine arguments:") < text.index("--speculative-config ")
        assert text.startswith(f"usage: thinkspec {command} [MODEL] [options]\n")
    bench = help_text(capsys, "bench")
    assert "95% confidence" in bench and "%%" not in bench
