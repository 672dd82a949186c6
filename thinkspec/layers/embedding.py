"""Vocabulary-parallel token embedding: each rank holds a contiguous shard of the embedding rows.

A token outside this rank's shard looks up zeros; one all-reduce sums the ranks' lookups, so every
rank ends with the full embedding. The tied (or separate) lm_head uses the same shard layout
(TPLayout.vocab_shard) and the model gathers its logits columns (DecoderForCausalLM.compute_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout, all_reduce
from thinkspec.layers.linear import CheckpointSlice


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPLayout) -> None:
        self.row_start, rows = tp.vocab_shard(vocab_size)
        # An uninitialised weight (the loader fills it): nn.Embedding's normal_ init on the meta
        # device costs seconds of one-time imports in every fresh process.
        super().__init__(rows, hidden_size, _weight=nn.Parameter(torch.empty(rows, hidden_size)))
        self.vocab_size = vocab_size
        self.tp = tp

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        # rows [row_start, row_start + rows) of the checkpoint's [vocab, hidden]; rows past vocab are padding
        return None if self.tp.size == 1 else (0, self.row_start, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] int64 -> [T, hidden], identical on every rank
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.row_start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return all_reduce(x.masked_fill(~mine[:, None], 0.0))
