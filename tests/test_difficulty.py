"""thinkspec.bench.difficulty: the hard-level pick, per-level scores, the deadline, and a CPU run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from thinkspec.bench import difficulty
from thinkspec.bench.datasets import toy_dataset
from thinkspec.bench.difficulty import (
    format_grid,
    generate_until,
    level_literal,
    pick_hard,
    score_level,
    thinking_tokens,
)
from thinkspec.model_names import resolve_model_name
from thinkspec.toy.task import EASY, HARD, HARD_CANDIDATES, Level, generate_samples


def _score(label: str, accuracy: float | None, partial: bool = False) -> dict:
    return {"label": label, "accuracy": accuracy, "partial": partial, "literal": f"L({label})"}


def test_pick_is_the_finished_candidate_nearest_80_percent():
    scores = [_score("a", 0.97), _score("b", 0.86), _score("c", 0.71), _score("d", 0.79, partial=True)]
    pick = pick_hard(scores)
    assert pick == {"label": "b", "accuracy": 0.86, "in_band": True, "literal": "L(b)"}  # d is partial
    # Equally near: the harder (later) candidate; outside 70-90% it is still named, flagged out of band.
    assert pick_hard([_score("a", 0.85), _score("b", 0.75)])["label"] == "b"
    out = pick_hard([_score("a", 1.0), _score("b", 0.95)])
    assert out["label"] == "b" and out["in_band"] is False
    assert pick_hard([_score("a", 0.69)])["in_band"] is False
    assert pick_hard([_score("a", None), _score("b", 0.8, partial=True)]) is None


def test_level_literal_sets_the_constants():
    for level in (EASY, HARD, *HARD_CANDIDATES):
        assert eval(level_literal(level), {"Level": Level}) == level  # noqa: S307 - our own text


def test_thinking_tokens():
    assert thinking_tokens([3, 10, 11, 12, 4, 20, 2], 3, 4) == 3
    assert thinking_tokens([3, 10, 11], 3, 4) == 2  # never closed: to the end
    assert thinking_tokens([10, 11, 2], 3, 4) == 0


def _out(text: str, token_ids: list[int], finish_reason: str = "stop"):
    completion = SimpleNamespace(text=text, token_ids=token_ids, finish_reason=finish_reason)
    return SimpleNamespace(outputs=[completion])


def test_score_level_counts_finished_outputs_only():
    items = toy_dataset(3, 5, HARD)
    first, second = generate_samples(2, seed=5, level=HARD)  # the same problems as items[:2]
    assert first.problem.answer == items[0].grader.__defaults__[0].answer != second.problem.answer
    outs = [
        _out(first.completion, [3, 9, 9, 4, 7]),  # item 0 answered right: 2 thinking tokens of 5
        _out(first.completion, [3, 9, 9, 9], finish_reason="length"),  # item 1 given item 0's answer
        None,  # item 2 aborted at the deadline
    ]
    s = score_level(HARD, items, outs, (3, 4))
    assert (s["n"], s["requested"], s["partial"], s["correct"]) == (2, 3, True, 1)
    assert s["accuracy"] == 0.5 and s["accuracy_ci_low"] < 0.5 < s["accuracy_ci_high"]
    assert s["thinking_share"] == pytest.approx(5 / 9) and s["mean_output_tokens"] == 4.5
    assert s["truncated"] == 1 and s["label"] == HARD.label and s["literal"] == level_literal(HARD)
    empty = score_level(HARD, items, [None] * 3, (3, 4))
    assert empty["accuracy"] is None and empty["n"] == 0


@pytest.fixture(scope="module")
def toy_llm():
    from thinkspec.llm import LLM

    return LLM(resolve_model_name("toy-reasoner"), device="cpu")


def test_generate_until_aborts_what_runs_at_the_deadline(toy_llm, monkeypatch):
    from thinkspec.sampling_params import SamplingParams

    prompts = [item.prompt for item in toy_dataset(3, 1, EASY)]
    quick = SamplingParams(temperature=0.0, max_tokens=1)
    slow = SamplingParams(temperature=0.0, max_tokens=16)
    outs = generate_until(toy_llm, prompts, [quick, slow, slow], None, "t")
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 16, 16]
    # A clock that passes the deadline after a few steps: the one-token request finished, the rest not.
    calls = iter(range(10**6))
    monkeypatch.setattr(difficulty.time, "time", lambda: 0.0 if next(calls) < 4 else 1e9)
    engine, steps = toy_llm.llm_engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda *a, **kw: steps.append(1) or step(*a, **kw))
    cut = generate_until(toy_llm, prompts, [quick, slow, slow], 100.0, "t")
    assert cut[0] is not None and cut[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert cut[1] is None and cut[2] is None
    assert len(steps) <= 6  # aborted at the deadline, not run to their 16 tokens
    assert not toy_llm.llm_engine.has_unfinished_requests()
    monkeypatch.undo()
    past = generate_until(toy_llm, prompts, [slow] * 3, 0.0, "t")  # already over: nothing runs
    assert past == [None, None, None]
    again = generate_until(toy_llm, prompts[1:2], [slow], None, "t")  # the engine still serves
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_grid_stage_writes_every_level(tmp_path, capsys):
    out = tmp_path / "d.json"
    out.write_text(json.dumps({"kept": 1}))  # the stages add to an existing file
    argv = ["--target", resolve_model_name("toy-reasoner"), "--stage", "grid", "--json", str(out),
            "--n-easy", "2", "--n-hard", "1", "--device", "cpu", "--max-new-tokens-cap", "6"]  # fmt: skip
    assert difficulty.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["kept"] == 1 and data["dataset_seed"] == 20261201
    grid = data["grid"]
    assert [s["label"] for s in grid["levels"]] == [EASY.label] + [lv.label for lv in HARD_CANDIDATES]
    assert [s["requested"] for s in grid["levels"]] == [2] + [1] * len(HARD_CANDIDATES)
    assert all(s["truncated"] == s["n"] and s["mean_output_tokens"] == 6 for s in grid["levels"])
    assert grid["easy_gate"] == {"floor": 0.97, "met": False}  # 6 tokens answer nothing
    assert grid["hard_now"] == HARD.label and grid["hard_pick"]["in_band"] is False
    printed = capsys.readouterr().out
    assert format_grid(grid) in printed and "suggested hard level" in printed
    with pytest.raises(SystemExit, match="--n-hard must be >= 0"):
        difficulty.main([*argv, "--n-hard", "-1"])
