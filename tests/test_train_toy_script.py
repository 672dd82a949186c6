"""scripts/train_toy.sh end to end on the CPU, shrunk to tiny models, data and problem counts.

One run covers the whole pipeline (target, drafts side by side with the greedy grid, the drafts'
cells, packing) and a draft that fails: the others are still packed and measured, and the script
says what failed and exits non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from thinkspec.toy.task import EASY, HARD_CANDIDATES

ROOT = Path(__file__).resolve().parents[1]
TINY = "1:32:2:16:64:2"  # layers:hidden:heads:head_dim:ffn:steps


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_train_toy_script_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ,
        "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(out), "WORK": str(work),
        "TARGET_SIZE": "--hidden-size 32 --num-layers 1 --num-heads 2 --head-dim 16 --intermediate-size 64",
        "T_STEPS": "3", "T_SAMPLES": "30", "T_BATCH": "2",
        # hidden size 0 fails at construction: a draft that does not train
        "DRAFTS": f"draft:{TINY}:0.9 broken:1:0:2:16:64:2:0", "D_SAMPLES": "30", "D_BATCH": "2",
        "D_WORKERS": "1", "N_EASY": "2", "N_HARD": "1", "N_SPEC_EASY": "1", "N_SPEC_HARD": "1",
        "ANALYZE_ARGS": "--device cpu --max-new-tokens-cap 6",
    }  # fmt: skip
    run = subprocess.run(["bash", "scripts/train_toy.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["analysis.json", "analysis.log", "drafts.tar", "target.tar.part-aa", "train.log"]
    log = (out / "train.log").read_text()
    assert "FAILED: draft broken" in log and "drafts done: draft" in log and "weights to bundle" in log
    assert "hidden_size must be an integer" in log  # the failing draft's own error is kept
    # The packed checkpoints: the target at 2,048 positions on the range mix; the fork-biased draft.
    parts = sorted(out.glob("target.tar.part-*"))
    (work / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(work / "joined.tar") as tar:
        names = tar.getnames()
        assert "target/model.safetensors" in names and "target/tokenizer.json" in names
        config = json.load(tar.extractfile("target/config.json"))
        meta = json.load(tar.extractfile("target/train_meta.json"))
    assert config["max_position_embeddings"] == 2048
    assert meta["train"]["mix"] == "range" and meta["train"]["seq_len"] == 2048
    with tarfile.open(out / "drafts.tar") as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"draft"}
        assert json.load(tar.extractfile("draft/train_meta.json"))["train"]["fork_bias"] == 0.9
    data = json.loads((out / "analysis.json").read_text())
    assert [s["label"] for s in data["grid"]["levels"]] == [EASY.label] + [lv.label for lv in HARD_CANDIDATES]
    assert data["drafts_hard_level"] == data["grid"]["hard_pick"]["label"]
    (entry,) = data["drafts"]
    assert entry["path"].endswith("draft")
    cells = [(c["level"], c["mode"]) for c in entry["cells"]]
    hard = data["drafts_hard_level"]
    assert cells == [(EASY.label, "strict"), (EASY.label, "r=0.3 k=8"), (hard, "strict"), (hard, "r=0.3 k=8")]
    assert "vs_strict" in entry["cells"][1] and "thinking_acceptance_length" in entry["cells"][0]
    assert "suggested hard level" in (out / "analysis.log").read_text()
