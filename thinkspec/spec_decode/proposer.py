"""What every proposer returns, and the one call they share.

A proposer sees the scheduled batch (sequences, tokens each computes this step) and the decode
sequences that speculate (`spec_index`, with a cap on drafts for each). It never writes sequence
state: a draft model reports where its K/V pointers ended up, and the step's commit applies that.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from thinkspec.engine.sequence import Sequence

NO_DRAFT = -1  # padding of draft_token_ids past a row's drafts


@dataclass(slots=True)
class Proposal:
    """Drafts for the S speculating sequences of one step."""

    draft_token_ids: torch.Tensor  # [S, k] int64 on the device, NO_DRAFT past num_drafts[b]
    num_drafts: list[int]  # [S] drafts each row proposes (<= its cap)
    draft_probs: torch.Tensor | None = None  # [S, k, V] float32 q of sampled rows; None = one-hot drafts
    host_drafts: list[list[int]] | None = None  # [S][num_drafts[b]] when made on the host (fed as inputs)
    # Per scheduled sequence (batch order): tokens whose draft K/V is written after the proposer's
    # forwards; None without a draft model.
    draft_computed: list[int] | None = None

    def narrow(self, width: int) -> Proposal:
        """The same drafts in tensors [S, width] (width >= every num_drafts): a step whose rows all
        draft fewer than k verifies and accepts over narrower windows."""
        if width == self.draft_token_ids.shape[1]:
            return self
        probs = self.draft_probs[:, :width].contiguous() if self.draft_probs is not None else None
        return Proposal(
            self.draft_token_ids[:, :width].contiguous(), self.num_drafts, probs, self.host_drafts,
            self.draft_computed,
        )  # fmt: skip


@dataclass(slots=True)
class ProposalInput:
    """The step a proposer drafts for."""

    seqs: Seq[Sequence]  # the scheduled batch (M sequences)
    num_new_tokens: Seq[int]  # [M] tokens each computes this step
    spec_index: Seq[int]  # [S] batch positions of the speculating sequences
    max_drafts: Seq[int]  # [S] at most this many drafts each (0 allowed)


class Proposer(Protocol):
    def propose(self, batch: ProposalInput) -> Proposal: ...
