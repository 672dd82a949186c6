"""benchmarks/kernels/bench_cublas_chain.py on CPU: when its race test decides nothing (the kernels need a
GPU)."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_race_test_is_inconclusive_when_a_control_fails_or_nothing_was_rewired(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.kernels.bench_cublas_chain import inconclusive

    def case(consumer, stale, rewired=1, n=0):
        return dict(consumer=consumer, n=n, k=4096, stale=stale, rewired=rewired)

    controls = [case("copy", 5), case("copy+wait", 0), case("memset+copy", 5)]
    assert inconclusive([*controls, case("linear", 5, n=6144), case("linear", 0, n=4096)]) is None
    assert "stale: copy 0" in inconclusive([case("copy", 0), *controls[1:]])
    assert "copy+wait 2" in inconclusive([controls[0], case("copy+wait", 2), controls[2]])
    assert "memset+copy 0" in inconclusive([*controls[:2], case("memset+copy", 0)])
    assert inconclusive([*controls, case("linear", 0, rewired=0, n=24576)]) == (
        "no edge made programmatic for linear 24576 x 4096"
    )
