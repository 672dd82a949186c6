"""Projected speed from acceptance profiles and step costs (thinkspec/bench/projection.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from thinkspec.bench.projection import (
    AcceptanceProfile,
    StepCosts,
    conditional_rates,
    costs_from_spec_round,
    profiles_from_sweep,
    project,
    round_ms_at,
    simulate_batch,
)

ROOT = Path(__file__).resolve().parent.parent


def _phase(rounds: int, accepted: list[int], emitted: int) -> dict:
    return {"num_draft_tokens_per_pos": [rounds] * len(accepted), "num_accepted_tokens_per_pos": accepted,
            "num_emitted_tokens": emitted}  # fmt: skip


def _sweep() -> dict:
    cells = [
        {"name": "T=0 no_spec", "spec": None},
        # thinking: 10 rounds, position 0 accepted 8 times, 1: 6, 2: 4, 3: 2 -> AL 3.0
        # answer: 10 rounds, 5, 0, 0, 0 -> AL 1.5; 90 of 100 emitted tokens while thinking
        {"name": "T=0 strict", "spec": {"by_phase": {"thinking": _phase(10, [8, 6, 4, 2], 90),
                                                     "answer": _phase(10, [5, 0, 0, 0], 10)}}},
    ]  # fmt: skip
    return {"config": {"speculative_config": {"num_speculative_tokens": 4}}, "cells": cells}


def test_profile_from_sweep_counts():
    (p,) = profiles_from_sweep(_sweep(), k=4)
    assert p.thinking_rates == (0.8, 0.6, 0.4, 0.2) and p.answer_rates == (0.5, 0.0, 0.0, 0.0)
    assert p.acceptance_length("thinking") == pytest.approx(3.0)
    assert p.acceptance_length("answer") == pytest.approx(1.5)
    assert p.thinking_share == pytest.approx(0.9)
    assert p.rounds_per_token() == pytest.approx(0.9 / 3.0 + 0.1 / 1.5)


def test_projection_arithmetic_on_a_fake_cost_table():
    profile = AcceptanceProfile("x", (0.8, 0.6, 0.4, 0.2), (0.5, 0.0, 0.0, 0.0), 0.9)
    costs = [StepCosts(batch=16, k=4, plain_ms=5.0, draft_ms=0.5, verify_ms=8.0),
             StepCosts(batch=1, k=4, plain_ms=4.0, draft_ms=1.0, verify_ms=4.0)]  # fmt: skip
    rows = project([profile], costs)
    order = [(r["batch"], r["cell"]) for r in rows]
    assert order == [(1, "no speculation"), (1, "x"), (16, "no speculation"), (16, "x")]
    assert rows[0]["tokens_per_s"] == pytest.approx(250.0)  # 1 / 4 ms
    # round 4 * 1 + 4 = 8 ms; rounds per token 0.3667 -> 1 / (8 ms * 0.3667) = 340.9 tok/s
    assert rows[1]["tokens_per_s"] == pytest.approx(1e3 / (8.0 * (0.3 + 0.1 / 1.5)))
    assert rows[1]["vs_plain"] == pytest.approx(rows[1]["tokens_per_s"] / 250.0)
    # batch 16: round 2 + 8 = 10 ms for 16 rows
    assert rows[3]["tokens_per_s"] == pytest.approx(16e3 / (10.0 * (0.3 + 0.1 / 1.5)))
    assert rows[2]["tokens_per_s"] == pytest.approx(16e3 / 5.0)


def test_script_reads_spec_round_json(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep()))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"rows": [{"batch": 1, "k": 4, "decode_ms": 4.0, "draft_step_ms": 1.0,
                                           "verify_ms": 4.0}]}))  # fmt: skip
    assert costs_from_spec_round(json.loads(costs.read_text()))[0].round_ms == 8.0
    cost = {"batch": 16, "plain_ms": 5.0, "draft_ms": 1.5, "verify_ms": 6.0, "round_ms": 9.0}
    check = {"k": 2, "costs": [cost]}
    (c,) = costs_from_spec_round(check)  # the costs validate_projection.py measured beside the engine
    assert (c.batch, c.k, c.plain_ms, c.round_ms) == (16, 2, 5.0, 9.0)
    out = tmp_path / "p.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/speculative/project_speed.py", "--sweep", str(sweep),
         "--costs", str(costs), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["cell"] for r in rows] == ["no speculation", "T=0 strict"]
    assert "T=0 strict" in run.stdout


def test_round_time_interpolates_between_measured_batches():
    costs = [StepCosts(batch=1, k=4, plain_ms=4.0, draft_ms=1.0, verify_ms=4.0),     # round 8 ms
             StepCosts(batch=17, k=4, plain_ms=5.0, draft_ms=1.5, verify_ms=10.0)]  # round 16 ms
    assert round_ms_at(costs, 1) == pytest.approx(8.0)
    assert round_ms_at(costs, 9) == pytest.approx(12.0)
    assert round_ms_at(costs, 64) == pytest.approx(16.0)  # flat past the largest measured batch


def test_conditional_rates_undo_the_cumulative_shares():
    assert conditional_rates([0.8, 0.4, 0.2, 0.0]).tolist() == pytest.approx([0.8, 0.5, 0.5, 0.0])
    assert conditional_rates([0.0, 0.0]).tolist() == [0.0, 0.0]


def test_simulated_batch_of_one_matches_the_steady_state_formula():
    # One row has no tail: its expected rate is the formula's (up to sampling noise and the last,
    # capped round).
    profile = AcceptanceProfile("x", (0.8, 0.6, 0.4, 0.2), (0.5, 0.1, 0.0, 0.0), 0.9)
    costs = [StepCosts(batch=1, k=4, plain_ms=4.0, draft_ms=1.0, verify_ms=4.0)]
    steady = project([profile], costs)[1]["tokens_per_s"]
    sim = simulate_batch(profile, costs, batch=1, output_len=2001, thinking_tokens=1800, runs=400)
    assert sim == pytest.approx(steady, rel=0.02)


def test_simulated_batch_pays_for_its_tail():
    # Rows of a batch finish at different rounds and the round costs nearly as much with fewer rows,
    # so a batch of 64 started together is slower than the steady state; every draft always accepted
    # removes the spread and the two agree exactly.
    costs = [StepCosts(batch=1, k=4, plain_ms=4.0, draft_ms=1.0, verify_ms=8.0),
             StepCosts(batch=64, k=4, plain_ms=5.0, draft_ms=1.0, verify_ms=9.0)]  # fmt: skip
    noisy = AcceptanceProfile("n", (0.7, 0.5, 0.3, 0.2), (0.7, 0.5, 0.3, 0.2), 1.0)
    steady = project([noisy], costs)[-1]["tokens_per_s"]
    assert simulate_batch(noisy, costs, batch=64, output_len=257, thinking_tokens=257) < 0.95 * steady
    sure = AcceptanceProfile("s", (1.0,) * 4, (1.0,) * 4, 1.0)
    # 256 tokens after the first in rounds of 5: 51 rounds of 13 ms plus one capped round
    assert simulate_batch(sure, costs, batch=64, output_len=257, thinking_tokens=257) == pytest.approx(
        64 * 256 / (52 * 13.0) * 1e3
    )


def test_simulated_phase_switch_uses_each_phases_rates():
    costs = [StepCosts(batch=1, k=2, plain_ms=1.0, draft_ms=0.0, verify_ms=1.0)]
    always = AcceptanceProfile("t", (1.0, 1.0), (0.0, 0.0), 0.5)
    # 1 token from prefill; thinking until 7 emitted: rounds of 3 -> 7 after 2 rounds; then 1 per round
    # for the remaining 6 tokens of output_len 13: 8 rounds of 1 ms for 12 tokens
    assert simulate_batch(always, costs, batch=1, output_len=13, thinking_tokens=7, runs=3) == pytest.approx(
        12 / 8.0 * 1e3
    )
