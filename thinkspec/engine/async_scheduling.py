"""Async scheduling: a plain decode step launches before the previous step's tokens reach the host.

The previous step's sampled tokens stay on the device and feed the next step directly; the host
waits for them (one pinned, non-blocking copy) only after that next step is launched, so host
work overlaps device work. The scheduler keeps the sequences' bookkeeping: each sequence of a
step in flight carries a PENDING_TOKEN until its real token commits (Scheduler.launch_pending /
commit_pending).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from thinkspec.engine.sequence import Sequence


@dataclass(slots=True)
class InFlight:
    """A launched plain step whose sampled tokens the host has not committed yet."""

    tokens: torch.Tensor  # [S] int64 on the device: row i is the token sampled for batch row i
    host: torch.Tensor  # [S] int64: the host copy of tokens (pinned, filled by a non-blocking copy)
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: tokens is the host copy)
    pending: list[tuple[int, Sequence]] = field(default_factory=list)  # (batch row, seq)

    def drop(self, seq: Sequence) -> None:
        self.pending = [(r, s) for r, s in self.pending if s is not seq]


class TokenCopies:
    """Device->host copies of sampled tokens, double-buffered so a step's tokens can land while the
    previous step's are being read."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._host = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self._rows = torch.arange(max_num_seqs, device=device)

    def launch(self, tokens: torch.Tensor) -> InFlight:
        """Start the copy of a step's sampled tokens [S] int64."""
        if self.device.type != "cuda":
            return InFlight(tokens=tokens, host=tokens, done=None)
        self._host.reverse()  # the other buffer: the previous step's may still be unread
        host = self._host[0][: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(tokens=tokens, host=host, done=done)

    def feed(self, flight: InFlight, seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """device_inputs for a step decoding exactly flight's sequences: (batch rows [S], tokens [S])."""
        rows = {id(seq): r for r, seq in flight.pending}
        src = [rows[id(seq)] for seq in seqs]
        index = self._rows[: len(src)]
        if src == list(range(len(src))):
            return index, flight.tokens[: len(src)]
        return index, flight.tokens[torch.tensor(src, device=self.device)]

    @staticmethod
    def wait(flight: InFlight) -> list[int]:
        """flight's tokens on the host (the one sync of a step)."""
        if flight.done is not None:
            flight.done.synchronize()
        return flight.host.tolist()
