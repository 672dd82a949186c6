"""The engine's speculative step: propose, verify B x (k+1) positions in one target forward, accept.

Stages of `Speculator.step`, in order:
  propose        the proposer drafts up to k tokens for each decode sequence (Proposal)
  build          VerifyBatch: what the target computes for every scheduled sequence
  run target     one forward: prefill chunks and plain rows ride along with the verify windows
  split logits   plain rows, and the windows padded to [S, k+1, V]
  verify         relax mask from the phase tracker, then rejection_sample (sampling/rejection.py)
  to host        one copy of everything the host needs (HostPack)
  outcomes       a StepOutcome per scheduled sequence; Scheduler.postprocess commits them

For a decode sequence with N committed tokens and n drafts d_1..d_n the target scores
[t_{N-1}, d_1 .. d_n] at positions N-1 .. N-1+n; row i scores d_{i+1}, row n the bonus token. With a
accepted drafts the sequence commits d_1..d_a plus the correction/bonus token and its K/V pointer
moves to N + a: the slots of rejected drafts are overwritten later (no block churn).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from thinkspec.config import SpeculativeConfig
from thinkspec.engine.compiles import compile_count
from thinkspec.engine.cuda_graph import MAX_CAPTURE_BATCH, graph_batch_sizes
from thinkspec.engine.model_runner import ModelRunner
from thinkspec.engine.sampling_extras import PromptRows, StepExtras, attach_step_logprobs, sample_with_extras
from thinkspec.engine.scheduler import SchedulerOutput, StepOutcome
from thinkspec.engine.sequence import Sequence, mask_stops_before_min_tokens
from thinkspec.engine.verify_rows import VerifyRows
from thinkspec.reasoning.parsers import ResolvedReasoning
from thinkspec.reasoning.tracker import force_token
from thinkspec.sampling.logprobs import LogprobsTensors
from thinkspec.sampling.rejection import AcceptanceBatch, RejectionResult, rejection_sample
from thinkspec.sampling.sampler import Sampler, SamplingTensors, mix_seed, process_logits
from thinkspec.spec_decode.draft_length import (
    GROUPS,
    AdaptiveDraftLength,
    Drain,
    ForcedDraftLength,
    drain_weights,
    group_of,
)
from thinkspec.spec_decode.draft_model import DraftModelProposer, draft_behind
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.ngram import NgramProposer
from thinkspec.spec_decode.proposer import NO_DRAFT, Proposal, ProposalInput, Proposer
from thinkspec.spec_decode.step_costs import StepCostModel, default_costs, measure_bucket

_NO_STOP_ID = -2  # pads per-request stop-id lists; never equal to a draft (drafts are >= -1)


@dataclass(slots=True)
class VerifyBatch:
    """The target forward of one speculative step, for the scheduled batch (M sequences, S speculating)."""

    spec_index: list[int]  # [S] batch positions of the speculating sequences
    num_drafts: list[int]  # [S] drafts each window verifies
    num_new: list[int]  # [M] tokens each sequence feeds the target
    num_logits: list[int]  # [M] logits rows each sequence wants
    input_ids: list[list[int]]  # [M] host-side inputs (device-held drafts as 0 placeholders)
    device_inputs: tuple[torch.Tensor, torch.Tensor] | None  # (token rows [D], draft ids [D])

    @property
    def spec_of(self) -> dict[int, int]:
        return {i: b for b, i in enumerate(self.spec_index)}

    def row_starts(self) -> list[int]:
        """[M] each sequence's first row in the target's logits."""
        return np.concatenate([[0], np.cumsum(self.num_logits)[:-1]]).astype(int).tolist()

    def logits_rows(self, k: int, sample_mask: list[bool]) -> tuple[list[int], np.ndarray]:
        """Rows of the target's logits: those of plain sampled sequences [P] (a chunk that also
        scores prompt tokens samples from its last row), and each window's [S, k+1] (padded with
        the window's first row, never read as a decision)."""
        spec_of = self.spec_of
        plain: list[int] = []
        windows = np.zeros((len(self.spec_index), k + 1), dtype=np.int64)
        row = 0
        for i, nl in enumerate(self.num_logits):
            b = spec_of.get(i)
            if b is None:
                if sample_mask[i]:
                    plain.append(row + nl - 1)
            else:
                windows[b, :nl] = np.arange(row, row + nl)
                windows[b, nl:] = row
            row += nl
        return plain, windows


@dataclass(slots=True)
class HostPack:
    """Everything a speculative step brings to the host, from one device->host copy."""

    plain_tokens: list[int]  # [P] tokens sampled for plain rows
    tokens: np.ndarray  # [S, k+1] accepted drafts then the emitted token, NO_DRAFT after
    num_accepted: np.ndarray  # [S]
    relaxed: np.ndarray  # [S, k] bool, accepted only by the relaxed test
    thinking_before: np.ndarray  # [S, k] bool, the phase before each draft position
    extra: np.ndarray  # [X] int64: the packed logprobs that rode along, in the order given

    @classmethod
    def fetch(
        cls,
        plain: torch.Tensor | None,  # [P] int64
        result: RejectionResult | None,
        thinking_before: torch.Tensor | None,  # [S, k] bool
        k: int,
        extra: list[torch.Tensor] | None = None,  # flat int64 tensors (LogprobsTensors.pack())
        then: Callable[[], None] | None = None,
    ) -> HostPack:
        """One device->host copy of it all; `then` runs once the copy is queued, before the host waits
        for it (device work queued there runs after the copy, while the host waits and goes on)."""
        parts = [plain] if plain is not None else []
        extra = extra or []
        num_extra = sum(t.numel() for t in extra)
        if result is not None:
            columns = [
                result.output_token_ids,  # k + 1
                result.num_accepted[:, None],  # 1
                result.relaxed_accepted.long(),  # k
                thinking_before.long(),  # k
            ]
            parts.append(torch.cat(columns, dim=1).flatten())
        parts += extra
        if not parts:
            host = np.zeros(0, dtype=np.int64)
        elif then is not None and parts[0].is_cuda:
            flat = torch.cat(parts)
            pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            then()
            copied.synchronize()
            host = pinned.numpy()
        else:
            host = torch.cat(parts).cpu().numpy()
            if then is not None:
                then()
        num_plain = 0 if plain is None else plain.numel()
        spec = host[num_plain : host.size - num_extra].reshape(-1, 3 * k + 2)
        return cls(
            plain_tokens=host[:num_plain].tolist(),
            tokens=spec[:, : k + 1],
            num_accepted=spec[:, k + 1],
            relaxed=spec[:, k + 2 : 2 * k + 2].astype(bool),
            thinking_before=spec[:, 2 * k + 2 : 3 * k + 2].astype(bool),
            extra=host[host.size - num_extra :],
        )


# a step's draft lengths (Speculator._choose): (spec_index [S], max_drafts [S], GROUPS index [S] of the
# rows that draft, row_ks [R] of every decode row)
_Choice = tuple[list[int], list[int], list[int], np.ndarray]


@dataclass(slots=True)
class _Plan:
    """adaptive_k: the draft lengths chosen for the step about to run (Speculator.plan)."""

    seqs: list[Sequence]  # the scheduled sequences it was made for, in order
    decodes: list[Sequence]  # the decode rows
    choice: _Choice
    thinking: list[bool]  # [R] the phase each decode row's choice was made for
    context: int  # tokens of the decode rows' sequences, summed (what their attention reads)
    timed: tuple[float, int] | None  # (start, builds then) when the step is a timing sample
    switch: bool  # it drafts while the draft model is behind: its time is the switch cost's sample
    streak: bool = False  # a plain step of Speculator._streak: its rows are counted there


@dataclass(slots=True)
class _Streak:
    """adaptive_k: plain decode steps (every row k = 0) over the same scheduled rows. Their per-request
    draft-length counts wait here: row i has had Speculator._plain_steps - settled.get(i, start) plain
    steps not yet in its histogram (Speculator.settle). While the choice may be reused (reusable), a
    step of the same rows in the same phases takes it without the per-row pass of _choose
    (Speculator._plan_again)."""

    seqs: list[Sequence]  # [R] the scheduled rows, all decoding, in order
    thinking: list[bool]  # [R] each row's phase
    groups: list[int]  # [R] GROUPS index of each row
    start: int  # Speculator._plain_steps when the streak started
    # no per-row pass needed to reuse the choice: the adaptive chooser, and every group present has a
    # row whose draft is behind (plain steps only put it further behind), or there is no draft model
    reusable: bool
    choice: _Choice  # the plain choice: row_ks zeros [R]
    ones: list[int] = field(init=False)  # [R] 1s: each row's new tokens in a decode step
    trues: list[bool] = field(init=False)  # [R] True: each row samples
    settled: dict[int, int] | None = None  # row -> Speculator._plain_steps at its last settle
    index: dict[int, int] | None = None  # id(seq) -> its row, made at the first settle

    def __post_init__(self) -> None:
        self.ones = [1] * len(self.seqs)
        self.trues = [True] * len(self.seqs)


_MASK64 = (1 << 64) - 1
# Rows up to which a step runs the next one's first draft forward ahead: the host's work between
# steps weighs most at small batches, and the logits it keeps ([rows, vocab] float32, 19 MiB at 32
# rows of Qwen3's vocabulary) stay outside the memory the KV pool was sized around.
RUN_AHEAD_MAX_ROWS = 32


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def synthetic_uniforms(keys: np.ndarray, positions: np.ndarray, k: int, seed: int) -> np.ndarray:
    """[S, k] float64 uniforms in [0, 1), entry [s, j] a hash of (seed, keys[s], positions[s] + j)
    alone; keys [S] uint64 (one per request), positions [S] uint64 (output index of draft 0)."""
    base = _splitmix64(keys ^ np.uint64(seed & _MASK64))  # [S]
    with np.errstate(over="ignore"):
        at = base[:, None] + positions[:, None] + np.arange(k, dtype=np.uint64)[None, :]  # [S, k]
    return (_splitmix64(at) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _windows_of(logits: torch.Tensor, windows: np.ndarray) -> torch.Tensor:
    """logits [N, V], windows [S, k+1] row indexes -> [S, k+1, V]: a view when the windows are rows
    0..S(k+1)-1 in order (every row speculating with the full window: no 194 MB gather at 64 x 5
    rows), else a gather."""
    count = windows.size
    if count <= logits.shape[0] and np.array_equal(windows.reshape(-1), np.arange(count)):
        return logits[:count].view(*windows.shape, logits.shape[1])
    return logits[torch.from_numpy(windows).to(logits.device, non_blocking=True)]


def _decode_rows(seqs: list[Sequence], num_new: list[int], sample_mask: list[bool]) -> list[int]:
    """Batch positions of the decode rows, the ones that may speculate. A request's first output
    token is always sampled plainly (whether its prompt came from the cache or not), so seeded
    outputs do not depend on the schedule."""
    return [
        i
        for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask))
        if m and n == 1 and seq.num_output_tokens > 0
    ]


def _request_metrics(seq: Sequence) -> SpecDecodeMetrics:
    """seq's per-request speculative counters (made at first use)."""
    metrics = seq.metrics.spec_decode
    if metrics is None:
        metrics = seq.metrics.spec_decode = SpecDecodeMetrics()
    return metrics


_TOKEN_IDS = attrgetter("token_ids")


def _budget(params) -> int:
    """thinking_token_budget as an int for the device, -1 = none."""
    return -1 if params.thinking_token_budget is None else min(params.thinking_token_budget, 2**53)


class Speculator:
    # adaptive_k: no request waits to take a finished row's place (the engine sets it after it
    # schedules each step): the chooser then weighs rows by the tokens they may still emit
    # (draft_length.drain_weights)
    draining = False
    # adaptive_k: a plain step over the same rows as the plain step before it reuses that choice without
    # the per-row pass (_plan_again); False makes every step take the pass (tests compare the two)
    reuse_streaks = True

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        target_runner: ModelRunner,
        draft_runner: ModelRunner | None,
        reasoning: ResolvedReasoning | None,
        sampler: Sampler,
        vocab_size: int,
        max_model_len: int,
        seed: int,
        tokenizer: Any | None = None,  # decodes the tokens of logprobs entries
    ) -> None:
        if config.num_speculative_tokens is None:
            raise ValueError("SpeculativeConfig.num_speculative_tokens is required to speculate")
        self.config = config
        self.k = config.num_speculative_tokens
        self.target_runner = target_runner
        self.device = target_runner.device
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.tracker = reasoning.tracker() if reasoning is not None else None
        self.proposer: Proposer
        if draft_runner is not None:
            self.proposer = DraftModelProposer(draft_runner, sampler, self.k, vocab_size)
        else:
            lookup = (config.prompt_lookup_min or 1, config.prompt_lookup_max or 1)
            self.proposer = NgramProposer(self.k, *lookup, self.device)
        self.has_draft_model = draft_runner is not None
        self.draft_runner = draft_runner
        # Run the next step's first draft forward before committing this step's tokens (run_ahead);
        # the engine sets it from async_scheduling.
        self.run_ahead = False
        # adaptive_k: chooses each step's draft lengths; None drafts k every step.
        self.draft_length: AdaptiveDraftLength | ForcedDraftLength | None = None
        # (start, builds then, row_ks or a plain step's rows, context tokens, whether a switch) of the last
        # step, a timing sample
        self._last_step: tuple[float, int, np.ndarray | int, int, bool] | None = None
        self._plan: _Plan | None = None  # the step about to run (adaptive_k)
        self._streak: _Streak | None = None  # the plain steps running over the same rows (adaptive_k)
        self._plain_steps = 0  # plain steps of streaks so far (_Streak.start and settled count from it)
        # adaptive_k: what the chooser has still to learn, oldest first, as (its method, arguments):
        # observe_time / observe_switch (row_ks, wall ms, context) of a timed step, observe (groups,
        # num_drafts, num_accepted) of a step's windows. Learnt while the device runs the next
        # speculative step (see learn).
        self._to_learn: list[tuple[str, tuple]] = []
        # Triton compilations so far (None: none counted); Triton is a GPU-only import
        self._compile_count = compile_count if self.device.type == "cuda" else lambda: None
        if config.adaptive_k:
            self.draft_length = AdaptiveDraftLength(self.k, self._cost_model())
        self._synthetic_table: torch.Tensor | None = None  # [2, k] conditional rates, answer / thinking
        self._synthetic_keys: dict[tuple[str, int], int] = {}  # (request id, index) -> hash of its prompt
        self.metrics = SpecDecodeMetrics()
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 1)

    # ---- per-request settings ------------------------------------------------------------------

    def relax_enabled(self, seq: Sequence) -> bool:
        """Whether this request relaxes its thinking phase (resolved when it was added)."""
        return seq.relax.enabled

    def _cost_model(self) -> StepCostModel:
        """Measured from the graphs where the target replays them, the default model elsewhere."""
        graphs = self.target_runner.graphs
        if graphs is None:
            buckets = graph_batch_sizes(MAX_CAPTURE_BATCH)
            return StepCostModel(self.k, buckets, default_costs(self.k, buckets))

        def measure(bucket: int):
            return measure_bucket(self.target_runner, self.draft_runner, bucket, self.k)

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

    def plan(self, seqs: list[Sequence], num_new: list[int], sample_mask: list[bool]) -> bool:
        """adaptive_k, at the start of a step: choose the draft length of each of these scheduled rows
        (kept for the step, see record_plan). True when the step is the plain decode step: every row
        decodes, with k = 0 (the engine may then run its own plain step, async scheduling included).
        Also takes the last step's time (see _time_last_step)."""
        now = time.perf_counter()
        builds = self._num_builds()
        self._time_last_step(now, builds)
        if self._streak is not None:
            if self._plan_again(self._streak, seqs, num_new, sample_mask, (now, builds)):
                return True
            self._end_streak()
        decodes = _decode_rows(seqs, num_new, sample_mask)
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

    def _start_streak(
        self,
        seqs: list[Sequence],
        thinking: list[bool],
        groups: list[int],
        behind: list[bool],
        choice: _Choice,
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
            _request_metrics(streak.seqs[i]).count_draft_length(0, streak.thinking[i], done)
        return done > 0

    def _drain_weights(
        self, groups: list[int], seqs: list[Sequence], rows: list[int] | range
    ) -> Callable[[], Drain] | None:
        """While the batch drains, a function giving the drain of seqs' rows (GROUPS index groups [R]
        each), worked out only if the chooser searches; None otherwise (every row 1)."""
        if not self.draining:
            return None
        return lambda: drain_weights(groups, [self.tokens_left(seqs[i]) for i in rows])

    def _phases(self, seqs: list[Sequence]) -> list[bool]:
        """[R] the phase each of seqs is in for the step's choice and histogram (True = thinking): the
        synthetic profile's in that benchmark mode, else the request's own."""
        profile = self.config.synthetic_acceptance_profile
        if profile is None:
            return [s.thinking for s in seqs]
        limit = profile["thinking_tokens"]
        return [s.num_output_tokens < limit for s in seqs]

    def record_plan(self) -> _Choice:
        """The planned step runs: count its draft lengths (engine and per request) and time it at
        the next plan. Returns the plan's choice (see _choose)."""
        plan, self._plan = self._plan, None
        assert plan is not None
        row_ks = plan.choice[3]
        if plan.choice[0]:
            self.metrics.observe_draft_lengths(row_ks, np.array(plan.thinking, dtype=bool))
        else:  # the plain step (every row 0): no numpy on this path, it runs before every plain step
            self.metrics.observe_plain_rows(sum(plan.thinking), len(plan.thinking))
        if plan.streak:  # a plain step of the streak: per request, its rows are counted there
            self._plain_steps += 1
        else:
            ks = row_ks.tolist() if plan.choice[0] else [0] * len(plan.decodes)
            for seq, k, t in zip(plan.decodes, ks, plan.thinking):
                _request_metrics(seq).count_draft_length(k, t)
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

    def learn(self) -> None:
        """adaptive_k: the chooser learns what is queued (steps' times and windows), then redoes its
        grid search if the next choice would find it too old. A speculative step calls this once its
        forwards are launched, before it waits for their tokens: the chooser's host work then overlaps
        the device's instead of lengthening the step (a step's own windows are learnt at the next)."""
        chooser = self.draft_length
        if chooser is None:
            return
        queued, self._to_learn = self._to_learn, []
        for method, args in queued:
            getattr(chooser, method)(*args)
        chooser.refresh()

    def _time_last_step(self, now: float, builds: int) -> None:
        """adaptive_k learns what a step costs from the time between the starts of two steps: all
        of it, the host work around the step and a step left in flight included (queued: see learn).
        A step during which something was built (graphs, cost measurements) is no sample."""
        last, self._last_step = self._last_step, None
        if last is None or self.draft_length is None or last[1] != builds:
            return
        method = "observe_switch" if last[4] else "observe_time"
        self._to_learn.append((method, (last[2], 1e3 * (now - last[0]), last[3])))

    def _num_builds(self) -> int:
        """Graphs captured, cost buckets measured and Triton kernels compiled so far; a step that
        changed it paid for them (a first catch-up forward at a new shape compiles, say)."""
        runners = (self.target_runner, self.draft_runner)
        n = sum(len(r.graphs.graphs) for r in runners if r is not None and r.graphs is not None)
        if isinstance(self.draft_length, AdaptiveDraftLength):
            n += len(self.draft_length.costs.costs)
        return n + (self._compile_count() or 0)

    def tokens_left(self, seq: Sequence) -> int:
        """The most tokens the request may still emit (max_tokens, max_model_len)."""
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        return room if max_tokens is None else min(room, max_tokens - seq.num_output_tokens)

    def max_drafts_for(self, seq: Sequence) -> int:
        """Drafts worth proposing: no more than the tokens the request may still emit, minus the bonus."""
        return max(0, min(self.k, self.tokens_left(seq) - 1))

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, sched: SchedulerOutput) -> list[StepOutcome]:
        """Run one speculative step over sched; one StepOutcome per scheduled sequence (batch order)."""
        seqs, num_new = sched.seqs, sched.num_new_tokens
        sample_mask = sched.sample_mask()
        spec_index = _decode_rows(seqs, num_new, sample_mask)
        decodes_only = len(spec_index) == len(seqs)
        choice = None
        if self.draft_length is not None:
            plan = self._plan
            if plan is None or plan.seqs != seqs:
                self.plan(seqs, num_new, sample_mask)
            choice = self.record_plan()
            spec_index, max_drafts = choice[0], choice[1]
        else:
            max_drafts = [self.max_drafts_for(seqs[i]) for i in spec_index]
        if choice is not None and not spec_index and decodes_only:
            # The plain decode step: the draft model catches up when its rows speculate again.
            proposal = Proposal(torch.empty(0, self.k, dtype=torch.long, device=self.device), [])
        else:
            proposal = self.proposer.propose(ProposalInput(seqs, num_new, spec_index, max_drafts))
        if choice is not None:
            proposal = proposal.narrow(max(1, max(proposal.num_drafts, default=1)))
        k = proposal.draft_token_ids.shape[1]  # this step's window: k + 1 rows per speculating sequence
        prompt_rows = PromptRows.build(seqs, num_new, sample_mask)
        batch = self._build_verify_batch(sched, sample_mask, spec_index, proposal, prompt_rows)
        logits = self.target_runner.execute_model(
            seqs, batch.num_new, batch.num_logits, input_token_ids=batch.input_ids,
            device_inputs=batch.device_inputs,
        )  # fmt: skip  # [N, V] float32
        plain_rows, windows = batch.logits_rows(k, sample_mask)
        spec_of = batch.spec_of
        plain_index = [i for i, m in enumerate(sample_mask) if m and i not in spec_of]
        plain_seqs = [seqs[i] for i in plain_index]
        plain_tokens, plain_extras, plain_lp = self._sample_plain(logits, plain_rows, plain_seqs)
        prompt_lp = prompt_rows.logprobs(logits, batch.row_starts()) if prompt_rows is not None else None
        result = thinking_before = spec_extras = spec_lp = None
        if spec_index:
            target = _windows_of(logits, windows)  # [S, k+1, V]
            spec_seqs = [seqs[i] for i in spec_index]
            result, thinking_before, spec_extras, spec_lp = self._verify(spec_seqs, target, proposal)
        packed = [t.pack() for t in (plain_lp, spec_lp, prompt_lp) if t is not None]
        if choice is not None:
            self.learn()  # while the device runs this step's forwards
        # the next step's forward 1, queued behind the copy (see DraftModelProposer.run_ahead)
        drafter = launch = None
        if self.run_ahead and result is not None and len(spec_index) == len(seqs) and prompt_rows is None:
            drafter = self._ahead_proposer(seqs, proposal)
        if drafter is not None:
            assert result is not None
            out, accepted = result.output_token_ids, result.num_accepted

            def launch() -> None:
                drafter.run_ahead(seqs, proposal.num_drafts, out, accepted)

        host = HostPack.fetch(plain_tokens, result, thinking_before, k, packed, then=launch)
        if drafter is not None:
            drafter.settle_ahead(host.tokens, host.num_accepted)
        if choice is not None:
            groups = np.asarray(choice[2], dtype=np.int64)
            nd = np.asarray(batch.num_drafts, dtype=np.int64)
            self._to_learn.append(("observe", (groups, nd, host.num_accepted)))
        outcomes = self._outcomes(sched, sample_mask, batch, proposal, host)
        if packed:
            groups = [
                (plain_extras if plain_lp else None, plain_index, 1),
                (spec_extras if spec_lp else None, batch.spec_index, k + 1),
            ]
            attach_step_logprobs(outcomes, sched.seqs, groups, prompt_rows, host.extra, self.tokenizer)
        return outcomes

    # ---- stages --------------------------------------------------------------------------------

    def _ahead_proposer(self, seqs: list[Sequence], proposal: Proposal) -> DraftModelProposer | None:
        """The draft proposer when this step, whose rows all speculate, may run the next step's forward
        1 ahead (DraftModelProposer.run_ahead), else None: every row drafted and holds KV slots up to
        the last position the forward may feed (one past its window: reserved with the step's), not
        every row may finish by length in this step (nothing would use the forward), and there are
        at most RUN_AHEAD_MAX_ROWS rows."""
        proposer = self.proposer
        if not isinstance(proposer, DraftModelProposer) or proposal.draft_computed is None:
            return None
        if len(seqs) > RUN_AHEAD_MAX_ROWS:
            return None
        block_size = proposer.runner.block_size
        stays = False
        for seq, m in zip(seqs, proposal.num_drafts):
            if m == 0 or len(seq.block_table) * block_size < seq.num_tokens + m + 1:
                return None
            stays = stays or self.tokens_left(seq) > m + 1  # it emits at most m + 1 tokens now
        return proposer if stays else None

    def _choose(
        self, seqs: list[Sequence], decodes: list[int]
    ) -> tuple[_Choice, list[bool], int, bool, list[int], list[bool]]:
        """adaptive_k: the draft length of every decode row (its group's choice, capped by the room
        the request has left). Returns ((spec_index: rows that draft, their max_drafts, their GROUPS
        index, row_ks [R] of every decode row, 0 = a plain row), thinking [R] bool of every decode
        row, the decode rows' tokens summed: the context their attention reads, whether a drafting
        row's draft is more than CATCH_UP_WIDTH behind: the step first catches it up, a switch out
        of plain decoding, groups [R]: each decode row's GROUPS index, behind [G]: per group whether a
        row's draft is behind). Runs before every step but the plain steps a streak reuses its choice
        for (_plan_again): per row a few attribute reads unless its group drafts; a group's rows are
        checked for a draft that is behind until one is (after plain steps, the first), and the
        tokens each row has left (the drain weights) are read only when the chooser searches afresh."""
        assert self.draft_length is not None
        tracked = self.tracker is not None
        thinking = self._phases([seqs[i] for i in decodes])
        groups, counts, context = [], [0] * len(GROUPS), 0
        behind = [False] * len(GROUPS)  # per group: a row's draft is behind
        draft = self.has_draft_model
        for i, t in zip(decodes, thinking):
            seq = seqs[i]
            g = group_of(t, tracked and t and self.relax_enabled(seq))
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

    def _build_verify_batch(
        self,
        sched: SchedulerOutput,
        sample_mask: list[bool],
        spec_index: list[int],
        proposal: Proposal,
        prompt_rows: PromptRows | None = None,
    ) -> VerifyBatch:
        """Inputs of the target forward: unchanged chunks for plain rows, [last token, drafts] windows
        for speculating rows (drafts made on the device go in through device_inputs)."""
        k = proposal.draft_token_ids.shape[1]
        spec_of = {i: b for b, i in enumerate(spec_index)}
        num_new, num_logits, input_ids = [], [], []
        dev_pos: list[int] = []  # packed input positions that take a device-held draft
        dev_src: list[int] = []  # flat index into draft_token_ids [S*k]
        offset = 0
        for i, (seq, n, m) in enumerate(zip(sched.seqs, sched.num_new_tokens, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                num_new.append(n)
                num_logits.append(int(m) if prompt_rows is None else prompt_rows.num_logits[i])
                input_ids.append(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
            else:
                nd = proposal.num_drafts[b]
                num_new.append(1 + nd)
                num_logits.append(1 + nd)
                if proposal.host_drafts is not None:
                    input_ids.append([seq.last_token_id, *proposal.host_drafts[b]])
                else:
                    input_ids.append([seq.last_token_id] + [0] * nd)
                    dev_pos.extend(range(offset + 1, offset + 1 + nd))
                    dev_src.extend(range(b * k, b * k + nd))
            offset += num_new[-1]
        device_inputs = None
        if dev_pos:
            index = torch.tensor(dev_pos, dtype=torch.long).to(self.device, non_blocking=True)
            src = torch.tensor(dev_src, dtype=torch.long).to(self.device, non_blocking=True)
            device_inputs = (index, proposal.draft_token_ids.view(-1)[src])
        return VerifyBatch(spec_index, proposal.num_drafts, num_new, num_logits, input_ids, device_inputs)

    def _sample_plain(
        self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]
    ) -> tuple[torch.Tensor | None, StepExtras | None, LogprobsTensors | None]:
        """(tokens [P] int64, extras, logprobs) for the plain sampled rows (prefills that end, first
        output tokens)."""
        if not seqs:
            return None, None, None
        plain = logits[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
        tracker = self.tracker
        think_end = tracker.think_end_id if tracker is not None else None
        return sample_with_extras(self.sampler, plain, seqs, think_end)

    def _verify(
        self,
        seqs: list[Sequence],
        target: torch.Tensor,  # [S, k+1, V] float32
        proposal: Proposal,
    ) -> tuple[RejectionResult, torch.Tensor, StepExtras | None, LogprobsTensors | None]:
        """rejection_sample plus the phase bookkeeping; returns (result, thinking_before [S, k] bool,
        the windows' extras, logprobs [L*(k+1) rows] of those asking). Penalties apply to the target's
        rows before acceptance: row i as if drafts 1..i were kept."""
        drafts = proposal.draft_token_ids  # [S, k]
        params = [s.sampling_params for s in seqs]
        all_greedy = all(p.is_greedy for p in params)
        profile = self.config.synthetic_acceptance_profile
        limit = profile["thinking_tokens"] if profile is not None else 0
        rows = VerifyRows(
            [VerifyRows.row(n, s, _budget(p), limit) for n, s, p in zip(proposal.num_drafts, seqs, params)],
            self.device,
        )
        num_drafts, thinking = rows.num_drafts, rows.thinking
        extras = StepExtras.build(seqs, target.shape[-1], self.device)
        raw = extras.raw_rows(target) if extras is not None else None
        if extras is not None:
            target = extras.penalise_windows(target, drafts, num_drafts)
        mask_stops_before_min_tokens(target, seqs)
        if not all_greedy:
            flat = target.view(-1, target.shape[-1])
            t = SamplingTensors.from_params([p for p in params for _ in range(target.shape[1])], self.device)
            target = process_logits(flat, t).view_as(target)
        if self.tracker is not None and any(p.thinking_token_budget is not None for p in params):
            # Past the budget a row allows only </think>: no other draft is accepted there and the
            # correction token is the end marker, as in plain decoding.
            over = self.tracker.over_budget(thinking, rows.thinking_tokens, rows.budget, drafts)
            force_token(target, over, self.tracker.think_end_id)
        relax_mask, thinking_before = self._relax_mask(seqs, drafts, num_drafts, thinking, rows.relax_on)
        if profile is not None:  # benchmark mode: the metrics' phase is the profile's, as the acceptance's
            thinking_before = rows.profile_thinking[:, None].expand_as(drafts)
        seeds = None
        if not all_greedy:
            seeds = [
                int(self.rng.integers(2**62)) if p.seed is None else mix_seed(p.seed, s.num_output_tokens)
                for p, s in zip(params, seqs)
            ]
            seeds = torch.tensor(seeds, dtype=torch.long).to(self.device, non_blocking=True)
        # Sampled rows reach rejection_sample already scaled, so their temperature is 1, 0 = greedy.
        batch = AcceptanceBatch(
            target, drafts, num_drafts, relax_mask, rows.temperature, rows.ratio, rows.top_k, rows.delta,
            proposal.draft_probs, seeds, all_greedy=all_greedy,
        )  # fmt: skip
        result = rejection_sample(batch, self.generator)
        if self.config.synthetic_acceptance_rate is not None or profile is not None:
            result = self._synthetic(result, target, drafts, num_drafts, rows.profile_thinking, seqs)
        lp = extras.logprobs(raw, result.output_token_ids) if extras is not None else None
        return result, thinking_before, extras, lp

    def _relax_mask(
        self,
        seqs: list[Sequence],
        drafts: torch.Tensor,  # [S, k] int64
        num_drafts: torch.Tensor,  # [S] int64
        thinking: torch.Tensor,  # [S] bool
        enabled: torch.Tensor,  # [S] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(relax_mask [S, k] bool, thinking_before [S, k] bool): the tracker's per-token mask, minus
        each request's own stop token ids (protected like EOS)."""
        if self.tracker is None:
            none = torch.zeros_like(drafts, dtype=torch.bool)
            return none, none
        relax_mask = self.tracker.relax_mask(thinking, drafts, num_drafts, enabled)
        thinking_before = self.tracker.phase_before(thinking, drafts)
        stop_ids = [sorted(s.sampling_params.stop_token_ids) for s in seqs]
        if any(stop_ids):
            width = max(len(x) for x in stop_ids)
            pad = torch.tensor([x + [_NO_STOP_ID] * (width - len(x)) for x in stop_ids], dtype=torch.long)
            pad = pad.to(self.device, non_blocking=True)  # [S, W]
            relax_mask &= ~(drafts[:, :, None] == pad[:, None, :]).any(dim=2)
        return relax_mask, thinking_before

    def _outcomes(
        self,
        sched: SchedulerOutput,
        sample_mask: list[bool],
        batch: VerifyBatch,
        proposal: Proposal,
        host: HostPack,
    ) -> list[StepOutcome]:
        """What the step did to each scheduled sequence; counts the step in the metrics."""
        spec_of = batch.spec_of
        step = None
        if batch.spec_index:
            nd = np.asarray(batch.num_drafts, dtype=np.int64)
            step = self.metrics.observe(nd, host.num_accepted, host.relaxed, host.thinking_before)
        outcomes: list[StepOutcome] = []
        plain_tokens = iter(host.plain_tokens)
        for i, (seq, n, m) in enumerate(zip(sched.seqs, sched.num_new_tokens, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                tokens = [next(plain_tokens)] if m else []
                computed = seq.num_computed_tokens + n
            else:
                a = int(host.num_accepted[b])
                tokens = host.tokens[b, : a + 1].tolist()
                computed = seq.num_computed_tokens + 1 + a
                _request_metrics(seq).observe_step(step, b)
            draft = None
            if proposal.draft_computed is not None:  # the draft's K/V never runs past the target's
                draft = min(proposal.draft_computed[i], computed)
            outcomes.append(StepOutcome(tokens, computed, draft))
        return outcomes

    def _synthetic_rates(self, thinking: torch.Tensor) -> torch.Tensor | float:
        """Acceptance probability at each position given the previous ones accepted: [S, k] from the
        profile (a_i / a_{i-1}), or the flat synthetic rate."""
        profile = self.config.synthetic_acceptance_profile
        if profile is None:
            return float(self.config.synthetic_acceptance_rate)
        if self._synthetic_table is None:
            rows = []
            for phase in ("answer", "thinking"):
                shares = [1.0, *profile[phase]]
                rows.append([b / a if a > 0 else 0.0 for a, b in zip(shares, shares[1:])])
            self._synthetic_table = torch.tensor(rows, dtype=torch.float32, device=thinking.device)  # [2, k]
        return self._synthetic_table[thinking.long()]

    def _synthetic_key(self, seq: Sequence) -> int:
        """A request's key for the seeded synthetic draws: its prompt's hash (Python hashes tuples of
        ints the same in every process), so that the same prompts give the same keys in every run."""
        name = (seq.request_id, seq.index)
        key = self._synthetic_keys.get(name)
        if key is None:
            if len(self._synthetic_keys) > 1 << 16:
                self._synthetic_keys.clear()
            key = self._synthetic_keys[name] = hash((tuple(seq.prompt_token_ids), seq.index)) & _MASK64
        return key

    def _synthetic(
        self,
        result: RejectionResult,
        target: torch.Tensor,  # [S, k+1, V]
        drafts: torch.Tensor,  # [S, k]
        num_drafts: torch.Tensor,  # [S]
        thinking: torch.Tensor,  # [S] bool, the profile's phase of each row
        seqs: list[Sequence],
    ) -> RejectionResult:
        """Benchmark mode: draft i is accepted with a set probability regardless of the models: the
        synthetic rate, or the profile's share of its phase and position given the run reached i. A
        profile with a "seed" draws from a hash of (seed, request, output position) instead of the
        engine's generator: the same token of the same request meets the same draw whatever k or step
        drafts it, so settings compared over the same prompts see the same hard tokens."""
        num_spec, k = drafts.shape
        profile = self.config.synthetic_acceptance_profile
        if profile is not None and profile.get("seed") is not None:
            keys = np.array([self._synthetic_key(s) for s in seqs], dtype=np.uint64)
            positions = np.array([s.num_output_tokens for s in seqs], dtype=np.uint64)
            draws = synthetic_uniforms(keys, positions, k, int(profile["seed"]))
            u = torch.from_numpy(draws).to(drafts.device, non_blocking=True)  # float64: below 1, as drawn
        else:
            u = torch.rand(num_spec, k, generator=self.generator, device=drafts.device)
        pos = torch.arange(k, device=drafts.device)
        rates = self._synthetic_rates(thinking)
        rates = rates[:, :k] if isinstance(rates, torch.Tensor) else rates  # the step's window may be < K
        ok = (u < rates) & (pos[None, :] < num_drafts[:, None])
        num_accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # [S]
        emitted = target.argmax(dim=-1).gather(1, num_accepted[:, None])  # [S, 1]
        out = torch.full((num_spec, k + 1), NO_DRAFT, dtype=torch.long, device=drafts.device)
        out[:, :k] = torch.where(pos[None, :] < num_accepted[:, None], drafts, NO_DRAFT)
        out.scatter_(1, num_accepted[:, None], emitted)
        return RejectionResult(out, num_accepted, torch.zeros_like(result.relaxed_accepted))
