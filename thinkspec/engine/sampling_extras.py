"""Logit bias, penalties and log-probabilities for the requests of a step that ask for them.

A step whose requests ask for neither builds nothing here (`StepExtras.build` returns None), so
plain decoding pays no extra host work, device work or copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thinkspec.engine.scheduler import StepOutcome
from thinkspec.engine.sequence import Sequence, force_think_end_over_budget, mask_stops_before_min_tokens
from thinkspec.outputs import Logprob, PositionLogprobs
from thinkspec.sampling.logprobs import HostLogprobs, LogprobsTensors, compute_logprobs
from thinkspec.sampling.penalties import PenaltyTensors, apply_penalties, window_counts
from thinkspec.sampling.sampler import Sampler
from thinkspec.sampling.structured import GrammarState, advance_grammar, apply_grammar, grammar_rows


def prompt_logprob_rows(seq: Sequence, num_new: int) -> int:
    """How many leading rows of a chunk of num_new tokens score prompt tokens still missing their
    logprobs (the chunk must start right after the last one held: a resumed sequence's recompute
    asks for none)."""
    held = seq.prompt_logprobs
    if held is None or len(held) >= seq.num_prompt_tokens or seq.num_computed_tokens + 1 != len(held):
        return 0
    return min(num_new, seq.num_prompt_tokens - len(held))


@dataclass(slots=True)
class StepExtras:
    """S sequences (one per logits row, or per verify window)."""

    penalties: PenaltyTensors | None
    logprob_rows: list[int]  # sequences that want output logprobs
    num_logprobs: int  # the most alternatives any of them wants
    bias: torch.Tensor | None = None  # [S, V] float32: logit_bias, 0 where a request sets none
    grammar: list[tuple[int, GrammarState]] = dataclasses.field(default_factory=list)  # constrained rows

    @classmethod
    def build(cls, seqs: Seq[Sequence], vocab_size: int, device: torch.device) -> StepExtras | None:
        params = [s.sampling_params for s in seqs]
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        penalised = any(p.has_penalties for p in params)
        biased = any(p.logit_bias for p in params)
        grammar = grammar_rows(list(seqs)) if any(p.structured_outputs for p in params) else []
        if not rows and not penalised and not biased and not grammar:
            return None
        bias = _bias_rows([p.logit_bias for p in params], vocab_size, device) if biased else None
        penalties = None
        if penalised:
            penalties = PenaltyTensors.build(
                [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params],
                [s.prompt_token_ids if p.repetition_penalty != 1.0 else () for s, p in zip(seqs, params)],
                [s.output_token_ids if p.has_penalties else () for s, p in zip(seqs, params)],
                vocab_size,
                device,
            )
        return cls(penalties, rows, max((params[i].logprobs for i in rows), default=0), bias, grammar)

    def penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] float32 (one row per sequence) -> [S, V], biased then penalised (vLLM's
        order; a new tensor when either applies)."""
        if self.bias is not None:
            logits = logits + self.bias
        t = self.penalties
        if t is None:
            return logits
        return apply_penalties(logits[:, None], t, t.output_counts[:, None])[:, 0]

    def penalise_windows(
        self,
        target: torch.Tensor,  # [S, k+1, V] float32
        drafts: torch.Tensor,  # [S, k] int64
        num_drafts: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:
        """Verify windows -> [S, k+1, V]: every row biased (the bias does not depend on the prefix),
        then row i penalised as if drafts 1..i were committed; acceptance then tests the drafts
        against the distribution plain decoding would sample from."""
        if self.bias is not None:
            target = target + self.bias[:, None, :]
        t = self.penalties
        if t is None:
            return target
        return apply_penalties(target, t, window_counts(t.output_counts, drafts, num_drafts))

    def raw_rows(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [S, R, V] -> a copy [L, R, V] of the rows of the L sequences that want logprobs,
        taken before any penalty or in-place masking (logprobs are the model's raw ones)."""
        if not self.logprob_rows:
            return None
        return logits[self._index(logits.device)]

    def logprobs(self, raw: torch.Tensor | None, token_ids: torch.Tensor) -> LogprobsTensors | None:
        """raw [L, R, V] from raw_rows, token_ids [S, R] int64 the tokens each row decided (negative =
        none) -> L * R rows."""
        if raw is None:
            return None
        ids = token_ids[self._index(raw.device)]
        return compute_logprobs(raw.flatten(0, 1), ids.flatten(), self.num_logprobs)

    def _index(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.logprob_rows, dtype=torch.long).to(device, non_blocking=True)


def _bias_rows(biases: Seq[dict[int, float] | None], vocab_size: int, device: torch.device) -> torch.Tensor:
    """One logit_bias per sequence (None = none) -> [S, V] float32 on `device` (ids were checked
    against the vocabulary when the request was added)."""
    host = torch.zeros(len(biases), vocab_size, dtype=torch.float32)
    for row, bias in enumerate(biases):
        if bias:
            host[row, list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
    return host.to(device, non_blocking=True)


@dataclass(slots=True)
class PromptRows:
    """Logits rows of a step's forward when some chunk scores prompt tokens for prompt_logprobs."""

    num_logits: list[int]  # [M] rows each sequence asks of the forward (its last ones)
    sample_rows: list[int]  # rows that sample a token, in batch order
    parts: list[tuple[int, int, int]]  # (batch index, first row, count) of prompt-scoring rows
    token_ids: list[int]  # the prompt token each of those rows scores
    num: int  # the most alternatives any of them wants

    @classmethod
    def build(cls, seqs: Seq[Sequence], num_new: Seq[int], sample_mask: Seq[bool]) -> PromptRows | None:
        if all(s.prompt_logprobs is None for s in seqs):
            return None
        num_logits, sample_rows, parts, token_ids, num = [], [], [], [], 0
        row = 0
        for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask)):
            q = prompt_logprob_rows(seq, n)
            rows = n if q else int(m)
            if q:
                start = seq.num_computed_tokens
                parts.append((i, row, q))
                token_ids.extend(seq.prompt_token_ids[start + 1 : start + 1 + q])
                num = max(num, seq.sampling_params.prompt_logprobs or 0)
            if m:
                sample_rows.append(row + rows - 1)
            num_logits.append(rows)
            row += rows
        return cls(num_logits, sample_rows, parts, token_ids, num)

    def logprobs(self, logits: torch.Tensor, row_starts: Seq[int] | None = None) -> LogprobsTensors | None:
        """logits [N, V] of the forward -> one row per scored prompt token (None when none).
        row_starts: each sequence's first row, where the forward's layout is not num_logits's."""
        if not self.parts:
            return None
        firsts = [first if row_starts is None else row_starts[i] for i, first, _ in self.parts]
        rows = [r for first, (_, _, q) in zip(firsts, self.parts) for r in range(first, first + q)]
        host = torch.tensor([rows, self.token_ids], dtype=torch.long).to(logits.device, non_blocking=True)
        return compute_logprobs(logits[host[0]], host[1], self.num)

    def entries(
        self, host: HostLogprobs, seqs: Seq[Sequence], tokenizer: Any
    ) -> dict[int, list[PositionLogprobs]]:
        """Batch index -> the prompt positions' entries, from the host copy of logprobs()."""
        out: dict[int, list[PositionLogprobs]] = {}
        r = 0
        for i, _, q in self.parts:
            num = seqs[i].sampling_params.prompt_logprobs or 0
            out[i] = [position_logprobs(host, r + j, self.token_ids[r + j], num, tokenizer) for j in range(q)]
            r += q
        return out


def sample_with_extras(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], think_end_id: int | None = None
) -> tuple[torch.Tensor, StepExtras | None, LogprobsTensors | None]:
    """logits [S, V] float32 (may be masked in place) -> (tokens [S] int64, the rows' extras,
    logprobs of the rows asking): penalties, then the min_tokens mask and (with think_end_id) the
    thinking budget, then the grammars of structured outputs, then the sampler (whose tokens then
    advance those grammars)."""
    extras = StepExtras.build(seqs, logits.shape[-1], logits.device)
    raw = extras.raw_rows(logits[:, None]) if extras is not None else None
    if extras is not None:
        logits = extras.penalise(logits)
    mask_stops_before_min_tokens(logits.unsqueeze(1), seqs)
    if think_end_id is not None:
        force_think_end_over_budget(logits, seqs, think_end_id)
    if extras is not None and extras.grammar:
        apply_grammar(logits, seqs, extras.grammar)
    params, positions = [s.sampling_params for s in seqs], [s.num_output_tokens for s in seqs]
    tokens = sampler(logits, params, positions)
    if extras is not None and extras.grammar:
        advance_grammar(tokens, extras.grammar)
    lp = extras.logprobs(raw, tokens[:, None]) if extras is not None else None
    return tokens, extras, lp


def attach_logprobs(
    outcomes: Seq[StepOutcome],  # one per sequence of extras, token_ids already set
    seqs: Seq[Sequence],
    extras: StepExtras,
    host: np.ndarray,  # the host copy of extras' LogprobsTensors.pack()
    rows_per_seq: int,
    tokenizer: Any,
) -> None:
    """Set outcome.logprobs of the sequences that asked: row j of a sequence decided its token j."""
    host_lp = HostLogprobs.unpack(host, len(extras.logprob_rows) * rows_per_seq, extras.num_logprobs)
    for r, s in enumerate(extras.logprob_rows):
        num = seqs[s].sampling_params.logprobs or 0
        outcome = outcomes[s]
        outcome.logprobs = [
            position_logprobs(host_lp, r * rows_per_seq + j, t, num, tokenizer)
            for j, t in enumerate(outcome.token_ids)
        ]


def position_logprobs(
    host: HostLogprobs, row: int, token_id: int, num: int, tokenizer: Any | None
) -> PositionLogprobs:
    """{token: Logprob} for one position: the chosen token first, then the top `num` by rank."""

    def text(t: int) -> str | None:
        return tokenizer.decode([t]) if tokenizer is not None else None

    out = {token_id: Logprob(float(host.token_logprob[row]), int(host.token_rank[row]), text(token_id))}
    for r, (t, lp) in enumerate(zip(host.top_ids[row, :num].tolist(), host.top_logprobs[row, :num].tolist())):
        if t not in out:
            out[t] = Logprob(float(lp), r + 1, text(t))
    return out


def split_host(flat: np.ndarray, sizes: Seq[int]) -> list[np.ndarray]:
    """Consecutive pieces of one host copy."""
    return np.split(flat, np.cumsum(sizes)[:-1]) if sizes else []


# Rows of a step's packed logprobs: (their extras or None, the batch positions, rows per sequence).
LogprobGroup = tuple[StepExtras | None, Seq[int], int]


def attach_step_logprobs(
    outcomes: Seq[StepOutcome],  # one per scheduled sequence
    seqs: Seq[Sequence],
    groups: Seq[LogprobGroup],
    prompt_rows: PromptRows | None,
    flat: np.ndarray,  # the host copy of the packed logprobs: each group in order, then the prompt's
    tokenizer: Any,
) -> None:
    """Logprobs of one step into its outcomes: each group's rows (row j of a sequence decided its
    token j), then the prompt positions."""
    for extras, index, rows in groups:
        if extras is None:
            continue
        size = HostLogprobs.size(len(extras.logprob_rows) * rows, extras.num_logprobs)
        picked = [outcomes[i] for i in index]
        attach_logprobs(picked, [seqs[i] for i in index], extras, flat[:size], rows, tokenizer)
        flat = flat[size:]
    if prompt_rows is not None and prompt_rows.parts:
        host_lp = HostLogprobs.unpack(flat, len(prompt_rows.token_ids), prompt_rows.num)
        for i, entries in prompt_rows.entries(host_lp, seqs, tokenizer).items():
            outcomes[i].prompt_logprobs = entries
