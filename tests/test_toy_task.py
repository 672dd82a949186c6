from __future__ import annotations

import random
import re

import pytest

from thinkspec.toy.task import (
    EOS,
    MAX_VALUE,
    OPS,
    THINK_END,
    THINK_START,
    apply_op,
    chat_prompt,
    extract_answer,
    generate_problem,
    generate_samples,
    grade,
    render_sample,
)


def _eval(start: int, ops: list[tuple[str, int]]) -> int:
    v = start
    for op, b in ops:
        v = {"+": v + b, "-": v - b, "x": v * b}[op]
    return v


def test_generator_is_seeded_and_varied():
    a = [s.text for s in generate_samples(20, seed=7)]
    b = [s.text for s in generate_samples(20, seed=7)]
    c = [s.text for s in generate_samples(20, seed=8)]
    assert a == b
    assert a != c
    assert len(set(a)) == 20


def test_problem_constraints_and_answer():
    rng = random.Random(123)
    n_ops_seen, ops_seen = set(), set()
    for _ in range(2000):
        p = generate_problem(rng)
        assert 2 <= len(p.operands) <= 4
        n_ops_seen.add(len(p.ops))
        v = p.start
        assert 10 <= p.start <= 999
        for op, b in p.ops:
            assert op in OPS
            ops_seen.add(op)
            if op == "x":
                assert 2 <= b <= 9
            else:
                assert 10 <= b <= 999
            v = apply_op(v, op, b)
            assert 1 <= v <= MAX_VALUE
        assert p.answer == v == _eval(p.start, p.ops)
        assert p.intermediates()[-1] == p.answer
        assert str(p.start) in p.question and p.name in p.question
    assert n_ops_seen == {1, 2, 3}
    assert ops_seen == set(OPS)


def test_chat_format_is_qwen3():
    s = generate_samples(1, seed=3)[0]
    assert s.prompt == f"<|im_start|>user\n{s.problem.question}<|im_end|>\n<|im_start|>assistant\n"
    assert s.prompt == chat_prompt(s.problem.question)
    assert s.completion.startswith(f"{THINK_START}\n")
    assert f"\n{THINK_END}\n\n" in s.completion
    assert s.completion.endswith(EOS)
    assert s.text == s.prompt + s.completion
    assert s.completion.count(THINK_START) == 1 and s.completion.count(THINK_END) == 1


_EQ = re.compile(r"(?<!\d)(?<![\d+x/-] )(\d+(?: [-+x/] \d+)+) = (\d+)")


_WORDS = {
    "minus": "-",
    "less": "-",
    "take away": "-",
    "plus": "+",
    "and": "+",
    "added to": "+",
    "times": "x",
    "multiplied by": "x",
    "\\*": "x",
    "gives": "=",
    "makes": "=",
    "is": "=",
}


def _symbols(text: str) -> str:
    """Column lines written with words, rewritten with symbols so they can be checked."""
    for word, sym in _WORDS.items():
        text = re.sub(rf"(?<=\d) {word} (?=\d)", f" {sym} ", text)
    return text


def test_every_written_equation_is_correct():
    n_eq = 0
    for s in generate_samples(300, seed=11):
        for lhs, r in _EQ.findall(_symbols(s.thinking)):
            terms = lhs.split(" ")
            v = int(terms[0])
            for op, b in zip(terms[1::2], terms[2::2]):
                v = v // int(b) if op == "/" else apply_op(v, op, int(b))
            assert v == int(r), (lhs, r)
            n_eq += 1
        # The last number of the trace is the answer, and the answer section repeats it.
        assert int(re.findall(r"\d+", s.thinking)[-1]) == s.problem.answer
        assert extract_answer(s.completion) == s.problem.answer
    assert n_eq > 2000  # column lines included


def test_column_steps_follow_the_digits():
    # A one-operation addition: the per-column sums written in the trace must be the real ones.
    rng = random.Random(5)
    for _ in range(200):
        p = generate_problem(rng, 2, 2)
        s = render_sample(p, rng)
        op, b = p.ops[0]
        if op != "+":
            continue
        a = p.start
        cols = re.findall(
            r"(?:Ones|Tens|Hundreds|Thousands|ones|tens|hundreds|thousands)(?: column)?[:,] "
            r"(\d) (?:\+|plus|and|added to) (\d)(?: \+ 1)? (?:=|gives|makes|is) (\d+)",
            s.thinking,
        )
        da, db = str(a)[::-1], str(b)[::-1]
        for j, (x, y, _) in enumerate(cols):
            assert int(x) == (int(da[j]) if j < len(da) else 0)
            assert int(y) == (int(db[j]) if j < len(db) else 0)
        assert len(cols) == max(len(da), len(db))


def test_wording_varies_but_numbers_do_not():
    p = generate_problem(random.Random(1), 3, 3)
    texts = [render_sample(p, random.Random(i)).thinking for i in range(60)]
    assert len(set(texts)) == 60
    # The sequence of results is fixed by the problem; only phrasing changes.
    for t in texts:
        pattern = r"(?:So \d+ [-+x] \d+ = |That gives |This makes |The result is )(\d+)"
        sums = [int(x) for x in re.findall(pattern, t)]
        assert sums == p.intermediates()


def test_forks_never_start_on_a_digit():
    for s in generate_samples(100, seed=21):
        comp = s.completion
        assert s.forks
        for off, m in s.forks:
            assert m >= 2
            nxt = comp[off : off + 2].lstrip()
            assert not nxt[:1].isdigit(), comp[off - 20 : off + 20]


def test_grader():
    s = generate_samples(1, seed=4)[0]
    ans = s.problem.answer
    assert grade(s.completion, s.problem)
    wrong = s.completion.replace(f"**Answer:** {ans}", f"**Answer:** {ans + 1}")
    assert not grade(wrong, s.problem)
    assert extract_answer(f"{THINK_START}\nstill thinking 12") is None
    assert extract_answer(f"{THINK_START}\nx\n{THINK_END}\n\nIt is 42.") == 42
    assert extract_answer("no think block, answer 17 then **Answer:** 19") == 19
    assert extract_answer(f"{THINK_START}\n5\n{THINK_END}\n\nno number") is None


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_operands"):
        generate_problem(random.Random(0), 2, 5)
    with pytest.raises(ValueError, match="min_operands"):
        generate_problem(random.Random(0), 1, 3)
    with pytest.raises(ValueError, match="op must be one of"):
        apply_op(1, "/", 2)
    with pytest.raises(ValueError, match="n must be"):
        generate_samples(-1, seed=0)


def test_fork_bias_moves_choices_to_the_first_phrasing():
    p = generate_problem(random.Random(3), 4, 4)
    # Bias 1: every fork takes its first option, so the wording no longer depends on the RNG.
    canonical = {render_sample(p, random.Random(i), fork_bias=1.0).thinking for i in range(20)}
    assert len(canonical) == 1
    # Bias 0 is the default stream exactly (no extra draws).
    for i in range(5):
        biased = render_sample(p, random.Random(i), fork_bias=0.0)
        assert biased.thinking == render_sample(p, random.Random(i)).thinking
    # Bias b: the first option's share at 4-way forks is about b + (1 - b) / 4; numbers are untouched.
    first = total = 0
    for s in generate_samples(300, seed=9, fork_bias=0.5):
        assert extract_answer(s.completion) == s.problem.answer
        pos, n = s.forks[0]  # the opening word: Okay / Alright / So / Hmm
        assert n == 4
        first += s.completion.startswith("Okay", pos)
        total += 1
    assert total == 300 and abs(first / total - (0.5 + 0.5 / 4)) < 0.07
    with pytest.raises(ValueError, match="fork_bias"):
        render_sample(p, random.Random(0), fork_bias=1.5)
