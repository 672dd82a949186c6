"""Prompt-lookup (n-gram) proposer: copy what followed the last earlier occurrence of the current suffix.

For each request, the longest suffix of n tokens (prompt_lookup_max >= n >= prompt_lookup_min) that
also occurs earlier in the request's own tokens (prompt + output) wins; among its occurrences the most
recent one is used, since recent context predicts a reasoning trace best. The proposal is the up-to-k
tokens that followed that occurrence. Everything is batched tensor work: one unfold-and-compare per n.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from thinkspec.spec_decode.proposer import NO_DRAFT, Proposal, ProposalInput

if TYPE_CHECKING:
    pass


def ngram_propose(
    token_ids: torch.Tensor,  # [B, L] int64, each row's tokens left-aligned, anything past seq_lens ignored
    seq_lens: torch.Tensor,  # [B] int64, number of valid tokens per row
    k: int,
    min_n: int,
    max_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns draft_token_ids [B, k] int64 (-1 padded) and num_draft_tokens [B] int64."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    B, L = token_ids.shape
    device = token_ids.device
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    drafts = torch.full((B, k), -1, dtype=torch.long, device=device)
    num_drafts = torch.zeros(B, dtype=torch.long, device=device)
    # start[b] = where the copied continuation begins; -1 while no n has matched yet.
    start = torch.full((B,), -1, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)
    for n in range(max_n, min_n - 1, -1):
        if n + 1 > L:
            continue
        # Suffix of length n per row: tokens seq_len-n .. seq_len-1 (clamped; rows too short are masked).
        suffix_pos = (seq_lens - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=device)  # [B, n]
        suffix = token_ids.gather(1, suffix_pos.clamp(max=L - 1))  # [B, n]
        windows = token_ids.unfold(1, n, 1)  # [B, L-n+1, n]
        match = (windows == suffix.unsqueeze(1)).all(dim=2)  # [B, L-n+1]
        # A usable occurrence starts at j with j + n < seq_len (something follows it inside the row);
        # the suffix itself (j = seq_len - n) is excluded by that bound.
        j = torch.arange(L - n + 1, device=device)
        match &= (j.unsqueeze(0) + n) < seq_lens.unsqueeze(1)
        match &= (seq_lens > n).unsqueeze(1)
        # Most recent occurrence: the largest j with a match.
        best = torch.where(match, j.unsqueeze(0), -1).amax(dim=1)  # [B]
        take = (start < 0) & (best >= 0)
        start = torch.where(take, best + n, start)
    found = start >= 0
    avail = torch.where(found, seq_lens - start, 0).clamp(min=0, max=k)  # [B]
    offs = torch.arange(k, device=device)
    src = (start.clamp(min=0).unsqueeze(1) + offs).clamp(max=L - 1)  # [B, k]
    valid = offs.unsqueeze(0) < avail.unsqueeze(1)
    drafts = torch.where(valid, token_ids[rows.unsqueeze(1), src], drafts)
    num_drafts = avail
    return drafts, num_drafts


class NgramProposer:
    """Prompt lookup over each speculating sequence's own tokens, on the host where the tokens live."""

    def __init__(self, k: int, min_n: int, max_n: int, device: torch.device) -> None:
        self.k, self.min_n, self.max_n, self.device = k, min_n, max_n, device

    def propose(self, batch: ProposalInput) -> Proposal:
        seqs, spec_index, max_drafts = batch.seqs, batch.spec_index, batch.max_drafts
        if not spec_index:
            return Proposal(torch.empty(0, self.k, dtype=torch.long, device=self.device), [])
        rows = [seqs[i] for i in spec_index]
        tokens = np.full((len(rows), max(s.num_tokens for s in rows)), NO_DRAFT, dtype=np.int64)
        for b, s in enumerate(rows):
            tokens[b, : s.num_tokens] = s.token_ids
        lens = torch.tensor([s.num_tokens for s in rows], dtype=torch.long)
        drafts, num = ngram_propose(torch.from_numpy(tokens), lens, self.k, self.min_n, self.max_n)
        num_drafts = [min(int(n), cap) for n, cap in zip(num.tolist(), max_drafts)]
        host = [drafts[b, :n].tolist() for b, n in enumerate(num_drafts)]
        padded = torch.full((len(rows), self.k), NO_DRAFT, dtype=torch.long)
        for b, row in enumerate(host):
            padded[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        return Proposal(padded.to(self.device, non_blocking=True), num_drafts, host_drafts=host)
