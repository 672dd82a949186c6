"""benchmarks/kernels/bench_persistent_chain.py on CPU: its check catches a wrong product, and bad arguments
fail with a clear message before anything runs (the kernels themselves need a GPU: the persistent one spins
on a grid barrier, which the interpreter's one-program-at-a-time run would never pass)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_check_chain_accepts_the_chain_and_rejects_a_wrong_product(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.kernels.bench_persistent_chain import check_chain

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 32, 32, generator=gen) / 32**0.5).to(torch.bfloat16)
    y = torch.zeros(5, 32, dtype=torch.bfloat16)
    y[0] = torch.randn(32, generator=gen)
    for s in range(4):
        y[s + 1] = (w[s].float() @ y[s].float()).to(torch.bfloat16)
    assert check_chain(w, y) < 1e-2
    y[3, 5] += 1.0  # product 2 off in one element
    with pytest.raises(SystemExit, match="chain result off by"):
        check_chain(w, y)


@pytest.mark.parametrize(("args", "message"), [
    (["--hidden", "0"], "expected comma-separated integers >= 1, got '0'"),
    (["--hidden", "2x"], "expected comma-separated integers >= 1, got '2x'"),
    (["--products", "1"], "--products must be >= 2 and --repeats >= 1"),
])  # fmt: skip
def test_bad_arguments_fail_before_running(args, message):
    script = str(BENCH / "kernels" / "bench_persistent_chain.py")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
