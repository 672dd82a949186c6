"""benchmarks/common.py and the layout of benchmarks/: scripts share helpers through common.py only, the
docs cite scripts and raw JSON that exist, and benchmarks/results/ holds only what the docs cite."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from argparse import Namespace

import pytest
from script_env import ROOT

BENCH = ROOT / "benchmarks"
SUBJECTS = ("kernels", "engine", "speculative", "toy")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _scripts() -> list:
    return sorted(p for d in SUBJECTS for p in (BENCH / d).glob("*.py") if p.name != "__init__.py")


def _imported_modules(path) -> set[str]:
    """Every module a file imports (function-level imports included), as written."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_script_imports_another_script():
    scripts = _scripts()
    assert len(scripts) >= 15  # the subfolders hold the scripts
    stems = {p.stem for p in scripts}
    for path in scripts:
        for name in _imported_modules(path):
            parts = name.split(".")
            # a sibling imported by bare name (the old flat layout) or through the package
            assert parts[0] not in stems, f"{path.relative_to(ROOT)} imports the script {name}"
            if parts[0] == "benchmarks" and len(parts) > 1:
                assert parts[1] == "common", f"{path.relative_to(ROOT)} imports {name}: use benchmarks.common"


def test_at_most_twelve_python_files_sit_directly_in_benchmarks():
    top = sorted(p.name for p in BENCH.glob("*.py"))
    assert "common.py" in top and len(top) <= 12, top


def test_write_json_creates_the_folder_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.common import write_json

    out = tmp_path / "a" / "b" / "r.json"
    data = {"rows": [{"batch": 1, "ms": 4.25}, {"batch": 64, "ms": 5.14}]}
    write_json(out, data)
    back = json.loads(out.read_text())
    assert back == data and len(back["rows"]) == 2


@pytest.mark.parametrize(("length", "k"), [(3.0, 4), (1.5, 1), (4.6, 8)])
def test_rate_for_acceptance_length_gives_that_length(length, k, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.common import rate_for_acceptance_length

    r = rate_for_acceptance_length(length, k)
    assert 0.0 < r < 1.0
    assert sum(r**i for i in range(k + 1)) == pytest.approx(length, abs=1e-9)


def test_the_floor_counts_qwen3_8b_parameters(monkeypatch):
    """The 3.89 ms floor of docs/BENCHMARKS.md is 8.19e9 parameters: the shape in common.py gives them."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.common import QWEN3_8B, QWEN_VOCAB

    s = QWEN3_8B
    h, heads, kv, d = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    attn = h * (heads + 2 * kv) * d + heads * d * h
    mlp = 3 * h * s["intermediate_size"]
    params = s["num_hidden_layers"] * (attn + mlp) + 2 * QWEN_VOCAB * h  # untied embedding and lm_head
    assert params / 1e9 == pytest.approx(8.19, abs=0.01)


def test_validate_projection_fails_when_its_step_costs_fail(monkeypatch):
    """The step costs come from bench_spec_round.py in its own process: a run that fails raises."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.speculative import validate_projection

    args = Namespace(k=2, prompt_len=8, device="no-such-device", small=True)
    with pytest.raises(subprocess.CalledProcessError):
        validate_projection.measure_costs(args, [1])


def _cited(pattern: str) -> set[str]:
    return {m for doc in DOCS for m in re.findall(pattern, doc.read_text())}


def test_the_docs_cite_scripts_that_exist():
    # a path after "<commit>:" names a script git keeps (removed since), not one in the tree
    cited = _cited(r"(?<![0-9a-f]{7}:)benchmarks/(?:kernels|engine|speculative|toy)/\w+\.py")
    assert len(cited) >= 15
    missing = sorted(c for c in cited if not (ROOT / c).exists())
    assert not missing, missing


def test_results_hold_exactly_the_json_the_docs_cite():
    cited = _cited(r"20\d\d-\d\d-\d\d-[A-Za-z0-9.-]+\.json")
    kept = {p.name for p in (BENCH / "results").iterdir()}
    assert len(kept) >= 50
    assert not sorted(cited - kept), "cited but missing"
    assert not sorted(kept - cited), "kept but cited nowhere in README.md or docs/"
