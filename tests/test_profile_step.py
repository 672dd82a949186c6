"""The engine-step profiler (benchmarks/profile_step.py) runs on CPU and its phases add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_step_smoke(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "benchmarks/profile_step.py", "--small", "--device", "cpu", "--batch", "2",
           "--steps", "3", "--warmup", "3", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    phases = result["phases_ms"]
    assert result["batch"] == 2 and result["device_profile"] is None
    assert phases["execute_model"] > 0 and phases["schedule"] >= 0 and phases["sample"] >= 0
    parts = phases["schedule"] + phases["execute_model"] + phases["sample"] + phases["wait_and_commit"]
    assert abs(parts - phases["step"]) < 0.5 * phases["step"]  # medians of parts vs median of sums
    assert phases["step_min"] <= phases["step"] <= phases["step_max"]
