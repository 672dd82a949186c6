"""Per-forward attention metadata shared by every attention layer of one model call.

The ModelRunner builds one `AttentionMetadata` per forward and installs it with
`forward_context(meta)`; each `Attention` layer reads it with `get_forward_context()`.
This keeps model code free of engine plumbing (nano-vllm's pattern).

KV cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Ragged batch of B sequences with T new tokens in total, packed sequence after sequence.

    Sequence b's new tokens are rows query_start_loc[b]:query_start_loc[b+1] of q/k/v; they sit at
    positions seq_lens[b] - query_len_b ... seq_lens[b] - 1 of that sequence and attend causally to
    every earlier position (cached or new). Prefill chunks, single-token decode and (k+1)-token
    verification all take this one form.
    """

    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts, starts at 0
    seq_lens: torch.Tensor  # [B] int32, context length per sequence including this step's tokens
    slot_mapping: torch.Tensor  # [T] int64, KV slot each new token writes; -1 = padding, not written
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical block ids, -1 padded
    max_query_len: int  # host copy of max(query lens), for kernel launch shapes
    max_seq_len: int  # host copy of max(seq_lens)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_CONTEXT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside forward_context(); the ModelRunner sets it")
    return _CONTEXT


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield meta
    finally:
        _CONTEXT = previous
