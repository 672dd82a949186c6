"""Log-probabilities of chosen tokens and their top alternatives, packed for one device->host copy.

They are the model's raw log-probabilities, log_softmax of the logits row that decided the token
(before penalties, temperature and top-k/top-p), as vLLM reports them by default
(`logprobs_mode="raw_logprobs"`). Ranks are 1-based: 1 is the most likely token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LogprobsTensors:
    """R rows, each with its chosen token and the top `num` alternatives."""

    token_logprob: torch.Tensor  # [R] float32
    token_rank: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, num] int64, most likely first
    top_logprobs: torch.Tensor  # [R, num] float32

    def pack(self) -> torch.Tensor:
        """-> [R * (2 + 2 * num)] int64 (floats travel bit-cast as float64)."""
        as_i64 = [
            self.token_rank[:, None],
            self.top_ids,
            self.token_logprob.double()[:, None].view(torch.int64),
            self.top_logprobs.double().view(torch.int64),
        ]
        return torch.cat(as_i64, dim=1).flatten()


@dataclass(slots=True)
class HostLogprobs:
    """LogprobsTensors on the host."""

    token_logprob: np.ndarray  # [R] float64
    token_rank: np.ndarray  # [R] int64
    top_ids: np.ndarray  # [R, num] int64
    top_logprobs: np.ndarray  # [R, num] float64

    @classmethod
    def unpack(cls, flat: np.ndarray, rows: int, num: int) -> HostLogprobs:
        """flat [rows * (2 + 2 * num)] int64, as LogprobsTensors.pack wrote it."""
        table = flat.reshape(rows, 2 + 2 * num)
        return cls(
            token_logprob=table[:, 1 + num].view(np.float64),
            token_rank=table[:, 0],
            top_ids=table[:, 1 : 1 + num],
            top_logprobs=np.ascontiguousarray(table[:, 2 + num :]).view(np.float64),
        )

    @staticmethod
    def size(rows: int, num: int) -> int:
        return rows * (2 + 2 * num)


def compute_logprobs(
    logits: torch.Tensor,  # [R, V] float
    token_ids: torch.Tensor,  # [R] int64; negative ids (no token) give rank 0 and logprob NaN
    num: int,
) -> LogprobsTensors:
    """The chosen tokens' log-probabilities and ranks, and the top `num` of each row."""
    logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
    valid = token_ids >= 0
    ids = token_ids.clamp(min=0)
    chosen = logprobs.gather(1, ids[:, None])  # [R, 1]
    rank = (logprobs > chosen).sum(dim=1) + 1
    top_logprobs, top_ids = logprobs.topk(num, dim=-1) if num else (logprobs[:, :0], ids[:, None][:, :0])
    return LogprobsTensors(
        token_logprob=torch.where(valid, chosen[:, 0], torch.nan),
        token_rank=torch.where(valid, rank, 0),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
