"""How rank 0 hands each model step to the other ranks: broadcasts on the default group.

Rank 0 (the scheduler's process) packs a step on the host exactly as at TP=1 (cuda_graph.pack_batch:
one int64 buffer laid out as step_inputs.InputLayout). Per step it then broadcasts, from rank 0:

  header         int64 [HEADER_LEN]: a StepHeader (which runner, graph key or eager, the layout)
  packed inputs  int64 [layout.size]: the same buffer, into the receiver's graph input buffer or
                 a fresh one; on CUDA from device memory (rank 0 copied it there anyway)
  device tokens  int64 [2M] (only when the header says M > 0): packed positions, then token ids,
                 of drafts that live on rank 0's device

The other ranks wait in recv_header between steps; StepHeader.runner == EXIT ends their loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from thinkspec.step_inputs import InputLayout

HEADER_LEN = 12
EXIT = -1  # StepHeader.runner that stops the workers


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed or exited; the engine cannot run further steps."""


@dataclass(frozen=True, slots=True)
class StepHeader:
    runner: int  # 0 the target's runner, 1 the draft's (when split too); EXIT stops the workers
    bucket: int  # graph key (bucket, q); bucket 0 = an eager step
    q: int
    num_tokens: int  # InputLayout
    num_rows: int
    num_seqs: int
    width: int
    max_query_len: int  # of the real sequences (eager steps' attention metadata)
    max_seq_len: int
    num_out_rows: int  # logits rows returned: sum(num_logits)
    num_device_inputs: int
    pad: int = 0

    @property
    def graph_key(self) -> tuple[int, int] | None:
        return (self.bucket, self.q) if self.bucket else None

    @property
    def layout(self) -> InputLayout:
        return InputLayout(self.num_tokens, self.num_rows, self.num_seqs, self.width)


class StepChannel:
    """The broadcasts of one rank (driver: rank 0, the sender; otherwise a receiver)."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device = device
        self.driver = rank == 0
        self.broken: BaseException | None = None  # set once a step failed midway on rank 0
        # rank 0: turns the error of a failed step into the one to raise (TPWorkers.failure)
        self.explain: Callable[[BaseException], BaseException] | None = None
        pin = device.type == "cuda"
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        self._host_header = torch.zeros(HEADER_LEN, dtype=torch.int64, pin_memory=pin)
        self._header_sent = torch.cuda.Event() if pin else None  # guards reuse of _host_header

    def fail(self, error: BaseException) -> BaseException:
        """Rank 0, after a step raised midway (the other ranks may wait in its collectives): mark the
        group unusable; returns the error to raise (the failed worker's message when there is one)."""
        if isinstance(error, TensorParallelError):
            return error
        self.broken = error
        return self.explain(error) if self.explain is not None else TensorParallelError(str(error))

    def send_header(self, header: StepHeader) -> None:
        """Rank 0: broadcast one step's header."""
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.broken}")
        if self._header_sent is None:
            self._host_header.copy_(torch.tensor(astuple(header), dtype=torch.int64))
            dist.broadcast(self._host_header, src=0)
            return
        self._header_sent.synchronize()
        self._host_header.copy_(torch.tensor(astuple(header), dtype=torch.int64))
        self._header.copy_(self._host_header, non_blocking=True)
        self._header_sent.record()
        dist.broadcast(self._header, src=0)

    def recv_header(self) -> StepHeader:
        """Ranks > 0: wait for the next step's header."""
        buf = self._host_header if self.device.type == "cpu" else self._header
        dist.broadcast(buf, src=0)
        return StepHeader(*buf.tolist())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """tensor: contiguous, rank 0's values land in every rank's tensor."""
        dist.broadcast(tensor, src=0)

    def share_device_inputs(
        self, header: StepHeader, tokens: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rank 0's execute_model device_inputs (index [M], values [M]) int64, on every rank."""
        m = header.num_device_inputs
        if not m:
            return None
        if self.driver:
            assert tokens is not None
            packed = torch.cat([tokens[0].to(torch.int64), tokens[1].to(torch.int64)])
        else:
            packed = torch.empty(2 * m, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0)
        return packed[:m], packed[m:]
