"""benchmarks/engine/compare_trees.py on CPU: two trees, each in its own worker, every cell timed for both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from script_env import ENV, ROOT

SCRIPT = ROOT / "benchmarks" / "engine" / "compare_trees.py"


def test_compare_trees_times_both_trees_in_every_cell(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(ROOT / "thinkspec", old / "thinkspec", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "trees.json"
    cmd = [sys.executable, str(SCRIPT), "--old", str(old), "--new", str(ROOT), "--small", "--device", "cpu",
           "--batch-sizes", "1,2", "--output-len", "6", "--prompt-len", "8", "--repeats", "2",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    roots = {name: info["thinkspec"] for name, info in result["trees"].items()}
    assert roots == {"old": str((old / "thinkspec").resolve()), "new": str((ROOT / "thinkspec").resolve())}
    cells = [(c["mode"], c["batch"]) for c in result["cells"]]
    assert cells == [("plain", 1), ("plain", 2), ("spec", 1), ("spec", 2)]
    for c in result["cells"]:
        for tree in ("old", "new"):
            assert len(c[tree]["reps"]) == 2 and all(t > 0 for t in c[tree]["reps"])
        assert c["new_over_old"] > 0
    assert "new/old" in proc.stdout.splitlines()[-5]  # the table's header, before one row per cell


def test_compare_trees_refuses_an_unknown_mode():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--modes", "plain,beam"], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "unknown ['beam']" in proc.stderr
