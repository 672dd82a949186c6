import random

import pytest

from thinkspec.engine.block_manager import BlockManager, hash_block
from thinkspec.engine.sequence import Sequence
from thinkspec.sampling_params import SamplingParams


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def assert_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    """Ref counts equal the number of live tables holding each block; free list = ref 0 blocks."""
    refs = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}
    for h, b in bm.cached_block_ids.items():
        assert bm.blocks[b].hash == h


def admit(bm: BlockManager, seq: Sequence, extra: int = 0) -> list[int]:
    hits = bm.get_computed_blocks(seq)
    bm.allocate(seq, seq.num_tokens + extra, hits)
    return hits


def test_allocate_and_free_restores_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(range(10), "a"), make_seq(range(100, 105), "b")
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    assert_consistent(bm, [a, b])
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and a.block_table == [] and b.block_table == []
    assert_consistent(bm, [])
    with pytest.raises(RuntimeError, match="freed twice"):
        a.block_table = [0]
        bm.deallocate(a)


def test_lookahead_slots_and_growth():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = make_seq(range(5))
    bm.allocate(seq, 5 + 3)  # 3 lookahead slots -> 2 blocks
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    assert bm.can_allocate(seq, 9)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    bm.allocate(seq, 7)  # shrinking request keeps the table (rollback never frees)
    assert len(seq.block_table) == 3
    assert not bm.can_allocate(seq, 4 * 7)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq, 4 * 7)
    bm.deallocate(seq)
    assert_consistent(bm, [])


def test_prefix_hits_share_blocks_and_count():
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(1, 11))  # 10 tokens: 2 full blocks
    a = make_seq(shared + [50, 51], "a")
    assert admit(bm, a) == []
    a.num_computed_tokens = a.num_tokens
    bm.cache_blocks(a)  # 3 full blocks registered
    assert len(bm.cached_block_ids) == 3

    b = make_seq(shared + [60, 61, 62], "b")
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_cached_tokens == 8  # the scheduler moves b's K/V pointers there
    assert bm.blocks[hits[0]].ref_count == 2
    assert bm.stats.hits_blocks == 2 and bm.stats.hits_tokens == 8
    assert bm.stats.queries_tokens == 12 + 13
    assert_consistent(bm, [a, b])

    # Free both: the cached blocks stay findable until reused.
    a_table = list(a.block_table)
    bm.deallocate(a)
    bm.deallocate(b)
    c = make_seq(shared + [50, 51, 7], "c")
    assert admit(bm, c) == a_table[:3]
    assert c.num_cached_tokens == 12
    bm.deallocate(c)
    assert_consistent(bm, [])


def test_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(8), "a")
    admit(bm, a)
    a.num_computed_tokens = 8
    bm.cache_blocks(a)
    b = make_seq(range(8), "b")  # identical prompt, exactly 2 blocks
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1  # the last block is recomputed so the last token has logits
    bm.allocate(b, 8, hits)
    assert b.num_cached_tokens == 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert_consistent(bm, [])


def test_hash_chain_depends_on_parent():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 9], "a")
    admit(bm, a)
    a.num_computed_tokens = 5
    bm.cache_blocks(a)
    b = make_seq([7, 7, 3, 4, 9], "b")  # second block equal, first differs -> no hit
    assert bm.get_computed_blocks(b) == []
    assert hash_block(b"", [3, 4]) != hash_block(hash_block(b"", [1, 2]), [3, 4])
    bm.deallocate(a)


def test_cached_free_blocks_count_as_free_and_get_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    a.num_computed_tokens = 5
    bm.cache_blocks(a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and len(bm.cached_block_ids) == 2
    # A hit on a free cached block must not be double counted as free space.
    b = make_seq([1, 2, 3, 4, 6, 7, 8, 9], "b")
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert bm.can_allocate(b, 8, hits)
    assert not bm.can_allocate(b, 11, hits)
    bm.allocate(b, 8, hits)
    assert bm.num_free_blocks == 0
    bm.deallocate(b)
    # Unrelated data now evicts cached blocks.
    c = make_seq(range(20, 28), "c")
    admit(bm, c)
    assert bm.stats.evicted_blocks >= 1
    assert len(bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5]))) < 2
    bm.deallocate(c)
    assert_consistent(bm, [])


def test_duplicate_content_is_registered_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([1, 2, 3], "b")
    admit(bm, a)
    admit(bm, b)  # admitted before a computed anything: no hit
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.cache_blocks(s)
    assert len(bm.cached_block_ids) == 1
    assert bm.cached_block_ids[a.block_hashes[0]] == a.block_table[0]
    bm.deallocate(a)
    bm.deallocate(b)
    assert_consistent(bm, [])


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3], "a")
    admit(bm, a)
    a.num_computed_tokens = 3
    bm.cache_blocks(a)
    assert bm.cached_block_ids == {} and bm.get_computed_blocks(make_seq([1, 2, 3])) == []
    bm.deallocate(a)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    for step in range(400):
        if live and rng.random() < 0.35:
            seq = live.pop(rng.randrange(len(live)))
            bm.deallocate(seq)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            seq = make_seq(tokens, f"s{step}")
            hits = bm.get_computed_blocks(seq)
            extra = rng.randrange(3)
            if bm.can_allocate(seq, seq.num_tokens + extra, hits):
                bm.allocate(seq, seq.num_tokens + extra, hits)
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_blocks(seq)
                live.append(seq)
        assert_consistent(bm, live)
    assert bm.stats.hits_blocks > 0
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == bm.num_blocks
    assert_consistent(bm, [])


def test_bad_config():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
