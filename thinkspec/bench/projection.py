"""Projected decode speed of a sweep's settings on another model pair, from measured step costs.

A sweep on the toy pair measures how often drafts are accepted: per draft position and per phase
(thinking / answer), and the share of emitted tokens in each phase. A cost table measured on the
GPU for a real-shaped pair gives, per batch size b, the time of one plain decode step, one draft
step and one verify forward of b x (k+1) tokens. Together they give the expected tokens/s:

  AL_p       = 1 + sum_i a_p[i]           tokens a round emits in phase p; a_p[i] is the share of
                                           rounds whose draft at position i was accepted
  rounds/tok = f / AL_thinking + (1 - f) / AL_answer     f: share of tokens emitted while thinking
  spec tok/s = b / (round_ms(b) * rounds/tok),  round_ms = k * draft_ms + verify_ms
  plain tok/s = b / plain_ms(b)

Rows of one batch advance in lockstep, one round at a time, so a batch's rate is b times one row's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class StepCosts:
    """Measured milliseconds at one batch size."""

    batch: int
    k: int
    plain_ms: float  # one plain decode step of the batch
    draft_ms: float  # one draft step of the batch
    verify_ms: float  # one target forward of batch x (k+1) tokens

    @property
    def round_ms(self) -> float:
        return self.k * self.draft_ms + self.verify_ms


@dataclass(slots=True, frozen=True)
class AcceptanceProfile:
    """What a sweep cell measured: acceptance per position in each phase, and the thinking share."""

    name: str
    thinking_rates: tuple[float, ...]  # [k] accepted share of rounds at each draft position
    answer_rates: tuple[float, ...]  # [k]
    thinking_share: float  # emitted tokens while thinking / all emitted tokens

    def acceptance_length(self, phase: str) -> float:
        rates = self.thinking_rates if phase == "thinking" else self.answer_rates
        return 1.0 + sum(rates)

    def rounds_per_token(self) -> float:
        f = self.thinking_share
        return f / self.acceptance_length("thinking") + (1.0 - f) / self.acceptance_length("answer")


def costs_from_spec_round(data: Mapping[str, Any]) -> list[StepCosts]:
    """StepCosts per batch from benchmarks/bench_spec_round.py's JSON (rows of batch, k, draft_step_ms,
    verify_ms, decode_ms)."""
    rows = data["rows"]
    if not rows:
        raise ValueError("the cost table has no rows")
    return [
        StepCosts(
            batch=int(r["batch"]),
            k=int(r["k"]),
            plain_ms=float(r["decode_ms"]),
            draft_ms=float(r["draft_step_ms"]),
            verify_ms=float(r["verify_ms"]),
        )
        for r in rows
    ]


def _phase_rates(phase: Mapping[str, Any], k: int) -> tuple[float, ...]:
    """Share of rounds accepted at each position: accepted at i over the drafts at position 0 (every
    round drafts position 0), so a round that proposed fewer drafts counts as a rejection there."""
    rounds = (phase.get("num_draft_tokens_per_pos") or [0])[0]
    accepted = list(phase.get("num_accepted_tokens_per_pos") or [])
    accepted += [0] * (k - len(accepted))
    return tuple(a / rounds if rounds else 0.0 for a in accepted[:k])


def profiles_from_sweep(data: Mapping[str, Any], k: int) -> list[AcceptanceProfile]:
    """One profile per speculative cell of a sweep JSON (SweepResult.to_dict())."""
    out = []
    for cell in data["cells"]:
        spec = cell.get("spec")
        if spec is None:
            continue
        think, answer = spec["by_phase"]["thinking"], spec["by_phase"]["answer"]
        emitted = think["num_emitted_tokens"] + answer["num_emitted_tokens"]
        share = think["num_emitted_tokens"] / emitted if emitted else 0.0
        out.append(AcceptanceProfile(cell["name"], _phase_rates(think, k), _phase_rates(answer, k), share))
    return out


def project(profiles: Sequence[AcceptanceProfile], costs: Sequence[StepCosts]) -> list[dict[str, Any]]:
    """Rows of projected tok/s: per batch size, no speculation and each profile, with the speed-up."""
    rows = []
    for c in sorted(costs, key=lambda c: c.batch):
        plain = c.batch / c.plain_ms * 1e3
        rows.append({"batch": c.batch, "cell": "no speculation", "tokens_per_s": plain, "vs_plain": 1.0})
        for p in profiles:
            spec = c.batch / (c.round_ms * p.rounds_per_token()) * 1e3
            rows.append(
                {
                    "batch": c.batch,
                    "cell": p.name,
                    "tokens_per_s": spec,
                    "vs_plain": spec / plain,
                    "thinking_acceptance_length": p.acceptance_length("thinking"),
                    "answer_acceptance_length": p.acceptance_length("answer"),
                }
            )
    return rows
