"""What one engine step costs, as a function of batch size and draft length: the adaptive draft
length's cost model.

Per graph batch bucket b the model holds one `StepCosts` row (below; thinkspec/bench/projection.py
projects sweeps with the same record) for every k = 0..K: plain_ms = one plain decode forward,
draft_ms = one single-token draft forward, verify_ms = one target forward of b x (k+1) tokens; its
round_ms = k * draft_ms + verify_ms is a round where every row drafts k (k = 0: the plain step).
Between measured buckets a figure is linear in the batch size, flat beyond them
(round_ms_at). A step whose rows draft different numbers of tokens (one forward, each
row its own window, graph width max k + 1) costs

  round_ms(B, kmax) + sum_{j=1}^{kmax-1} (draft_ms(n_j) - draft_ms(B))     n_j: rows drafting > j

since draft forward j only runs the rows that still draft. Attention over the rows' contexts comes
on top, C x context_ms(B)[kmax] for C tokens of context over the rows: each forward reads the K/V
of every row again (kmax draft forwards and the verify), which at long contexts outweighs the rest.
On top of that each step pays work the
graph timings do not see (scheduling, packing, the logits windows and acceptance, the host copy),
which grows with the window at large batch: the model learns it online, per bucket and per longest
window kmax (0 = the plain step), from (measured wall time - modelled device time): the least of
its first few measurements, then a running mean, then an exponential moving average. An entry not
measured yet borrows the nearest measured window of its bucket (the plain step only its own), else
the nearest bucket's.
The first drafting step after plain steps costs more again: the draft model catches its drafting
rows up over every token since in one eager forward. That switch cost is learned apart
(observe_switch), one figure for all buckets, from what such steps took beyond a steady step's
model and overhead.

Where the figures come from: on CUDA with graphs, `measure_bucket` times replays of the captured
graphs (the target at every width 1..K+1, the draft at width 1) the first time a bucket is needed,
each on its own q tokens and again over CONTEXT_PROBE tokens of context per row (the difference,
per token, is its context_ms); without graphs (CPU, eager) `default_costs` stands in, a linear
model of tokens per forward without a context term, and the learned overhead carries the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from thinkspec.engine.model_runner import ModelRunner

OVERHEAD_ALPHA = 0.05  # weight of one step's measurement in the learned host overhead
# weight of one switch's measurement in the learned switch cost: switches are rare (a few per run)
SWITCH_ALPHA = 0.25
CONTEXT_PROBE = 1024  # tokens of context per row the graph replays are also timed over
MIN_OF = 3  # an overhead entry starts as the least of its first measurements


@dataclass(slots=True, frozen=True)
class StepCosts:
    """Measured milliseconds at one batch size."""

    batch: int
    k: int
    plain_ms: float  # one plain decode step of the batch
    draft_ms: float  # one draft step of the batch
    verify_ms: float  # one target forward of batch x (k+1) tokens
    # attention over the context, ms per token of context summed over the rows: one draft forward,
    # one target forward of width k+1 (0: not measured)
    draft_ctx_ms: float = 0.0
    verify_ctx_ms: float = 0.0

    @property
    def round_ms(self) -> float:
        return self.k * self.draft_ms + self.verify_ms

    @property
    def round_ctx_ms(self) -> float:
        return self.k * self.draft_ctx_ms + self.verify_ctx_ms


def round_ms_at(costs: Seq[StepCosts], batch: float, per_context_token: bool = False) -> float:
    """Round time at any batch size (per_context_token: its attention per token of context):
    linear between the measured batch sizes, flat beyond them."""
    pts = sorted((c.batch, c.round_ctx_ms if per_context_token else c.round_ms) for c in costs)
    return float(np.interp(batch, [b for b, _ in pts], [ms for _, ms in pts]))


def default_costs(k_max: int, buckets: Seq[int]) -> dict[int, list[StepCosts]]:
    """A stand-in without measurements: a forward costs 1 ms + 0.01 ms per token (target) and a
    tenth of that (draft), for every bucket."""
    table = {}
    for b in buckets:
        plain = 1.0 + 0.01 * b
        draft = 0.1 * plain
        table[b] = [StepCosts(b, k, plain, draft, 1.0 + 0.01 * b * (k + 1)) for k in range(k_max + 1)]
    return table


def measure_bucket(
    target: ModelRunner, draft: ModelRunner | None, bucket: int, k_max: int, reps: int = 5
) -> list[StepCosts]:
    """[K+1] StepCosts of one bucket from timed replays of the runners' graphs (captured here when
    missing); a proposer without a draft model (n-gram) drafts for free on the device. Each graph
    is timed twice: on q-token contexts (its own tokens only), and over CONTEXT_PROBE tokens of
    context per row (max_model_len if shorter), whose difference is its attention per token."""
    assert target.graphs is not None
    verify = [_replay_ms(target, (bucket, q), reps) for q in range(1, k_max + 2)]
    draft_ms = (0.0, 0.0)
    if draft is not None and draft.graphs is not None:
        draft_ms = _replay_ms(draft, (bucket, 1), reps)
    return [
        StepCosts(bucket, k, verify[0][0], draft_ms[0], verify[k][0], draft_ms[1], verify[k][1])
        for k in range(k_max + 1)
    ]


def _replay_ms(runner: ModelRunner, key: tuple[int, int], reps: int) -> tuple[float, float]:
    """(ms of one replay of key's graph on its own tokens, ms more per token of context over the
    rows); the second 0 where max_model_len leaves no longer context to time."""
    graphs = runner.graphs
    assert graphs is not None
    bucket, q = key
    base = graphs.time_replay(key, reps)
    context = min(CONTEXT_PROBE, graphs.spec.max_model_len)
    if context <= q:
        return base, 0.0
    long = graphs.time_replay(key, reps, context, runner.num_blocks, runner.block_size)
    return base, max(long - base, 0.0) / (bucket * (context - q))


class StepCostModel:
    """Milliseconds of a step's parts (see the module docstring)."""

    def __init__(
        self,
        k_max: int,
        buckets: Seq[int],
        costs: dict[int, list[StepCosts]] | None = None,
        measure: Callable[[int], list[StepCosts]] | None = None,
    ) -> None:
        self.k_max = k_max
        self.buckets = tuple(sorted(buckets))  # the graph batch buckets (overhead keys)
        self.costs: dict[int, list[StepCosts]] = dict(costs or {})  # bucket -> [K+1] rows, k = 0..K
        self.measure = measure  # bucket -> its rows (measure_bucket), for buckets not measured yet
        # [buckets, K+1] learned ms per step by longest window kmax (0 = plain), NaN = not measured
        self.overhead = np.full((len(self.buckets), k_max + 1), np.nan)
        self.seen = np.zeros((len(self.buckets), k_max + 1), dtype=np.int64)  # measurements of each entry
        # learned ms a drafting step costs beyond a steady one when the draft model first catches up
        # over the tokens of the plain steps before it (an eager forward); NaN = not measured
        self.switch = math.nan
        self.switches = 0  # measurements of it
        # per bucket row: every row, nearest first (ties: the smaller bucket), where overheads are borrowed
        n = len(self.buckets)
        self._by_distance = [sorted(range(n), key=lambda r, row=row: abs(r - row)) for row in range(n)]
        self._round: dict[int, np.ndarray] = {}  # batch -> round_ms(batch), until the next add
        self._context: dict[int, np.ndarray] = {}  # batch -> context_ms(batch), ditto
        self._draft_pts: tuple[np.ndarray, np.ndarray] | None = None  # (buckets, draft ms), ditto
        self._rows: dict[int, int] = {}  # batch -> index of its bucket in buckets
        self._plain: dict[int, tuple[float, float]] = {}  # batch -> plain_ms's figures, until the next add
        if not self.costs and measure is None:
            raise ValueError("StepCostModel needs costs or a way to measure them")

    def ensure(self, batch: int) -> None:
        """Measure batch's bucket unless it is known (or nothing can be measured)."""
        bucket = self.bucket(batch)
        if self.measure is not None and bucket not in self.costs:
            self.add(self.measure(bucket))

    def bucket(self, batch: int) -> int:
        """The smallest bucket >= batch (the largest one beyond them all)."""
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def _row(self, batch: int) -> int:
        """Index of batch's bucket in buckets (cached: observe runs after every step)."""
        row = self._rows.get(batch)
        if row is None:
            row = self._rows[batch] = self.buckets.index(self.bucket(batch))
        return row

    def add(self, rows: Seq[StepCosts]) -> None:
        """Measured rows of one bucket, k = 0..K."""
        if [r.k for r in rows] != list(range(self.k_max + 1)) or len({r.batch for r in rows}) != 1:
            raise ValueError(f"need one bucket's StepCosts for k = 0..{self.k_max}, got {list(rows)}")
        self.costs[rows[0].batch] = list(rows)
        self._round.clear()
        self._context.clear()
        self._plain.clear()
        self._draft_pts = None

    def round_ms(self, batch: int) -> np.ndarray:
        """[K+1] device ms of a step where all `batch` rows draft k (k = 0: the plain step)."""
        cached = self._round.get(batch)
        if cached is None:
            rows = [c for b in sorted(self.costs) for c in self.costs[b]]
            by_k = [[c for c in rows if c.k == k] for k in range(self.k_max + 1)]
            cached = self._round[batch] = np.array([round_ms_at(costs, batch) for costs in by_k])
        return cached

    def plain_ms(self, batch: int, context: int) -> float:
        """round_ms(batch)[0] + context * context_ms(batch)[0]: the plain step's device ms over context
        tokens, from Python floats (cached per batch until the next add)."""
        cached = self._plain.get(batch)
        if cached is None:
            cached = self._plain[batch] = (float(self.round_ms(batch)[0]), float(self.context_ms(batch)[0]))
        return cached[0] + context * cached[1]

    def context_ms(self, batch: int) -> np.ndarray:
        """[K+1] device ms per token of context (summed over the rows) of a step where all `batch`
        rows draft k: attention over the context, which the q-token replays of round_ms leave out."""
        cached = self._context.get(batch)
        if cached is None:
            rows = [c for b in sorted(self.costs) for c in self.costs[b]]
            by_k = [[c for c in rows if c.k == k] for k in range(self.k_max + 1)]
            cached = self._context[batch] = np.array([round_ms_at(costs, batch, True) for costs in by_k])
        return cached

    def draft_ms(self, rows: np.ndarray) -> np.ndarray:
        """Device ms of one draft forward over `rows` sequences (any shape, elementwise)."""
        if self._draft_pts is None:
            pts = sorted((b, c[0].draft_ms) for b, c in self.costs.items())
            self._draft_pts = (np.array([b for b, _ in pts]), np.array([ms for _, ms in pts]))
        return np.interp(rows, *self._draft_pts)

    def overhead_ms(self, batch: int) -> np.ndarray:
        """[K+1] learned ms per step beyond the modelled device time, by kmax, at batch's bucket
        (unmeasured entries filled as the module docstring says; 0 where nothing is measured)."""
        row = self._row(batch)
        by_distance = self._by_distance[row]
        known = ~np.isnan(self.overhead)  # [buckets, K+1]
        out = np.zeros(self.k_max + 1)
        plain = next((r for r in by_distance if known[r, 0]), None)  # the plain step: its own column only
        if plain is not None:
            out[0] = self.overhead[plain, 0]
        windows = known[:, 1:].any(axis=1).tolist()
        r = next((r for r in by_distance if windows[r]), None)
        if r is not None:  # each window from the nearest measured window of the nearest bucket
            have = np.flatnonzero(known[r, 1:])
            nearest = have[np.abs(np.arange(self.k_max)[:, None] - have[None, :]).argmin(axis=1)]
            out[1:] = self.overhead[r, 1:][nearest]
        return out

    def observe(self, batch: int, kmax: int, measured_ms: float, modelled_ms: float) -> None:
        """Learn the overhead from one step's wall time (the caller leaves out steps that captured
        a graph or measured costs). A step that compiled a kernel is an outlier too, and may be the
        first: an entry keeps the least of its first MIN_OF measurements. After that it is the mean
        of that least and the measurements since, until one measurement's share of the mean falls to
        OVERHEAD_ALPHA, and an exponential moving average from there: a window chosen for a few
        steps of a short run learns what it costs within that run, where the moving average alone
        would move a low start 5% of the way a step. A step moves it up by at most what twice the
        entry plus 1 ms would."""
        row = self._row(batch)
        extra = max(measured_ms - modelled_ms, 0.0)
        cur, seen = float(self.overhead[row, kmax]), int(self.seen[row, kmax])  # Python scalars: per step
        if math.isnan(cur) or seen < MIN_OF:
            new = extra if math.isnan(cur) else min(cur, extra)
        else:
            weight = max(OVERHEAD_ALPHA, 1.0 / (seen - MIN_OF + 2))  # the mean's count: the least + these
            new = cur + weight * (min(extra, 2.0 * cur + 1.0) - cur)
        self.overhead[row, kmax] = new
        self.seen[row, kmax] = seen + 1

    def switch_ms(self) -> float:
        """Learned ms of leaving plain decoding (see observe_switch); 0 before any was measured."""
        return 0.0 if math.isnan(self.switch) else self.switch

    def observe_switch(self, extra_ms: float) -> None:
        """Learn the cost of leaving plain decoding from one such step's wall time beyond its modelled
        device time and learned overhead: the least of the first MIN_OF (a first one may compile),
        then an exponential moving average."""
        extra = max(extra_ms, 0.0)
        if math.isnan(self.switch) or self.switches < MIN_OF:
            self.switch = extra if math.isnan(self.switch) else min(self.switch, extra)
        else:
            self.switch += SWITCH_ALPHA * (extra - self.switch)
        self.switches += 1
