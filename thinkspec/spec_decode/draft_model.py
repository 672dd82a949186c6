"""Draft-model proposer: a small model with its own paged KV pool that shares the target's block tables.

KV bookkeeping: `seq.num_draft_computed_tokens` counts the tokens whose draft K/V is written; it is
never more than the target's `num_computed_tokens`, and `min(draft, target)` is where the draft
resumes, so preemption, prefix-cache hits and rejected drafts need no extra work: stale slots are
overwritten by the next forward (rollback = moving the pointer back). The proposer reports the
pointer its forwards reached (Proposal.draft_computed); the step's commit writes it.

One round for the decode sequences S of a step, each with n_b <= k drafts allowed:
  forward 1  every scheduled sequence feeds the tokens the draft has not seen yet (prefill chunks
             mirror the target's; decode sequences catch up through their last committed token),
             and S gets logits of its last row -> draft token 1; a decode sequence that drafts
             nothing this step and is more than CATCH_UP_WIDTH tokens behind (plain steps ran) is
             left behind until it drafts, so that a few rows drafting do not catch up them all
  forward j  S feeds draft token j-1 (still on the device) -> draft token j, for j = 2 .. max n_b
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from thinkspec.models.loader import ModelInfo
from thinkspec.sampling.sampler import (
    Sampler,
    SamplingTensors,
    exponential_race,
    greedy_sample,
    process_logits,
)
from thinkspec.spec_decode.proposer import NO_DRAFT, Proposal, ProposalInput

if TYPE_CHECKING:
    from thinkspec.engine.model_runner import ModelRunner
    from thinkspec.engine.sequence import Sequence
    from thinkspec.sampling_params import SamplingParams

# Draft noise for a seeded request is keyed apart from the target's own sampling positions.
_DRAFT_NOISE_POSITION = 1 << 40
# Tokens a decode row that drafts nothing still feeds: what a steady step feeds (its new token, and
# the last accepted draft), the widest forward 1 the draft's CUDA graphs cover.
CATCH_UP_WIDTH = 2


def draft_lag(seq: Sequence) -> int:
    """Tokens of this sequence whose draft K/V is not written (where the draft resumes: see above)."""
    return seq.num_tokens - min(seq.num_draft_computed_tokens, seq.num_computed_tokens)


def draft_behind(seq: Sequence) -> bool:
    """The draft's K/V of this decode sequence lags more than CATCH_UP_WIDTH tokens (plain steps ran):
    drafting first catches it up in a forward no CUDA graph covers."""
    return draft_lag(seq) > CATCH_UP_WIDTH


def _blocks_fed(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    """The ids of seq's KV blocks that hold positions start ... start + n - 1."""
    return seq.block_table[start // block_size : (start + n - 1) // block_size + 1]


@dataclass(slots=True)
class ForwardAhead:
    """Forward 1 of the next step, run before this step's tokens reached the host (run_ahead): the
    rows it fed, and the logits of their last positions."""

    seqs: list[Sequence]
    starts: list[int]  # [R] first position fed
    tokens: list[list[int]]  # [R][n] the tokens fed, at starts[r] ... starts[r] + n - 1
    blocks: list[list[int]]  # [R] the block ids those positions were written to
    logits: torch.Tensor  # [R, V] float32, a copy (the graph's output buffer is reused)

    def serves(
        self, seqs: Seq[Sequence], num: Seq[int], starts: Seq[int], want: Seq[int], block_size: int
    ) -> list[int] | None:
        """The rows of self.logits that forward 1 as _catch_up would run it wants (want[i] = 1), when
        this forward fed every one of its sequences what it would, else None: the same sequence
        object, ending at the same position and starting no later, with the same tokens there and
        the same KV blocks. The extra positions it fed hold committed tokens, whose K/V is what a
        later forward would write there; rows it fed that the step leaves out (finished) are unused."""
        index = {id(s): r for r, s in enumerate(self.seqs)}
        rows = []
        for seq, n, start, w in zip(seqs, num, starts, want):
            r = index.get(id(seq))
            if r is None:
                return None
            first, tokens = self.starts[r], self.tokens[r]
            if first > start or first + len(tokens) != start + n:
                return None
            if seq.token_ids[first : start + n] != tokens:
                return None
            if _blocks_fed(seq, first, len(tokens), block_size) != self.blocks[r]:
                return None
            if w:
                rows.append(r)
        return rows


class DraftModelProposer:
    """Proposes with a small model run by its own ModelRunner (the only thing it calls)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, k: int, vocab_size: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.k = k
        self.vocab_size = vocab_size
        self.device = runner.device
        self._ahead: ForwardAhead | None = None  # see run_ahead
        self._launched: tuple[list[Sequence], torch.Tensor] | None = None  # run_ahead until settle_ahead
        self._rows = torch.arange(16, device=self.device)  # see _row_index
        self.num_run_ahead = 0  # forwards run ahead, and of them those a step used
        self.num_used_ahead = 0

    def run_ahead(
        self,
        seqs: list[Sequence],
        num_drafts: Seq[int],  # [R] drafts each row's window verified
        output_token_ids: torch.Tensor,  # [R, k+1] int64 on the device: accepted drafts, emitted token
        num_accepted: torch.Tensor,  # [R] on the device
    ) -> None:
        """Run the next step's forward 1 now, before this step's outcome reaches the host, so that the
        device works through it while the host waits for the copy, commits and schedules. Row r ends
        at E = num_tokens + a + 1 after the commit (a = num_accepted[r]); the forward feeds its last
        two tokens, at E-2 and E-1, taken on the device (device_inputs): E-1 is always new, E-2 is the
        last accepted draft, which the draft has not fed when every draft was accepted. Every row must
        have drafted (its draft K/V holds num_tokens - 1 + num_drafts positions) and hold KV slots up
        to num_tokens + num_drafts. The next step takes the logits when its forward 1 would be this
        one (settle_ahead, ForwardAhead.serves), else runs its own; either way the K/V written here is
        that of committed tokens at their positions (rows the step finishes included: their blocks
        are freed after this forward in stream order)."""
        r, bs = len(seqs), self.runner.block_size
        width = output_token_ids.shape[1]  # k + 1
        _, layout = self.runner.step_layout([2] * r, [1] * r, max(len(s.block_table) for s in seqs))
        # Everything the forward needs but the tokens follows from a = num_accepted[r], so the host
        # lays it out for every a in 0..k and the device picks row a (one gather, not a dozen small
        # kernels): table [R, k+1, 7] = positions E-2, E-1, their slots, E, and the columns of
        # [token before the window, output_token_ids] that hold the tokens at E-2, E-1 (a, a+1);
        # then the token before the window [R] and the layout indexes the values go to [R, 7].
        n_table = r * width * 7
        host = np.full(n_table + 8 * r, -1, dtype=np.int64)
        table = host[:n_table].reshape(r, width, 7)
        before = host[n_table : n_table + r]
        slots = np.full((r, width + 1), -1, dtype=np.int64)  # positions num_tokens - 1 ... num_tokens + k
        for i, seq in enumerate(seqs):
            before[i] = seq.token_ids[-1]
            blocks = seq.block_table
            for j, p in enumerate(range(seq.num_tokens - 1, min(seq.num_tokens + width, len(blocks) * bs))):
                slots[i, j] = blocks[p // bs] * bs + p % bs
        a = np.arange(width)[None, :]  # [1, k+1]
        n = np.array([seq.num_tokens for seq in seqs], dtype=np.int64)[:, None]  # [R, 1]
        for c, column in enumerate((n + a - 1, n + a, slots[:, :-1], slots[:, 1:], n + a + 1, a, a + 1)):
            table[:, :, c] = column
        o = layout.offsets  # input_ids, positions, slot_mapping at o[0..2]; seq_lens at o[5]
        two = 2 * np.arange(r)[:, None] + np.arange(2)  # [R, 2]
        index = host[n_table + r :].reshape(r, 7)
        index[:] = np.concatenate([o[0] + two, o[1] + two, o[2] + two, o[5] + np.arange(r)[:, None]], axis=1)
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        accepted = num_accepted.long().reshape(r, 1, 1).expand(r, 1, 7)
        picked = dev[:n_table].view(r, width, 7).gather(1, accepted).view(r, 7)  # table row a of each row
        tokens = torch.cat([dev[n_table : n_table + r, None], output_token_ids], dim=1)  # [R, k+2]
        values = torch.cat([tokens.gather(1, picked[:, 5:]), picked[:, :5]], dim=1).flatten()  # [7R] as index
        # placeholders: the window of every draft accepted (the longest context, as a graph sizes it)
        starts = [s.num_tokens + m - 1 for s, m in zip(seqs, num_drafts)]
        logits = self.runner.execute_model(
            seqs, [2] * r, [1] * r, input_token_ids=[[0, 0]] * r, start_positions=starts,
            device_inputs=(dev[n_table + r :], values),
        )  # fmt: skip
        self._launched = (list(seqs), logits.clone())
        self.num_run_ahead += 1

    def settle_ahead(self, tokens: np.ndarray, num_accepted: np.ndarray) -> None:
        """run_ahead's outcome on the host (before the commit): what its forward fed, from the step's
        tokens [R, k+1] and num_accepted [R], kept for the next step's forward 1."""
        assert self._launched is not None, "settle_ahead without run_ahead"
        (seqs, logits), self._launched = self._launched, None
        bs = self.runner.block_size
        starts, fed, blocks = [], [], []
        for r, seq in enumerate(seqs):
            a = int(num_accepted[r])
            prev = int(tokens[r, a - 1]) if a else seq.token_ids[-1]
            starts.append(seq.num_tokens + a - 1)
            fed.append([prev, int(tokens[r, a])])
            blocks.append(_blocks_fed(seq, starts[-1], 2, bs))
        self._ahead = ForwardAhead(seqs, starts, fed, blocks, logits)

    def propose(self, batch: ProposalInput) -> Proposal:
        """Run the draft over this step's batch and propose max_drafts[b] tokens for each speculating
        sequence b (see proposer.Proposal for what comes back)."""
        seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
        spec_index, max_drafts = batch.spec_index, batch.max_drafts
        num_spec = len(spec_index)
        drafts = torch.full((num_spec, self.k), NO_DRAFT, dtype=torch.long, device=self.device)
        params = [seqs[i].sampling_params for i in spec_index]
        probs = None
        if any(not p.is_greedy for p in params):
            probs = torch.zeros(num_spec, self.k, self.vocab_size, dtype=torch.float32, device=self.device)
        computed = [min(s.num_draft_computed_tokens, s.num_computed_tokens) for s in seqs]
        proposal = Proposal(drafts, list(max_drafts), probs, draft_computed=computed)
        logits = self._catch_up(seqs, num_new_tokens, spec_index, max_drafts, computed)
        if logits is None:
            return proposal
        active = [b for b in range(num_spec) if max_drafts[b] > 0]
        for j in range(max((max_drafts[b] for b in active), default=0)):
            rows = [b for b in active if max_drafts[b] > j]
            # every row drafts token j (the common case): a slice, no index tensor to build and copy
            rows_t: slice | torch.Tensor = slice(None)
            if len(rows) < num_spec:
                rows_t = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
            row_seqs = [seqs[spec_index[b]] for b in rows]
            if j > 0:  # feed draft token j (made at step j-1) at position num_tokens - 1 + j
                logits = self.runner.execute_model(
                    row_seqs,
                    [1] * len(rows),
                    [1] * len(rows),
                    input_token_ids=[[0]] * len(rows),
                    start_positions=[s.num_tokens - 1 + j for s in row_seqs],
                    device_inputs=(self._row_index(len(rows)), drafts[rows_t, j - 1]),
                )
                for b in rows:
                    computed[spec_index[b]] = seqs[spec_index[b]].num_tokens + j
            # every row: the token goes straight into its column of drafts (no copy launch)
            column = drafts[:, j] if isinstance(rows_t, slice) else None
            tokens, q = self._sample(logits, [params[b] for b in rows], row_seqs, j, column)
            if column is None:
                drafts[rows_t, j] = tokens
            if probs is not None and q is not None:
                probs[rows_t, j] = q
        return proposal

    def _row_index(self, n: int) -> torch.Tensor:
        """arange(n) [n] int64 on the device, kept from call to call."""
        if self._rows.numel() < n:
            self._rows = torch.arange(max(n, 2 * self._rows.numel()), device=self.device)
        return self._rows[:n]

    def _catch_up(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        spec_index: Seq[int],
        max_drafts: Seq[int],
        computed: list[int],
    ) -> torch.Tensor | None:
        """Forward 1: every sequence feeds the tokens the draft has not seen (prefill chunks mirror the
        target's, decodes catch up through their last token, those that draft nothing only when at
        most CATCH_UP_WIDTH behind); logits [R, V] float32 of the speculating rows that want drafts,
        in spec order (None when nothing ran). Updates computed in place."""
        ahead, self._ahead = self._ahead, None
        spec_of = {i: b for b, i in enumerate(spec_index)}
        f_seqs, f_num, f_start, f_logits = [], [], [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            b = spec_of.get(i)
            end = seq.num_tokens if b is not None else seq.num_computed_tokens + n
            if end <= computed[i]:
                continue
            if b is None and n == 1 and end == seq.num_tokens and draft_behind(seq):  # a decode row
                continue
            f_seqs.append(seq)
            f_num.append(end - computed[i])
            f_start.append(computed[i])
            f_logits.append(int(b is not None and max_drafts[b] > 0))
            computed[i] = end
        if not f_seqs:
            return None
        bs = self.runner.block_size
        rows = None if ahead is None else ahead.serves(f_seqs, f_num, f_start, f_logits, bs)
        if rows is not None:
            assert ahead is not None
            self.num_used_ahead += 1
            if rows == list(range(len(ahead.seqs))):
                return ahead.logits
            return ahead.logits[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
        return self.runner.execute_model(f_seqs, f_num, f_logits, start_positions=f_start)

    def _sample(
        self,
        logits: torch.Tensor,  # [R, V] float32
        params: list[SamplingParams],
        seqs: list[Sequence],
        j: int,
        out: torch.Tensor | None = None,  # [R] int64 (any stride) to write the tokens into
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token per row [R] int64 (`out` when given) and its distribution q [R, V] float32 (None
        if all greedy)."""
        if all(p.is_greedy for p in params):
            return greedy_sample(logits, out), None
        greedy = greedy_sample(logits)
        t = SamplingTensors.from_params(params, logits.device)
        filtered = process_logits(logits, t)
        positions = [_DRAFT_NOISE_POSITION + s.num_output_tokens + j for s in seqs]
        noise = self.sampler.exponential_noise(filtered.shape, params, positions, filtered.device)
        tokens = torch.where(t.greedy, greedy, exponential_race(filtered, noise))
        if out is not None:
            tokens = out.copy_(tokens)
        return tokens, torch.softmax(filtered, dim=-1)


def check_draft_compatible(target_tokenizer: Any, target_info: ModelInfo, draft_info: ModelInfo) -> None:
    """Raise ValueError when the draft cannot propose in the target's vocabulary.

    The logits widths must match, and when the draft folder ships a tokenizer its vocabulary and
    special/added tokens must equal the target's: a token id has to mean the same text in both.
    """
    if draft_info.vocab_size != target_info.vocab_size:
        raise ValueError(
            f"draft model {draft_info.path} has vocab_size {draft_info.vocab_size}, the target "
            f"{target_info.path} has {target_info.vocab_size}; the draft must share the target's vocabulary"
        )
    if target_tokenizer is None or not any(
        (draft_info.path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return
    from transformers import AutoTokenizer

    draft_tok = AutoTokenizer.from_pretrained(str(draft_info.path))
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(
            t for t in set(target_vocab) | set(draft_vocab) if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise ValueError(
            f"draft tokenizer ({draft_info.path}) differs from the target's in {len(differ)} tokens, "
            f"e.g. {differ[:5]}; the draft must share the target's tokenizer"
        )
    t_special = sorted(set(target_tokenizer.all_special_tokens) | set(target_tokenizer.get_added_vocab()))
    d_special = sorted(set(draft_tok.all_special_tokens) | set(draft_tok.get_added_vocab()))
    if t_special != d_special:
        raise ValueError(
            f"draft special tokens {d_special} differ from the target's {t_special}; "
            "the draft must share the target's tokenizer"
        )
