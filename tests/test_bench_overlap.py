"""benchmarks/speculative/bench_overlap.py on CPU: the expected round of drafting ahead, the default
acceptance rate, and bad arguments failing with a clear message before anything runs (the cells need a GPU:
two CUDA streams replaying CUDA graphs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = str(BENCH / "speculative" / "bench_overlap.py")


def test_expected_gain_counts_the_rounds_drafted_again(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.speculative.bench_overlap import expected_gain

    # k = 2, c = 0.5: ahead succeeds with p = 0.125; a failed round drafts its 2 ms again
    got = expected_gain({"serial": 7.0, "overlapped": 5.0, "drafts": 2.0}, 2, 0.5)
    assert got["p_ahead"] == pytest.approx(0.125)
    assert got["expected_ms"] == pytest.approx(5.0 + 0.875 * 2.0)
    assert got["gain"] == pytest.approx(7.0 / 6.75)
    # every round accepted: the drafts cost nothing beyond what they add to the verify
    cells = {"serial": 7.0, "overlapped": 5.0, "drafts": 2.0}
    assert expected_gain(cells, 4, 1.0)["gain"] == pytest.approx(1.4)
    # what the H200 measured at batch 1, k = 4: drafting ahead loses
    h200 = {"serial": 7.49, "overlapped": 6.87, "drafts": 3.14}
    assert expected_gain(h200, 4, 0.818)["gain"] < 0.9


def test_default_rate_is_the_thinking_profile(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.speculative.bench_overlap import thinking_rate

    c = thinking_rate()
    assert 1 + sum(c**i for i in range(1, 9)) == pytest.approx(4.6, abs=1e-4)  # AL 4.6 over K = 8


@pytest.mark.parametrize(("args", "message"), [
    (["--ks", "0"], "--ks must be >= 1 and <= 8, got '0'"),
    (["--ks", "9"], "--ks must be >= 1 and <= 8, got '9'"),
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers, got '1,x'"),
    (["--rate", "1.5"], "--rate must be in (0, 1], got 1.5"),
    (["--reps", "0"], "--reps and --repeats must be >= 1 and --watchdog > 0"),
    (["--watchdog", "0"], "--reps and --repeats must be >= 1 and --watchdog > 0"),
])  # fmt: skip
def test_bad_arguments_fail_before_running(args, message):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_without_cuda_it_says_so():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, SCRIPT, "--ks", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "bench_overlap needs a CUDA device" in proc.stderr
