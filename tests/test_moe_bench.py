"""benchmarks/engine/bench_moe.py on CPU at tiny shapes (a smoke test of the script the GPU runs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from script_env import ENV, ROOT


def test_bench_moe_smoke(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "benchmarks/engine/bench_moe.py", "--small", "--device", "cpu",
           "--batch-sizes", "1,2", "--prompt-len", "16", "--output-len", "8", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [
        ("hf_eager", 1), ("hf_static", 1), ("hf_eager", 2), ("hf_static", 2),
        ("thinkspec", 1), ("thinkspec", 2),
    ]  # fmt: skip
    assert result["moe_layers"] == 2 and result["expert_bytes"] == 3 * 128 * 64 * 4  # fp32 on CPU
    for r in rows:
        assert math.isfinite(r["ms_per_step"]) and r["ms_per_step"] > 0
        assert r["floor_ms"] > 0 and r["x_floor"] == r["ms_per_step"] / r["floor_ms"]
    plain = {r["batch"]: r for r in rows if r["engine"] == "thinkspec"}
    # top-2 of 8 experts: one token reads exactly 2 a layer; two tokens between 2 and 4
    assert plain[1]["experts_per_layer"] == 2.0
    assert 2.0 <= plain[2]["experts_per_layer"] <= 4.0
    verify = result["verify"]
    assert verify["batch"] == 1 and verify["k"] == 4 and verify["count"] > 0
    assert 2.0 <= verify["experts_per_layer"] <= 8.0  # 5 tokens of top-2, of 8 experts
    assert verify["x_floor"] == verify["ms"] / verify["floor_ms"]
    assert "verify batch 1 k=4" in proc.stdout
