from __future__ import annotations

import dataclasses
import hashlib
import random
import re

import pytest

from thinkspec.toy.task import (
    EASY,
    EOS,
    HARD,
    HARD_CANDIDATES,
    LEVELS,
    MAX_VALUE,
    OPS,
    THINK_END,
    THINK_START,
    TRAIN_MIXES,
    Level,
    apply_op,
    chat_prompt,
    extract_answer,
    generate_mixed_samples,
    generate_problem,
    generate_samples,
    grade,
    render_sample,
)


def _ops(lo: int, hi: int) -> Level:
    """The easy level with another operand-count range."""
    return dataclasses.replace(EASY, min_operands=lo, max_operands=hi)


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
        p = generate_problem(rng, _ops(2, 2))
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
    p = generate_problem(random.Random(1), _ops(3, 3))
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
    with pytest.raises(ValueError, match="max_operands <= 12"):
        _ops(2, 13)
    with pytest.raises(ValueError, match="min_operands"):
        _ops(1, 3)
    with pytest.raises(ValueError, match="min_operands <= max_operands"):
        _ops(4, 3)
    with pytest.raises(ValueError, match=r"max_value must be in \[999, 999999\]"):
        dataclasses.replace(EASY, max_value=10**6)
    with pytest.raises(ValueError, match="max_operand must be in"):
        dataclasses.replace(EASY, max_operand=10**4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dataclasses.replace(EASY, max_new_tokens=8)
    with pytest.raises(ValueError, match="op must be one of"):
        apply_op(1, "/", 2)
    with pytest.raises(ValueError, match="n must be"):
        generate_samples(-1, seed=0)
    with pytest.raises(ValueError, match="weight > 0"):
        generate_mixed_samples(2, 0, [(EASY, 0.0)])
    with pytest.raises(ValueError, match="weight > 0"):
        generate_mixed_samples(2, 0, [])


def test_fork_bias_moves_choices_to_the_first_phrasing():
    p = generate_problem(random.Random(3), _ops(4, 4))
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


# --- difficulty levels ---


def _digest(samples) -> str:
    return hashlib.sha256("\x00".join(s.text for s in samples).encode()).hexdigest()


def test_easy_level_is_the_original_stream():
    # Digests of the generator's output before levels existed: the bundled pair, the sweep's easy
    # numbers and every seeded test depend on this stream staying the same.
    assert _digest(generate_samples(300, seed=20261201)) == (
        "2af9dc3694c62b7e7ae7e7174d47a530a518b8d17dd1a97841107e67d5b5d51d"
    )
    assert _digest(generate_samples(200, seed=0, fork_bias=0.9)) == (
        "0cb1ba8b2348471dc9a4e17c303ef788043fd130d07b59dc0414394033df75c4"
    )
    assert generate_samples(5, seed=3, level=EASY)[4].text == generate_samples(5, seed=3)[4].text
    rng = random.Random(5)
    pinned = [(p.start, p.ops, p.name, p.item, p.answer) for p in (generate_problem(rng) for _ in range(3))]
    assert pinned == [
        (271, [("x", 7), ("+", 870), ("-", 804)], "Sam", "cookies", 1963),
        (390, [("-", 136)], "Lily", "pencils", 254),
        (265, [("+", 758), ("+", 427), ("-", 196)], "Lily", "marbles", 1254),
    ]
    first = generate_samples(1, seed=20261201)[0].problem
    assert first.question == "Sam has 934 coins. He gets 162 more. How many coins does Sam have now?"
    # A one-level mix draws nothing for the level: it is that level's stream.
    assert _digest(generate_mixed_samples(50, 7, [(EASY, 2.0)])) == _digest(generate_samples(50, seed=7))


@pytest.mark.parametrize("level", HARD_CANDIDATES, ids=lambda lv: lv.label)
def test_hard_candidates_stay_in_bounds_and_grade(level):
    rng = random.Random(17)
    counts, ops_seen, biggest = set(), set(), {"+": 0, "-": 0}
    for _ in range(400):
        p = generate_problem(rng, level)
        counts.add(len(p.operands))
        for op, b in p.ops:
            if op != "x":
                biggest[op] = max(biggest[op], b)
        assert 10 <= p.start <= level.max_operand
        v = p.start
        for op, b in p.ops:
            ops_seen.add(op)
            if op == "x":
                assert 2 <= b <= 9 and v <= level.max_operand
            else:
                assert 10 <= b <= level.max_operand
            v = apply_op(v, op, b)
            assert 1 <= v <= level.max_value
        assert p.answer == v
    assert counts == set(range(level.min_operands, level.max_operands + 1))
    # +/- operands use the level's digits
    assert [len(str(b)) for b in biggest.values()] == [len(str(level.max_operand))] * 2
    assert ops_seen == set(OPS)
    # Big enough to need the extra columns, and every trace is right and gradable.
    samples = generate_samples(60, seed=23, level=level)
    assert max(len(str(s.problem.answer)) for s in samples) == len(str(level.max_value))
    for s in samples:
        _check_equations(s.thinking)
        assert int(re.findall(r"\d+", s.thinking)[-1]) == s.problem.answer
        assert grade(s.completion, s.problem)
        wrong = s.completion.replace(f"**Answer:** {s.problem.answer}", f"**Answer:** {s.problem.answer + 1}")
        assert not grade(wrong, s.problem)
        for off, m in s.forks:
            assert m >= 2 and not s.completion[off : off + 2].lstrip()[:1].isdigit()


def _check_equations(thinking: str) -> int:
    n = 0
    for lhs, r in _EQ.findall(_symbols(thinking)):
        terms = lhs.split(" ")
        v = int(terms[0])
        for op, b in zip(terms[1::2], terms[2::2]):
            v = v // int(b) if op == "/" else apply_op(v, op, int(b))
        assert v == int(r), (lhs, r)
        n += 1
    return n


def test_large_numbers_name_every_column():
    # 35,417 + 62,855: five columns, the last two named past the thousands.
    p = generate_problem(random.Random(0), _ops(2, 2))
    p.start, p.ops = 35417, [("+", 62855)]
    s = render_sample(p, random.Random(4))
    heads = re.findall(r"(Ones|Tens|Hundreds|Thousands|Ten thousands|ones|tens|hundreds|thousands|"
                       r"ten thousands)(?: column)?[:,] (\d) (?:\+|plus|and|added to) (\d)", s.thinking)
    assert [(h.lower(), int(x), int(y)) for h, x, y in heads] == [
        ("ones", 7, 5), ("tens", 1, 5), ("hundreds", 4, 8), ("thousands", 5, 2), ("ten thousands", 3, 6)
    ]  # fmt: skip
    assert extract_answer(s.completion) == 98272


def test_levels_are_data_and_hard_is_a_trained_candidate():
    assert LEVELS == {"easy": EASY, "hard": HARD}
    assert (EASY.min_operands, EASY.max_operands, EASY.max_operand, EASY.max_value) == (2, 4, 999, MAX_VALUE)
    assert EASY.max_new_tokens == 512  # the sweep's easy budget before levels existed
    assert HARD in HARD_CANDIDATES  # picking the hard level = choosing one candidate
    trained = [lv for lv, w in TRAIN_MIXES["range"] if w > 0]
    assert EASY in trained and all(lv in trained for lv in HARD_CANDIDATES)
    assert TRAIN_MIXES["easy"] == ((EASY, 1.0),)
    assert len({lv.label for lv in HARD_CANDIDATES}) == len(HARD_CANDIDATES)
    assert EASY.label == "ops2-4 d3/4"


def test_mixed_samples_draw_levels_by_weight():
    samples = generate_mixed_samples(3000, 5, TRAIN_MIXES["range"])
    weights = dict((lv.label, w) for lv, w in TRAIN_MIXES["range"])
    total = sum(weights.values())

    def box(s) -> str:  # the smallest box of the mix that holds the problem
        n, top = len(s.problem.operands), max([s.problem.start, *(b for _, b in s.problem.ops)])
        for lv, _ in TRAIN_MIXES["range"]:
            if lv.min_operands <= n <= lv.max_operands and top <= lv.max_operand:
                return lv.label
        raise AssertionError(s.problem)

    easy_share = sum(box(s) == EASY.label for s in samples) / len(samples)
    # The easy box also catches small-number problems of the wider boxes: a lower bound.
    assert easy_share >= weights[EASY.label] / total - 0.03
    assert max(len(s.problem.operands) for s in samples) == 10
    assert max(s.problem.answer for s in samples) > 99999
    assert _digest(generate_mixed_samples(20, 5, TRAIN_MIXES["range"])) == _digest(samples[:20])
