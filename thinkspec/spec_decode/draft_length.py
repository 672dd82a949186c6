"""Adaptive draft length: how many tokens each group of rows drafts in the next speculative step.

Rows are grouped by phase and acceptance mode (GROUPS): answer rows (always strict), thinking rows
verified strictly, thinking rows verified with the relaxed test. For every group and draft
position i the chooser keeps c[g, i], its estimate of the probability that draft i is accepted given
drafts 0..i-1 were: the position's decayed counts of tries and acceptances (an exponential window
of about 1/RATE_ALPHA tries), shrunk toward the group's rate pooled over all positions by SHRINK
tries. A position tried often keeps its own rate; one seldom tried (beyond the drafts the chooser
picks) takes the group's, not a fixed prior that only rare probes would correct, and the pooled
rate averages away most of the per-position noise that made the choice flicker between near-equal
lengths. The prior PRIOR_RATE enters the pooled rate as a window's worth of tries that decays as
the counts do, so a group's first few unlucky steps cannot send it to plain decoding for good (no
draft is tried there to correct them). A row of group g that drafts k tokens then emits, expected,

  E_g(k) = 1 + sum_{i<k} prod_{j<=i} c[g, j]      tokens (the accepted drafts plus the bonus/correction)

and a step where group g (n_g rows) drafts k_g costs StepCostModel's device time plus its learned
host overhead (step_costs.py). `AdaptiveDraftLength.choose` takes the k per group, 0..K each, that
maximises sum_g n_g E_g(k_g) / cost over the whole (K+1)^G grid (G <= 3 groups present); all
zeros is the engine's plain decode step, kept unless drafting beats it by PLAIN_MARGIN. After plain
steps the draft model is behind and the first drafting step first catches up its drafting rows (an
eager forward over every token since, tens of ms at batch 16): a choice that drafts with a group the
engine reports behind also pays the learned switch cost, spread over SWITCH_HORIZON steps. While no
request waits to take a finished row's place, n_g is replaced by the group's rows weighted by their
share of the tokens left (drain_weights): the batch takes as long as its longest rows. And since a
drafting row emits a random number of tokens per step, the longest rows do not all finish together:
the last of n rows with L tokens left, each emitting mu tokens a step with spread sigma, needs about
z_n sigma sqrt(L / mu) / mu steps more than the mean one (z_n: the expected largest of n standard
normal draws), so a draining group's E_g(k) counts as E_g(k) / (1 + z_n sigma_g(k) / sqrt(E_g(k) L)),
n its drain weight (the rows that can still be last, each by its share) and L its longest row's
tokens left, while L >= SPREAD_MIN_LEFT (spread_factor). Plain steps have no spread; one row has
none to lose to.

Estimates of positions a group does not draft are not updated, so a pessimistic one could never
recover: every PROBE_PERIOD-th choice one group (the groups present, in turn) drafts one token more
than its best k, which measures the next position (every PLAIN_PROBE_PERIOD-th while all groups
decode plainly, and then only PLAIN_PROBE_ROWS of the group's rows: the draft model has to catch up
first, over every token since, for each row that drafts; `probe_rows` tells the engine).

`ForcedDraftLength` replaces the choice by a function of the step (tests, benchmarks: a fixed k, or
k varying per step and group to exercise mixed windows).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from thinkspec.spec_decode.step_costs import StepCostModel

GROUPS = ("answer", "thinking", "thinking_relaxed")
ANSWER, THINKING, THINKING_RELAXED = range(3)
PRIOR_RATE = 0.7  # c[g, i] before anything is observed: optimistic enough to try speculation
RATE_ALPHA = 0.02  # weight of one observed draft in its position's decayed counts (a window of ~50 tries)
# Tries of the group's pooled rate each position's own counts are shrunk toward: a position with about
# this many tries in its window weighs its own rate and the pool's alike (BENCHMARKS.md, "Acceptance
# estimates pooled over positions": against per-position averages over ~20 tries, +0.3-0.4% at batch 1
# in the simulator with flat, falling and rising acceptance profiles, +0.65% on the H200)
SHRINK = 30.0
# At most this weight for one step's drafts however many rows tried: at batch 64 the 64 tries of one
# step would otherwise weigh 96%, and the estimate (and the choice) would follow one step's noise.
MAX_STEP_WEIGHT = 0.2
PROBE_PERIOD = 32
# Drafting replaces the plain step only when modelled to emit over this much more tokens per ms: the
# per-step model does not see what speculation costs beyond its own step (the rows' lengths drift
# apart, and leaving plain decoding starts with the draft catching up). It was 10% while the model
# left out attention over the context (it then rated k = 3 7-9% above plain at batch 64, where a fixed
# k = 3 ran 5-10% below); with the context term the model itself rates drafting below plain there,
# and 10% kept batch 16's answer-phase tail (drafting modelled 4-9% above plain) at plain steps that a
# fixed k = 3 outran by 5%.
PLAIN_MARGIN = 0.03
# Steps a switch out of plain decoding is spread over: about what a choice lasts (REFRESH at least,
# and a drafting choice is usually chosen again).
SWITCH_HORIZON = 16
REFRESH = 8  # steps a choice is reused for while the groups' sizes stay about the same
# An all-plain choice learns nothing about acceptance while it lasts (no row drafts), only the cost
# model's overheads move: reuse it longer, so that plain steps pay almost no host time for choosing.
REFRESH_PLAIN = 32
# While every group decodes plainly the draft model falls behind, and a probe first catches it up
# over every token since: probe more rarely there, and with a few rows only (the catch-up of every
# row of a batch of 64 after 256 plain steps is a 16k-token draft forward, ~8% of the time probed).
PLAIN_PROBE_PERIOD = 256
PLAIN_PROBE_ROWS = 4
# The spread term (spread_factor) counts only while a group's longest row has this many tokens left.
# It takes the rows that can be last as all L tokens from their end, which holds at the start of a
# closed batch; near the end the rows are spread already (the drain weights see it) and it over-counts.
# Past this point only the switch cost keeps a closed batch that stayed plain from drafting again
# (figures: docs/BENCHMARKS.md, "Figures behind code choices").
SPREAD_MIN_LEFT = 128


class Drain(NamedTuple):
    """A draining batch (no request waits to take a finished row's place), as the chooser weighs it."""

    weights: list[float]  # [G] the group's rows, each by its tokens left over the most any row has
    longest: list[int]  # [G] the most tokens any row of the group has left (0: no row)


# The drain (see drain_weights), a function that works it out, or None (every row 1, no spread)
DrainArg = Drain | Callable[[], Drain] | None


def drain_weights(groups: list[int] | np.ndarray, left: list[int] | np.ndarray) -> Drain:
    """Per group, its rows' tokens left (left [R], of rows in groups [R]) over the most any row has
    left, and its longest row's: the weights of a batch that drains. Its time is then the time its
    longest rows take, and a row about to finish adds little to it: at 12 answer rows with ~20 tokens
    left and 4 thinking rows with ~50, the plain step emits the most tokens per ms, but leaves the 4
    thinking rows one token per step for the batch's last 50 steps."""
    top = max(max(left, default=0), 1)
    out = [0.0] * len(GROUPS)
    longest = [0] * len(GROUPS)
    for g, r in zip(groups, left):
        out[g] += max(r, 0) / top
        longest[g] = max(longest[g], int(r))
    return Drain(out, longest)


def expected_largest_normal(n: float) -> float:
    """The expected largest of n standard normal draws (Blom's approximation: 4.5% high at n = 2,
    within 2% from n = 4); 0 for n <= 1. n may be fractional (a drain weight)."""
    if n <= 1.0:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def spread_factor(tokens: np.ndarray, drain: Drain, groups: np.ndarray) -> np.ndarray:
    """[P, K+1] what a step's expected tokens count for in a draining batch, for the groups [P] whose
    steps drafting k emit E(k) = tokens[:, k] expected tokens (expected_tokens; see the module
    docstring): 1 / (1 + z_n sigma(k) / sqrt(E(k) L)); 1 at k = 0, for a group with at most one row
    that counts and while L < SPREAD_MIN_LEFT."""
    reach = np.diff(tokens, axis=1)  # [P, K] P(A >= i), A the accepted drafts: E(k) = 1 + sum_{i<=k}
    odd = 2 * np.arange(1, reach.shape[1] + 1) - 1  # E[A^2] = sum_i (2i - 1) P(A >= i)
    square = np.concatenate([np.zeros((reach.shape[0], 1)), np.cumsum(odd * reach, axis=1)], axis=1)
    sigma = np.sqrt(np.maximum(square - (tokens - 1.0) ** 2, 0.0))  # [P, K+1] of the tokens a step emits
    longest = np.array([max(drain.longest[g], 1) for g in groups], dtype=np.float64)[:, None]  # [P, 1]
    z = np.array([expected_largest_normal(drain.weights[g]) for g in groups])[:, None]  # [P, 1]
    z[longest < SPREAD_MIN_LEFT] = 0.0
    return 1.0 / (1.0 + z * sigma / np.sqrt(tokens * longest))


def sample_rows(row_ks: np.ndarray | int) -> tuple[int, int]:
    """(rows, longest window) of a timing sample: row_ks [R] each decode row's draft length, or an int,
    the rows of a plain step (every one 0)."""
    if isinstance(row_ks, int):
        return row_ks, 0
    return len(row_ks), int(row_ks.max(initial=0))


def group_of(thinking: bool, relaxed: bool) -> int:
    """GROUPS index of a row: relaxation only applies while thinking."""
    return (THINKING_RELAXED if relaxed else THINKING) if thinking else ANSWER


def expected_tokens(rates: np.ndarray) -> np.ndarray:
    """[G, K+1] E_g(k) for k = 0..K from conditional acceptance rates [G, K]."""
    reach = np.cumprod(rates, axis=1)  # [G, K] P(drafts 0..i all accepted)
    return 1.0 + np.concatenate([np.zeros((rates.shape[0], 1)), np.cumsum(reach, axis=1)], axis=1)


class AcceptanceEstimates:
    """c[g, i] for every group and draft position (see the module docstring)."""

    def __init__(
        self,
        k_max: int,
        prior: float = PRIOR_RATE,
        alpha: float = RATE_ALPHA,
        max_weight: float = MAX_STEP_WEIGHT,
        shrink: float = SHRINK,
    ) -> None:
        self.rates = np.full((len(GROUPS), k_max), prior)  # [G, K]
        self.tries = np.zeros((len(GROUPS), k_max))  # [G, K] decayed tries of each position
        self.accepts = np.zeros((len(GROUPS), k_max))  # [G, K] decayed acceptances, <= tries
        # [G] tries the prior counts as in the pooled rate: a window's worth at first, decaying as a try
        # made then would (a group's first few windows, unlucky, would otherwise set the estimates alone)
        self.prior_tries = np.full(len(GROUPS), 1.0 / alpha)
        self.prior = prior
        self.alpha = alpha
        self.max_weight = max_weight
        self.shrink = shrink

    def observe(
        self,
        groups: np.ndarray,  # [S] int, GROUPS index of each row
        num_drafts: np.ndarray,  # [S] int, drafts each row proposed
        num_accepted: np.ndarray,  # [S] int, of which accepted
    ) -> None:
        """Position i of a row was tried when i < num_drafts and i <= num_accepted (drafts before it
        were accepted), and accepted when i < num_accepted. A step's t tries of a position take the
        share of its window that t single tries would (1 - (1 - alpha)^t), at most max_weight: its
        older counts keep the rest, and the step adds that share over alpha tries at the step's
        acceptance ratio. The groups tried are then re-estimated."""
        num_groups, k = self.rates.shape
        pos = np.arange(k)
        tried = (pos[None, :] < num_drafts[:, None]) & (pos[None, :] <= num_accepted[:, None])  # [S, K]
        accepted = tried & (pos[None, :] < num_accepted[:, None])  # [S, K]
        onehot = (groups[None, :] == np.arange(num_groups)[:, None]).astype(np.float64)  # [G, S]
        t, a = onehot @ tried, onehot @ accepted  # [G, K] each
        weight = np.minimum(1.0 - (1.0 - self.alpha) ** t, self.max_weight)  # [G, K], 0 where untried
        added = weight / self.alpha  # [G, K] tries the step counts as
        self.tries = (1.0 - weight) * self.tries + added
        ratio = np.divide(a, t, out=np.zeros_like(a), where=t > 0)  # [G, K] the step's acceptance
        self.accepts = (1.0 - weight) * self.accepts + added * ratio
        seen = t.any(axis=1)  # [G]
        # the share of a window the step's tries take, as for a position's counts: the prior ages with them
        step = np.minimum(1.0 - (1.0 - self.alpha) ** t.sum(axis=1), self.max_weight)  # [G]
        self.prior_tries *= 1.0 - step
        # the group's rate over all its positions, the prior among them
        prior = self.prior_tries[seen]  # [g]
        accepts, tries = self.accepts[seen].sum(axis=1), self.tries[seen].sum(axis=1)  # [g] each
        pooled = (accepts + prior * self.prior) / (tries + prior)  # [g]
        own = self.tries[seen] + self.shrink  # [g, K]; 0 only for an untried position with no shrinkage
        share = np.divide(self.accepts[seen] + self.shrink * pooled[:, None], own, where=own > 0, out=own * 0)
        self.rates[seen] = np.where(own > 0, share, pooled[:, None])


class AdaptiveDraftLength:
    """Chooses k per group before each step, learns from what the step accepted and cost."""

    def __init__(self, k_max: int, costs: StepCostModel) -> None:
        self.k_max = k_max
        self.costs = costs
        self.estimates = AcceptanceEstimates(k_max)
        self.num_choices = 0
        self._grids: dict[int, np.ndarray] = {}
        # (counts [G], which groups were behind [G], best ks of the groups present, whether any
        # drafts, choice number)
        self._cache: tuple[list[int], list[bool], np.ndarray, bool, int] | None = None
        self._context = 0  # the last choice's context (refresh redoes its search)
        self._drain: DrainArg = None  # and its drain
        # A list to record every fresh evaluation in (benchmarks, diagnosis: what the choice saw), or None
        self.trace: list[dict] | None = None
        # Rows of the probed group that draft in this choice's step: PLAIN_PROBE_ROWS for a probe out of
        # plain decoding, None = every row of each group (read by the engine right after choose)
        self.probe_rows: int | None = None
        # A list to record every timed step in, (rows, kmax, wall ms, modelled device ms, whether it
        # left plain decoding: a switch), or None
        self.steps: list[tuple[int, int, float, float, bool]] | None = None

    def choose(
        self,
        counts: np.ndarray | list[int],
        context: int = 0,
        behind: list[bool] | None = None,
        drain: DrainArg = None,
    ) -> np.ndarray:
        """[G] k per group for a step with counts[g] speculating rows in group g (absent groups 0),
        context tokens in all (their sequences' lengths summed); behind [G]: the group has rows whose
        draft must catch up first (plain steps ran; None: none); drain: the groups' rows weighted by
        their share of the work left and their longest rows' tokens left (see drain_weights; None:
        every row 1), or a function giving it, called only when the choice is searched afresh. A
        reused all-plain choice takes the plain-Python path: it runs before every plain step."""
        behind = behind or [False] * len(GROUPS)
        key = [int(c) for c in counts]
        present = [g for g, c in enumerate(key) if c]
        self.probe_rows = None
        if not present:
            return np.zeros(len(GROUPS), dtype=np.int64)
        self.num_choices += 1
        self._context, self._drain = context, drain
        best = self._cached_best(key, behind)
        if best is None:
            best = self._search(key, context, behind, drain)
        assert self._cache is not None
        drafts = self._cache[3]
        period = PROBE_PERIOD if drafts else PLAIN_PROBE_PERIOD
        probe = self.num_choices % period == 0
        ks = np.zeros(len(GROUPS), dtype=np.int64)
        if drafts or probe:
            ks[present] = best
        if probe:
            g = present[(self.num_choices // period) % len(present)]
            ks[g] = min(self.k_max, ks[g] + 1)
            if not drafts:
                self.probe_rows = PLAIN_PROBE_ROWS
        return ks

    def choose_plain_again(self, context: int, drain: DrainArg = None) -> bool:
        """The cached all-plain choice once more, as choose would give it for the counts and behind
        flags it was made for (the caller knows they hold): True, counted as a choice, while it is
        fresh and no probe falls on this choice; else False with nothing changed (call choose)."""
        cache = self._cache
        if cache is None or cache[3]:
            return False
        n = self.num_choices + 1
        if n - cache[4] >= REFRESH_PLAIN or n % PLAIN_PROBE_PERIOD == 0:
            return False
        self.num_choices = n
        self._context, self._drain = context, drain
        self.probe_rows = None
        return True

    def refresh(self) -> None:
        """Redo the last choice's grid search now (its counts, context and behind flags) when the next
        choose would find it too old: the engine calls this while the device runs a step, which takes
        the search (~0.1-0.2 ms of host time) off the steps' critical path."""
        if self._cache is None:
            return
        key, behind, _, drafts, made = self._cache
        if self.num_choices + 1 - made >= (REFRESH if drafts else REFRESH_PLAIN):
            self._search(key, self._context, behind, self._drain)

    def _search(self, key: list[int], context: int, behind: list[bool], drain: DrainArg = None) -> np.ndarray:
        """The best ks [P] of the groups present for counts key [G] (cached as made at this choice)."""
        if callable(drain):
            drain = drain()
        self.costs.ensure(sum(key))
        grid, gain, cost = self.evaluate(np.array(key, dtype=np.int64), context, behind, drain)
        rates = gain / cost  # [N] modelled tokens per ms of every choice, column 0 the plain step
        pick = int(np.argmax(rates))
        if rates[pick] <= (1.0 + PLAIN_MARGIN) * rates[0]:
            pick = 0
        best = grid[:, pick]
        self._cache = (key, behind, best, bool(best.any()), self.num_choices)
        if self.trace is not None:
            self._record(key, best, rates, pick, cost[pick], context, behind, drain)
        return best

    def _record(
        self,
        counts: list[int],
        best: np.ndarray,
        rates: np.ndarray,
        pick: int,
        ms: float,
        context: int,
        behind: list[bool],
        drain: Drain | None = None,
    ) -> None:
        """One trace entry: the choice (best [P], the ks of the groups present; column pick of the
        grid) and what it was made from (rates [N]: modelled tokens per ms of every choice, column 0
        the plain step; ms: the choice's modelled time; the groups whose draft was behind and the
        learned switch cost; the learned overheads by kmax, the acceptance estimates; the drain
        weights and longest rows' tokens left of the groups present, or None when every row counted
        alike)."""
        assert self.trace is not None
        present = [g for g, c in enumerate(counts) if c]
        self.trace.append({
            "choice": self.num_choices,
            "counts": counts,
            "ks": {GROUPS[g]: int(k) for g, k in zip(present, best)},
            "tok_per_ms": round(float(rates[pick]), 4),
            "best_drafting_tok_per_ms": round(float(rates[1:].max(initial=0.0)), 4),
            "plain_tok_per_ms": round(float(rates[0]), 4),
            "modelled_ms": round(float(ms), 4),
            "context": int(context),
            "behind": [GROUPS[g] for g in present if behind[g]],
            "switch_ms": round(self.costs.switch_ms(), 4),
            "overhead_ms": self.costs.overhead_ms(sum(counts)).round(4).tolist(),
            "rates": {GROUPS[g]: self.estimates.rates[g].round(4).tolist() for g in present},
            "weights": None if drain is None else {GROUPS[g]: round(drain.weights[g], 4) for g in present},
            "longest": None if drain is None else {GROUPS[g]: drain.longest[g] for g in present},
        })  # fmt: skip

    def evaluate(
        self,
        counts: np.ndarray,
        context: int = 0,
        behind: list[bool] | None = None,
        drain: Drain | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every choice for the groups present: (grid [P, N] k of each present group, expected tokens
        [N] (where a drain is given, weighted by its weights and counted as spread_factor says),
        modelled ms [N]) for the N = (K+1)^P choices;
        context: tokens of context in all; behind [G]: a choice drafting with such a group first
        catches its draft up (the switch cost, spread over SWITCH_HORIZON)."""
        present = np.flatnonzero(counts)
        n = counts[present].astype(np.float64)  # [P]
        batch = int(counts.sum())
        grid = self._grid(present.size)  # [P, N]
        table = expected_tokens(self.estimates.rates[present])  # [P, K+1]
        w = n
        if drain is not None:
            w = np.asarray(drain.weights, dtype=np.float64)[present]  # [P]
            table = table * spread_factor(table, drain, present)
        gain = (w[:, None] * np.take_along_axis(table, grid, axis=1)).sum(axis=0)  # [N]
        kmax = grid.max(axis=0)  # [N]
        cost = self.costs.round_ms(batch)[kmax]  # [N]: draft forwards over every row, verify at kmax+1
        if self.k_max > 1:
            j = np.arange(1, self.k_max)  # draft forwards 2..K run only the rows still drafting
            rows = (n[:, None, None] * (grid[:, :, None] > j[None, None, :])).sum(axis=0)  # [N, K-1]
            fix = np.where(rows > 0, self.costs.draft_ms(rows) - self.costs.draft_ms(np.array(batch)), 0.0)
            cost = cost + np.where(j[None, :] < kmax[:, None], fix, 0.0).sum(axis=1)
        cost = cost + self.costs.overhead_ms(batch)[kmax] + context * self.costs.context_ms(batch)[kmax]
        late = [i for i, g in enumerate(present) if behind is not None and behind[g]]  # rows of grid
        if late:
            pays = (grid[late] > 0).any(axis=0)  # [N]
            cost = cost + np.where(pays, self.costs.switch_ms() / SWITCH_HORIZON, 0.0)
        return grid, gain, np.maximum(cost, 1e-6)

    def _cached_best(self, counts: list[int], behind: list[bool]) -> np.ndarray | None:
        """The last choice, while it is recent (REFRESH steps, REFRESH_PLAIN for an all-plain one) and
        made for about these counts, the draft model as far behind: the same groups, each within 1/8
        of its count (the grid search costs ~0.1 ms of host time, a plain toy step ~0.3 ms)."""
        if self._cache is None:
            return None
        cached, was_behind, best, drafts, made = self._cache
        if was_behind != behind or self.num_choices - made >= (REFRESH if drafts else REFRESH_PLAIN):
            return None
        for c, n in zip(cached, counts):
            if (c > 0) != (n > 0) or abs(c - n) * 8 > c:
                return None
        return best

    def _grid(self, num_groups: int) -> np.ndarray:
        """[P, (K+1)^P] every choice of k for P groups (cached); column 0 is all zeros, the plain step."""
        grid = self._grids.get(num_groups)
        if grid is None:
            choices = itertools.product(range(self.k_max + 1), repeat=num_groups)
            grid = self._grids[num_groups] = np.array(list(choices), dtype=np.int64).T
        return grid

    def modelled_ms(self, row_ks: np.ndarray, kmax: int | None = None, context: int = 0) -> float:
        """Device ms the cost model gives a step whose decode rows draft row_ks [R] (overhead left out)
        over context tokens in all; kmax: row_ks.max() when the caller has it."""
        batch = len(row_ks)
        if batch == 0:
            return 0.0
        kmax = int(row_ks.max()) if kmax is None else kmax
        ms = float(self.costs.round_ms(batch)[kmax] + context * self.costs.context_ms(batch)[kmax])
        if kmax > 1:
            rows = (row_ks[None, :] > np.arange(1, kmax)[:, None]).sum(axis=1)  # [kmax-1]
            ms += float((self.costs.draft_ms(rows) - self.costs.draft_ms(np.array(batch))).sum())
        return ms

    def observe(
        self,
        groups: np.ndarray,  # [S] int, GROUPS index of each speculating row
        num_drafts: np.ndarray,  # [S] int
        num_accepted: np.ndarray,  # [S] int
    ) -> None:
        """Learn from one step's windows what its groups accept."""
        if len(groups):
            self.estimates.observe(groups, num_drafts, num_accepted)

    def observe_time(self, row_ks: np.ndarray | int, wall_ms: float, context: int = 0) -> None:
        """Learn from the wall time of one step whose decode rows drafted row_ks [R] (0 = plain; an
        int: the rows of a plain step, every one 0) over context tokens in all."""
        self._observe_step(row_ks, wall_ms, context, switch=False)

    def observe_switch(self, row_ks: np.ndarray, wall_ms: float, context: int = 0) -> None:
        """Learn the switch cost from the wall time of a step that left plain decoding (its draft
        caught up first; decode rows drafted row_ks [R]): what it took beyond the model and the
        learned overhead of a steady step like it."""
        self._observe_step(row_ks, wall_ms, context, switch=True)

    def _observe_step(self, row_ks: np.ndarray | int, wall_ms: float, context: int, switch: bool) -> None:
        batch, kmax = sample_rows(row_ks)
        if not batch:
            return
        # a plain step's model from Python floats (it runs before every plain step), the same figure
        modelled = (
            self.costs.plain_ms(batch, context) if kmax == 0 else self.modelled_ms(row_ks, kmax, context)
        )
        if switch:
            self.costs.observe_switch(wall_ms - modelled - float(self.costs.overhead_ms(batch)[kmax]))
        else:
            self.costs.observe(batch, kmax, wall_ms, modelled)
        if self.steps is not None:
            self.steps.append((batch, kmax, wall_ms, modelled, switch))


class ForcedDraftLength:
    """k per group from a function of (step number, counts [G]) -> [G] ks; learns nothing."""

    def __init__(self, k_max: int, pick: Callable[[int, np.ndarray], np.ndarray]) -> None:
        self.k_max = k_max
        self.pick = pick
        self.num_choices = 0
        self.probe_rows: int | None = None  # every row drafts its group's k
        # As AdaptiveDraftLength's (modelled ms NaN: no cost model)
        self.steps: list[tuple[int, int, float, float, bool]] | None = None

    @classmethod
    def fixed(cls, k_max: int, k: int) -> ForcedDraftLength:
        """Every group drafts k (0 = plain decode steps)."""
        return cls(k_max, lambda step, counts: np.full(len(GROUPS), k))

    def choose(
        self,
        counts: np.ndarray,
        context: int = 0,
        behind: list[bool] | None = None,
        drain: DrainArg = None,
    ) -> np.ndarray:
        ks = np.asarray(self.pick(self.num_choices, np.asarray(counts)), dtype=np.int64)
        ks = np.clip(ks, 0, self.k_max)
        self.num_choices += 1
        return ks

    def observe(self, *args: object) -> None:
        pass

    def refresh(self) -> None:
        pass

    def observe_time(
        self, row_ks: np.ndarray | int, wall_ms: float, context: int = 0, switch: bool = False
    ) -> None:
        if self.steps is None:
            return
        rows, kmax = sample_rows(row_ks)
        if rows:
            self.steps.append((rows, kmax, wall_ms, float("nan"), switch))

    def observe_switch(self, row_ks: np.ndarray, wall_ms: float, context: int = 0) -> None:
        self.observe_time(row_ks, wall_ms, context, True)
