"""The target forward of a speculative step and what it brings back to the host.

VerifyBatch says what the target computes for every scheduled sequence (plain chunks, and each
speculating sequence's [last token, drafts] window); HostPack is everything the step copies to the
host, in one device->host copy; windows_of cuts the windows' rows out of the target's logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from thinkspec.engine.sampling_extras import PromptRows
    from thinkspec.engine.scheduler import SchedulerOutput
    from thinkspec.sampling.rejection import RejectionResult
    from thinkspec.spec_decode.proposer import Proposal


@dataclass(slots=True)
class VerifyBatch:
    """The target forward of one speculative step, for the scheduled batch (M sequences, S speculating)."""

    spec_index: list[int]  # [S] batch positions of the speculating sequences
    num_drafts: list[int]  # [S] drafts each window verifies
    num_new: list[int]  # [M] tokens each sequence feeds the target
    num_logits: list[int]  # [M] logits rows each sequence wants
    input_ids: list[list[int]]  # [M] host-side inputs (device-held drafts as 0 placeholders)
    device_inputs: tuple[torch.Tensor, torch.Tensor] | None  # (token rows [D], draft ids [D])

    @property
    def spec_of(self) -> dict[int, int]:
        return {i: b for b, i in enumerate(self.spec_index)}

    @classmethod
    def build(
        cls,
        sched: SchedulerOutput,
        sample_mask: list[bool],
        spec_index: list[int],
        proposal: Proposal,
        prompt_rows: PromptRows | None = None,
    ) -> VerifyBatch:
        """Inputs of the target forward: unchanged chunks for plain rows, [last token, drafts] windows
        for speculating rows (drafts made on the device go in through device_inputs)."""
        k = proposal.draft_token_ids.shape[1]
        spec_of = {i: b for b, i in enumerate(spec_index)}
        num_new, num_logits, input_ids = [], [], []
        dev_pos: list[int] = []  # packed input positions that take a device-held draft
        dev_src: list[int] = []  # flat index into draft_token_ids [S*k]
        offset = 0
        for i, (seq, n, m) in enumerate(zip(sched.seqs, sched.num_new_tokens, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                num_new.append(n)
                num_logits.append(int(m) if prompt_rows is None else prompt_rows.num_logits[i])
                input_ids.append(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
            else:
                nd = proposal.num_drafts[b]
                num_new.append(1 + nd)
                num_logits.append(1 + nd)
                if proposal.host_drafts is not None:
                    input_ids.append([seq.last_token_id, *proposal.host_drafts[b]])
                else:
                    input_ids.append([seq.last_token_id] + [0] * nd)
                    dev_pos.extend(range(offset + 1, offset + 1 + nd))
                    dev_src.extend(range(b * k, b * k + nd))
            offset += num_new[-1]
        device_inputs = None
        if dev_pos:
            device = proposal.draft_token_ids.device
            index = torch.tensor(dev_pos, dtype=torch.long).to(device, non_blocking=True)
            src = torch.tensor(dev_src, dtype=torch.long).to(device, non_blocking=True)
            device_inputs = (index, proposal.draft_token_ids.view(-1)[src])
        return cls(spec_index, proposal.num_drafts, num_new, num_logits, input_ids, device_inputs)

    def row_starts(self) -> list[int]:
        """[M] each sequence's first row in the target's logits."""
        return np.concatenate([[0], np.cumsum(self.num_logits)[:-1]]).astype(int).tolist()

    def logits_rows(self, k: int, sample_mask: list[bool]) -> tuple[list[int], np.ndarray]:
        """Rows of the target's logits: those of plain sampled sequences [P] (a chunk that also
        scores prompt tokens samples from its last row), and each window's [S, k+1] (padded with
        the window's first row, never read as a decision)."""
        spec_of = self.spec_of
        plain: list[int] = []
        windows = np.zeros((len(self.spec_index), k + 1), dtype=np.int64)
        row = 0
        for i, nl in enumerate(self.num_logits):
            b = spec_of.get(i)
            if b is None:
                if sample_mask[i]:
                    plain.append(row + nl - 1)
            else:
                windows[b, :nl] = np.arange(row, row + nl)
                windows[b, nl:] = row
            row += nl
        return plain, windows


@dataclass(slots=True)
class HostPack:
    """Everything a speculative step brings to the host, from one device->host copy."""

    plain_tokens: list[int]  # [P] tokens sampled for plain rows
    tokens: np.ndarray  # [S, k+1] accepted drafts then the emitted token, NO_DRAFT after
    num_accepted: np.ndarray  # [S]
    relaxed: np.ndarray  # [S, k] bool, accepted only by the relaxed test
    thinking_before: np.ndarray  # [S, k] bool, the phase before each draft position
    extra: np.ndarray  # [X] int64: the packed logprobs that rode along, in the order given

    @classmethod
    def fetch(
        cls,
        plain: torch.Tensor | None,  # [P] int64
        result: RejectionResult | None,
        thinking_before: torch.Tensor | None,  # [S, k] bool
        k: int,
        extra: list[torch.Tensor] | None = None,  # flat int64 tensors (LogprobsTensors.pack())
        then: Callable[[], None] | None = None,
    ) -> HostPack:
        """One device->host copy of it all; `then` runs once the copy is queued, before the host waits
        for it (device work queued there runs after the copy, while the host waits and goes on)."""
        parts = [plain] if plain is not None else []
        extra = extra or []
        num_extra = sum(t.numel() for t in extra)
        if result is not None:
            columns = [
                result.output_token_ids,  # k + 1
                result.num_accepted[:, None],  # 1
                result.relaxed_accepted.long(),  # k
                thinking_before.long(),  # k
            ]
            parts.append(torch.cat(columns, dim=1).flatten())
        parts += extra
        if not parts:
            host = np.zeros(0, dtype=np.int64)
        elif then is not None and parts[0].is_cuda:
            flat = torch.cat(parts)
            pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            then()
            copied.synchronize()
            host = pinned.numpy()
        else:
            host = torch.cat(parts).cpu().numpy()
            if then is not None:
                then()
        num_plain = 0 if plain is None else plain.numel()
        spec = host[num_plain : host.size - num_extra].reshape(-1, 3 * k + 2)
        return cls(
            plain_tokens=host[:num_plain].tolist(),
            tokens=spec[:, : k + 1],
            num_accepted=spec[:, k + 1],
            relaxed=spec[:, k + 2 : 2 * k + 2].astype(bool),
            thinking_before=spec[:, 2 * k + 2 : 3 * k + 2].astype(bool),
            extra=host[host.size - num_extra :],
        )


def windows_of(logits: torch.Tensor, windows: np.ndarray) -> torch.Tensor:
    """logits [N, V], windows [S, k+1] row indexes -> [S, k+1, V]: a view when the windows are rows
    0..S(k+1)-1 in order (every row speculating with the full window: no 194 MB gather at 64 x 5
    rows), else a gather."""
    count = windows.size
    if count <= logits.shape[0] and np.array_equal(windows.reshape(-1), np.arange(count)):
        return logits[:count].view(*windows.shape, logits.shape[1])
    return logits[torch.from_numpy(windows).to(logits.device, non_blocking=True)]
