"""thinkspec.bench: statistics, datasets and graders, one bench cell, `thinkspec bench`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from checkpoints import tiny_checkpoint

from thinkspec.bench.bench import run_cell, sampling_params_for
from thinkspec.bench.datasets import jsonl_dataset, load_dataset, match_answer
from thinkspec.bench.results import CellResult
from thinkspec.bench.stats import (
    binomial_two_sided_p,
    compare_paired,
    mcnemar_exact_p,
    paired_bootstrap_diff_ci,
    wilson_interval,
)
from thinkspec.entrypoints.cli import main
from thinkspec.llm import LLM
from thinkspec.toy.task import generate_samples

# --- statistics -------------------------------------------------------------------------------


def test_wilson_matches_hand_computed_values():
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and math.isclose(high, 0.16113, abs_tol=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="num_correct"):
        wilson_interval(5, 4)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_wilson_coverage_on_simulated_data(p):
    rng = np.random.default_rng(123)
    n, trials = 80, 4000
    hits = 0
    for k in rng.binomial(n, p, size=trials):
        low, high = wilson_interval(int(k), n)
        hits += low <= p <= high
    assert 0.92 <= hits / trials <= 0.985


def test_paired_bootstrap_coverage_on_simulated_pairs():
    rng = np.random.default_rng(7)
    n, trials, hits = 150, 150, 0
    p_ref, true_diff = 0.8, -0.05
    for t in range(trials):
        ref = rng.random(n) < p_ref
        # The cell loses each solved problem with prob 1/16 and gains each unsolved with prob 0 -> diff -0.05
        cell = ref & (rng.random(n) >= -true_diff / p_ref)
        _, low, high = paired_bootstrap_diff_ci(cell, ref, num_resamples=1000, seed=t)
        hits += low <= true_diff <= high
    assert 0.88 <= hits / trials <= 0.995


def test_paired_bootstrap_edge_cases():
    same = np.array([True, False, True, True])
    assert paired_bootstrap_diff_ci(same, same) == (0.0, 0.0, 0.0)
    diff, low, high = paired_bootstrap_diff_ci([True] * 5, [False] * 5)
    assert (diff, low, high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap_diff_ci([True], [True, False])
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap_diff_ci([], [])


def test_mcnemar_against_hand_computed_cases():
    # 1 problem only the cell solves, 5 only the reference: 2 * (C(6,0) + C(6,1)) / 2**6 = 14/64.
    cell = [True] + [False] * 5 + [True, False]
    ref = [False] + [True] * 5 + [True, False]
    assert math.isclose(mcnemar_exact_p(cell, ref), 14 / 64)
    assert math.isclose(mcnemar_exact_p(ref, cell), 14 / 64)
    assert mcnemar_exact_p([True, False], [True, False]) == 1.0  # no discordant pairs
    assert math.isclose(binomial_two_sided_p(0, 10), 2 / 1024)
    assert binomial_two_sided_p(3, 6) == 1.0  # balanced: capped at 1
    assert math.isclose(binomial_two_sided_p(40, 100), 0.056888, abs_tol=1e-5)  # 2 * P(Bin(100, .5) <= 40)
    assert binomial_two_sided_p(10, 5000) < 1e-300  # no overflow for large n


def test_compare_paired_counts_discordant_pairs():
    cmp = compare_paired([True, True, False, False], [True, False, True, True], num_resamples=200)
    assert (cmp.only_cell, cmp.only_reference) == (1, 2)
    assert math.isclose(cmp.diff, -0.25) and cmp.ci_low <= cmp.diff <= cmp.ci_high


# --- datasets ---------------------------------------------------------------------------------


def test_toy_items_grade_reference_completions():
    items = load_dataset("toy", 3, seed=5)
    samples = generate_samples(3, seed=5)
    for item, s in zip(items, samples):
        assert item.prompt == s.prompt and item.answer == str(s.problem.answer) and not item.chat
        assert item.grade(s.completion)
        assert not item.grade(s.completion.replace(f"**Answer:** {s.problem.answer}", "**Answer:** -12345"))
        assert not item.grade("<think>\nstill thinking")  # truncated inside thinking: no answer


def test_match_answer():
    assert match_answer("<think>x</think>\n\nSo 12 apples.\n\n**Answer:** 42", "42")
    assert match_answer("<think>x</think>\nit is 1,024", "1024")
    assert not match_answer("<think>x</think>\n**Answer:** 41", "42")
    assert not match_answer("<think>the answer is 42", "42")
    assert match_answer("<think>a</think>\n**Answer:** Paris.", "paris")
    assert not match_answer("<think>a</think>\n**Answer:** Lyon", "Paris")


def test_jsonl_dataset_and_its_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": 2}\n\n{"prompt": "capital?", "answer": "Paris"}\n')
    items = jsonl_dataset(path)
    assert [i.answer for i in items] == ["2", "Paris"] and all(i.chat for i in items)
    assert len(load_dataset(str(path), 1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{"question": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        jsonl_dataset(bad)
    with pytest.raises(ValueError, match="dataset must be"):
        load_dataset(str(tmp_path / "missing.jsonl"), 3)
    with pytest.raises(ValueError, match="num_prompts"):
        load_dataset("toy", 0)


def test_reasoning_gym_missing_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ValueError, match="pip install reasoning-gym"):
        load_dataset("rg:basic_arithmetic", 3)


# --- one cell ---------------------------------------------------------------------------------


def test_sampling_params_seed_per_item_only_when_sampling():
    greedy = sampling_params_for(3, 0.0, 16, seed=10)
    sampled = sampling_params_for(3, 0.6, 16, seed=10, relaxed_thinking=True, relax_ratio=0.2, relax_top_k=3)
    assert [p.seed for p in greedy] == [None] * 3
    assert [p.seed for p in sampled] == [10, 11, 12]
    assert all(p.relax_top_k == 3 and p.relaxed_thinking for p in sampled)


def test_cell_summary_numbers():
    cell = CellResult(
        name="c",
        setting={"mode": "strict", "temperature": 0.0},
        correct=[True, False, True, True],
        output_tokens=[10, 20, 30, 40],
        truncated=1,
        seconds=2.0,
        latencies=[1.0, 2.0, 3.0, 4.0],
        ttfts=[0.1] * 4,
    )
    s = cell.summary()
    assert s["accuracy"] == 0.75 and s["num_correct"] == 3 and s["tokens_per_s"] == 50.0
    assert s["accuracy_ci_low"] < 0.75 < s["accuracy_ci_high"]
    assert s["truncation_rate"] == 0.25 and s["mean_output_tokens"] == 25.0 and s["latency_p50_s"] == 2.5
    assert "mean_acceptance_length" not in s  # no speculation, no acceptance numbers
    assert CellResult.from_dict(json.loads(json.dumps(cell.to_dict()))) == cell


@pytest.fixture(scope="module")
def ckpt():
    return str(tiny_checkpoint("qwen3", tied=True))


def test_run_cell_self_draft_accepts_everything(ckpt, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(3)))
    items = load_dataset(str(path), 3)
    k = 3
    spec = {"model": ckpt, "num_speculative_tokens": k}
    llm = LLM(ckpt, device="cpu", speculative_config=spec)
    cell = run_cell(llm, items, "self", {"mode": "strict", "temperature": 0.0}, 0.0, 13, use_tqdm=False)
    assert cell.n == 3 and len(cell.latencies) == 3 and all(x > 0 for x in cell.latencies)
    s = cell.summary()
    # A draft identical to the target is always right under greedy verification: k + 1 per step,
    # except the last step of a request that hits max_tokens mid-round.
    assert s["mean_acceptance_length"] > k and s["draft_acceptance_rate"] > 0.9
    assert s["relaxed_share"] == 0.0 and len(s["acceptance_rate_per_pos"]) == k
    assert all(1 <= t <= 13 for t in cell.output_tokens)
    assert cell.truncated == sum(t == 13 for t in cell.output_tokens)


def test_bench_command_writes_json_and_table(ckpt, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(2)))
    out = tmp_path / "bench.json"
    spec = json.dumps({"model": ckpt, "num_speculative_tokens": 2})
    argv = [
        "bench",
        ckpt,
        "--device",
        "cpu",
        "--dataset",
        str(path),
        "--num-prompts",
        "2",
        "--max-tokens",
        "8",
    ]
    assert main([*argv, "--speculative-config", spec, "--output-json", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "acc" in table and "AL" in table and "tok/s" in table
    per_pos = [line for line in table.splitlines() if line.startswith("per-position acceptance: ")]
    assert len(per_pos) == 1 and len(per_pos[0].split(": ")[1].split(", ")) == 2  # k = 2
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["num_prompts"] == 2 and summary["mode"] == "spec"
    assert 0 <= summary["accuracy_ci_low"] <= summary["accuracy"] <= summary["accuracy_ci_high"] <= 1
    assert summary["mean_acceptance_length"] >= 1 and summary["tokens_per_s"] > 0
    assert len(data["cell"]["correct"]) == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset", "/nonexistent.jsonl"], "dataset must be"),
        (["--temperature", "-0.5"], "temperature must be"),
        (["--num-prompts", "0"], "num_prompts must be >= 1"),
    ],
)
def test_bench_command_rejects_bad_flags(capsys, flags, message):
    assert main(["bench", "/nonexistent/model", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert "thinkspec bench: error:" in err and message in err
