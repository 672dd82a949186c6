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
That is the steady state of a server that keeps b requests in flight. A batch of b requests started
together ends more slowly: rows finish after different numbers of rounds, and the last rounds run
with fewer rows at almost the same cost. `simulate_batch` projects that case (what a benchmark of b
requests of equal length measures) by sampling rounds from the same profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from thinkspec.spec_decode.step_costs import StepCosts, round_ms_at


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
    """StepCosts per batch from benchmarks/speculative/bench_spec_round.py's JSON (rows of batch, k,
    draft_step_ms, verify_ms, decode_ms), or from benchmarks/speculative/validate_projection.py's (k, and
    costs of batch, plain_ms, draft_ms, verify_ms, measured in the same run as the engine it checked)."""
    if "costs" in data:
        return [
            StepCosts(
                batch=int(c["batch"]),
                k=int(data["k"]),
                plain_ms=float(c["plain_ms"]),
                draft_ms=float(c["draft_ms"]),
                verify_ms=float(c["verify_ms"]),
            )  # fmt: skip
            for c in data["costs"]
        ]
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


def conditional_rates(shares: Sequence[float]) -> np.ndarray:
    """[k] probability that draft i is accepted given drafts 0..i-1 were: a_i / a_{i-1}."""
    prev = np.concatenate([[1.0], np.asarray(shares[:-1], dtype=np.float64)])
    cur = np.asarray(shares, dtype=np.float64)
    return np.divide(cur, prev, out=np.zeros_like(cur), where=prev > 0)


def simulate_batch(
    profile: AcceptanceProfile,
    costs: Sequence[StepCosts],
    batch: int,
    output_len: int,
    thinking_tokens: int,
    runs: int = 200,
    seed: int = 0,
) -> float:
    """Expected decode tok/s of `batch` requests started together, each emitting output_len tokens:
    the first from prefill (not counted), the rest in rounds. A row is thinking while it has emitted
    fewer than thinking_tokens; each round costs round_ms_at(rows still running)."""
    rng = np.random.default_rng(seed)
    cond = np.stack([conditional_rates(profile.answer_rates), conditional_rates(profile.thinking_rates)])
    k = cond.shape[1]
    emitted = np.ones((runs, batch), dtype=np.int64)  # [runs, batch] output tokens so far
    total_ms = np.zeros(runs)
    while (running := emitted < output_len).any():
        active = running.sum(axis=1)  # [runs]
        total_ms += np.array([round_ms_at(costs, a) if a else 0.0 for a in active])
        rates = cond[(emitted < thinking_tokens).astype(np.int64)]  # [runs, batch, k]
        ok = rng.random((runs, batch, k)) < rates
        accepted = np.cumprod(ok, axis=2).sum(axis=2)  # [runs, batch]
        emitted = np.where(running, np.minimum(emitted + accepted + 1, output_len), emitted)
    return float(np.mean(batch * (output_len - 1) / total_ms * 1e3))
