"""Speculative decoding counters, split by reasoning phase.

Definitions (one verify step of one request proposes `n = num_draft_tokens` drafts and accepts
the first `a <= n` of them; the step then emits `a + 1` tokens, the +1 being the bonus or
correction token):

- num_drafts: verify steps with n >= 1 (steps with no draft are plain decode and not counted).
- num_draft_tokens / num_accepted_tokens: proposed / accepted draft tokens.
- num_draft_tokens_per_pos[k] / num_accepted_tokens_per_pos[k]: the same at draft position k.
- num_relaxed_accepted_tokens: accepted drafts that the strict rule would have rejected
  (accepted only because of the relaxation).
- num_emitted_tokens: a + 1 summed over counted steps.
- draft_length_histogram[k] (adaptive_k only): decode rows of a step for which the engine chose to
  draft k tokens, k = 0 included (a plain decode row); a row counts once per step, in the phase the
  choice was made for.

Phase split: token-level counters use each position's own phase (the phase before it, see
`PhaseTracker.phase_before`); step-level counters (num_drafts, num_emitted_tokens) use the phase
before the step's first draft position. The totals are the sum of the two phases.

Derived figures (0.0 when the denominator is 0):
- mean_acceptance_length = num_emitted_tokens / num_drafts (= 1 + accepted drafts per step)
- draft_acceptance_rate = num_accepted_tokens / num_draft_tokens
- acceptance_rate_per_pos[k] = num_accepted_tokens_per_pos[k] / num_draft_tokens_per_pos[k]
- relaxed_share = num_relaxed_accepted_tokens / num_accepted_tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

PHASES = ("thinking", "answer")
# Steps of up to this many rows are counted in Python (SpecDecodeStep._count_rows), larger ones with numpy.
SMALL_STEP_ROWS = 8


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def _add_into(acc: list[int], values: list[int], start: int, n: int) -> None:
    """acc[i] += values[start + i] for i < n, in place, growing acc to n entries."""
    if len(acc) < n:
        acc.extend([0] * (n - len(acc)))
    for i, v in enumerate(values[start : start + n]):
        if v:
            acc[i] += v


def _add_lists(a: list[int], b: Sequence[int]) -> list[int]:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for k, v in enumerate(b):
        out[k] += int(v)
    return out


@dataclass(slots=True)
class PhaseCounters:
    """Integer counters for one phase (or for the total)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_relaxed_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    draft_length_histogram: list[int] = field(default_factory=list)

    def merge(self, other: PhaseCounters) -> PhaseCounters:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_relaxed_accepted_tokens += other.num_relaxed_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_draft_tokens_per_pos = _add_lists(
            self.num_draft_tokens_per_pos, other.num_draft_tokens_per_pos
        )
        self.num_accepted_tokens_per_pos = _add_lists(
            self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        )
        self.draft_length_histogram = _add_lists(self.draft_length_histogram, other.draft_length_histogram)
        return self

    def add_packed(self, values: list[int]) -> None:  # [5 + 2K] ints: 5 scalars, drafted, accepted per pos
        """Add one packed row in place (per-request accumulation: no intermediate objects)."""
        k = (len(values) - 5) // 2
        self.num_drafts += values[0]
        self.num_draft_tokens += values[1]
        self.num_accepted_tokens += values[2]
        self.num_relaxed_accepted_tokens += values[3]
        self.num_emitted_tokens += values[4]
        _add_into(self.num_draft_tokens_per_pos, values, 5, k)
        _add_into(self.num_accepted_tokens_per_pos, values, 5 + k, k)

    def copy(self) -> PhaseCounters:
        return PhaseCounters().merge(self)

    @property
    def mean_acceptance_length(self) -> float:
        return _ratio(self.num_emitted_tokens, self.num_drafts)

    @property
    def draft_acceptance_rate(self) -> float:
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [_ratio(a, d) for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def relaxed_share(self) -> float:
        return _ratio(self.num_relaxed_accepted_tokens, self.num_accepted_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_relaxed_accepted_tokens": self.num_relaxed_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "draft_length_histogram": list(self.draft_length_histogram),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "relaxed_share": self.relaxed_share,
        }


@dataclass(slots=True)
class SpecDecodeStep:
    """Host copy of one verify step of a batch (what `SpecDecodeMetrics.observe_step` consumes)."""

    num_draft_tokens: np.ndarray  # [B] int64
    num_accepted: np.ndarray  # [B] int64, accepted drafts (bonus/correction not included)
    relaxed_accepted: np.ndarray  # [B, K] bool, True where only the relaxed test accepted
    thinking_before: np.ndarray  # [B, K] bool, phase before each draft position
    _per_row: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _row_lists: list | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_tensors(
        cls,
        num_draft_tokens: torch.Tensor | np.ndarray,  # [B] int
        num_accepted: torch.Tensor | np.ndarray,  # [B] int
        relaxed_accepted: torch.Tensor | np.ndarray,  # [B, K] bool
        thinking_before: torch.Tensor | np.ndarray,  # [B, K] bool
    ) -> SpecDecodeStep:
        """Validate shapes and bring the step to the host in one device->host copy."""
        if isinstance(relaxed_accepted, torch.Tensor):
            nd, na = torch.as_tensor(num_draft_tokens), torch.as_tensor(num_accepted)
            thinking_before = torch.as_tensor(thinking_before)
            dev = relaxed_accepted.device
            cls._check_shapes(
                tuple(nd.shape), tuple(na.shape), tuple(relaxed_accepted.shape), tuple(thinking_before.shape)
            )
            packed = (
                torch.cat(
                    [
                        nd.to(dev, torch.long)[:, None],
                        na.to(dev, torch.long)[:, None],
                        relaxed_accepted.to(torch.long),
                        thinking_before.to(dev, torch.long),
                    ],
                    dim=1,
                )
                .cpu()
                .numpy()
            )  # [B, 2 + 2K] int64
            k = relaxed_accepted.shape[1]
            step = cls(packed[:, 0], packed[:, 1], packed[:, 2 : 2 + k] != 0, packed[:, 2 + k :] != 0)
        else:
            step = cls(
                np.asarray(num_draft_tokens, dtype=np.int64),
                np.asarray(num_accepted, dtype=np.int64),
                np.asarray(relaxed_accepted, dtype=bool),
                np.asarray(thinking_before, dtype=bool),
            )
            cls._check_shapes(
                step.num_draft_tokens.shape,
                step.num_accepted.shape,
                step.relaxed_accepted.shape,
                step.thinking_before.shape,
            )
        k = step.relaxed_accepted.shape[1]
        # on Python ints: numpy's small reductions cost tens of microseconds each between two steps
        nd, na = step.num_draft_tokens.tolist(), step.num_accepted.tolist()
        if any(n < 0 or n > k for n in nd):
            raise ValueError(f"num_draft_tokens must be in [0, {k}], got {nd}")
        if any(a < 0 or a > n for a, n in zip(na, nd)):
            raise ValueError(
                f"num_accepted must be in [0, num_draft_tokens], got {na} for num_draft_tokens {nd}"
            )
        return step

    @staticmethod
    def _check_shapes(nd: tuple, na: tuple, relaxed: tuple, thinking: tuple) -> None:
        if len(relaxed) != 2 or len(nd) != 1 or nd != na or relaxed != thinking or nd[0] != relaxed[0]:
            raise ValueError(
                "expected num_draft_tokens [B], num_accepted [B], relaxed_accepted [B, K], "
                f"thinking_before [B, K]; got {nd}, {na}, {relaxed}, {thinking}"
            )

    def per_row(self) -> np.ndarray:  # [B, 2, 5 + 2K] int64, computed once per step
        """Each row's counters for (thinking, answer), packed as `PhaseCounters.add_packed` reads them.

        Per-request accumulation indexes this array instead of recounting, so keeping one
        SpecDecodeMetrics per request costs a few Python additions per request and step.
        """
        if self._per_row is not None:
            return self._per_row
        nd, na = self.num_draft_tokens, self.num_accepted
        relaxed, thinking = self.relaxed_accepted, self.thinking_before
        k = relaxed.shape[1]
        pos = np.arange(k)
        drafted = pos[None, :] < nd[:, None]  # [B, K]
        accepted = pos[None, :] < na[:, None]  # [B, K]
        in_phase = np.stack([thinking, ~thinking])  # [2, B, K]: thinking, answer
        d = drafted[None] & in_phase  # [2, B, K]
        a = accepted[None] & in_phase  # [2, B, K]
        # A step belongs to the phase before its first draft position; rows without drafts count nowhere.
        steps = (nd >= 1)[None] & (in_phase[:, :, 0] if k else np.zeros((2, len(nd)), dtype=bool))  # [2, B]
        scalars = np.stack(
            [steps, d.sum(-1), a.sum(-1), (a & relaxed[None]).sum(-1), steps * (na + 1)[None]], axis=-1
        )  # [2, B, 5]
        packed = np.concatenate([scalars, d, a], axis=-1).astype(np.int64)  # [2, B, 5 + 2K]
        self._per_row = packed.transpose(1, 0, 2).copy()
        return self._per_row

    def row_lists(self) -> list[list[list[int]]]:  # [B][2][5 + 2K] ints, per_row() as lists, once per step
        if self._row_lists is None:
            if len(self.num_accepted) <= SMALL_STEP_ROWS:
                self._row_lists = self._count_rows()
            else:
                self._row_lists = self.per_row().tolist()
        return self._row_lists

    def _count_rows(self) -> list[list[list[int]]]:  # [B][2][5 + 2K] ints: per_row's counts, in Python
        """per_row() for a few rows, where numpy's cost per call outweighs the work (a step's metrics
        are on the host's path between two steps)."""
        k = self.relaxed_accepted.shape[1]
        out = []
        for n, a, relaxed, thinking in zip(
            self.num_draft_tokens.tolist(), self.num_accepted.tolist(),
            self.relaxed_accepted.tolist(), self.thinking_before.tolist(),
        ):  # fmt: skip
            row = []
            for phase in (True, False):
                d = [int(j < n and thinking[j] == phase) for j in range(k)]
                acc = [int(j < a and thinking[j] == phase) for j in range(k)]
                step = int(n >= 1 and k > 0 and thinking[0] == phase)
                relaxed_acc = sum(x for x, r in zip(acc, relaxed) if r)
                row.append([step, sum(d), sum(acc), relaxed_acc, step * (a + 1), *d, *acc])
            out.append(row)
        return out

    def packed_sum(self, rows: slice | Sequence[int] | np.ndarray | None = None) -> list[list[int]]:
        """[2][5 + 2K] ints: the selected rows' packed counters (all rows when None) for (thinking,
        answer), summed, as PhaseCounters.add_packed reads them."""
        if len(self.num_accepted) <= SMALL_STEP_ROWS and not isinstance(rows, np.ndarray):
            lists = self.row_lists()
            if rows is None or isinstance(rows, slice):
                picked = lists[slice(None) if rows is None else rows]
            else:
                picked = [lists[i] for i in rows]
            width = 5 + 2 * self.relaxed_accepted.shape[1]
            return [[sum(r[p][c] for r in picked) for c in range(width)] for p in range(2)]
        per_row = self.per_row()
        return per_row[slice(None) if rows is None else rows].sum(0).tolist()


@dataclass(slots=True)
class SpecDecodeMetrics:
    """Accumulated speculative decoding counters, by phase; cheap to keep per request and per call."""

    thinking: PhaseCounters = field(default_factory=PhaseCounters)
    answer: PhaseCounters = field(default_factory=PhaseCounters)

    def observe(
        self,
        num_draft_tokens: torch.Tensor | np.ndarray,  # [B] int
        num_accepted: torch.Tensor | np.ndarray,  # [B] int
        relaxed_accepted: torch.Tensor | np.ndarray,  # [B, K] bool
        thinking_before: torch.Tensor | np.ndarray,  # [B, K] bool
        request_index: int | slice | Sequence[int] | None = None,
    ) -> SpecDecodeStep:
        """Add one verify step (or its rows `request_index`); returns the host copy for reuse.

        Reuse the returned step with `observe_step(step, i)` for per-request metrics, so the
        device is read once per step.
        """
        step = SpecDecodeStep.from_tensors(num_draft_tokens, num_accepted, relaxed_accepted, thinking_before)
        self.observe_step(step, request_index)
        return step

    def observe_step(
        self, step: SpecDecodeStep, request_index: int | slice | Sequence[int] | None = None
    ) -> SpecDecodeMetrics:
        if isinstance(request_index, (int, np.integer)):  # one request: the hot per-request path
            thinking, answer = step.row_lists()[request_index]
            self.thinking.add_packed(thinking)
            self.answer.add_packed(answer)
            return self
        thinking, answer = step.packed_sum(request_index)  # several rows: one sum, no objects
        self.thinking.add_packed(thinking)
        self.answer.add_packed(answer)
        return self

    def observe_draft_lengths(
        self,
        draft_lengths: np.ndarray,  # [R] int, k chosen for each decode row of one step
        thinking: np.ndarray,  # [R] bool, the phase each choice was made for
    ) -> None:
        """Count one step's chosen draft lengths in the per-phase histograms."""
        for counters, rows in ((self.thinking, thinking), (self.answer, ~thinking)):
            if rows.any():
                counts = np.bincount(draft_lengths[rows])
                counters.draft_length_histogram = _add_lists(counters.draft_length_histogram, counts)

    def observe_plain_rows(self, num_thinking: int, num_rows: int) -> None:
        """observe_draft_lengths of a step whose num_rows decode rows all draft 0, num_thinking of
        them thinking (plain Python: this runs before every plain step of an adaptive engine)."""
        for counters, n in ((self.thinking, num_thinking), (self.answer, num_rows - num_thinking)):
            if n:
                hist = list(counters.draft_length_histogram) or [0]  # a new list, as _add_lists makes
                hist[0] += n
                counters.draft_length_histogram = hist

    def count_draft_length(self, k: int, thinking: bool, n: int = 1) -> None:
        """One row's choice, made n times (per-request metrics: one Python addition)."""
        hist = (self.thinking if thinking else self.answer).draft_length_histogram
        hist.extend([0] * (k + 1 - len(hist)))
        hist[k] += n

    def merge(self, other: SpecDecodeMetrics) -> SpecDecodeMetrics:
        self.thinking.merge(other.thinking)
        self.answer.merge(other.answer)
        return self

    def phase(self, phase: str | None = None) -> PhaseCounters:
        """Counters of one phase ("thinking" / "answer"), or the total for None."""
        if phase is None:
            return self.thinking.copy().merge(self.answer)
        if phase == "thinking":
            return self.thinking
        if phase == "answer":
            return self.answer
        raise ValueError(f"phase must be one of {PHASES} or None, got {phase!r}")

    @property
    def total(self) -> PhaseCounters:
        return self.phase(None)

    def mean_acceptance_length(self, phase: str | None = None) -> float:
        return self.phase(phase).mean_acceptance_length

    def draft_acceptance_rate(self, phase: str | None = None) -> float:
        return self.phase(phase).draft_acceptance_rate

    def acceptance_rate_per_pos(self, phase: str | None = None) -> list[float]:
        return self.phase(phase).acceptance_rate_per_pos

    def relaxed_share(self, phase: str | None = None) -> float:
        return self.phase(phase).relaxed_share

    def to_dict(self) -> dict[str, Any]:
        """Totals at the top level, and the same keys per phase under "by_phase"."""
        out = self.total.to_dict()
        out["by_phase"] = {"thinking": self.thinking.to_dict(), "answer": self.answer.to_dict()}
        return out
