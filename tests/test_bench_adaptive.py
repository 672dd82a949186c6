"""benchmarks/speculative/bench_adaptive.py on the bundled toy pair (--toy) runs on CPU, and its determinism
check."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from script_env import ENV, ROOT

K_MAX = 2


@pytest.mark.slow
def test_bench_adaptive_toy_smoke(tmp_path):
    out = tmp_path / "adaptive.json"
    cmd = [sys.executable, "benchmarks/speculative/bench_adaptive.py", "--toy", "--device", "cpu",
           "--batch-sizes", "1,2",
           "--repeats", "2", "--fixed-ks", "1,2", "--k-max", str(K_MAX), "--max-tokens", "16",
           "--engine-args", '{"async_scheduling": true}', "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "criterion (toy pair, relaxed): ad/best >= 1.0" in proc.stdout
    result = json.loads(out.read_text())
    assert result["repeats_done"] == 2 and result["k_max"] == K_MAX
    # every engine got the extra argument: the speculating one ran first draft forwards ahead
    assert result["engine_args"] == {"async_scheduling": True}
    assert 0 < result["run_ahead"]["used"] <= result["run_ahead"]["run"]
    toy = result["toy"]
    assert (toy["level"], toy["relax_ratio"], toy["relax_top_k"], toy["max_tokens"]) == ("easy", 0.3, 8, 16)
    rows = {(r["cell"], r["batch"]): r for r in result["rows"]}
    cells = ("plain", "toy k=1", "toy k=2", "toy adaptive")
    assert list(rows) == [(c, b) for c in cells for b in (1, 2)]
    for (cell, b), r in rows.items():
        assert len(r["reps"]) == 2 and r["min"] <= r["tok_per_s"] <= r["max"]
        assert r["num_problems"] == b and all(0 <= c <= b for c in r["correct_reps"])
        assert len(r["output_digest_reps"]) == 2
        if cell != "toy adaptive":  # a fixed policy repeats its greedy outputs (the script checks it)
            assert r["outputs_repeat"]
        if cell == "plain":
            assert "mean_acceptance_length" not in r
            continue
        k = K_MAX if r["k"] is None else r["k"]
        # 0.0: no step speculated (adaptive may keep to k = 0 where steps look costly)
        assert all(
            1.0 <= al <= k + 1 or (r["k"] is None and al == 0.0) for al in r["acceptance_length_reps"]
        ), r
    for b in (1, 2):
        hist = rows[("toy adaptive", b)]["draft_length_histogram"]  # rows choosing k = 0, 1, ...
        assert 1 <= len(hist["thinking"]) <= K_MAX + 1 and sum(hist["thinking"]) > 0
        assert "draft_length_histogram" not in rows[("toy k=1", b)]
        trace = rows[("toy adaptive", b)]["choice_trace"]  # at least the first choice of the run
        assert trace and all(len(t["overhead_ms"]) == K_MAX + 1 and t["tok_per_ms"] > 0 for t in trace)
        assert "choice_trace" not in rows[("toy k=1", b)]
        for cell in ("toy k=1", "toy k=2", "toy adaptive"):  # every speculating row logs its timed steps
            last, by_rep = rows[(cell, b)]["step_times"], rows[(cell, b)]["step_times_by_rep"]
            assert len(by_rep) == 2 and last["num_steps"] == len(last["kmax_seq"]) == len(last["wall_ms_seq"])
            assert last["num_steps"] > 0 and last["timed_ms"] == pytest.approx(
                sum(last["wall_ms_seq"]), abs=0.05
            )
            counted = {k: v for k, v in last.items() if k.isdigit()}  # per longest window
            assert sum(v["n"] for v in counted.values()) == last["num_steps"]
            assert {k: v for k, v in last.items() if not k.endswith("_seq")} == by_rep[-1]
            if cell == "toy k=1":  # a forced k=1 drafts one token (0 only where a request has no room)
                assert set(counted) <= {"0", "1"} and "modelled" not in counted["1"]
        assert "step_times" not in rows[("plain", b)]
    for s in result["summary"]:
        fixed = {c: rows[(c, s["batch"])]["tok_per_s"] for c in ("toy k=1", "toy k=2")}
        best = max(fixed, key=fixed.__getitem__)
        assert (s["best_fixed"], s["best_fixed_tok_per_s"]) == (best, fixed[best])
        assert s["adaptive_over_best_fixed"] == pytest.approx(s["toy_adaptive"] / fixed[best])
        assert s["adaptive_over_plain"] == pytest.approx(s["toy_adaptive"] / s["plain"])


def test_record_checks_determinism_of_fixed_policies(monkeypatch):
    """Greedy outputs that change between repetitions fail a plain or fixed-k cell; an adaptive
    cell's (its choices follow what it learns) are recorded as not repeating."""
    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.speculative.bench_adaptive")
    args = type("Args", (), {"temperature": 0.0})()
    cells = [
        ("plain", "", "plain", None),
        ("toy k=2", "toy", "spec", 2),
        ("toy adaptive", "toy", "spec", None),
    ]
    stats: dict = {"times": {(c[0], 1): [] for c in cells}, "hists": {}, "facts": {}}
    for cell in cells:
        bench.record(stats, cell, 1, (10.0, None, {"digest": "a", "correct": 1}), args, cell[0])
        bench.record(stats, cell, 1, (11.0, None, {"digest": "a", "correct": 1}), args, cell[0])
        assert stats["facts"][(cell[0], 1)]["outputs_repeat"]
        if bench.is_adaptive(cell):
            bench.record(stats, cell, 1, (12.0, None, {"digest": "b", "correct": 0}), args, cell[0])
            assert not stats["facts"][(cell[0], 1)]["outputs_repeat"]
        else:
            with pytest.raises(RuntimeError, match="greedy outputs differ"):
                bench.record(stats, cell, 1, (12.0, None, {"digest": "b", "correct": 1}), args, cell[0])
    sampled = type("Args", (), {"temperature": 0.6})()  # sampled outputs are not checked
    bench.record(stats, cells[1], 1, (13.0, None, {"digest": "c", "correct": 1}), sampled, "sampled")
    assert stats["times"][("toy k=2", 1)] == [10.0, 11.0, 12.0, 13.0]


def test_summary_pairs_adaptive_with_the_best_cell_within_each_repetition(monkeypatch):
    """The criterion's ratio is of medians; the paired one is the median of the ratios within each
    repetition, against the cell that is best by median (plain where plain is faster)."""
    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.speculative.bench_adaptive")
    args = type("Args", (), {"toy": False})()

    def row(cell, b, reps):
        return {"cell": cell, "batch": b, "tok_per_s": sorted(reps)[len(reps) // 2], "reps": reps}

    rows = [
        row("plain", 1, [100.0, 100.0, 100.0]),
        row("good k=3", 1, [200.0, 180.0, 190.0]),  # median 190: the best fixed cell
        row("good k=4", 1, [150.0, 185.0, 160.0]),
        row("good adaptive", 1, [190.0, 171.0, 200.0]),  # median 190; per repetition .95, .95, 1.053
        row("bad adaptive", 1, [99.0, 99.0, 99.0]),
        row("plain", 64, [300.0, 330.0, 320.0]),  # plain is the anchor here
        row("good k=3", 64, [250.0, 250.0, 250.0]),
        row("good adaptive", 64, [297.0, 297.0, 330.0]),  # per repetition .99, .9, 1.031
    ]
    one, big = bench.summarise(rows, [1, 64], args)
    assert (one["best_fixed"], one["good_adaptive_over_best"]) == ("good k=3", pytest.approx(1.0))
    assert one["good_adaptive_over_best_paired"] == pytest.approx(0.95)
    assert one["bad_adaptive_over_plain"] == pytest.approx(0.99)
    assert big["good_adaptive_over_best"] == pytest.approx(297 / 320)
    assert big["good_adaptive_over_best_paired"] == pytest.approx(0.99)
    stats: dict = {"times": {("good k=3", 1): []}, "hists": {}, "facts": {}}
    for ms in (5.0, 7.0):  # the runs' wall times are kept per repetition
        facts = {"run_ms": 700.0 + ms, "first_token_ms": 30.0, "first_token_spread_ms": 0.0}
        facts["gc_pause_ms"] = ms
        bench.record(stats, ("good k=3", "good", "spec", 3), 1, (10.0, None, facts), args, "k=3")
    kept = stats["facts"][("good k=3", 1)]
    assert kept["run_ms_reps"] == [705.0, 707.0] and kept["gc_pause_ms_reps"] == [5.0, 7.0]
    assert kept["first_token_ms_reps"] == [30.0, 30.0] and kept["first_token_spread_ms_reps"] == [0.0, 0.0]


def test_timed_run_times_decode_from_the_batch_first_token(monkeypatch):
    """tok/s = the tokens after each request's first over the time from the batch's first token to its
    last; the prefill before it (whose host time varies from run to run) is not in it."""
    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.speculative.bench_adaptive")
    from thinkspec.outputs import CompletionOutput, RequestMetrics, RequestOutput

    clock = {"now": 100.0}
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock["now"])

    class FakeLLM:
        last_spec_metrics = None

        def generate(self, prompts, params, use_tqdm=False):
            outs = []
            for i, (first, end) in enumerate(((100.5, 102.5), (100.5, 103.5))):  # prefill 0.5 s
                m = RequestMetrics(100.0, first_token_time=first, finished_time=end)
                done = CompletionOutput(0, "", list(range(params.max_tokens)), finish_reason="length")
                outs.append(RequestOutput(str(i), None, prompts[i], [done], True, metrics=m))
            clock["now"] = 104.0
            return outs

    tok_s, metrics, facts = bench.timed_run(FakeLLM(), [[1], [2]], 11)
    assert tok_s == pytest.approx(2 * 10 / 3.0)  # 20 tokens after the first ones, from 100.5 to 103.5
    assert metrics is None
    assert facts["run_ms"] == pytest.approx(4000.0) and facts["first_token_ms"] == pytest.approx(500.0)
    assert facts["first_token_spread_ms"] == 0.0 and facts["gc_pause_ms"] >= 0.0


def test_phase_ks_cells_are_reported_apart_from_fixed_k(monkeypatch):
    """A k=T/A cell drafts T tokens on thinking rows and A on answer rows; the summary's best fixed k
    leaves such cells out (the criteria name fixed k) and reports the best pair beside it."""
    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.speculative.bench_adaptive")
    from thinkspec.spec_decode.draft_length import ANSWER, THINKING, THINKING_RELAXED

    policy = bench.forced(8, (5, 2))
    ks = policy.choose([3, 4, 1])
    assert (ks[THINKING], ks[THINKING_RELAXED], ks[ANSWER]) == (5, 5, 2)
    assert bench.forced(8, 3).choose([1, 1, 0]).tolist() == [3, 3, 3]
    args = type("Args", (), {"toy": False, "fixed_ks": [4], "bad_fixed_ks": [], "phase_ks": [(4, 2)],
                             "check_k": 0})()  # fmt: skip
    assert [c[0] for c in bench.build_cells(args)] == ["plain", "good k=4", "good k=4/2", "good adaptive",
                                                       "bad adaptive"]  # fmt: skip

    def row(cell, reps):
        return {"cell": cell, "batch": 1, "tok_per_s": sorted(reps)[len(reps) // 2], "reps": reps}

    cells = {"plain": 100.0, "good k=4": 180.0, "good k=4/2": 200.0, "good k=5/2": 190.0,
             "good adaptive": 195.0, "bad adaptive": 99.0}  # fmt: skip
    rows = [row(cell, [v] * 3) for cell, v in cells.items()]
    (one,) = bench.summarise(rows, [1], args)
    assert (one["best_fixed"], one["best_fixed_tok_per_s"]) == ("good k=4", 180.0)
    assert (one["best_phase_ks"], one["best_phase_ks_tok_per_s"]) == ("good k=4/2", 200.0)
    assert one["adaptive_over_best_phase_ks"] == pytest.approx(0.975)
    assert one["best_phase_ks_over_plain"] == pytest.approx(2.0)
    assert one["good_adaptive_over_best"] == pytest.approx(195 / 180)


@pytest.mark.parametrize("value", ["4", "4:2:1", "9:2", "4:-1", "a:2"])
def test_bad_phase_ks_fail_before_running(value):
    cmd = [sys.executable, "benchmarks/speculative/bench_adaptive.py", "--phase-ks", value]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--phase-ks takes THINKING:ANSWER pairs of draft lengths in [0, 8], got '{value}'" in proc.stderr
