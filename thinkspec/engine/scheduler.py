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
from thinkspec.engine.sequence import Sequence, SequenceStatus, commit_token


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: seqs[i] computes num_new_tokens[i] tokens starting at its num_computed_tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # for stop strings / output text; None = token ids only
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

    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

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
            hits = bm.get_computed_blocks(seq)
            num_computed = len(hits) * bm.block_size
            num_new = min(self._num_to_compute(seq, num_computed, num_lookahead_tokens), budget)
            need = self._slots_needed(seq, num_computed, num_new, num_lookahead_tokens)
            if not bm.can_allocate(seq, need, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, need, hits)
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
        """Advance KV pointers by this step's tokens, commit sampled tokens, free finished sequences.

        token_ids[i] are the tokens to commit for out.seqs[i] (empty for a mid-prompt chunk).
        Returns the sequences that got tokens or finished, in batch order.
        """
        changed: list[Sequence] = []
        for seq, num_new, new_ids in zip(out.seqs, out.num_new_tokens, token_ids):
            if seq.is_finished:  # aborted between schedule() and postprocess()
                continue
            seq.num_computed_tokens += num_new
            if self.commit(seq, new_ids):
                changed.append(seq)
        return changed

    def commit(self, seq: Sequence, token_ids: Seq[int]) -> bool:
        """Commit generated tokens to a running seq until one finishes it, offer its full blocks to
        the prefix cache, and free its blocks if it finished. Returns whether seq got a token or
        finished."""
        for token_id in token_ids:
            if commit_token(seq, token_id, max_model_len=self.max_model_len, tokenizer=self.tokenizer):
                break
        # After the tokens are appended: a block is hashed over the tokens its K/V was written for.
        self.block_manager.cache_blocks(seq)
        if seq.is_finished:
            self._free(seq)
        return bool(token_ids) or seq.is_finished

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with reason "abort" and free its blocks; None if it is unknown or done."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
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
