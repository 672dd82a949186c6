"""benchmarks/engine/graph_census.py's counting on CPU (the census itself reads CUDA graphs on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_summarize_counts_nodes_by_identity_and_full_edges_by_target(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.engine.graph_census import summarize
    from benchmarks.kernels.graph_edges import FULL, PROGRAMMATIC

    # two nodes share a kernel name: they are still two nodes
    named = [
        (1, 2, "gemm", FULL), (2, 3, "norm", PROGRAMMATIC), (3, 4, "gemm", FULL), (4, 5, "<memset>", FULL),
        (5, 6, "gemm", FULL), (6, 7, "norm", PROGRAMMATIC),
    ]  # fmt: skip
    s = summarize(named)
    assert (s["nodes"], s["edges"], s["programmatic"], s["full"]) == (7, 6, 2, 4)
    assert s["full_into"] == [("gemm", 3), ("<memset>", 1)]
    assert summarize([]) == dict(nodes=0, edges=0, programmatic=0, full=0, full_into=[])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_it_says_so():
    script = str(BENCH / "engine" / "graph_census.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                          cwd=BENCH.parent)  # fmt: skip
    assert proc.returncode != 0 and "needs a CUDA device" in proc.stderr
