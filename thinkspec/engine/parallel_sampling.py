"""Parallel sampling (SamplingParams.n > 1): one request, n sequences, one RequestOutput.

Each completion is a Sequence of its own (request id `{index}_{request_id}`, as vLLM names
them). The first is scheduled at once; the others wait until its prompt's full blocks are in the
prefix cache (its first token is committed), then take them from there instead of recomputing.
With a seed, sequence i samples with seed + i, so the n completions differ and are reproducible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from thinkspec.engine.sequence import Sequence
from thinkspec.outputs import RequestMetrics
from thinkspec.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from thinkspec.spec_decode.metrics import SpecDecodeMetrics


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The SamplingParams of completion `index`: n = 1, seed + index (wrapped to int64); the prompt's
    logprobs are the first completion's to compute (the others take the prompt from the cache)."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - INT64_MIN) % 2**64 + INT64_MIN
        assert INT64_MIN <= seed <= INT64_MAX
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


@dataclass(eq=False, slots=True)
class ParentRequest:
    """The n sequences of one request; `held` ones are not yet handed to the scheduler."""

    request_id: str
    seqs: list[Sequence]
    held: list[Sequence] = field(default_factory=list)

    def release(self) -> list[Sequence]:
        """The held sequences that may be scheduled now: once the first has a committed token (its
        prompt blocks are cached) or is finished."""
        lead = self.seqs[0]
        if not self.held or (lead.metrics.first_token_time is None and not lead.is_finished):
            return []
        out, self.held = self.held, []
        return out

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def metrics(self) -> RequestMetrics:
        """The request's metrics over its n sequences (token counts summed, times the extremes)."""
        lead = self.seqs[0].metrics
        firsts = [s.metrics.first_token_time for s in self.seqs if s.metrics.first_token_time is not None]
        m = RequestMetrics(
            lead.arrival_time,
            first_scheduled_time=lead.first_scheduled_time,
            first_token_time=min(firsts, default=None),
            finished_time=max(s.metrics.finished_time or 0.0 for s in self.seqs) if self.finished else None,
            num_prompt_tokens=lead.num_prompt_tokens,
            num_generated_tokens=sum(s.metrics.num_generated_tokens for s in self.seqs),
            num_cached_tokens=sum(s.metrics.num_cached_tokens for s in self.seqs),
            num_preemptions=sum(s.metrics.num_preemptions for s in self.seqs),
        )
        specs = [s.metrics.spec_decode for s in self.seqs if s.metrics.spec_decode is not None]
        if specs:
            m.spec_decode = SpecDecodeMetrics()
            for spec in specs:
                m.spec_decode.merge(spec)
        return m
