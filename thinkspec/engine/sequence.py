"""One request's state: tokens, KV bookkeeping, detokenized text and the per-token stop check."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from thinkspec.engine.detokenizer import IncrementalDetokenizer
from thinkspec.outputs import PositionLogprobs, RequestMetrics
from thinkspec.reasoning.tracker import force_token
from thinkspec.sampling_params import RELAX_OFF, RelaxSettings, SamplingParams

PENDING_TOKEN = -1  # stands for a sampled token still on its way to the host (never an input)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False, slots=True)
class Sequence:
    """Prompt + generated tokens of one request.

    KV bookkeeping: the first `num_computed_tokens` tokens have their K/V in the cache, in the
    blocks of `block_table` (token i lives in block_table[i // block_size] at offset i % block_size).
    Rolling back speculative tokens is just lowering num_computed_tokens: stale slots are
    overwritten by the next forward. `num_cached_tokens` counts prompt tokens served by the
    prefix cache when the sequence was first admitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of full blocks
    num_hashed_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with "error"
    detokenizer: IncrementalDetokenizer | None = None  # made at the first commit that needs text
    # Speculative decoding: tokens whose K/V the draft model holds (never more than the target's),
    # and the reasoning phase after the committed tokens (True = inside <think>).
    num_draft_computed_tokens: int = 0
    has_draft: bool = False
    thinking: bool = False
    starts_thinking: bool = False  # the phase the output started in (the reasoning split's start)
    num_thinking_tokens: int = 0  # output tokens committed inside <think> (markers not counted)
    relax: RelaxSettings = RELAX_OFF  # relaxed acceptance inside <think>, resolved when the request is added
    # Parallel sampling (n > 1): the request this sequence is one completion of, and its index.
    parent_id: str | None = None
    index: int = 0
    # Log-probabilities, when the request asks (None otherwise): one entry per output token, and
    # [None, one per prompt token after the first].
    output_logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty (0 tokens)")
        if self.sampling_params.logprobs is not None:
            self.output_logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_kv_complete_tokens(self) -> int:
        """Leading tokens whose K/V every model of the engine has written (what a prefix-cache block
        must hold before another request may reuse it)."""
        if self.has_draft:
            return min(self.num_computed_tokens, self.num_draft_computed_tokens)
        return self.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def thinking_budget_spent(self) -> bool:
        """The next token must close the think block (thinking_token_budget reached while thinking)."""
        budget = self.sampling_params.thinking_token_budget
        return self.thinking and budget is not None and self.num_thinking_tokens >= budget

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()


def length_reached(seq: Sequence, max_model_len: int) -> bool:
    """seq's tokens reach max_tokens or max_model_len: it finishes by length."""
    max_tokens = seq.sampling_params.max_tokens
    return (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= max_model_len


def commit_token(seq: Sequence, token_id: int, *, max_model_len: int, tokenizer: Any | None) -> bool:
    """Append one generated token, update the text and finish the sequence if it must stop.

    Returns True when the sequence finished with this token. Speculative decoding commits its
    accepted tokens by calling this once per token and stopping at the first True, so a
    multi-token commit ends exactly where one-token-at-a-time decoding would.

    Order: EOS / stop_token_ids (not before min_tokens), then stop strings on the incremental
    text, then max_tokens / max_model_len ("length"). A token that stops by id is kept in
    token_ids but its text is added only with include_stop_str_in_output.
    """
    if seq.is_finished:
        raise RuntimeError(f"request {seq.request_id!r} is finished; cannot commit token {token_id}")
    params = seq.sampling_params
    seq.token_ids.append(token_id)
    seq.metrics.num_generated_tokens = seq.num_output_tokens
    if seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = time.monotonic()

    stop_by_id: tuple[str, int | None] | None = None
    if seq.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            stop_by_id = ("stop", token_id)
        elif not params.ignore_eos and token_id in seq.eos_token_ids:
            stop_by_id = ("stop", None)

    if tokenizer is not None and (stop_by_id is None or params.include_stop_str_in_output):
        if seq.detokenizer is None:
            skip = params.skip_special_tokens
            seq.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, skip)
        delta = seq.detokenizer.step(seq.token_ids)
        seq.output_text += delta
        if stop_by_id is None and params.stop and delta and _check_stop_strings(seq, len(delta)):
            return True

    if stop_by_id is not None:
        seq.finish(*stop_by_id)
        return True
    if length_reached(seq, max_model_len):
        seq.finish("length")
        return True
    return False


def _check_stop_strings(seq: Sequence, new_chars: int) -> bool:
    """Look for a stop string that ends inside the newly added text; truncate and finish if found."""
    params = seq.sampling_params
    if seq.num_output_tokens < params.min_tokens:
        return False
    text = seq.output_text
    for stop in params.stop:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx == -1:
            continue
        end = idx + len(stop) if params.include_stop_str_in_output else idx
        seq.output_text = text[:end]
        seq.finish("stop", stop)
        return True
    return False


def mask_stops_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: EOS and stop ids get -inf in rows that would emit an output token before min_tokens.

    logits [S, R, V] float32; row r of seqs[s] scores that request's output token num_output + r
    (R = 1 for plain decoding, k + 1 for a verify window).
    """
    for b, seq in enumerate(seqs):
        params = seq.sampling_params
        short = params.min_tokens - seq.num_output_tokens
        if short <= 0:
            continue
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(seq.eos_token_ids))
        ids_l = sorted(t for t in ids if 0 <= t < logits.shape[-1])
        if ids_l:
            logits[b, : min(short, logits.shape[1]), ids_l] = -math.inf


def force_think_end_over_budget(logits: torch.Tensor, seqs: list[Sequence], think_end_id: int) -> None:
    """In place: rows of logits [S, V] whose sequence has spent its thinking budget allow only the
    end marker. Decided on the host from committed state (plain rows: the next token only)."""
    rows = [b for b, seq in enumerate(seqs) if seq.thinking_budget_spent]
    if rows:
        mask = torch.zeros(logits.shape[0], dtype=torch.bool)
        mask[rows] = True
        force_token(logits, mask.to(logits.device, non_blocking=True), think_end_id)
