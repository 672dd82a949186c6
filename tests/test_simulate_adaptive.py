"""benchmarks/speculative/simulate_adaptive.py: the chooser replayed on step times from a bench_adaptive JSON
(CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speculative import simulate_adaptive as sim  # noqa: E402

K = 3


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """benchmarks/speculative/simulate_adaptive.py run with args from the repository root (exit 0 asserted
    when check)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "benchmarks/speculative/simulate_adaptive.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _result(plain_ms: float, draft_ms: float, k_ms: list[float], rate: float) -> dict:
    """A bench_adaptive-shaped JSON: step times at batch 1 and 4 (the same per step), a graph-replay
    cost model that agrees with them, acceptance rate per position `rate` in both phases."""
    rows = []
    for b in (1, 4):
        rows.append({"cell": "plain", "batch": b, "tok_per_s": 1e3 * b / plain_ms})
        for k in range(1, K + 1):
            rows.append({"cell": f"good k={k}", "batch": b, "step_times": {str(k): {"median": k_ms[k - 1]}}})
    shares = [rate ** (i + 1) for i in range(K)]
    cost = {str(b): {"verify_ms": [plain_ms] * (K + 1), "draft_ms": draft_ms} for b in (1, 2, 4)}
    return {"k_max": K, "output_len": 64, "rows": rows, "cost_model": cost,
            "profiles": {"good": {"thinking": shares, "answer": shares, "thinking_tokens": 32}}}  # fmt: skip


def test_step_table_and_missing_cells():
    result = _result(5.0, 0.5, [5.5, 6.0, 6.5], 0.8)
    batches, ms = sim.step_table(result, K)
    assert batches.tolist() == [1, 4] and ms[:, 0].tolist() == pytest.approx([5.0, 5.0])
    assert ms[0, 1:].tolist() == [5.5, 6.0, 6.5]
    # a grid that stops at k = 2: k = 3 extrapolated from the last two
    top2 = {**result, "rows": [r for r in result["rows"] if r["cell"] != "good k=3"]}
    assert sim.step_table(top2, K)[1][0, 1:].tolist() == pytest.approx([5.5, 6.0, 6.5])
    result["rows"] = [r for r in result["rows"] if r["cell"] != "good k=2"]
    with pytest.raises(ValueError, match=r"good k=1..K at batch 1 needed, got k in \[1, 3\]"):
        sim.step_table(result, K)


@pytest.mark.parametrize("cheap", [True, False], ids=["drafting pays", "drafting loses"])
def test_adaptive_follows_the_step_times(cheap):
    """Cheap drafts that are always accepted: fixed k = K is best and adaptive gets close to it.
    Drafting steps that cost 3x a plain step with rare acceptance: every fixed k loses to plain,
    and adaptive decodes (nearly) plainly."""
    if cheap:
        result = _result(5.0, 0.1, [5.1, 5.2, 5.3], 0.99)
    else:
        result = _result(5.0, 5.0, [15.0, 20.0, 25.0], 0.1)
        result["cost_model"] = {b: {**e, "draft_ms": 5.0} for b, e in result["cost_model"].items()}
    tok = sim.simulate(result, 4, K, runs=2, seed=0)
    assert set(tok) == {"plain", "k=1", "k=2", "k=3", "adaptive"}
    fixed = max(v for n, v in tok.items() if n.startswith("k="))
    if cheap:
        assert tok["k=3"] == fixed > 2 * tok["plain"] and tok["adaptive"] > 0.9 * fixed
    else:
        assert fixed < 0.5 * tok["plain"] and tok["adaptive"] > 0.9 * tok["plain"]


def test_one_chooser_across_batch_sizes():
    """--shared: one chooser runs every batch size in turn; where drafting pays at both sizes it
    stays close to the best fixed k at each."""
    result = _result(5.0, 0.1, [5.1, 5.2, 5.3], 0.99)
    shared = sim.simulate_shared(result, [1, 4], K, runs=2, seed=0)
    assert set(shared) == {1, 4}
    for b in (1, 4):
        own = sim.simulate(result, b, K, runs=2, seed=0)
        assert shared[b] > 0.9 * own["k=3"] > 0.9 * 2 * own["plain"]


def test_cli_on_a_measured_result(tmp_path):
    out = tmp_path / "sim.json"
    src = ROOT / "benchmarks/results/2026-12-01-adaptive-h200-tolerance-b1-b128.json"
    proc = _cli(str(src), "--batch-sizes", "1,64", "--runs", "1", "--seeds", "2",
                "--set", "MAX_STEP_WEIGHT=0.5", "--shared", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert (
        result["settings"] == {"MAX_STEP_WEIGHT": 0.5} and result["seeds"] == 2 and result["shared_chooser"]
    )
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 64]
    for r in rows:
        best = r["tok_per_s"][r["best_fixed"]]
        assert r["adaptive_over_best"] == pytest.approx(
            r["tok_per_s"]["adaptive"] / max(r["tok_per_s"]["plain"], best)
        )
    assert "simulated closed batch" in proc.stdout
    for r in rows:
        assert r["adaptive_over_best_min"] <= r["adaptive_over_best"] + 1e-9
    bad = _cli(str(src), "--set", "PRIOR_RATE=0.5", check=False)
    assert bad.returncode == 2 and "--set takes NAME=VALUE" in bad.stderr


def test_phase_grid_finds_the_best_k_of_each_phase():
    """Thinking rows that always accept and answer rows that never do: thinking should draft K and
    answer nothing. The pair K/0 beats every fixed k, and a fixed pair drafts only per its phase."""
    result = _result(5.0, 0.5, [5.5, 6.0, 6.5], 0.99)
    result["profiles"]["good"]["answer"] = [0.0] * K
    tok = sim.simulate(result, 1, K, runs=2, seed=0, phase_grid=True)
    pairs = {n for n in tok if "/" in n}
    assert len(pairs) == (K + 1) * K and "k=3/0" in pairs and "k=1/1" not in pairs  # T == A: fixed k
    assert tok["k=3/0"] == max(tok.values()) > max(tok[f"k={k}"] for k in range(1, K + 1))
    assert tok["k=0/3"] < tok["k=3/0"]
    batch = sim.closed_batch(result, 1, K)
    steps: dict[int, int] = {}
    orig = batch.step_time

    def counted(rows: int, kmax: int) -> float:
        steps[kmax] = steps.get(kmax, 0) + 1
        return orig(rows, kmax)

    batch.step_time = counted  # type: ignore[method-assign]
    batch.run((2, 0), np.random.default_rng(0))
    assert set(steps) <= {0, 2} and 2 in steps and 0 in steps  # thinking drafts 2, answer plain steps


def test_token_draws_meet_every_policy_at_the_same_tokens():
    """--draws token: one draw per output position, drawn at the start of a run, so a run's steps follow
    from those draws alone (checked against a replay of them at k = 1) and every policy leaves the
    generator where any other does (the next run of each meets the same draws)."""
    result = _result(5.0, 0.5, [5.5, 6.0, 6.5], 0.5)
    batch = sim.closed_batch(result, 1, K, draws="token")
    steps = []
    orig = batch.step_time

    def counted(rows: int, kmax: int) -> float:
        steps.append(kmax)
        return orig(rows, kmax)

    batch.step_time = counted  # type: ignore[method-assign]
    batch.run(1, np.random.default_rng(3))
    u = np.random.default_rng(3).random((1, 64 + K))[0]
    done, expected = 1, 0
    while done < 64:  # a draft at output position done, accepted when its draw is under the rate
        done += 2 if u[done] < 0.5 and done < 63 else 1
        expected += 1
    assert len(steps) == expected
    states = []
    for policy in (0, 1, 3, (3, 1), sim.chooser(result, K, {})):
        rng = np.random.default_rng(5)
        batch.run(policy, rng)
        states.append(rng.random())
    assert len(set(states)) == 1
    step = sim.closed_batch(result, 1, K)  # per step: a policy that drafts more draws more
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    step.run(1, a)
    step.run(3, b)
    assert a.random() != b.random()
    with pytest.raises(ValueError, match="draws must be one of"):
        sim.closed_batch(result, 1, K, draws="row")


def test_oracle_chooser_keeps_the_true_rates():
    """--oracle: the chooser told the profile's rates drafts K for thinking rows that always accept and
    nothing for answer rows that never do, from its first choice on, and its rates never move."""
    result = _result(5.0, 0.5, [5.5, 6.0, 6.5], 0.99)
    result["profiles"]["good"]["answer"] = [0.0] * K
    batch = sim.closed_batch(result, 1, K, draws="token")
    policy = sim.oracle(result, K, {}, batch.rates)
    truth = policy.estimates.rates.copy()
    assert truth[1].tolist() == pytest.approx([0.99] * K) and truth[0].tolist() == [0.0] * K
    assert truth[2].tolist() == truth[1].tolist()  # relaxed thinking rows as thinking ones
    assert policy.choose([0, 1, 0]).tolist() == [0, K, 0]
    assert policy.choose([1, 0, 0]).tolist() == [0, 0, 0]
    batch.run(policy, np.random.default_rng(0))
    assert np.array_equal(policy.estimates.rates, truth)
    tok = sim.simulate(result, 1, K, runs=2, seed=0, phase_grid=True, draws="token", with_oracle=True)
    assert tok["oracle"] > 0.97 * tok["k=3/0"] and tok["oracle"] > tok["k=3"]


def test_rates_override_and_per_seed_figures(tmp_path):
    """--thinking-rates / --answer-rates replace the JSON's good profile (conditional rates, the last
    one repeated up to K); the output records the profile used and each seed's tok/s, so that two runs
    on the same draws (other trees or settings) compare seed by seed."""
    assert sim.profile_shares("0.5,1.0", K) == pytest.approx([0.5, 0.5, 0.5])
    assert sim.profile_shares("0.9", K) == pytest.approx([0.9, 0.81, 0.729])
    for bad in ("", "0.5,1.5", "-0.1"):
        with pytest.raises(ValueError, match="conditional rates in"):
            sim.profile_shares(bad, K)
    src = tmp_path / "result.json"
    src.write_text(json.dumps(_result(5.0, 0.5, [5.5, 6.0, 6.5], 0.8)))
    out = tmp_path / "sim.json"
    _cli(str(src), "--batch-sizes", "1", "--runs", "1", "--seeds", "3", "--draws", "token", "--oracle",
         "--thinking-rates", "0.9,0.6", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["profile"]["thinking"] == pytest.approx([0.9, 0.54, 0.324])
    assert result["profile"]["answer"] == pytest.approx([0.8, 0.64, 0.512])  # the JSON's
    assert result["draws"] == "token"
    row = result["rows"][0]
    assert set(row["per_seed"]) == {"plain", "adaptive", "oracle"} and len(row["per_seed"]["adaptive"]) == 3
    assert np.mean(row["per_seed"]["adaptive"]) == pytest.approx(row["tok_per_s"]["adaptive"])
    bad = _cli(str(src), "--answer-rates", "2", check=False)
    assert bad.returncode == 2 and "--answer-rates: conditional rates in [0, 1] needed" in bad.stderr


def test_a_closed_batch_stays_plain_where_its_slowest_row_loses(monkeypatch):
    """On step times measured at batch 64 where the chooser drafted at the start of closed batches and
    lost to plain (0.944 on the device), the spread term keeps it within 3% of plain; off, it drafts
    and loses over 5%. Same seeds and draws for both."""
    from thinkspec.spec_decode import draft_length

    src = ROOT / "benchmarks/results/2026-12-04-adaptive-h200-running-mean-b64-2.json"
    result = json.loads(src.read_text())
    k_max = result["k_max"]
    ratio = {}
    for name, min_left in (("kept", draft_length.SPREAD_MIN_LEFT), ("off", 10**9)):
        monkeypatch.setattr(draft_length, "SPREAD_MIN_LEFT", min_left)
        tok = [sim.simulate(result, 64, k_max, 2, s, switch_ms=30.0, draws="token") for s in range(3)]
        ratio[name] = np.mean([t["adaptive"] / t["plain"] for t in tok])
    assert ratio["kept"] > 0.97 and ratio["off"] < 0.95, ratio
