"""The layout of one model step's packed inputs: one int64 buffer, seven sections.

The model runner packs a step this way on the host (`thinkspec.engine.cuda_graph.pack_batch`), a
CUDA graph's static input buffer holds it, and with tensor parallelism rank 0 broadcasts it to the
other ranks (`thinkspec.distributed.step_channel`): below both, it imports no thinkspec module.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class InputLayout:
    """Packed int64 step inputs, one section after another (one host buffer, one copy):

    input_ids [num_tokens], positions [num_tokens], slot_mapping [num_tokens],
    logits_indices [num_rows], query_start_loc [num_seqs + 1], seq_lens [num_seqs],
    block_tables [num_seqs * width] (row-major). Eager steps use the batch's own sizes; a graph
    step pads to its key: num_tokens = num_rows = B' * q, num_seqs = B'.
    """

    num_tokens: int
    num_rows: int
    num_seqs: int
    width: int

    @property
    def sizes(self) -> tuple[int, ...]:
        t, r, b = self.num_tokens, self.num_rows, self.num_seqs
        return (t, t, t, r, b + 1, b, b * self.width)

    @property
    def offsets(self) -> tuple[int, ...]:
        # Several times per forward on the host's critical path: plain ints, cached per layout
        # (np.cumsum over a tuple cost ~30 us a call).
        return _offsets(self.num_tokens, self.num_rows, self.num_seqs, self.width)

    @property
    def size(self) -> int:
        return self.offsets[-1]

    @property
    def fixed_size(self) -> int:
        """Length of the sections before the block tables (fixed for a graph key)."""
        return self.offsets[6]

    def split(self, buf: Any) -> list[Any]:
        """The seven sections of a 1-D buffer (numpy array or tensor) laid out this way, as views."""
        o = self.offsets
        return [buf[o[i] : o[i + 1]] for i in range(7)]


@functools.lru_cache(maxsize=4096)
def _offsets(num_tokens: int, num_rows: int, num_seqs: int, width: int) -> tuple[int, ...]:
    """InputLayout.offsets: the start of each section and the end of the last (8 ints)."""
    t, r, b = num_tokens, num_rows, num_seqs
    return tuple(itertools.accumulate((t, t, t, r, b + 1, b, b * width), initial=0))
