"""Request outputs, in vLLM's shape (`RequestOutput.outputs[0].text`, `.token_ids`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thinkspec.spec_decode.metrics import SpecDecodeMetrics


@dataclass(slots=True)
class Logprob:
    """One token's log-probability (the model's raw distribution), its 1-based rank, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob}, the chosen token first, then the top alternatives by rank.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when logprobs asked
    logprobs: list[PositionLogprobs] | None = None  # one per token_ids entry, when logprobs asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    reasoning_content: str | None = None  # set when the engine has a reasoning parser
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) and counts for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    spec_decode: SpecDecodeMetrics | None = None  # speculative-decoding counters, when speculating

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed (finish_reason "error"); None otherwise
    error_status: int | None = None  # with error: 400 when the request's input caused it, 500 otherwise
    num_cached_tokens: int = field(default=0)  # summed over the n sequences of the request
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None, then one per prompt token]
