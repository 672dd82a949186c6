"""benchmarks/toy/toy_plain_overhead.py runs on CPU: its engines differ as its docstring says."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest
from script_env import ENV, ROOT

from thinkspec import SamplingParams


def _run(*extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "benchmarks/toy/toy_plain_overhead.py", "--device", "cpu", "--max-tokens", "6",
           "--repeats", "2", "--warmups", "1", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_toy_plain_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    modes = ",".join(("plain", "adaptive", "adaptive-fresh-pass", "adaptive-no-bookkeeping",
                      "adaptive-plain-only", "adaptive-no-speculator"))  # fmt: skip
    proc = _run("--batch-sizes", "1,2", "--modes", modes, "--engine-args", '{"async_scheduling": true}',
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["mode"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [(m, b) for b in (1, 2) for m in modes.split(",")]
    for (mode, _), r in rows.items():
        assert len(r["reps"]) == 2 and r["min"] <= r["tok_per_s"] <= r["max"]
        if mode not in ("adaptive", "adaptive-fresh-pass"):  # the chooser may draft on CPU; these never do
            assert r["drafts_per_run"] == [0, 0]
    assert rows[("plain", 1)]["over_plain"] == 1.0
    table = proc.stdout.splitlines()[-len(rows) :]  # the table comes last, a line per cell
    assert [line.split()[2] for line in table] == [m for m, _ in rows]


def test_toy_plain_overhead_checks_its_modes():
    proc = _run("--modes", "adaptive")  # no plain anchor
    assert proc.returncode == 2 and "--modes" in proc.stderr
    proc = _run("--modes", "plain,adaptive-no-bookkeeping", "--batch-sizes", "1")  # CPU without async
    assert proc.returncode != 0 and "needs async scheduling" in proc.stderr


def _build(mode: str, engine_args: str = "{}"):
    """The benchmark's engine of one mode, on CPU (the script imported as a module)."""
    path = ROOT / "benchmarks" / "toy" / "toy_plain_overhead.py"
    spec = importlib.util.spec_from_file_location("toy_plain_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(device="cpu", batch_sizes=[1], engine_args=engine_args, k_max=4)
    return bench.build(mode, args)


def test_toy_plain_overhead_fresh_pass_turns_the_streaks_off():
    assert _build("adaptive").llm_engine.speculator.planner.reuse_streaks
    assert not _build("adaptive-fresh-pass").llm_engine.speculator.planner.reuse_streaks


@pytest.mark.parametrize(
    ("mode", "draft_prompt_forwards"), [("adaptive-no-bookkeeping", 1), ("adaptive-plain-only", 0)]
)
def test_toy_plain_overhead_stubs_the_plain_steps_only_where_it_says(mode, draft_prompt_forwards):
    """adaptive-no-bookkeeping sends a prefill through the speculator (the draft model's prompt forward
    runs), adaptive-plain-only does not; neither makes a choice for a plain decode step."""
    llm = _build(mode, '{"async_scheduling": true}')
    speculator = llm.llm_engine.speculator
    calls = {"choose": 0, "draft": 0}
    choose, execute = speculator.planner._choose, speculator.draft_runner.execute_model

    def counting(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    speculator.planner._choose = counting("choose", choose)
    speculator.draft_runner.execute_model = counting("draft", execute)
    out = llm.generate(["Q: 2+3=?"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 1
    assert calls == {"choose": draft_prompt_forwards, "draft": draft_prompt_forwards}
