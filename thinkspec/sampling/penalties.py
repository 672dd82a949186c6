"""Presence, frequency and repetition penalties on logits rows, with vLLM's semantics.

Per row, on the raw logits, before temperature and filtering (vLLM's order):
  repetition  tokens seen in prompt + output: logit / r if logit > 0 else logit * r (HF transformers)
  frequency   logit -= f * count(token in output)
  presence    logit -= p * [token in output]

A verify window's row i scores the token after drafts d_1..d_i, so its output counts include those
drafts: the row is exactly the distribution plain decoding would see after that prefix, which keeps
speculative acceptance lossless with penalties on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyTensors:
    """Per-request penalty state on the logits' device. S requests."""

    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32
    prompt_mask: torch.Tensor  # [S, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [S, V] float32: occurrences in the committed output

    @classmethod
    def build(
        cls,
        penalties: Sequence[tuple[float, float, float]],  # (presence, frequency, repetition) per request
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyTensors:
        """One host->device copy of the ragged token lists, then counts by scatter_add on the device."""
        s = len(penalties)
        lengths = [len(p) for p in prompts] + [len(o) for o in outputs]
        flat = [t for p in prompts for t in p] + [t for o in outputs for t in o]
        host = torch.tensor([x for row in penalties for x in row] + lengths + flat, dtype=torch.float64).to(
            device, non_blocking=True
        )
        params = host[: 3 * s].view(s, 3).float()
        lens = host[3 * s : 5 * s].long()
        ids = host[5 * s :].long()
        rows = torch.repeat_interleave(torch.arange(2 * s, device=device), lens)  # [T]
        counts = torch.zeros(2 * s, vocab_size, dtype=torch.float32, device=device)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        return cls(params[:, 0], params[:, 1], params[:, 2], counts[:s] > 0, counts[s:])


def window_counts(
    output_counts: torch.Tensor,  # [S, V] float32
    drafts: torch.Tensor,  # [S, k] int64, NO_DRAFT (-1) or anything at padding positions
    num_drafts: torch.Tensor,  # [S] int64
) -> torch.Tensor:
    """[S, k+1, V] float32: output counts as row i of a verify window sees them (plus d_1..d_i)."""
    s, k = drafts.shape
    counts = output_counts[:, None, :].repeat(1, k + 1, 1)
    if k == 0:
        return counts
    pos = torch.arange(k, device=drafts.device)
    row = torch.arange(k + 1, device=drafts.device)
    used = pos[None, :] < num_drafts[:, None]  # [S, k]
    # Draft j counts in rows i > j of its window.
    add = (pos[None, None, :] < row[None, :, None]) & used[:, None, :]  # [S, k+1, k]
    index = drafts.clamp(min=0)[:, None, :].expand(s, k + 1, k)
    counts.scatter_add_(2, index, add.float())
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [S, R, V] float32
    t: PenaltyTensors,
    output_counts: torch.Tensor,  # [S, R, V] float32 (window_counts, or t.output_counts[:, None])
) -> torch.Tensor:
    """-> [S, R, V] float32, a new tensor; rows of requests without penalties are unchanged."""
    seen = t.prompt_mask[:, None, :] | (output_counts > 0)
    rep = t.repetition[:, None, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - t.frequency[:, None, None] * output_counts
    return logits - t.presence[:, None, None] * (output_counts > 0).float()
