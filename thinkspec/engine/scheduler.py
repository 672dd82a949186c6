"""Continuous batching with chunked prefill and preemption by recompute.

Each step the scheduler fills a token budget (max_num_batched_tokens): first the running
sequences in admission order (a decode costs 1 token, an unfinished prompt its next chunk),
then waiting ones from the front of the queue, while fewer than max_num_seqs run. A sequence
is scheduled for `num_tokens - num_computed_tokens` tokens, cut to the remaining budget, so
prefill chunks and decodes share one forward. When the KV pool runs out the latest admitted
running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue; on resume it recomputes prompt + generated tokens (or takes them from the prefix
cache) and continues, so its output is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus, commit_token, length_reached
from thinkspec.outputs import PositionLogprobs
from thinkspec.reasoning.tracker import PhaseTracker


@dataclass(slots=True)
class StepOutcome:
    """What one step did to one scheduled sequence; Scheduler.commit is the one place that applies it."""

    token_ids: list[int]  # tokens to commit (empty for a mid-prompt chunk)
    num_computed_tokens: int  # leading tokens whose target K/V is now valid
    num_draft_computed_tokens: int | None = None  # the draft model's, when there is one
    logprobs: list[PositionLogprobs] | None = None  # one per token_ids entry, for requests that ask
    prompt_logprobs: list[PositionLogprobs] | None = None  # the next prompt positions', when asked


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: seqs[i] computes num_new_tokens[i] tokens starting at its num_computed_tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def plain_outcomes(self, token_ids: Seq[Seq[int]]) -> list[StepOutcome]:
        """Outcomes of a plain step: every fed token's K/V is written; token_ids[i] are seqs[i]'s."""
        return [
            StepOutcome(list(ids), seq.num_computed_tokens + n)
            for seq, n, ids in zip(self.seqs, self.num_new_tokens, token_ids)
        ]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def sample_mask(self) -> list[bool]:
        """True where this step reaches the end of a sequence's known tokens, so a token is sampled."""
        return [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        tokenizer: Any | None = None,
        tracker: PhaseTracker | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # for stop strings / output text; None = token ids only
        self.tracker = tracker  # advances each sequence's reasoning phase; None = not tracked
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_lookahead_tokens: int = 0) -> SchedulerOutput:
        """Pick this step's batch and reserve its KV slots.

        num_lookahead_tokens extra slots are reserved for each sequence that reaches the end of
        its tokens this step (room for speculative tokens scored in the same forward).
        """
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.ends_with_pending(seq):  # finishes when the step in flight commits: nothing to run
                i += 1
                continue
            num_new = min(self._num_to_compute(seq, seq.num_computed_tokens, num_lookahead_tokens), budget)
            need = self._slots_needed(seq, seq.num_computed_tokens, num_new, num_lookahead_tokens)
            if need > len(seq.block_table) * bm.block_size:  # a usual decode step needs no new block
                while not bm.can_allocate(seq, need):
                    victim = self.running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break
                bm.allocate(seq, need)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # Admit new work only when the running set fits: a preemption means memory is short.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position: no cache hits until they are held.
            lp = seq.prompt_logprobs
            hits = [] if lp is not None and len(lp) < seq.num_prompt_tokens else bm.get_computed_blocks(seq)
            num_computed = len(hits) * bm.block_size
            num_new = min(self._num_to_compute(seq, num_computed, num_lookahead_tokens), budget)
            need = self._slots_needed(seq, num_computed, num_new, num_lookahead_tokens)
            if not bm.can_allocate(seq, need, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, need, hits)
            seq.num_computed_tokens = seq.num_draft_computed_tokens = num_computed
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
                seq.metrics.num_cached_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def postprocess(self, out: SchedulerOutput, token_ids: Seq[Seq[int]]) -> list[Sequence]:
        """Commit a plain step: token_ids[i] are the tokens for out.seqs[i] (empty mid-prompt)."""
        return self.apply(out, out.plain_outcomes(token_ids))

    def apply(self, out: SchedulerOutput, outcomes: Seq[StepOutcome]) -> list[Sequence]:
        """Commit each scheduled sequence's outcome; returns those that got tokens or finished, in
        batch order."""
        changed: list[Sequence] = []
        for seq, outcome in zip(out.seqs, outcomes):
            if seq.is_finished:  # aborted between schedule() and now
                continue
            if self.commit(seq, outcome):
                changed.append(seq)
        return changed

    def commit(self, seq: Sequence, outcome: StepOutcome) -> bool:
        """Apply one step's outcome to a running seq: its K/V pointers, then its tokens until one
        finishes it, advancing its phase and thinking-token count with each (PhaseTracker.step_host);
        offer its full blocks to the prefix cache, free them if it finished. Returns whether seq got
        a token or finished. The only writer of these fields after admission."""
        seq.num_computed_tokens = outcome.num_computed_tokens
        if outcome.num_draft_computed_tokens is not None:
            seq.num_draft_computed_tokens = outcome.num_draft_computed_tokens
        if outcome.prompt_logprobs and seq.prompt_logprobs is not None:
            # A resumed sequence recomputes its prompt: positions already held are kept.
            room = seq.num_prompt_tokens - len(seq.prompt_logprobs)
            seq.prompt_logprobs.extend(outcome.prompt_logprobs[:room])
        tracker = self.tracker
        for i, token_id in enumerate(outcome.token_ids):
            if tracker is not None:  # phase and thinking budget follow exactly the committed tokens
                seq.thinking, counted = tracker.step_host(seq.thinking, token_id)
                seq.num_thinking_tokens += counted
            if outcome.logprobs is not None and seq.output_logprobs is not None:
                seq.output_logprobs.append(outcome.logprobs[i])
                seq.cumulative_logprob += outcome.logprobs[i][token_id].logprob
            if commit_token(seq, token_id, max_model_len=self.max_model_len, tokenizer=self.tokenizer):
                break
        # After the tokens are appended: a block is hashed over the tokens its K/V was written for.
        self.block_manager.cache_blocks(seq)
        if seq.is_finished:
            self._free(seq)
        return bool(outcome.token_ids) or seq.is_finished

    # ---- async scheduling: a plain step whose tokens reach the host one step later ---------------

    def launch_pending(self, out: SchedulerOutput) -> list[tuple[int, Sequence]]:
        """Advance out's sequences past the step's inputs and give each a PENDING_TOKEN, so the next
        schedule() feeds that position; returns (batch row, seq) of those still running."""
        pending = []
        for row, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += n  # blocks are offered to the cache when the token commits
            seq.token_ids.append(PENDING_TOKEN)
            pending.append((row, seq))
        return pending

    def commit_pending(self, seq: Sequence, token_id: int) -> bool:
        """Replace seq's PENDING_TOKEN by the sampled token_id and commit it (see commit)."""
        if seq.token_ids.pop() != PENDING_TOKEN:
            raise RuntimeError(f"request {seq.request_id!r} has no pending token")
        return self.commit(seq, StepOutcome([token_id], seq.num_computed_tokens))

    def rollback_pending(self, seq: Sequence) -> None:
        """Drop seq's PENDING_TOKEN, if any; between steps the last token is the next step's input,
        so the K/V pointer goes back before it (recomputing it writes the same values)."""
        if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
            seq.token_ids.pop()
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)

    def ends_with_pending(self, seq: Sequence) -> bool:
        """seq holds a pending token that finishes it by length (max_tokens, max_model_len): known
        finished before the token arrives, so no later step decodes it."""
        return seq.last_token_id == PENDING_TOKEN and length_reached(seq, self.max_model_len)

    def run_ahead_rows(self, pending: Seq[Sequence]) -> list[Sequence] | None:
        """The sequences the next step decodes if it may launch before pending's tokens commit, else
        None: every running sequence must be pending, with no preemption for KV blocks; those that
        finish by length with their pending token are left out (as schedule() leaves them out; with
        none left it comes back empty and the step in flight commits)."""
        if self.waiting or not self.running or len(self.running) > self.max_num_batched_tokens:
            return None
        ids = {id(seq) for seq in pending}
        bm = self.block_manager
        new_blocks = 0
        rows = []
        for seq in self.running:
            if id(seq) not in ids or seq.num_tokens - seq.num_computed_tokens != 1:
                return None
            if self.ends_with_pending(seq):
                continue
            # The pending token may spend the thinking budget; the next step must then be forced.
            budget = seq.sampling_params.thinking_token_budget
            if budget is not None and seq.num_thinking_tokens + 1 >= budget:
                return None
            need = self._slots_needed(seq, seq.num_computed_tokens, 1, 0)
            new_blocks += max(0, bm.blocks_for(need) - len(seq.block_table))
            rows.append(seq)
        return rows if new_blocks <= bm.num_free_blocks else None

    def abort(self, request_id: str, drop_pending: bool = False) -> Sequence | None:
        """Finish a request with reason "abort" and free its blocks; None if it is unknown or done.
        drop_pending: it has a PENDING_TOKEN (async scheduling), which is dropped with it."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if drop_pending and seq.token_ids[-1] == PENDING_TOKEN:
            seq.token_ids.pop()
        seq.finish("abort")
        self._free(seq)
        return seq

    @staticmethod
    def _num_to_compute(seq: Sequence, num_computed: int, lookahead: int) -> int:
        """Tokens seq still has to compute. When speculating, a sequence that already has output
        (resumed after preemption) recomputes up to its last token only: that token then opens a
        verify window as it would have without the preemption, so a seeded request samples the
        same tokens however it is scheduled."""
        remaining = seq.num_tokens - num_computed
        if lookahead and remaining > 1 and seq.num_output_tokens > 0:
            return remaining - 1
        return remaining

    def fail(self, seq: Sequence, message: str) -> None:
        """Finish seq with reason "error" (message in seq.error) and free its blocks."""
        seq.finish("error")
        seq.error = message
        self._free(seq)

    def _slots_needed(self, seq: Sequence, num_computed: int, num_new: int, lookahead: int) -> int:
        end = num_computed + num_new
        return end + lookahead if end == seq.num_tokens else end

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.requests.pop(seq.request_id, None)
