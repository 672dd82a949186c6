"""Paged KV cache bookkeeping: fixed-size blocks, ref counts, a free list and a prefix cache.

A block holds the K/V of `block_size` consecutive tokens of one or more sequences. Full blocks
whose K/V has been computed are registered in the prefix cache under a hash chain
h_i = sha256(h_{i-1} || token ids of block i), so a later request with the same prefix reuses
them. Freed blocks keep their hash while they sit in the free list; they are evicted (hash
dropped) only when handed out again, least recently freed first.

The BlockManager only does bookkeeping on host lists; the tensors live in the ModelRunner, so a
draft model can share the same block tables with a second pool of the same `num_blocks`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from thinkspec.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while registered in the prefix cache


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters; queries/hits are counted once per admission of a sequence."""

    queries_tokens: int = 0  # tokens looked up (every token of an admitted sequence)
    hits_tokens: int = 0  # tokens whose K/V came from the cache
    queries_blocks: int = 0  # full blocks eligible for a hit
    hits_blocks: int = 0
    evicted_blocks: int = 0  # cached blocks reused for other data

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Hash of one full block given its parent's hash (b"" for the first block)."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first; they may still carry a cached hash.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest full-block prefix of seq's tokens. Pure lookup.

        At most (num_tokens - 1) // block_size blocks, so the last token is always recomputed
        and its logits exist.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits: list[int] = []
        for h in self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.cached_block_ids.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, computed_blocks: Seq[int] = ()) -> bool:
        """Whether seq's block table can grow to hold `num_tokens` tokens (computed + new + lookahead)."""
        num_new = self.blocks_for(num_tokens) - len(seq.block_table) - len(computed_blocks)
        # Cache hits with no owner sit in the free list; taking them shrinks it.
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return num_new <= len(self.free_block_ids) - reclaimed

    def allocate(self, seq: Sequence, num_tokens: int, computed_blocks: Seq[int] = ()) -> None:
        """Grow seq's block table to hold `num_tokens` tokens, first attaching prefix-cache hits.

        computed_blocks (from get_computed_blocks) is only allowed for a sequence with no blocks;
        it sets num_cached_tokens to the hit length (left alone when there are no hits). The
        scheduler moves the sequence's K/V pointers to the hits.
        """
        if not self.can_allocate(seq, num_tokens, computed_blocks):
            raise RuntimeError(f"out of KV blocks for request {seq.request_id!r} ({num_tokens} tokens)")
        if not seq.block_table:
            self._count_query(seq, len(computed_blocks))
        if computed_blocks:
            if seq.block_table:
                raise RuntimeError("prefix-cache hits can only be attached to a sequence with no blocks")
            for block_id in computed_blocks:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
            seq.num_cached_tokens = len(computed_blocks) * self.block_size
            seq.num_hashed_blocks = len(computed_blocks)
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def cache_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks in the prefix cache: those whose tokens are committed and whose
        K/V every model has written. Call after a step's tokens are committed."""
        if not self.enable_prefix_caching:
            return
        # num_computed_tokens may run past the committed tokens when a stop ends the sequence
        # inside an accepted draft run: the slots after the stop hold uncommitted tokens.
        num_complete = min(seq.num_kv_complete_tokens, seq.num_tokens)
        num_full = min(num_complete // self.block_size, len(seq.block_table))
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached_block_ids:
                block.hash = hashes[i]
                self.cached_block_ids[hashes[i]] = block.block_id
        seq.num_hashed_blocks = num_full

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go to the free list first, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice (request {seq.request_id!r})")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached_block_ids.get(block.hash) == block_id:
                del self.cached_block_ids[block.hash]
            block.hash = None
            self.stats.evicted_blocks += 1
        block.ref_count = 1
        return block_id

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hash chain of seq's first num_blocks full blocks, extended lazily and kept on seq."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            block = seq.token_ids[i * bs : (i + 1) * bs]
            if len(block) != bs:  # a stored hash lives as long as seq: it must describe real tokens
                raise RuntimeError(
                    f"request {seq.request_id!r}: block {i} holds {len(block)} of {bs} tokens; "
                    "only full blocks of committed tokens are hashed"
                )
            hashes.append(hash_block(hashes[-1] if hashes else b"", block))
        return hashes[:num_blocks]

    def _count_query(self, seq: Sequence, num_hit_blocks: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.stats.queries_tokens += seq.num_tokens
        self.stats.hits_tokens += num_hit_blocks * self.block_size
        self.stats.queries_blocks += (seq.num_tokens - 1) // self.block_size
        self.stats.hits_blocks += num_hit_blocks
