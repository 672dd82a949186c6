"""adaptive_k's side of a speculative step: choose each decode row's draft length before the step,
count what was chosen, time steps and feed the chooser (draft_length.AdaptiveDraftLength).

A run of plain decode steps (every row k = 0) over the same scheduled rows is a streak: its per-request
draft-length counts wait in the planner (settle brings them up to date) and a step of the same rows in
the same phases reuses the plain choice without the per-row pass (_plan_again).

The engine calls plan at the start of a step (or the speculator does, when the engine did not),
record_plan once the planned step runs, settle before a request's output is read and forget_last_step
when it runs out of work; the speculator calls learn once a step's forwards are launched and queues
the windows' outcomes with observe_windows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from thinkspec.spec_decode.draft_length import (
    GROUPS,
    AdaptiveDraftLength,
    Drain,
    ForcedDraftLength,
    drain_weights,
    group_of,
)
from thinkspec.spec_decode.draft_model import draft_behind
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.step_costs import StepCostModel, default_costs, measure_bucket

if TYPE_CHECKING:
    from thinkspec.engine.model_runner import ModelRunner
    from thinkspec.engine.sequence import Sequence

# a step's draft lengths (DraftPlanner._choose): (spec_index [S], max_drafts [S], GROUPS index [S] of the
# rows that draft, row_ks [R] of every decode row)
Choice = tuple[list[int], list[int], list[int], np.ndarray]

_TOKEN_IDS = attrgetter("token_ids")


def decode_rows(seqs: list[Sequence], num_new: list[int], sample_mask: list[bool]) -> list[int]:
    """Batch positions of the decode rows, the ones that may speculate. A request's first output
    token is always sampled plainly (whether its prompt came from the cache or not), so seeded
    outputs do not depend on the schedule."""
    return [
        i
        for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask))
        if m and n == 1 and seq.num_output_tokens > 0
    ]


def request_metrics(seq: Sequence) -> SpecDecodeMetrics:
    """seq's per-request speculative counters (made at first use)."""
    metrics = seq.metrics.spec_decode
    if metrics is None:
        metrics = seq.metrics.spec_decode = SpecDecodeMetrics()
    return metrics


@dataclass(slots=True)
class _Plan:
    """The draft lengths chosen for the step about to run (DraftPlanner.plan)."""

    seqs: list[Sequence]  # the scheduled sequences it was made for, in order
    decodes: list[Sequence]  # the decode rows
    choice: Choice
    thinking: list[bool]  # [R] the phase each decode row's choice was made for
    context: int  # tokens of the decode rows' sequences, summed (what their attention reads)
    timed: tuple[float, int] | None  # (start, builds then) when the step is a timing sample
    switch: bool  # it drafts while the draft model is behind: its time is the switch cost's sample
    streak: bool = False  # a plain step of DraftPlanner._streak: its rows are counted there


@dataclass(slots=True)
class _Streak:
    """Plain decode steps (every row k = 0) over the same scheduled rows. Their per-request
    draft-length counts wait here: row i has had DraftPlanner._plain_steps - settled.get(i, start)
    plain steps not yet in its histogram (DraftPlanner.settle). While the choice may be reused
    (reusable), a step of the same rows in the same phases takes it without the per-row pass of _choose
    (DraftPlanner._plan_again)."""

    seqs: list[Sequence]  # [R] the scheduled rows, all decoding, in order
    thinking: list[bool]  # [R] each row's phase
    groups: list[int]  # [R] GROUPS index of each row
    start: int  # DraftPlanner._plain_steps when the streak started
    # no per-row pass needed to reuse the choice: the adaptive chooser, and every group present has a
    # row whose draft is behind (plain steps only put it further behind), or there is no draft model
    reusable: bool
    choice: Choice  # the plain choice: row_ks zeros [R]
    ones: list[int] = field(init=False)  # [R] 1s: each row's new tokens in a decode step
    trues: list[bool] = field(init=False)  # [R] True: each row samples
    settled: dict[int, int] | None = None  # row -> DraftPlanner._plain_steps at its last settle
    index: dict[int, int] | None = None  # id(seq) -> its row, made at the first settle

    def __post_init__(self) -> None:
        self.ones = [1] * len(self.seqs)
        self.trues = [True] * len(self.seqs)


@dataclass(slots=True)
class PlannerInputs:
    """What the planner reads from the engine, passed in (spec_decode imports no engine module)."""

    k: int  # K, the most drafts a row may take
    target_runner: ModelRunner  # its graphs are timed for the cost model and counted as builds
    draft_runner: ModelRunner | None  # the draft model's, None for n-gram proposals
    default_buckets: tuple[int, ...]  # batch buckets of the default cost model (no target graphs)
    tracked: bool  # a phase tracker exists: thinking rows may relax
    metrics: SpecDecodeMetrics  # the engine's counters, where the draft lengths are counted
    relax_enabled: Callable[[Sequence], bool]  # whether a request relaxes its thinking phase
    tokens_left: Callable[[Sequence], int]  # the most tokens a request may still emit
    compile_count: Callable[[], int | None]  # Triton compilations so far (None: none counted)


class DraftPlanner:
    # no request waits to take a finished row's place (the engine sets it after it schedules each
    # step): the chooser then weighs rows by the tokens they may still emit (draft_length.drain_weights)
    draining = False
    # a plain step over the same rows as the plain step before it reuses that choice without the per-row
    # pass (_plan_again); False makes every step take the pass (tests compare the two)
    reuse_streaks = True

    def __init__(self, inputs: PlannerInputs, adaptive: bool) -> None:
        self.inputs = inputs
        self.k = inputs.k
        self.has_draft_model = inputs.draft_runner is not None
        self.metrics = inputs.metrics  # the engine's counters (SpecDecodeMetrics), the speculator's too
        # chooses each step's draft lengths; None (adaptive_k off) drafts k every step
        self.draft_length: AdaptiveDraftLength | ForcedDraftLength | None = None
        # (start, builds then, row_ks or a plain step's rows, context tokens, whether a switch) of the last
        # step, a timing sample
        self._last_step: tuple[float, int, np.ndarray | int, int, bool] | None = None
        self._plan: _Plan | None = None  # the step about to run
        self._streak: _Streak | None = None  # the plain steps running over the same rows
        self._plain_steps = 0  # plain steps of streaks so far (_Streak.start and settled count from it)
        # what the chooser has still to learn, oldest first, as (its method, arguments): observe_time /
        # observe_switch (row_ks, wall ms, context) of a timed step, observe (groups, num_drafts,
        # num_accepted) of a step's windows. Learnt while the device runs the next speculative step.
        self._to_learn: list[tuple[str, tuple]] = []
        if adaptive:
            self.draft_length = AdaptiveDraftLength(self.k, self._cost_model())

    def _cost_model(self) -> StepCostModel:
        """Measured from the graphs where the target replays them, the default model elsewhere."""
        inputs = self.inputs
        graphs = inputs.target_runner.graphs
        if graphs is None:
            buckets = inputs.default_buckets
            return StepCostModel(self.k, buckets, default_costs(self.k, buckets))

        def measure(bucket: int):
            return measure_bucket(inputs.target_runner, inputs.draft_runner, bucket, self.k)

        return StepCostModel(self.k, graphs.spec.batch_sizes, measure=measure)

    def measure_costs(self, max_batch: int) -> None:
        """Measure the adaptive cost model at every bucket up to max_batch's now (a warm-up does
        this so that no timed step measures); nothing to do without adaptive_k or graphs."""
        chooser = self.draft_length
        if not isinstance(chooser, AdaptiveDraftLength) or chooser.costs.measure is None:
            return
        for b in chooser.costs.buckets:
            chooser.costs.ensure(b)
            if b >= max_batch:
                return

    def max_drafts_for(self, seq: Sequence) -> int:
        """Drafts worth proposing: no more than the tokens the request may still emit, minus the bonus."""
        return max(0, min(self.k, self.inputs.tokens_left(seq) - 1))

    # ---- the plan ------------------------------------------------------------------------------

    def plan(self, seqs: list[Sequence], num_new: list[int], sample_mask: list[bool]) -> bool:
        """At the start of a step: choose the draft length of each of these scheduled rows (kept for
        the step, see record_plan). True when the step is the plain decode step: every row decodes, with
        k = 0 (the engine may then run its own plain step, async scheduling included). Also takes the
        last step's time (see _time_last_step)."""
        now = time.perf_counter()
        builds = self._num_builds()
        self._time_last_step(now, builds)
        if self._streak is not None:
            if self._plan_again(self._streak, seqs, num_new, sample_mask, (now, builds)):
                return True
            self._end_streak()
        decodes = decode_rows(seqs, num_new, sample_mask)
        decodes_only = len(decodes) == len(seqs)
        choice, thinking, context, switch, groups, behind = self._choose(seqs, decodes)
        plain = decodes_only and not choice[0]
        rows = list(seqs)
        if plain:
            self.learn()  # a plain step: its host time is mostly hidden (async), the chooser learns now
            self._start_streak(rows, thinking, groups, behind, choice)
        # A step whose draft first catches up over many tokens (after plain steps) samples the switch
        # cost, not the steady step's.
        timed = (now, builds) if decodes_only else None
        decoding = rows if decodes_only else [seqs[i] for i in decodes]
        self._plan = _Plan(rows, decoding, choice, thinking, context, timed, switch, plain)
        return plain

    def choice_for(self, seqs: list[Sequence], num_new: list[int], sample_mask: list[bool]) -> Choice:
        """The choice of the step about to run over seqs, planned now unless the engine planned it,
        recorded as run (record_plan)."""
        plan = self._plan
        if plan is None or plan.seqs != seqs:
            self.plan(seqs, num_new, sample_mask)
        return self.record_plan()

    def _plan_again(
        self,
        streak: _Streak,
        seqs: list[Sequence],
        num_new: list[int],
        sample_mask: list[bool],
        timed: tuple[float, int],
    ) -> bool:
        """Plan the plain step again without the per-row pass when nothing it depends on can have
        changed: the same rows (compared by identity), each decoding, each in the phase it had, the
        groups' draft still behind (it only falls further behind), and the chooser reusing its plain
        choice for the same counts (no search or probe due: AdaptiveDraftLength.choose_plain_again)."""
        if not (
            self.reuse_streaks and streak.reusable and seqs == streak.seqs
            and num_new == streak.ones and sample_mask == streak.trues
        ):  # fmt: skip
            return False
        thinking = self._phases(seqs)
        if thinking != streak.thinking:
            return False
        context = sum(map(len, map(_TOKEN_IDS, seqs)))
        weights = self._drain_weights(streak.groups, seqs, range(len(seqs)))
        chooser = self.draft_length
        assert isinstance(chooser, AdaptiveDraftLength)
        if not chooser.choose_plain_again(context, weights):
            return False
        self.learn()
        self._plan = _Plan(streak.seqs, streak.seqs, streak.choice, thinking, context, timed, False, True)
        return True

    def _choose(
        self, seqs: list[Sequence], decodes: list[int]
    ) -> tuple[Choice, list[bool], int, bool, list[int], list[bool]]:
        """The draft length of every decode row (its group's choice, capped by the room the request has
        left). Returns ((spec_index: rows that draft, their max_drafts, their GROUPS index, row_ks [R] of
        every decode row, 0 = a plain row), thinking [R] bool of every decode row, the decode rows'
        tokens summed: the context their attention reads, whether a drafting row's draft is more than
        CATCH_UP_WIDTH behind: the step first catches it up, a switch out of plain decoding, groups [R]:
        each decode row's GROUPS index, behind [G]: per group whether a row's draft is behind). Runs
        before every step but the plain steps a streak reuses its choice for (_plan_again): per row a
        few attribute reads unless its group drafts; a group's rows are checked for a draft that is
        behind until one is (after plain steps, the first), and the tokens each row has left (the drain
        weights) are read only when the chooser searches afresh."""
        assert self.draft_length is not None
        tracked, relax_enabled = self.inputs.tracked, self.inputs.relax_enabled
        thinking = self._phases([seqs[i] for i in decodes])
        groups, counts, context = [], [0] * len(GROUPS), 0
        behind = [False] * len(GROUPS)  # per group: a row's draft is behind
        draft = self.has_draft_model
        for i, t in zip(decodes, thinking):
            seq = seqs[i]
            g = group_of(t, tracked and t and relax_enabled(seq))
            groups.append(g)
            counts[g] += 1
            context += seq.num_tokens
            if draft and not behind[g] and draft_behind(seq):
                behind[g] = True
        weights = self._drain_weights(groups, seqs, decodes)
        group_ks = self.draft_length.choose(counts, context, behind, weights)
        group_ks = group_ks.tolist()
        if not any(group_ks):  # the plain step: no row drafts, no caps to work out
            plain = ([], [], [], np.zeros(len(decodes), dtype=np.int64))
            return plain, thinking, context, False, groups, behind
        row_list = [min(group_ks[g], self.max_drafts_for(seqs[i])) if group_ks[g] else 0
                    for g, i in zip(groups, decodes)]  # fmt: skip
        chosen = [b for b, k in enumerate(row_list) if k > 0]
        limit = self.draft_length.probe_rows
        if limit is not None:  # a probe out of plain decoding: its first rows only (each catches up)
            for b in chosen[limit:]:
                row_list[b] = 0
            chosen = chosen[:limit]
        spec_index = [decodes[b] for b in chosen]
        choice = (spec_index, [row_list[b] for b in chosen], [groups[b] for b in chosen],
                  np.array(row_list, dtype=np.int64))  # fmt: skip
        switch = draft and any(draft_behind(seqs[i]) for i in spec_index)
        return choice, thinking, context, switch, groups, behind

    @staticmethod
    def _phases(seqs: list[Sequence]) -> list[bool]:
        """[R] the phase each of seqs is in for the step's choice and histogram (True = thinking)."""
        return [s.thinking for s in seqs]

    def _drain_weights(
        self, groups: list[int], seqs: list[Sequence], rows: list[int] | range
    ) -> Callable[[], Drain] | None:
        """While the batch drains, a function giving the drain of seqs' rows (GROUPS index groups [R]
        each), worked out only if the chooser searches; None otherwise (every row 1)."""
        if not self.draining:
            return None
        tokens_left = self.inputs.tokens_left
        return lambda: drain_weights(groups, [tokens_left(seqs[i]) for i in rows])

    # ---- streaks -------------------------------------------------------------------------------

    def _start_streak(
        self,
        seqs: list[Sequence],
        thinking: list[bool],
        groups: list[int],
        behind: list[bool],
        choice: Choice,
    ) -> None:
        """A plain step over seqs (all decoding, a list the streak keeps; thinking, groups [R] and
        behind [G] as _choose found them) starts a streak: see _Streak."""
        reusable = isinstance(self.draft_length, AdaptiveDraftLength) and (
            not self.has_draft_model or all(behind[g] for g in groups)
        )
        self._streak = _Streak(seqs, thinking, groups, self._plain_steps, reusable, choice)

    def _end_streak(self) -> None:
        """Count the streak's plain steps into each of its rows' per-request histograms."""
        streak, self._streak = self._streak, None
        if streak is None:
            return
        if self._plain_steps == streak.start and streak.settled is None:
            return
        for i in range(len(streak.seqs)):
            self._count_streak_row(streak, i)

    def settle(self, seq: Sequence) -> None:
        """Bring seq's per-request draft-length counts up to date (before its output is read)."""
        streak = self._streak
        if streak is None:
            return
        if streak.index is None:
            streak.index, streak.settled = {id(s): i for i, s in enumerate(streak.seqs)}, {}
        i = streak.index.get(id(seq))
        if i is not None and self._count_streak_row(streak, i):
            assert streak.settled is not None
            streak.settled[i] = self._plain_steps

    def _count_streak_row(self, streak: _Streak, i: int) -> bool:
        """Count row i's plain steps of the streak not yet in its request's histogram; whether any were."""
        last = streak.start if streak.settled is None else streak.settled.get(i, streak.start)
        done = self._plain_steps - last
        if done > 0:
            request_metrics(streak.seqs[i]).count_draft_length(0, streak.thinking[i], done)
        return done > 0

    # ---- counting, timing, learning --------------------------------------------------------------

    def record_plan(self) -> Choice:
        """The planned step runs: count its draft lengths (engine and per request) and time it at
        the next plan. Returns the plan's choice (see _choose)."""
        plan, self._plan = self._plan, None
        assert plan is not None
        row_ks = plan.choice[3]
        metrics = self.metrics
        if plan.choice[0]:
            metrics.observe_draft_lengths(row_ks, np.array(plan.thinking, dtype=bool))
        else:  # the plain step (every row 0): no numpy on this path, it runs before every plain step
            metrics.observe_plain_rows(sum(plan.thinking), len(plan.thinking))
        if plan.streak:  # a plain step of the streak: per request, its rows are counted there
            self._plain_steps += 1
        else:
            ks = row_ks.tolist() if plan.choice[0] else [0] * len(plan.decodes)
            for seq, k, t in zip(plan.decodes, ks, plan.thinking):
                request_metrics(seq).count_draft_length(k, t)
        if plan.timed is None:
            self._last_step = None
        else:  # a plain step's rows as their number: its sample takes no numpy (see observe_time)
            sample = row_ks if plan.choice[0] else len(plan.thinking)
            self._last_step = (*plan.timed, sample, plan.context, plan.switch)
        return plan.choice

    def forget_last_step(self) -> None:
        """The engine ran out of work: the time until its next step is no step's; what the chooser has
        still to learn it learns now."""
        self._last_step = None
        self._end_streak()
        self.learn()

    def observe_windows(self, groups: list[int], num_drafts: list[int], num_accepted: np.ndarray) -> None:
        """Queue a step's windows for the chooser (GROUPS index, drafts and accepted drafts [S] each)."""
        nd = np.asarray(num_drafts, dtype=np.int64)
        self._to_learn.append(("observe", (np.asarray(groups, dtype=np.int64), nd, num_accepted)))

    def learn(self) -> None:
        """The chooser learns what is queued (steps' times and windows), then redoes its grid search if
        the next choice would find it too old. A speculative step calls this once its forwards are
        launched, before it waits for their tokens: the chooser's host work then overlaps the device's
        instead of lengthening the step (a step's own windows are learnt at the next)."""
        chooser = self.draft_length
        if chooser is None:
            return
        queued, self._to_learn = self._to_learn, []
        for method, args in queued:
            getattr(chooser, method)(*args)
        chooser.refresh()

    def _time_last_step(self, now: float, builds: int) -> None:
        """The chooser learns what a step costs from the time between the starts of two steps: all of
        it, the host work around the step and a step left in flight included (queued: see learn). A
        step during which something was built (graphs, cost measurements) is no sample."""
        last, self._last_step = self._last_step, None
        if last is None or self.draft_length is None or last[1] != builds:
            return
        method = "observe_switch" if last[4] else "observe_time"
        self._to_learn.append((method, (last[2], 1e3 * (now - last[0]), last[3])))

    def _num_builds(self) -> int:
        """Graphs captured, cost buckets measured and Triton kernels compiled so far; a step that
        changed it paid for them (a first catch-up forward at a new shape compiles, say)."""
        runners = (self.inputs.target_runner, self.inputs.draft_runner)
        n = sum(len(r.graphs.graphs) for r in runners if r is not None and r.graphs is not None)
        if isinstance(self.draft_length, AdaptiveDraftLength):
            n += len(self.draft_length.costs.costs)
        return n + (self.inputs.compile_count() or 0)
