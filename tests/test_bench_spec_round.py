"""Smoke test of benchmarks/speculative/bench_spec_round.py on CPU (tiny shapes): it runs, and its JSON holds
every part of the round, timed alone and back to back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_small_run_writes_every_part(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative" / "bench_spec_round.py"
    out = tmp_path / "spec_round.json"
    args = ["--small", "--device", "cpu", "--rounds", "2", "--warmup", "1", "--reps", "2"]
    args += ["--batch-sizes", "1,3"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        for part in ("draft", "draft_first", "verify", "decode"):
            assert r[f"{part}_back_to_back_ms"] > 0
        assert r["draft_first_ms"] > 0
        assert r["draft_step_ms"] > 0 and r["parts_ms"] == r["verify_ms"] + 4 * r["draft_step_ms"]
        assert 1 <= r["tokens_per_round"] <= 5
    assert "back to back (ms per call)" in proc.stdout
