"""benchmarks/toy_plain_overhead.py runs on CPU: its engines differ as its docstring says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from script_env import ENV, ROOT


def _run(*extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "benchmarks/toy_plain_overhead.py", "--device", "cpu", "--max-tokens", "6",
           "--repeats", "2", "--warmups", "1", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_toy_plain_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    modes = "plain,adaptive,adaptive-fresh-pass,adaptive-no-bookkeeping,adaptive-no-speculator"
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


def test_toy_plain_overhead_fresh_pass_turns_the_streaks_off():
    import argparse
    import importlib.util

    path = ROOT / "benchmarks" / "toy_plain_overhead.py"
    spec = importlib.util.spec_from_file_location("toy_plain_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(device="cpu", batch_sizes=[1], engine_args="{}", k_max=4)
    assert bench.build("adaptive", args).llm_engine.speculator.reuse_streaks
    assert not bench.build("adaptive-fresh-pass", args).llm_engine.speculator.reuse_streaks
