"""benchmarks/engine/bench_plain_bookkeeping.py runs on CPU: its modes take the per-row pass as they say."""

from __future__ import annotations

import json
import subprocess
import sys

from script_env import ENV, ROOT


def test_bench_plain_bookkeeping_smoke(tmp_path):
    out = tmp_path / "bookkeeping.json"
    cmd = [sys.executable, "benchmarks/engine/bench_plain_bookkeeping.py", "--device", "cpu",
           "--batch-sizes", "1,4",
           "--chunks", "2", "--steps", "20", "--k-max", "4", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tree_has_streaks"]
    rows = {(r["mode"], r["batch"]): r for r in report["rows"]}
    assert list(rows) == [(m, b) for b in (1, 4) for m in ("streak", "fresh-pass")]
    for (mode, _), r in rows.items():
        assert len(r["chunks"]) == 2 and r["p10"] <= r["us_per_step"] <= r["p90"]
        # a streak reuses the choice of the step before (no probe falls in 60 choices); the fresh pass never
        assert r["passes_per_step"] == (0.0 if mode == "streak" else 1.0)
        assert r["drafting_rows_per_step"] == 0.0  # every step timed is a plain one
    table = proc.stdout.splitlines()[-len(rows) :]
    assert [line.split()[2] for line in table] == [m for m, _ in rows]
