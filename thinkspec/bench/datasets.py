"""Benchmark datasets: the toy task, JSONL files with prompt/answer, reasoning-gym when installed.

Every dataset becomes a list of `BenchItem`: a prompt (already formatted, or a user message to
wrap in the tokenizer's chat template) and a grader from completion text to right/wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinkspec.toy.task import LEVELS, THINK_END, THINK_START, Level, chat_prompt, generate_samples
from thinkspec.toy.task import grade as toy_grade

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_RE = re.compile(r"\*\*Answer:\*\*\s*(.+)")


@dataclass(slots=True)
class BenchItem:
    """One problem: what to send, the expected answer, and how to grade a completion."""

    prompt: str
    answer: str
    grader: Callable[[str], bool]
    chat: bool = False  # True: `prompt` is a user message to format with the chat template

    def grade(self, completion: str) -> bool:
        return bool(self.grader(completion))


def final_answer_text(completion: str) -> str | None:
    """The answer part of a completion: after `</think>`; None while still thinking."""
    if THINK_END in completion:
        return completion.rsplit(THINK_END, 1)[1].strip()
    if THINK_START in completion:
        return None
    return completion.strip()


def match_answer(completion: str, answer: str) -> bool:
    """Generic grader: numbers compare as numbers (the last one given), text by exact match.

    Looks at an `**Answer:**` line when there is one, else at the whole answer part; text answers
    match case- and whitespace-insensitively against that line or the answer's last line.
    """
    final = final_answer_text(completion)
    if final is None or not final:
        return False
    tagged = _ANSWER_RE.findall(final)
    region = tagged[-1] if tagged else final
    expected = answer.strip()
    if _NUMBER_RE.fullmatch(expected):
        found = _NUMBER_RE.findall(region.replace(",", ""))
        return bool(found) and float(found[-1]) == float(expected)
    norm = " ".join(expected.lower().split())
    last_line = region.strip().splitlines()[-1] if region.strip() else ""
    candidates = {" ".join(region.lower().split()), " ".join(last_line.lower().split())}
    return norm in {c.rstrip(".") for c in candidates}


def toy_dataset(num_prompts: int, seed: int, level: Level | None = None) -> list[BenchItem]:
    """`num_prompts` fresh toy problems of `level` (default easy), graded by their exact answer."""
    items = []
    for s in generate_samples(num_prompts, seed=seed, level=level):
        p = s.problem
        items.append(
            BenchItem(
                prompt=chat_prompt(p.question), answer=str(p.answer), grader=lambda t, p=p: toy_grade(t, p)
            )
        )
    return items


def jsonl_dataset(path: str | Path, num_prompts: int | None = None) -> list[BenchItem]:
    """Lines of {"prompt": str, "answer": str|number}; the prompt is a user message (chat template)."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or "prompt" not in record or "answer" not in record:
                raise ValueError(f"{path}:{lineno}: each line needs 'prompt' and 'answer' fields")
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            answer = str(record["answer"])
            items.append(
                BenchItem(record["prompt"], answer, lambda t, a=answer: match_answer(t, a), chat=True)
            )
            if num_prompts is not None and len(items) >= num_prompts:
                break
    if not items:
        raise ValueError(f"{path}: no records")
    return items


def reasoning_gym_dataset(name: str, num_prompts: int, seed: int) -> list[BenchItem]:
    """A reasoning-gym task (pip install reasoning-gym), graded by the task's own score_answer."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as e:
        raise ValueError(
            f"dataset 'rg:{name}' needs the reasoning-gym package: pip install reasoning-gym"
        ) from e
    data = reasoning_gym.create_dataset(name, size=num_prompts, seed=seed)

    def grader(text: str, entry: dict[str, Any]) -> bool:
        final = final_answer_text(text)
        if not final:
            return False
        tagged = _ANSWER_RE.findall(final)
        return float(data.score_answer(answer=(tagged[-1] if tagged else final).strip(), entry=entry)) >= 1.0

    return [BenchItem(e["question"], str(e["answer"]), lambda t, e=e: grader(t, e), chat=True) for e in data]


def check_level(spec: str, level: str) -> Level:
    """The toy task's level named `level`; ValueError for an unknown name or a dataset without levels."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
    if spec != "toy" and level != "easy":
        raise ValueError(f"--level applies to the toy dataset only, got --level {level} for {spec!r}")
    return LEVELS[level]


def default_max_tokens(spec: str, level: str) -> int:
    """Generation budget when none is given: the toy level's (it fits every completion), else 512."""
    return check_level(spec, level).max_new_tokens if spec == "toy" else 512


def load_dataset(spec: str, num_prompts: int, seed: int = 20261201, level: str = "easy") -> list[BenchItem]:
    """'toy' (at `level`: easy or hard), 'rg:TASK' (reasoning-gym) or a path to a .jsonl file;
    `num_prompts` items at most."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    toy_level = check_level(spec, level)
    if spec == "toy":
        return toy_dataset(num_prompts, seed, toy_level)
    if spec.startswith("rg:"):
        return reasoning_gym_dataset(spec[3:], num_prompts, seed)
    if Path(spec).is_file():
        return jsonl_dataset(spec, num_prompts)
    raise ValueError(f"dataset must be 'toy', 'rg:TASK' or an existing JSONL file, got {spec!r}")
