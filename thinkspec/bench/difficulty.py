"""How a trained toy pair does across difficulty levels, measured with the thinkspec engine.

Run after training, it gives what choosing the hard level's constants needs:

- stage `grid`: the target alone, greedy, on `n_easy` easy problems and `n_hard` problems of every
  `HARD_CANDIDATES` level (one dataset seed for all, the one `thinkspec sweep --level` uses): answer
  accuracy with its Wilson 95% interval, thinking share of output tokens, mean output tokens; and the
  suggested hard level, the finished candidate nearest 80%;
- stage `drafts`: per draft, strict and relaxed speculative decoding on the easy level and on the
  suggested hard level: accuracy, its paired difference from strict (bootstrap 95% CI), acceptance
  length by phase and the relaxed-only share.

Requests still running when the time budget ends are aborted; their level is marked partial and is
never suggested. The JSON is rewritten after every stage and cell, so a cut-short run keeps what it
measured.

    python -m thinkspec.bench.difficulty --target DIR --stage grid --json difficulty.json
    python -m thinkspec.bench.difficulty --target DIR --draft DIR --stage drafts --json difficulty.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thinkspec.bench.datasets import BenchItem, toy_dataset
from thinkspec.bench.stats import compare_paired, wilson_interval
from thinkspec.toy.task import EASY, HARD, HARD_CANDIDATES, THINK_END, THINK_START, Level

PICK_TARGET = 0.8  # the hard level's intended greedy accuracy
HARD_BAND = (0.7, 0.9)  # the accepted range for it
EASY_GATE = 0.97  # the easy level's floor
DATASET_SEED = 20261201  # thinkspec sweep's default --dataset-seed

Save = Callable[[Any], None]


def level_literal(level: Level) -> str:
    """The Python text that sets a level's constants, e.g. for task.HARD."""
    fields = ", ".join(f"{f.name}={getattr(level, f.name)}" for f in dataclasses.fields(level))
    return f"Level({fields})"


def engine_kwargs(opts: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) settings for a few thousand problems at once; a bounded KV pool (--kv-cache-gib)
    leaves the rest of the GPU's memory to other processes, such as drafts in training."""
    kwargs: dict[str, Any] = {
        "device": opts.device,
        "max_num_seqs": opts.max_num_seqs,
        "max_num_batched_tokens": 8192,
    }
    if opts.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * 2**30)
    return kwargs


def generate_until(
    llm: Any, prompts: list[str], params: list[Any], deadline: float | None, desc: str
) -> list[Any]:
    """LLM.generate with a wall-clock deadline (a time.time() value): requests unfinished then are
    aborted. Returns one RequestOutput per prompt, in order, or None for an aborted one."""
    from tqdm.auto import tqdm

    engine = llm.llm_engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True, mininterval=5.0)
    try:
        while engine.has_unfinished_requests():
            if deadline is not None and time.time() > deadline:
                for request_id in ids:
                    if request_id not in done:
                        engine.abort_request(request_id)
                while engine.has_unfinished_requests():  # collects the aborted outputs
                    engine.step(finished_only=True)
                break
            for out in engine.step(finished_only=True):
                if out.outputs[0].finish_reason != "abort":
                    done[out.request_id] = out
                    bar.update(1)
    finally:
        bar.close()
    return [done.get(i) for i in ids]


def thinking_tokens(token_ids: list[int], think_start: int, think_end: int) -> int:
    """Tokens strictly inside the think block of one output (to its end when it never closes)."""
    try:
        a = token_ids.index(think_start)
    except ValueError:
        return 0
    b = token_ids.index(think_end) if think_end in token_ids else len(token_ids)
    return max(0, b - a - 1)


def score_level(
    level: Level, items: list[BenchItem], outs: list, think_ids: tuple[int, int]
) -> dict[str, Any]:
    """Accuracy, its Wilson 95% CI, thinking share and output length over the finished outputs
    (outs: one RequestOutput or None per item)."""
    pairs = [(item, o) for item, o in zip(items, outs) if o is not None]
    n = len(pairs)
    correct = sum(item.grade(o.outputs[0].text) for item, o in pairs)
    tokens = [list(o.outputs[0].token_ids) for _, o in pairs]
    total = sum(len(t) for t in tokens)
    low, high = wilson_interval(correct, n)
    return {
        "label": level.label,
        "level": dataclasses.asdict(level),
        "literal": level_literal(level),
        "requested": len(items),
        "n": n,
        "partial": n < len(items),
        "correct": correct,
        "accuracy": correct / n if n else None,
        "accuracy_ci_low": low,
        "accuracy_ci_high": high,
        "thinking_share": sum(thinking_tokens(t, *think_ids) for t in tokens) / max(1, total),
        "mean_output_tokens": total / max(1, n),
        "truncated": sum(o.outputs[0].finish_reason == "length" for _, o in pairs),
    }


def pick_hard(scores: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished candidate whose accuracy is nearest PICK_TARGET (on a tie, the harder one:
    later in the list); None when no candidate finished."""
    done = [s for s in scores if not s["partial"] and s["accuracy"] is not None]
    if not done:
        return None
    best = min(reversed(done), key=lambda s: round(abs(s["accuracy"] - PICK_TARGET), 9))
    return {
        "label": best["label"],
        "accuracy": best["accuracy"],
        "in_band": HARD_BAND[0] <= best["accuracy"] <= HARD_BAND[1],
        "literal": best["literal"],
    }


def token_budget(level: Level, cap: int | None) -> int:
    return level.max_new_tokens if cap is None else min(level.max_new_tokens, cap)


def run_grid(opts: argparse.Namespace, deadline: float | None, save: Save) -> dict[str, Any]:
    """Stage grid: the target's greedy accuracy on easy and every hard candidate; one submission for
    all levels (the engine keeps its batch full), easy first, candidates in order."""
    from thinkspec.llm import LLM
    from thinkspec.sampling_params import SamplingParams

    llm = LLM(opts.target, **engine_kwargs(opts))
    tok = llm.get_tokenizer()
    think_ids = (tok.convert_tokens_to_ids(THINK_START), tok.convert_tokens_to_ids(THINK_END))
    plan = [(EASY, opts.n_easy)] + [(lv, opts.n_hard) for lv in HARD_CANDIDATES]
    jobs = [(lv, toy_dataset(n, opts.dataset_seed, lv)) for lv, n in plan if n > 0]
    prompts = [item.prompt for _, items in jobs for item in items]
    params = [
        SamplingParams(temperature=0.0, max_tokens=token_budget(lv, opts.max_new_tokens_cap))
        for lv, items in jobs
        for _ in items
    ]
    t0 = time.time()
    outs = generate_until(llm, prompts, params, deadline, "greedy, all levels")
    del llm
    free_memory()
    levels, start = [], 0
    for lv, items in jobs:
        levels.append(score_level(lv, items, outs[start : start + len(items)], think_ids))
        start += len(items)
    hard = [s for s in levels if s["label"] != EASY.label]
    result: dict[str, Any] = {"seconds": round(time.time() - t0, 1), "levels": levels}
    easy = next((s for s in levels if s["label"] == EASY.label and s["accuracy"] is not None), None)
    if easy is not None:
        result["easy_gate"] = {"floor": EASY_GATE, "met": easy["accuracy"] >= EASY_GATE}
    result["hard_pick"] = pick_hard(hard)
    result["hard_now"] = next((s["label"] for s in hard if s["literal"] == level_literal(HARD)), None)
    save(result)
    return result


def run_drafts(opts: argparse.Namespace, hard: Level, deadline: float | None, save: Save) -> list[dict]:
    """Stage drafts: per draft, one speculative engine runs strict and each relaxed setting on easy
    and on `hard`; `save(entries)` after every cell."""
    entries: list[dict[str, Any]] = []
    for path in opts.draft:
        entry: dict[str, Any] = {"path": path, "cells": []}
        entries.append(entry)
        if deadline is not None and time.time() > deadline:
            entry["skipped"] = "time budget"
            save(entries)
            continue
        draft_cells(opts, path, hard, deadline, entry["cells"], lambda: save(entries))
    return entries


def draft_cells(
    opts: argparse.Namespace,
    draft: str,
    hard: Level,
    deadline: float | None,
    cells: list[dict[str, Any]],
    saved: Callable[[], None],
) -> None:
    """Appends to `cells` one summary per (level, setting): strict first, then the relaxed ones,
    each with its paired accuracy difference from strict on the same problems."""
    from thinkspec.bench.bench import grade_outputs
    from thinkspec.llm import LLM
    from thinkspec.sampling_params import SamplingParams

    spec = {"model": draft, "num_speculative_tokens": opts.k, "reasoning_parser": "qwen3"}
    llm = LLM(opts.target, speculative_config=spec, **engine_kwargs(opts))
    settings: list[tuple[float, int] | None] = [None, *opts.relax]
    for level, n in ((EASY, opts.n_spec_easy), (hard, opts.n_spec_hard)):
        items = toy_dataset(n, opts.dataset_seed, level) if n > 0 else []
        strict = None
        for setting in settings if items else []:
            mode = "strict" if setting is None else f"r={setting[0]:g} k={setting[1]}"
            relax = {} if setting is None else {
                "relaxed_thinking": True, "relax_ratio": setting[0], "relax_top_k": setting[1]
            }  # fmt: skip
            budget = token_budget(level, opts.max_new_tokens_cap)
            sp = SamplingParams(temperature=0.0, max_tokens=budget, **relax)
            t0 = time.time()
            prompts = [i.prompt for i in items]
            outs = generate_until(llm, prompts, [sp] * len(items), deadline, f"{level.label} {mode}")
            row: dict[str, Any] = {"level": level.label, "mode": mode}
            if any(o is None for o in outs):
                cells.append({**row, "skipped": "time budget"})
                saved()
                continue
            cell = grade_outputs(outs, items, mode, row, time.time() - t0, speculating=True)
            # Accuracy and acceptance only: this engine was not warmed up, so its speed says nothing.
            untimed = ("latency", "ttft", "tokens_per_s")
            summary = {k: v for k, v in cell.summary().items() if not k.startswith(untimed)}
            if setting is None:
                strict = cell
            elif strict is not None:
                summary["vs_strict"] = compare_paired(cell.correct, strict.correct).to_dict()
            cells.append(summary)
            saved()
    del llm
    free_memory()


def free_memory() -> None:
    """Return a dropped engine's memory before the next engine sizes its KV pool."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _relax(text: str) -> tuple[float, int]:
    try:
        ratio, top_k = text.split(",")
        return float(ratio), int(top_k)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--relax takes ratio,top_k (e.g. 0.3,8), got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint folder")
    ap.add_argument("--draft", action="append", default=[], help="draft checkpoint folder (repeatable)")
    ap.add_argument("--stage", choices=("grid", "drafts", "all"), default="all")
    ap.add_argument("--json", required=True, help="result file; the drafts stage adds to what grid wrote")
    ap.add_argument("--n-easy", type=int, default=500, help="easy problems for the greedy grid")
    ap.add_argument("--n-hard", type=int, default=200, help="problems per hard candidate")
    ap.add_argument("--n-spec-easy", type=int, default=300, help="easy problems per speculative cell")
    ap.add_argument("--n-spec-hard", type=int, default=200, help="hard problems per speculative cell")
    ap.add_argument("--relax", type=_relax, action="append", default=None, help="ratio,top_k (default 0.3,8)")
    ap.add_argument("--k", type=int, default=4, help="draft length")
    ap.add_argument("--dataset-seed", type=int, default=DATASET_SEED)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size (default: the engine's)")
    ap.add_argument("--max-new-tokens-cap", type=int, default=None, help="caps every level's budget (smoke)")
    ap.add_argument("--time-budget-s", type=float, default=None, help="abort what still runs after this")
    return ap


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    opts.relax = opts.relax or [(0.3, 8)]
    for name in ("n_easy", "n_hard", "n_spec_easy", "n_spec_hard"):
        if getattr(opts, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(opts, name)}")
    deadline = None if opts.time_budget_s is None else time.time() + opts.time_budget_s
    path = Path(opts.json)
    data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    data.update(
        target=opts.target, dataset_seed=opts.dataset_seed, pick_target=PICK_TARGET, hard_band=HARD_BAND
    )

    def saver(key: str) -> Save:
        def write(value: Any) -> None:
            data[key] = value
            tmp = path.with_name(path.name + ".tmp")  # replaced whole: a run killed mid-write keeps the last
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            tmp.replace(path)

        return write

    if opts.stage in ("grid", "all"):
        run_grid(opts, deadline, saver("grid"))
        print(format_grid(data["grid"]), flush=True)
    if opts.stage in ("drafts", "all") and opts.draft:
        pick = (data.get("grid") or {}).get("hard_pick")
        hard = next((lv for lv in HARD_CANDIDATES if pick is not None and lv.label == pick["label"]), HARD)
        data["drafts_hard_level"] = hard.label
        run_drafts(opts, hard, deadline, saver("drafts"))
        print(format_drafts(data["drafts"]), flush=True)
    return 0


def format_grid(grid: dict[str, Any]) -> str:
    lines = ["level | n | accuracy (95% CI) | thinking share | mean output tokens"]
    for s in grid["levels"]:
        acc = "-"
        if s["accuracy"] is not None:
            acc = f"{s['accuracy']:.3f} ({s['accuracy_ci_low']:.3f}-{s['accuracy_ci_high']:.3f})"
        n = f"{s['n']}/{s['requested']}" if s["partial"] else str(s["n"])
        share, length = s["thinking_share"], s["mean_output_tokens"]
        lines.append(f"{s['label']} | {n} | {acc} | {share:.3f} | {length:.0f}")
    pick = grid.get("hard_pick")
    if pick is None:
        lines.append("suggested hard level: none (no candidate finished)")
    else:
        lines.append(
            f"suggested hard level: {pick['label']}, accuracy {pick['accuracy']:.3f} "
            f"(in {HARD_BAND[0]:g}-{HARD_BAND[1]:g}: {pick['in_band']}): HARD = {pick['literal']}"
        )
    return "\n".join(lines)


def format_drafts(entries: list[dict[str, Any]]) -> str:
    lines = ["draft | level | mode | accuracy | vs strict (95% CI) | thinking AL | answer AL | relaxed share"]
    for e in entries:
        if "skipped" in e:
            lines.append(f"{e['path']} | skipped ({e['skipped']})")
        for c in e["cells"]:
            head = f"{e['path']} | {c['level']} | {c['mode']}"
            if "skipped" in c:
                lines.append(f"{head} | skipped ({c['skipped']})")
                continue
            vs = c.get("vs_strict")
            d = "-" if vs is None else f"{vs['diff']:+.3f} ({vs['ci_low']:+.3f}, {vs['ci_high']:+.3f})"
            lines.append(
                f"{head} | {c['accuracy']:.3f} | {d} | {c['thinking_acceptance_length']:.2f} | "
                f"{c['answer_acceptance_length']:.2f} | {c['relaxed_share']:.3f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
