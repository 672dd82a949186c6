"""thinkspec.bench.sweep: grid, Pareto frontier, calibration, and a CPU smoke run of `thinkspec sweep`."""

from __future__ import annotations

import csv
import json

import pytest

from thinkspec.bench.results import CellResult, SweepResult, pareto_frontier
from thinkspec.bench.sweep import RelaxSetting, calibrate, make_grid
from thinkspec.config import SpeculativeConfig
from thinkspec.entrypoints.cli import main
from thinkspec.model_names import TOY_MODELS, resolve_model_name, toy_name


def test_grid_is_the_full_product_and_validates():
    grid = make_grid([0.1, 0.3], [2, 4], [None, 0.2])
    assert len(grid) == 8 and len(set(grid)) == 8
    assert grid[0] == RelaxSetting(0.1, 2, None) and grid[-1].label == "r=0.3 k=4 d=0.2"
    assert grid[0].overrides() == {
        "relaxed_thinking": True,
        "relax_ratio": 0.1,
        "relax_top_k": 2,
        "relax_delta": None,
    }
    with pytest.raises(ValueError, match="relax_top_k"):
        RelaxSetting(0.1, 0)
    with pytest.raises(ValueError, match="relax_ratio"):
        RelaxSetting(1.5, 2)
    with pytest.raises(ValueError, match="at least one"):
        make_grid([], [2])


def test_extra_settings_join_the_grid():
    from thinkspec.bench.sweep import _extra_settings

    assert _extra_settings("0.1:8:0.2, 0.3:3") == [RelaxSetting(0.1, 8, 0.2), RelaxSetting(0.3, 3, None)]
    assert _extra_settings("") == []


def test_pareto_frontier_hand_cases():
    pts = [(0.9, 10.0), (0.8, 12.0), (0.8, 11.0), (0.95, 9.0), (0.7, 12.0), (0.99, None)]
    assert pareto_frontier(pts) == [True, True, False, True, False, False]
    assert pareto_frontier([(0.5, 1.0), (0.5, 1.0)]) == [True, True]  # ties dominate neither


def _cell(name, mode, correct, tok_s, al, temperature=0.0, ratio=None, top_k=None):
    n = len(correct)
    spec = None
    if mode != "no_spec":
        spec = {
            "mean_acceptance_length": al,
            "draft_acceptance_rate": 0.5,
            "relaxed_share": 0.0,
            "acceptance_rate_per_pos": [0.5],
            "by_phase": {
                "thinking": {"mean_acceptance_length": al},
                "answer": {"mean_acceptance_length": al},
            },
        }
    return CellResult(
        name=name,
        setting={
            "mode": mode,
            "temperature": temperature,
            "relax_ratio": ratio,
            "relax_top_k": top_k,
            "relax_delta": None,
        },
        correct=list(correct),
        output_tokens=[100] * n,
        truncated=0,
        seconds=100 * n / tok_s,
        latencies=[1.0] * n,
        ttfts=[0.1] * n,
        spec=spec,
    )


def synthetic_sweep() -> SweepResult:
    n = 400
    strict = [True] * n
    dropped = [i >= 40 for i in range(n)]  # 10% worse than strict: far outside a 2% budget
    slight = [i != 0 for i in range(n)]  # one problem worse: inside a 2% budget
    cfg = {
        "speculative_config": {
            "model": "draft",
            "num_speculative_tokens": 4,
            "reasoning_parser": "qwen3",
            "relaxed_thinking": False,
        },
        "num_prompts": n,
    }
    result = SweepResult(config=cfg)
    result.cells = [
        _cell("T=0 no_spec", "no_spec", strict, 500.0, None),
        _cell("T=0 strict", "strict", strict, 1000.0, 3.0),
        _cell("T=0 r=0.5 k=8", "relaxed", dropped, 1500.0, 3.8, ratio=0.5, top_k=8),
        _cell("T=0 r=0.1 k=4", "relaxed", slight, 1200.0, 3.3, ratio=0.1, top_k=4),
        _cell("T=0 r=0.1 k=2", "relaxed", strict, 1100.0, 3.5, ratio=0.1, top_k=2),
    ]
    result.compare_all(num_resamples=2000)
    return result


def test_calibration_picks_the_fastest_setting_within_budget():
    result = synthetic_sweep()
    cal = calibrate(result, 0.02, 0.0)
    assert cal.chosen == "T=0 r=0.1 k=4"  # fastest whose CI low end stays above -0.02
    assert cal.speculative_config["relax_ratio"] == 0.1 and cal.speculative_config["relax_top_k"] == 4
    assert cal.speculative_config["relaxed_thinking"] is True
    SpeculativeConfig.from_dict(cal.speculative_config)  # a config the engine accepts
    within = {c["name"]: c["within_budget"] for c in cal.candidates}
    assert within == {
        "T=0 strict": True,
        "T=0 r=0.5 k=8": False,
        "T=0 r=0.1 k=4": True,
        "T=0 r=0.1 k=2": True,
    }
    assert calibrate(result, 0.02, 0.0, by="acceptance_length").chosen == "T=0 r=0.1 k=2"
    assert calibrate(result, 0.2, 0.0).chosen == "T=0 r=0.5 k=8"  # a loose budget admits the big drop
    zero = calibrate(result, 0.0, 0.0)
    assert zero.chosen == "T=0 r=0.1 k=2"  # identical outcomes: CI is [0, 0]
    with pytest.raises(ValueError, match="accuracy_budget"):
        calibrate(result, -0.1, 0.0)
    with pytest.raises(ValueError, match="by must be"):
        calibrate(result, 0.1, 0.0, by="latency")


def test_calibration_falls_back_to_strict():
    result = synthetic_sweep()
    result.cells = [c for c in result.cells if c.name in ("T=0 strict", "T=0 r=0.5 k=8")]
    result.compare_all(num_resamples=500)
    cal = calibrate(result, 0.01, 0.0)
    assert cal.chosen == "T=0 strict" and cal.speculative_config["relaxed_thinking"] is False


def test_rows_mark_the_frontier_and_round_trip():
    result = synthetic_sweep()
    rows = {r["name"]: r for r in result.rows()}
    assert rows["T=0 strict"]["vs_strict_diff"] == 0.0 and rows["T=0 strict"]["vs_strict_mcnemar_p"] == 1.0
    assert rows["T=0 r=0.5 k=8"]["vs_strict_only_reference"] == 40
    assert rows["T=0 r=0.5 k=8"]["vs_strict_mcnemar_p"] < 1e-9
    # strict (acc 1.0, 1000 tok/s) is dominated by r=0.1 k=2 (acc 1.0, 1100 tok/s); r=0.1 k=4 trades
    # one problem for more speed, r=0.5 k=8 forty problems for the most speed
    assert [n for n, r in rows.items() if r["frontier_tokens_per_s"]] == [
        "T=0 r=0.5 k=8",
        "T=0 r=0.1 k=4",
        "T=0 r=0.1 k=2",
    ]
    assert not rows["T=0 no_spec"]["frontier_acceptance_length"]
    again = SweepResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.rows() == result.rows()


def test_toy_name_names_the_bundled_folders_only(tmp_path):
    assert toy_name(str(TOY_MODELS["toy-reasoner"])) == "toy-reasoner"
    assert toy_name(str(TOY_MODELS["toy-reasoner-draft"]) + "/") == "toy-reasoner-draft"
    assert resolve_model_name(toy_name(str(TOY_MODELS["toy-reasoner-draft"]))) == str(
        TOY_MODELS["toy-reasoner-draft"]
    )
    assert toy_name(str(tmp_path)) == str(tmp_path)
    assert toy_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


@pytest.mark.slow
def test_sweep_smoke_on_the_toy_pair(tmp_path, capsys):
    """Tiny grid on the bundled toy pair; outputs truncated (the toy answers need ~250 tokens)."""
    out = tmp_path / "sweep"
    grid = ["sweep", "--device", "cpu", "--num-prompts", "3", "--max-tokens", "16", "--relax-top-ks", "8",
            "--repeats", "2"]  # fmt: skip
    argv = [
        *grid,
        "--relax-ratios",
        "0.1,0.5",
        "--output-dir",
        str(out),
        "--accuracy-budget",
        "0.05",
        "--calibrate-by",
        "acceptance_length",
        "--hf-baseline-prompts",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"sweep.json", "sweep.csv", "pareto.png", "report.md"}
    data = json.loads((out / "sweep.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["T=0 no_spec", "T=0 strict", "T=0 r=0.1 k=8", "T=0 r=0.5 k=8"]
    for r in rows.values():
        assert r["num_prompts"] == 3 and r["truncation_rate"] == 1.0 and r["mean_output_tokens"] == 16.0
        assert r["repeats"] == 2 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["tokens_per_s_min"] <= 3 * 16 / r["seconds"] <= r["tokens_per_s_max"]  # the first run's
        assert r["speedup_vs_strict_min"] <= r["speedup_vs_strict"] <= r["speedup_vs_strict_max"]
        assert r["speedup_vs_no_spec"] > 0
    assert rows["T=0 strict"]["speedup_vs_strict"] == pytest.approx(1.0)
    assert rows["T=0 no_spec"]["speedup_vs_no_spec"] == pytest.approx(1.0)
    assert "mean_acceptance_length" not in rows["T=0 no_spec"]
    assert rows["T=0 strict"]["relaxed_share"] == 0.0 and rows["T=0 strict"]["vs_strict_diff"] == 0.0
    for name in ("T=0 strict", "T=0 r=0.1 k=8", "T=0 r=0.5 k=8"):
        assert 1.0 <= rows[name]["mean_acceptance_length"] <= 5.0
    assert any(r["frontier_acceptance_length"] for r in rows.values())
    assert [r["mode"] for r in data["hf_rows"]] == ["hf_generate", "hf_assisted"]
    # greedy assisted generation is lossless: same tokens, same grade as plain generate
    hf_plain, hf_assisted = data["hf"]
    assert (
        hf_plain["output_tokens"] == hf_assisted["output_tokens"]
        and hf_plain["correct"] == hf_assisted["correct"]
    )
    cal = data["calibrations"][0]
    assert cal["chosen"] in rows and rows[cal["chosen"]]["mode"] in ("strict", "relaxed")
    # reports name the bundled pair, not this machine's folders; the CLI resolves the names back
    assert data["config"]["model"] == "toy-reasoner"
    assert (
        data["config"]["speculative_config"]["model"]
        == cal["speculative_config"]["model"]
        == "toy-reasoner-draft"
    )
    assert json.dumps(cal["speculative_config"]) in printed
    with open(out / "sweep.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["name"] for r in csv_rows] == [*rows, "hf_generate", "hf_assisted"]
    assert float(csv_rows[1]["accuracy"]) == rows["T=0 strict"]["accuracy"]
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert data["config"]["level"] == "easy" and data["config"]["level_params"]["max_value"] == 9999
    assert "Dataset `toy` at level easy (2-4 numbers, operands up to 999, totals up to 9999)" in report
    assert (
        "| T=0 strict |" in report and "Pareto frontier" in report and "![Pareto plot](pareto.png)" in report
    )
    assert "HF transformers" in report and cal["chosen"] in report.split("## Calibration")[1]

    # --resume keeps finished cells (same measurements) and runs only the new one
    argv2 = [
        *grid,
        "--relax-ratios",
        "0.1,0.3,0.5",
        "--output-dir",
        str(out),
        "--resume",
        "--no-progress",
        "--no-plot",
    ]
    assert main(argv2) == 0
    assert "resuming: 4 cells" in capsys.readouterr().err
    resumed = {r["name"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    assert list(resumed) == ["T=0 no_spec", "T=0 strict", "T=0 r=0.1 k=8", "T=0 r=0.3 k=8", "T=0 r=0.5 k=8"]
    assert all(resumed[n]["seconds"] == rows[n]["seconds"] for n in rows)
    assert [r["mode"] for r in json.loads((out / "sweep.json").read_text())["hf_rows"]] == [
        "hf_generate",
        "hf_assisted",
    ]
    assert not (out / "sweep.partial.json").exists()
    bad = ["sweep", "--device", "cpu", "--num-prompts", "4", "--output-dir", str(out), "--resume"]
    (out / "sweep.partial.json").write_text((out / "sweep.json").read_text())
    assert main([*bad, "--no-progress"]) == 2
    assert "cannot resume" in capsys.readouterr().err


def test_reports_without_matplotlib(tmp_path, monkeypatch):
    import sys

    from thinkspec.bench.report import write_sweep_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    result = synthetic_sweep()
    cal = calibrate(result, 0.02, 0.0)
    paths = write_sweep_outputs(result, tmp_path, [cal], plot=False)
    assert sorted(p.name for p in paths.values()) == ["report.md", "sweep.csv", "sweep.json"]
    report = paths["markdown"].read_text()
    assert "**T=0 r=0.1 k=4**" in report and '"relax_top_k": 4' in report
    assert "Pareto frontier (accuracy vs tokens/s): T=0 r=0.5 k=8, T=0 r=0.1 k=4, T=0 r=0.1 k=2." in report
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 and rows[2]["vs_strict_only_reference"] == "40"
    data = json.loads(paths["json"].read_text())
    assert data["calibrations"][0]["chosen"] == "T=0 r=0.1 k=4"
    with pytest.raises(ImportError):
        write_sweep_outputs(result, tmp_path / "with-plot", [cal], plot=True)


def test_batch_curves_group_cells_by_requests_in_flight():
    """Each cap on requests in flight is its own set of cells, compared within the set."""
    from thinkspec.bench.datasets import load_dataset
    from thinkspec.bench.sweep import RelaxSetting, run_sweep

    items = load_dataset("toy", 3, 0)
    draft = resolve_model_name("toy-reasoner-draft")
    spec = {"model": draft, "num_speculative_tokens": 4, "reasoning_parser": "qwen3"}
    result = run_sweep(
        {"model": resolve_model_name("toy-reasoner"), "device": "cpu"}, spec, items, [RelaxSetting(0.3, 8)],
        max_tokens=12, repeats=1, batch_sizes=[1, None], use_tqdm=False,
    )  # fmt: skip
    rows = {r["name"]: r for r in result.rows()}
    assert list(rows) == [
        "T=0 no_spec b=1", "T=0 strict b=1", "T=0 r=0.3 k=8 b=1",
        "T=0 no_spec", "T=0 strict", "T=0 r=0.3 k=8",
    ]  # fmt: skip
    assert rows["T=0 strict b=1"]["speedup_vs_strict"] == pytest.approx(1.0)
    assert rows["T=0 r=0.3 k=8 b=1"]["max_in_flight"] == 1 and rows["T=0 strict"]["max_in_flight"] is None
    # greedy outputs do not depend on how many requests share the engine
    assert rows["T=0 strict b=1"]["mean_output_tokens"] == rows["T=0 strict"]["mean_output_tokens"]
    assert result.comparisons["T=0 r=0.3 k=8 b=1"] == result.comparisons["T=0 r=0.3 k=8"]


def test_level_flag_reaches_the_items_and_the_record():
    """`thinkspec sweep --level hard`: hard problems, the level's token budget, and a record of both."""
    from dataclasses import asdict

    from thinkspec.bench.sweep import _sweep_config, _sweep_inputs
    from thinkspec.entrypoints.cli import build_parser
    from thinkspec.toy.task import EASY, HARD

    def inputs(*flags: str):
        args = build_parser().parse_args(["sweep", "--device", "cpu", "--num-prompts", "4", *flags])
        _, _, kwargs, _, items = _sweep_inputs(args)
        return args, items, _sweep_config(args, kwargs, None)

    args, items, config = inputs("--level", "hard")
    assert args.max_tokens == HARD.max_new_tokens
    assert config["level"] == "hard" and config["level_params"] == asdict(HARD)
    for item in items:  # one sentence per number, plus the question
        numbers = item.prompt.split("user\n")[1].split("<|im_end|>")[0].count(".")
        assert HARD.min_operands <= numbers <= HARD.max_operands
    args, easy_items, config = inputs()
    assert args.max_tokens == EASY.max_new_tokens == 512 and config["level"] == "easy"
    assert [i.prompt for i in easy_items] != [i.prompt for i in items]
    args, _, _ = inputs("--level", "hard", "--max-tokens", "64")
    assert args.max_tokens == 64


def test_resume_refuses_another_level():
    from thinkspec.bench.sweep import _level_config, _resumable_cells

    strict = _cell("T=0 strict", "strict", [True, False], 10.0, 2.0)
    base = {"dataset": "toy", "num_prompts": 2, "max_tokens": 512, "seed": 0, "speculative_config": {}}
    before_levels = SweepResult(config=dict(base), cells=[strict])  # a file from before --level
    assert list(_resumable_cells(before_levels, {**base, **_level_config("toy", "easy")})) == ["T=0 strict"]
    with pytest.raises(ValueError, match="level"):
        _resumable_cells(before_levels, {**base, **_level_config("toy", "hard")})
    hard = SweepResult(config={**base, **_level_config("toy", "hard")}, cells=[strict])
    edited = {**base, **_level_config("toy", "hard"), "level_params": {"max_operands": 99}}
    with pytest.raises(ValueError, match="level_params"):  # the hard constants changed since
        _resumable_cells(hard, edited)


def test_calibration_on_a_level_the_target_gets_wrong_sometimes():
    """Strict at 80%: relaxation can gain as well as lose problems, and a setting whose gains and
    losses cancel still fails a 1-point budget when its paired CI is wide."""
    n = 500
    strict = [i % 5 != 0 for i in range(n)]  # 400 / 500
    churn = list(strict)
    for i in range(0, 100, 5):  # 20 gained ...
        churn[i] = True
    for i in range(1, 101, 5):  # ... and 20 lost: the same accuracy, many discordant pairs
        churn[i] = False
    gains = list(strict)
    for i in range(0, 25, 5):  # 5 gained, none lost
        gains[i] = True
    losses = [ok and i >= 15 for i, ok in enumerate(strict)]  # 12 lost
    result = SweepResult(
        config={
            "speculative_config": {
                "model": "draft",
                "num_speculative_tokens": 4,
                "reasoning_parser": "qwen3",
            },
            "num_prompts": n,
        }
    )
    result.cells = [
        _cell("T=0 strict", "strict", strict, 1000.0, 3.0),
        _cell("T=0 r=0.1 k=8", "relaxed", churn, 1600.0, 4.0, ratio=0.1, top_k=8),
        _cell("T=0 r=0.3 k=8", "relaxed", gains, 1300.0, 3.6, ratio=0.3, top_k=8),
        _cell("T=0 r=0.6 k=8", "relaxed", losses, 1700.0, 4.2, ratio=0.6, top_k=8),
    ]  # fmt: skip
    result.compare_all(num_resamples=4000)
    rows = {r["name"]: r for r in result.rows()}
    assert rows["T=0 strict"]["accuracy"] == 0.8
    wide = rows["T=0 r=0.1 k=8"]
    assert wide["vs_strict_diff"] == 0.0
    assert wide["vs_strict_only_cell"] == 20 == wide["vs_strict_only_reference"]
    assert wide["vs_strict_ci_low"] < -0.01 < 0.01 < wide["vs_strict_ci_high"]
    assert rows["T=0 r=0.3 k=8"]["vs_strict_diff"] == pytest.approx(0.01)
    assert rows["T=0 r=0.3 k=8"]["vs_strict_ci_low"] >= 0.0
    assert rows["T=0 r=0.6 k=8"]["vs_strict_diff"] == pytest.approx(-12 / n)
    cal = calibrate(result, 0.01, 0.0)
    assert cal.chosen == "T=0 r=0.3 k=8"  # the fastest whose CI stays above -1 point
    within = {c["name"]: c["within_budget"] for c in cal.candidates}
    assert within == {
        "T=0 strict": True, "T=0 r=0.1 k=8": False, "T=0 r=0.3 k=8": True, "T=0 r=0.6 k=8": False
    }  # fmt: skip
    assert calibrate(result, 0.05, 0.0).chosen == "T=0 r=0.6 k=8"  # a 5-point budget admits the losses


def test_rule_settings_labels_overrides_and_parsing():
    from thinkspec.bench.sweep import _extra_settings, _typical_pairs, rule_grid

    lenient, typical = RelaxSetting.lenient(0.5), RelaxSetting.typical(0.09, 0.3)
    assert lenient.label == "lenient l=0.5" and typical.label == "typical e=0.09 a=0.3"
    assert lenient.overrides() == {"relaxed_thinking": True, "relax_rule": "lenient", "relax_lambda": 0.5}
    assert typical.overrides() == {
        "relaxed_thinking": True,
        "relax_rule": "typical",
        "posterior_threshold": 0.09,
        "posterior_alpha": 0.3,
    }
    assert _extra_settings("lenient:0.5, typical:0.09:0.3, 0.3:3") == [
        lenient,
        typical,
        RelaxSetting(0.3, 3, None),
    ]
    assert rule_grid([0.5], _typical_pairs("0.09:0.3")) == [lenient, typical]
    with pytest.raises(ValueError, match="relax_lambda must be a float in"):
        RelaxSetting.lenient(0.0)
    with pytest.raises(ValueError, match="posterior_alpha must be a finite float"):
        RelaxSetting.typical(0.1, -1.0)
    with pytest.raises(ValueError, match="lenient:lambda and typical:threshold:alpha"):
        _extra_settings("typical:0.1")
    with pytest.raises(ValueError, match="threshold:alpha items"):
        _typical_pairs("0.1")


def test_calibration_chooses_among_all_rules():
    result = synthetic_sweep()
    n = result.cells[0].n
    lenient = _cell("T=0 lenient l=0.5", "relaxed", [True] * n, 1800.0, 3.9)
    lenient.setting = {"mode": "relaxed", "temperature": 0.0, "relax_rule": "lenient", "relax_lambda": 0.5}
    typical = _cell("T=0 typical e=0.09 a=0.3", "relaxed", [i >= 60 for i in range(n)], 2000.0, 4.0)
    typical.setting = {"mode": "relaxed", "temperature": 0.0, "relax_rule": "typical"}
    typical.setting.update(posterior_threshold=0.09, posterior_alpha=0.3)
    result.cells += [lenient, typical]
    result.compare_all(num_resamples=2000)
    cal = calibrate(result, 0.02, 0.0)
    assert cal.chosen == "T=0 lenient l=0.5"  # the typical cell is faster but outside the budget
    spec = cal.speculative_config
    assert spec["relax_rule"] == "lenient" and spec["relax_lambda"] == 0.5 and spec["relaxed_thinking"]
    assert "relax_ratio" not in spec
    SpeculativeConfig.from_dict(spec)
    assert calibrate(result, 0.2, 0.0).chosen == "T=0 typical e=0.09 a=0.3"
    assert calibrate(result, 0.2, 0.0).speculative_config["posterior_alpha"] == 0.3


def test_sweep_of_the_rules_measures_their_distortion(tmp_path):
    """Lenient and typical cells at T = 0.6 beside strict on the toy pair; each speculative cell
    records implied_tv, 0 for strict (lossless) and above 0 for a lenient lambda of 0.3."""
    out = tmp_path / "rules"
    argv = ["sweep", "--device", "cpu", "--num-prompts", "2", "--max-tokens", "12", "--relax-ratios", "",
            "--relax-top-ks", "", "--relax-lambdas", "0.3", "--typical-settings", "0.09:0.3",
            "--temperatures", "0.6", "--repeats", "1", "--skip-no-spec", "--no-plot", "--no-progress",
            "--output-dir", str(out), "--accuracy-budget", "1"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((out / "sweep.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["T=0.6 strict", "T=0.6 lenient l=0.3", "T=0.6 typical e=0.09 a=0.3"]
    assert rows["T=0.6 strict"]["implied_tv"] < 1e-6
    assert rows["T=0.6 lenient l=0.3"]["implied_tv"] > 1e-4
    assert rows["T=0.6 typical e=0.09 a=0.3"]["implied_tv"] >= 0
    assert rows["T=0.6 lenient l=0.3"]["relax_rule"] == "lenient"
    assert data["calibrations"][0]["chosen"] in rows
    assert "| TV |" in (out / "report.md").read_text()
