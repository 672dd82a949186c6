"""Every command and Python example of README.md, run as written against the bundled toy pair.

The code blocks are read from README.md itself, so a changed example is what gets run: the
checkpoint paths the Python example names (path/to/Qwen3-8B, ...) become the toy pair, and the
long-running commands get flags appended that shrink them (argparse keeps a flag's last value).
A README command that no test here knows fails `test_every_command_is_run`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from server_process import serve_process

from thinkspec.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# The README's checkpoint folders, and what runs in their place.
CHECKPOINTS = {"path/to/Qwen3-8B": "toy-reasoner", "path/to/Qwen3-0.6B": "toy-reasoner-draft"}


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def commands() -> list[list[str]]:
    """Each shell command of the README's bash blocks as argv (continuations and quoted newlines
    joined, comments dropped)."""
    found = []
    for block in code_blocks("bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if argv:
                found.append(argv)
            pending = ""
        assert pending == "", f"unterminated command in README.md: {pending!r}"
    return found


def command(*head: str) -> list[str]:
    matches = [argv for argv in commands() if tuple(argv[: len(head)]) == head]
    assert len(matches) == 1, f"README.md has {len(matches)} commands starting {head}"
    return matches[0]


def python_examples() -> list[str]:
    blocks = code_blocks("python")
    assert len(blocks) == 2, "README.md's Python examples changed: update this test"
    return blocks


def test_every_command_is_run():
    heads = sorted(tuple(argv[:2]) for argv in commands())
    assert heads == [("make", "demo"), ("make", "test"), ("thinkspec", "generate"),
                     ("thinkspec", "serve"), ("thinkspec", "sweep")]  # fmt: skip


@pytest.mark.parametrize(("target", "runs"), [("demo", "/thinkspec demo"), ("test", " -m pytest")])
def test_make_targets(target, runs):
    """`make demo` / `make test` exist and run what the README says (dry run: `make test` here
    would recurse, and test_demo.py runs the demo at a reduced size)."""
    assert command("make", target) == ["make", target]
    # --no-print-directory: under `make test` this make is nested and would end with "Leaving directory"
    dry = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert runs in dry.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def llm_example() -> tuple[dict, str]:
    """The README's LLM example run once (the toy pair for its checkpoints): its namespace and output."""
    import contextlib
    import io

    code = python_examples()[0]
    for path, toy in CHECKPOINTS.items():
        assert f'"{path}"' in code, f"the LLM example no longer names {path}"
        code = code.replace(f'"{path}"', f'"{toy}"')
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    return namespace, printed.getvalue()


def test_llm_example(llm_example):
    namespace, printed = llm_example
    out = namespace["out"][0].outputs[0]
    assert out.reasoning_content and out.content and "**Answer:**" in out.content
    assert printed.startswith(out.reasoning_content)
    metrics = namespace["llm"].last_spec_metrics
    assert metrics is not None and metrics.total.num_drafts > 0
    assert str(metrics.to_dict()) in printed


def test_off_task_question_is_all_reasoning_as_the_readme_says():
    """The README: other questions may end without `</think>` ("What is 37 + 48?" does, greedy
    without relaxation); then all of the output, its **Answer:** line included, is
    reasoning_content and content is None. Strict speculation decodes as plain greedy does."""
    from thinkspec import LLM, SamplingParams

    found = re.search(r'\("(What is [^"]+\?)" does, decoded greedily', " ".join(README.split()))
    assert found is not None, "README.md no longer gives the off-task example"
    spec = {"model": "toy-reasoner-draft", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=512)
    conversation = [{"role": "user", "content": found[1]}]
    texts = []
    for speculative_config in (None, spec):
        llm = LLM("toy-reasoner", reasoning_parser="qwen3", speculative_config=speculative_config)
        out = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) > 0
        assert "</think>" not in out.text and out.content is None
        assert "**Answer:**" in out.reasoning_content and out.reasoning_content.strip() == out.text.strip()
        texts.append(out.text)
    assert texts[0] == texts[1]


def test_generate_command(capfd):
    argv = command("thinkspec", "generate")
    assert main(argv[1:]) == 0
    captured = capfd.readouterr()
    answer = captured.out.split("--- answer\n", 1)[1]
    assert "--- reasoning\n" in captured.out and "**Answer:** 42" in answer  # 12 + 30
    assert "speculative decoding:" in captured.err and "mean acceptance length" in captured.err


def test_serve_command_and_openai_client():
    argv = command("thinkspec", "serve")
    with serve_process(*argv[2:]) as (proc, url, log):
        code = python_examples()[1]
        assert '"http://127.0.0.1:8000/v1"' in code, "the client example no longer names the default port"
        namespace: dict = {}
        exec(compile(code.replace("http://127.0.0.1:8000/v1", f"{url}/v1"), "README.md", "exec"), namespace)
        message = namespace["resp"].choices[0].message
        assert message.reasoning_content and "**Answer:** 42" in message.content


def test_sweep_command(tmp_path, capsys):
    argv = command("thinkspec", "sweep")
    shrink = ["--num-prompts", "2", "--max-tokens", "16", "--repeats", "1", "--relax-ratios", "0.1",
              "--relax-top-ks", "8", "--output-dir", str(tmp_path), "--no-plot", "--no-progress"]  # fmt: skip
    assert main([*argv[1:], *shrink]) == 0
    assert (tmp_path / "sweep.json").is_file() and (tmp_path / "report.md").is_file()
    printed = capsys.readouterr().out
    assert "calibrated (temperature 0, budget 0.01" in printed  # --accuracy-budget's pick
    chosen = json.loads(printed.splitlines()[-1])  # the speculative config to use
    assert chosen["method"] == "draft_model" and chosen["num_speculative_tokens"] >= 1
