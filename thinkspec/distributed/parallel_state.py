"""The tensor-parallel layout of one model and the collectives its layers call.

A model is built for a `TPLayout` (its rank and the number of ranks it is split over). Layers keep
the layout they were built with, so a draft model built with size 1 never communicates even when the
target is split. Collectives run on torch.distributed's default group (NCCL on CUDA, gloo on CPU),
which the engine initialises with one rank per process (workers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPLayout:
    """Rank `rank` of `size` ranks; size 1 is the unsplit model."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """total / size for a dimension split evenly over the ranks; ValueError when it does not divide."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} must divide {what}={total} (allowed: a divisor of {total})"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds. With fewer KV heads than ranks each rank keeps
        the one KV head its query heads use (replicated over size / num_kv_heads ranks)."""
        if num_kv_heads >= self.size:
            per_rank = self.split(num_kv_heads, "num_key_value_heads")
            return self.rank * per_rank, per_rank
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} must divide num_key_value_heads={num_kv_heads} "
                "or be a multiple of it"
            )
        return self.rank // (self.size // num_kv_heads), 1

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of this rank's vocabulary shard: ceil(vocab / size) rows each, the last
        shard padded past the vocabulary (padding rows are zero and sliced off the gathered logits)."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, per_rank


def check_tp_layout(
    size: int, *, num_attention_heads: int, num_key_value_heads: int, intermediate_size: int
) -> None:
    """ValueError (naming tensor_parallel_size) when a model of these shapes cannot be split `size` ways."""
    layout = TPLayout(0, size)
    layout.split(num_attention_heads, "num_attention_heads")
    layout.kv_heads(num_key_value_heads)
    layout.split(intermediate_size, "intermediate_size")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place; x: any shape, identical on every rank afterwards."""
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """x: [N, C] this rank's columns -> [N, size * C], rank r's columns at [r*C, (r+1)*C)."""
    if dist.get_backend() == "nccl":
        out = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous())  # capturable in a CUDA graph
    else:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous())
        out = torch.stack(parts)
    return out.permute(1, 0, 2).reshape(x.shape[0], size * x.shape[1])
