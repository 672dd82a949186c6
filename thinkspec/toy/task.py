"""Synthetic reasoning task: multi-step arithmetic word problems with reasoning-model traces.

A problem is a running total: a start value followed by operations (+, -, x) applied in order.
The thinking trace works each operation column by column. Every number in the trace is a
function of the text before it; the wording around the numbers is drawn uniformly from several
near-equivalent phrasings (synonyms, connectives, optional checks, operand order), so a model
trained on it has high-entropy forks on words and near-certainty on digits.

A `Level` says how many numbers a problem has and how large they get: `easy` (2-4 numbers,
totals up to 4 digits) is the original task, `hard` has more steps and larger numbers. Training
data mixes several boxes of that space (`TRAIN_MIXES`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

OPS = ("+", "-", "x")
MAX_VALUE = 9999  # the easy level's bound on every running total (four digits)
COLUMN_NAMES = ("ones", "tens", "hundreds", "thousands", "ten thousands", "hundred thousands")
MAX_FACTOR = 9  # x multiplies by one digit: the column trace writes one product per digit
MAX_OPERANDS = 12

NAMES = (
    ("Mia", "she"),
    ("Leo", "he"),
    ("Ava", "she"),
    ("Sam", "he"),
    ("Zoe", "she"),
    ("Max", "he"),
    ("Lily", "she"),
    ("Ben", "he"),
    ("Emma", "she"),
    ("Noah", "he"),
    ("Ella", "she"),
    ("Jack", "he"),
)
ITEMS = (
    "apples",
    "stickers",
    "marbles",
    "coins",
    "books",
    "stamps",
    "cards",
    "shells",
    "pencils",
    "beads",
    "cookies",
    "buttons",
)

CHAT_USER = "<|im_start|>user\n{content}<|im_end|>\n"
CHAT_ASSISTANT_PROMPT = "<|im_start|>assistant\n"
THINK_START, THINK_END, EOS = "<think>", "</think>", "<|im_end|>"


@dataclass(frozen=True, slots=True)
class Level:
    """How many numbers a problem has and how large they get; a level is data, nothing else."""

    min_operands: int  # numbers in the problem, the start value included
    max_operands: int
    max_operand: int  # the start value and every +/- operand are drawn from [10, max_operand]
    max_value: int  # every running total stays in [1, max_value]
    max_new_tokens: int  # a generation budget that fits every completion of the level

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands <= MAX_OPERANDS:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands <= {MAX_OPERANDS}, got "
                f"min_operands={self.min_operands}, max_operands={self.max_operands}"
            )
        top = 10 ** len(COLUMN_NAMES) - 1  # every column of a total needs a name in the trace
        if not 999 <= self.max_value <= top:
            raise ValueError(f"max_value must be in [999, {top}], got {self.max_value}")
        if not 99 <= self.max_operand <= self.max_value:
            raise ValueError(
                f"max_operand must be in [99, max_value={self.max_value}], got {self.max_operand}"
            )
        if not 16 <= self.max_new_tokens <= 65536:
            raise ValueError(f"max_new_tokens must be in [16, 65536], got {self.max_new_tokens}")

    @property
    def label(self) -> str:
        """Short name, e.g. 'ops5-6 d4/5': operand count range, digits of operands / totals."""
        digits = f"d{len(str(self.max_operand))}/{len(str(self.max_value))}"
        return f"ops{self.min_operands}-{self.max_operands} {digits}"


def _box(ops: tuple[int, int], digits: int, max_new_tokens: int) -> Level:
    """Operand counts in `ops`, operands of up to `digits` digits, totals of up to digits + 1."""
    return Level(ops[0], ops[1], 10**digits - 1, 10 ** (digits + 1) - 1, max_new_tokens)


# The original task, unchanged (same generator output for the same seed).
EASY = Level(min_operands=2, max_operands=4, max_operand=999, max_value=9999, max_new_tokens=512)
# Candidates for HARD: more steps x larger numbers, each a box of the training range below.
# max_new_tokens: the longest completion of 5,000 samples (task tokenizer) plus 10%, in 64s.
HARD_CANDIDATES = (
    _box((5, 6), 3, 832),
    _box((5, 6), 4, 960),
    _box((5, 6), 5, 1152),
    _box((7, 8), 3, 1088),
    _box((7, 8), 4, 1344),
    _box((7, 8), 5, 1536),
    _box((9, 10), 3, 1344),
    _box((9, 10), 4, 1600),
    _box((9, 10), 5, 1856),
)
# The candidate whose measured greedy accuracy of the bundled target is nearest 80%
# (`python -m thinkspec.bench.difficulty`); it must stay one of HARD_CANDIDATES.
HARD = Level(min_operands=9, max_operands=10, max_operand=99999, max_value=999999, max_new_tokens=1856)
LEVELS = {"easy": EASY, "hard": HARD}
# Training data: (level, weight) pairs, one level drawn per sample. "range" covers easy, short
# problems with larger numbers and every hard candidate; easy weighs 4, a quarter of the samples.
TRAIN_MIXES: dict[str, tuple[tuple[Level, float], ...]] = {
    "easy": ((EASY, 1.0),),
    "range": ((EASY, 4.0), (_box((2, 4), 4, 640), 1.0), (_box((2, 4), 5, 768), 1.0))
    + tuple((lv, 1.0) for lv in HARD_CANDIDATES),
}


@dataclass(slots=True)
class Problem:
    """A start value and the operations applied to it in order."""

    start: int
    ops: list[tuple[str, int]]
    name: str
    pronoun: str
    item: str
    question: str = ""

    @property
    def operands(self) -> list[int]:
        return [self.start] + [b for _, b in self.ops]

    def intermediates(self) -> list[int]:
        """Running totals after each operation."""
        out, v = [], self.start
        for op, b in self.ops:
            v = apply_op(v, op, b)
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.intermediates()[-1]


@dataclass(slots=True)
class Sample:
    """One training/eval example: prompt text, completion text and where the forks are."""

    problem: Problem
    prompt: str  # chat-formatted, ends with the assistant header
    thinking: str  # text between "<think>\n" and "\n</think>"
    answer_text: str  # text after "</think>\n\n", before the end-of-turn token
    # Character offsets into `completion` where a uniform wording choice starts, and its option count.
    forks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def completion(self) -> str:
        return f"{THINK_START}\n{self.thinking}\n{THINK_END}\n\n{self.answer_text}{EOS}"

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def apply_op(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "x":
        return a * b
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def generate_problem(rng: random.Random, level: Level | None = None) -> Problem:
    """Draw a problem of `level` (default easy): the start value and every +/- operand in
    [10, max_operand], x by a factor 2-9 of a total at most max_operand, totals in [1, max_value]."""
    lv = level or EASY
    n_ops = rng.randint(lv.min_operands, lv.max_operands) - 1
    start = rng.randint(10, lv.max_operand)
    ops: list[tuple[str, int]] = []
    v = start
    for _ in range(n_ops):
        allowed = []
        if v + 10 <= lv.max_value:
            allowed.append("+")
        if v >= 20:
            allowed.append("-")
        if v <= lv.max_operand and v * 2 <= lv.max_value:
            allowed.append("x")
        op = rng.choice(allowed)
        if op == "+":
            b = rng.randint(10, min(lv.max_operand, lv.max_value - v))
        elif op == "-":
            b = rng.randint(10, min(lv.max_operand, v - 1))
        else:
            b = rng.randint(2, min(MAX_FACTOR, lv.max_value // v))
        ops.append((op, b))
        v = apply_op(v, op, b)
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    p = Problem(start=start, ops=ops, name=name, pronoun=pronoun, item=item)
    p.question = _question(p, rng)
    return p


def _question(p: Problem, rng: random.Random) -> str:
    he, item = p.pronoun.capitalize(), p.item
    parts = [f"{p.name} has {p.start} {item}."]
    for i, (op, b) in enumerate(p.ops):
        then = "Then " if i else ""
        subj = he.lower() if i else he
        if op == "+":
            verb = rng.choice(("gets", "buys", "finds"))
            parts.append(f"{then}{subj} {verb} {b} more.")
        elif op == "-":
            verb = rng.choice(("gives away", "loses", "sells"))
            parts.append(f"{then}{subj} {verb} {b}.")
        else:
            parts.append(f"{then}{subj} ends up with {b} times as many.")
    parts.append(f"How many {item} does {p.name} have now?")
    return " ".join(parts)


def chat_prompt(question: str) -> str:
    """The Qwen3 chat format for one user turn plus the assistant header (thinking on)."""
    return CHAT_USER.format(content=question) + CHAT_ASSISTANT_PROMPT


class _Writer:
    """Accumulates trace text and records where each uniform wording choice begins."""

    def __init__(self, rng: random.Random, offset: int, fork_bias: float = 0.0) -> None:
        self.rng = rng
        self.fork_bias = fork_bias
        self.parts: list[str] = []
        self.pos = offset
        self.forks: list[tuple[int, int]] = []

    def put(self, text: str) -> None:
        self.parts.append(text)
        self.pos += len(text)

    def choose(self, *options: str) -> str:
        """Choice among phrasings whose first tokens differ; never decides a digit. Uniform unless
        fork_bias > 0, which picks the first (canonical) phrasing with that extra probability."""
        self.forks.append((self.pos, len(options)))
        # No extra draw at fork_bias 0, so the default stream (and every bundled dataset) is unchanged.
        if self.fork_bias > 0 and self.rng.random() < self.fork_bias:
            s = options[0]
        else:
            s = self.rng.choice(options)
        self.put(s)
        return s

    def text(self) -> str:
        return "".join(self.parts)


def _digits(n: int) -> list[int]:
    """Decimal digits, ones first."""
    return [int(c) for c in reversed(str(n))]


def _column_head(w: _Writer, j: int) -> None:
    col = COLUMN_NAMES[j]
    w.choose(f"{col.capitalize()}:", f"In the {col} column,", f"For the {col},", f"Now the {col}:")


def _equals(w: _Writer) -> None:
    w.choose(" =", " gives", " makes", " is")


_OP_WORDS = {
    "+": (" +", " plus", " and", " added to"),
    "-": (" -", " minus", " take away", " less"),
    "x": (" x", " times", " multiplied by", " *"),
}


def _op_word(w: _Writer, op: str) -> None:
    w.choose(*_OP_WORDS[op])


def _write_and_carry(w: _Writer, digit: int, carry: int) -> None:
    w.put(",")
    w.choose(" write", " keep", " put down", " note")
    w.put(f" {digit}")
    w.choose(f" and carry {carry}", f" with a carry of {carry}", f" carrying {carry}", f", carry {carry}")


def _add_columns(w: _Writer, a: int, b: int) -> None:
    da, db = _digits(a), _digits(b)
    n = max(len(da), len(db))
    carry = 0
    for j in range(n):
        x = da[j] if j < len(da) else 0
        y = db[j] if j < len(db) else 0
        s = x + y + carry
        w.put("\n")
        _column_head(w, j)
        w.put(f" {x}")
        _op_word(w, "+")
        w.put(f" {y}" + (f" + {carry}" if carry else ""))
        _equals(w)
        w.put(f" {s}")
        if s >= 10 and j < n - 1:
            _write_and_carry(w, s % 10, 1)
            carry = 1
        else:
            carry = 0
        w.put(".")


def _sub_columns(w: _Writer, a: int, b: int) -> None:
    da, db = _digits(a), _digits(b)
    borrow = 0
    for j in range(len(da)):
        x = da[j]
        y = db[j] if j < len(db) else 0
        tail = " - 1" if borrow else ""
        w.put("\n")
        _column_head(w, j)
        w.put(f" {x}")
        _op_word(w, "-")
        w.put(f" {y}{tail}")
        if x - y - borrow < 0:
            w.choose(" is negative", " goes below zero", " does not work", " cannot be done")
            w.put(", so")
            w.choose(" borrow:", " I borrow:", " take 1 from the next column:", " we borrow:")
            w.put(f" 1{x} - {y}{tail}")
            _equals(w)
            w.put(f" {10 + x - y - borrow}.")
            borrow = 1
        else:
            _equals(w)
            w.put(f" {x - y - borrow}.")
            borrow = 0


def _mul_columns(w: _Writer, a: int, f: int) -> None:
    da = _digits(a)
    carry = 0
    for j, x in enumerate(da):
        w.put("\n")
        _column_head(w, j)
        w.put(f" {x}")
        _op_word(w, "x")
        w.put(f" {f}")
        _equals(w)
        w.put(f" {x * f}")
        q = x * f + carry
        if carry:
            w.put(",")
            w.choose(" plus", " adding", " and with", " then adding")
            w.put(f" the carry {carry}")
            w.choose(" is", " that is", " we get", " which makes")
            w.put(f" {q}")
        if q >= 10 and j < len(da) - 1:
            _write_and_carry(w, q % 10, q // 10)
            carry = q // 10
        else:
            carry = 0
        w.put(".")


_ORDINALS = (
    ("First", "To start", "Step one", "Initially"),
    ("Next", "Then", "After that", "Now"),
    ("Finally", "Last", "And finally", "In the end"),
)


def _step(w: _Writer, p: Problem, i: int, a: int, op: str, b: int) -> int:
    r = apply_op(a, op, b)
    last = i == len(p.ops) - 1
    ordinals = _ORDINALS[0] if i == 0 else _ORDINALS[2] if last else _ORDINALS[1]
    w.put("\n\n")
    w.choose(*ordinals)
    w.put(",")
    w.choose(f" {p.pronoun}", f" {p.name}")
    if op == "+":
        w.choose(" gets", " adds", " gains", " receives")
        w.put(f" {b} more, so")
        # The wording fixes the operand order before any digit is written.
        form = w.choose(" we need", " that is", " I add", " let me do")
        w.put(f" {b} to {a}." if form == " I add" else f" {a} + {b}.")
        _add_columns(w, a, b)
    elif op == "-":
        w.choose(" gives away", " loses", " removes", " uses up")
        w.put(f" {b}, so")
        form = w.choose(" we need", " that is", " I take", " let me do")
        w.put(f" {b} from {a}." if form == " I take" else f" {a} - {b}.")
        _sub_columns(w, a, b)
    else:
        w.choose(" ends up with", " gets", " has", " now has")
        w.put(f" {b} times as many, so")
        form = w.choose(" we need", " that is", " I multiply", " let me do")
        w.put(f" {a} by {b}." if form == " I multiply" else f" {a} x {b}.")
        _mul_columns(w, a, b)
    w.put("\n")
    sym = {"+": "+", "-": "-", "x": "x"}[op]
    summary = w.choose("So", "That gives", "This makes", "The result is")
    if summary == "So":
        w.put(f" {a} {sym} {b} = {r}.")
    else:
        w.put(f" {r}.")
    # Optional verification by the inverse operation; "" (no check) is one of the options.
    inverse = {"+": f"{r} - {b} = {a}", "-": f"{r} + {b} = {a}", "x": f"{r} / {b} = {a}"}[op]
    check = w.choose("", " Wait,", " Let me double-check:", " Checking:")
    if check == " Wait,":
        w.choose(" is that right?", " let me check that.", " does it add up?")
        w.put(f" {inverse}, so")
        w.choose(" it checks out.", " that is correct.", " yes.")
    elif check:
        w.put(f" {inverse}.")
        w.choose(" Yes.", " Right.", " Good.", " Correct.")
    return r


def render_sample(p: Problem, rng: random.Random, fork_bias: float = 0.0) -> Sample:
    """Write the chat prompt, thinking trace and final answer for a problem (fork_bias: see _Writer)."""
    if not 0 <= fork_bias <= 1:
        raise ValueError(f"fork_bias must be in [0, 1], got {fork_bias}")
    prompt = chat_prompt(p.question)
    w = _Writer(rng, offset=len(THINK_START) + 1, fork_bias=fork_bias)
    w.choose("Okay", "Alright", "So", "Hmm")
    w.put(",")
    w.choose(" let me", " I need to", " we want to", " the goal is to")
    w.choose(" work out", " figure out", " find", " count")
    w.put(f" how many {p.item} {p.name}")
    w.choose(" has at the end.", " ends up with.", " is left with.", " gets in the end.")
    w.put("\n")
    w.choose(p.name, p.pronoun.capitalize(), f"At first {p.pronoun}", f"Initially {p.pronoun}")
    w.choose(" starts with", " begins with", " has", " owns")
    w.put(f" {p.start} {p.item}.")
    v = p.start
    for i, (op, b) in enumerate(p.ops):
        v = _step(w, p, i, v, op, b)
    w.put("\n\n")
    w.choose("So", "Therefore", "That means", "Overall")
    w.put(f" {p.name}")
    w.choose(" has", " ends up with", " is left with")
    w.put(f" {v} {p.item}.")
    answer = f"{p.name} ends up with {v} {p.item}.\n\n**Answer:** {v}"
    return Sample(problem=p, prompt=prompt, thinking=w.text(), answer_text=answer, forks=w.forks)


def generate_samples(n: int, seed: int, level: Level | None = None, fork_bias: float = 0.0) -> list[Sample]:
    """`n` samples of `level` (default easy) from one seeded stream (problem and wording share the RNG)."""
    return generate_mixed_samples(n, seed, ((level or EASY, 1.0),), fork_bias)


def generate_mixed_samples(
    n: int, seed: int, mix: Sequence[tuple[Level, float]], fork_bias: float = 0.0
) -> list[Sample]:
    """`n` samples, each of a level drawn from `mix` ((level, weight) pairs) in one seeded stream.

    A one-level mix draws nothing for the level, so it is exactly that level's stream.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not mix or any(w <= 0 for _, w in mix):
        raise ValueError(f"mix needs at least one (level, weight) pair with weight > 0, got {mix!r}")
    rng = random.Random(seed)
    levels, weights = [lv for lv, _ in mix], [w for _, w in mix]
    out = []
    for _ in range(n):
        lv = levels[0] if len(levels) == 1 else rng.choices(levels, weights)[0]
        out.append(render_sample(generate_problem(rng, lv), rng, fork_bias))
    return out


_ANSWER_RE = re.compile(r"\*\*Answer:\*\*\s*(-?\d+)")
_INT_RE = re.compile(r"-?\d+")


def extract_answer(completion: str) -> int | None:
    """Final answer from a completion: `**Answer:** N` after `</think>`, else its last integer."""
    if THINK_END in completion:
        completion = completion.rsplit(THINK_END, 1)[1]
    elif THINK_START in completion:
        return None  # still thinking: no answer was given
    m = _ANSWER_RE.findall(completion)
    if m:
        return int(m[-1])
    nums = _INT_RE.findall(completion)
    return int(nums[-1]) if nums else None


def grade(completion: str, problem: Problem) -> bool:
    """True iff the completion's final answer equals the problem's answer."""
    return extract_answer(completion) == problem.answer
