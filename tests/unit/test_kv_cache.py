"""BlockPool + PrefixIndex without a model: exact block ids, ref counts, eviction order,
verify-on-hit under a forced hash collision, out-of-memory behaviour (vLLM test_prefix_caching
style: 11 blocks of 16)."""

from __future__ import annotations

import pytest

from freetoken.engine.kv_cache import BlockPool, ChainCursor, chain_hash, root_hash

BS = 16


def make_pool(num_blocks=11, **kw) -> BlockPool:
    return BlockPool(num_blocks, BS, fingerprint=b"test-model", **kw)


class Seq:
    """The bits of a sequence the pool works on."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.cursor = ChainCursor()
        self.num_cached = 0


def admit(pool: BlockPool, seq: Seq) -> None:
    """find_cached_prefix -> admit (hits referenced, the rest allocated) -> 'compute' -> index
    full blocks."""
    prefix = pool.find_cached_prefix(seq.token_ids, seq.block_hashes, seq.cursor)
    blocks = pool.admit(prefix, len(seq.token_ids), len(seq.token_ids))
    assert blocks is not None
    seq.block_table = blocks.block_ids
    seq.num_cached = blocks.num_cached_tokens
    pool.cache_blocks(seq.block_table, seq.token_ids, seq.block_hashes, seq.cursor,
                      len(seq.token_ids))


def test_hash_is_chained_and_seeded():
    a = chain_hash(root_hash(b"m1"), list(range(16)))
    assert a == chain_hash(root_hash(b"m1"), list(range(16)))
    assert a != chain_hash(root_hash(b"m2"), list(range(16)))
    assert a != chain_hash(root_hash(b"m1"), list(range(1, 17)))
    assert chain_hash(a, [5] * 16) != chain_hash(root_hash(b"m1"), [5] * 16)


def test_allocate_free_exact_ids_and_ref_counts():
    pool = make_pool()
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 8
    pool.free([0, 1, 2])
    assert pool.num_free_blocks == 11
    # unindexed blocks go back to the head, tail of the table first -> 0, 1, 2 again
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([3])


def test_prefix_hit_exact_blocks_and_cap():
    pool = make_pool()
    common = list(range(3 * BS))  # 3 full blocks
    s1 = Seq(common + [100, 101, 102])  # 4 blocks, the last partial
    admit(pool, s1)
    assert s1.block_table == [0, 1, 2, 3]
    assert s1.num_cached == 0
    assert len(pool.index) == 3  # the partial tail block is never indexed

    s2 = Seq(common + [200] * 5)
    admit(pool, s2)
    assert s2.block_table[:3] == [0, 1, 2]
    assert s2.block_table[3:] == [4]
    assert s2.num_cached == 3 * BS
    assert [pool.ref_count(b) for b in range(5)] == [2, 2, 2, 1, 1]
    assert (pool.num_query_tokens, pool.num_hit_tokens) == (51 + 53, 48)

    # a prompt that is exactly the cached blocks: hit capped so the last token is computed
    s3 = Seq(common)
    admit(pool, s3)
    assert s3.num_cached == 2 * BS
    assert s3.block_table == [0, 1, 5]
    # one token more than the blocks: all three blocks hit
    s4 = Seq(common + [7])
    admit(pool, s4)
    assert s4.num_cached == 3 * BS and s4.block_table[:3] == [0, 1, 2]


def test_text_and_id_prompts_share_blocks_and_different_fingerprints_do_not():
    pool = make_pool()
    admit(pool, Seq(range(40)))
    s = Seq(list(range(40)))  # same ids, however they were produced
    admit(pool, s)
    assert s.num_cached == 32
    other = BlockPool(11, BS, fingerprint=b"another-model")
    admit(other, Seq(range(40)))
    t = Seq(range(40))
    assert pool.lookup(t.token_ids, t.block_hashes, t.cursor) == [0, 1]
    assert t.block_hashes[0] != chain_hash(root_hash(b"another-model"), list(range(16)))


def test_freed_blocks_stay_cached_and_eviction_is_lru_tail_first():
    pool = make_pool(num_blocks=8)
    a = Seq([1] * (2 * BS) + [9])       # blocks 0,1 full (indexed), 2 partial
    b = Seq([2] * (2 * BS) + [9])       # blocks 3,4 full, 5 partial
    admit(pool, a)
    admit(pool, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    pool.free(a.block_table)
    pool.free(b.block_table)
    assert pool.num_free_blocks == 8 and len(pool.index) == 4
    # Free queue: unindexed first (5, 2 at the head), then never-used 6, 7, then a's chain tail
    # first (1, 0), then b's (4, 3).
    assert list(pool.free_queue) == [5, 2, 6, 7, 1, 0, 4, 3]
    # a revived chain leaves the queue and comes back at the tail when freed again
    a2 = Seq([1] * (2 * BS) + [8])
    admit(pool, a2)
    assert a2.block_table == [0, 1, 5] and a2.num_cached == 32
    pool.free(a2.block_table)
    assert list(pool.free_queue) == [5, 2, 6, 7, 4, 3, 1, 0]
    # allocating evicts from the head: 5, 2, 6, 7 hold nothing; then b's tail 4 is evicted
    assert pool.allocate(5) == [5, 2, 6, 7, 4]
    assert len(pool.index) == 3
    c = Seq([2] * (2 * BS) + [9])
    assert pool.lookup(c.token_ids, c.block_hashes, c.cursor) == [3]  # b's head survives
    d = Seq([1] * (2 * BS) + [9])
    assert pool.lookup(d.token_ids, d.block_hashes, d.cursor) == [0, 1]


def test_forced_hash_collision_is_verified_and_refused():
    pool = make_pool(hash_fn=lambda parent, ids: 42)  # every block hashes to 42
    a = Seq([1] * BS + [5])
    admit(pool, a)
    assert len(pool.index) == 1
    b = Seq([2] * BS + [5])  # same hash, other ids
    admit(pool, b)
    assert b.num_cached == 0 and b.block_table == [2, 3]
    assert b.cursor.broken  # b's block could not be indexed (the slot is a's)
    # the chain-of-parents check: same ids in block 1 but a different block 0
    pool2 = make_pool(hash_fn=lambda parent, ids: hash(tuple(ids)))  # ignores the parent
    x = Seq([1] * BS + [3] * BS + [0])
    admit(pool2, x)
    y = Seq([2] * BS + [3] * BS + [0])
    hits = pool2.lookup(y.token_ids, y.block_hashes, y.cursor)
    assert hits == []  # block 0 differs, so block 1 (same ids, same hash) is not served


def test_collision_on_a_child_block_never_serves_foreign_kv():
    # block 0 of x and y collide (same hash, different ids); their block 1 has equal ids
    def h(parent, ids):
        return 7 if ids[0] in (1, 2) else hash((parent, tuple(ids)))

    pool = make_pool(hash_fn=h)
    x = Seq([1] * BS + [3] * BS + [0])
    admit(pool, x)
    y = Seq([2] * BS + [3] * BS + [0])
    admit(pool, y)
    assert y.num_cached == 0
    z = Seq([1] * BS + [3] * BS + [9])
    admit(pool, z)
    assert z.num_cached == 32 and z.block_table[:2] == x.block_table[:2]


def test_reallocated_parent_invalidates_children():
    pool = make_pool(num_blocks=4)
    a = Seq([1] * BS + [2] * BS + [0])
    admit(pool, a)
    pool.free(a.block_table)
    # free queue: [2 (partial), 3 (unused), 1, 0]; take 3 blocks -> evicts block 1 (child) first
    assert pool.allocate(3) == [2, 3, 1]
    s = Seq([1] * BS + [2] * BS + [0])
    assert pool.lookup(s.token_ids, s.block_hashes, s.cursor) == [0]


def test_duplicate_blocks_continue_the_existing_chain():
    pool = make_pool()
    # two sequences computed the same prefix concurrently (neither saw the other's blocks)
    a, b = Seq([4] * BS + [0]), Seq([4] * BS + [5] * BS + [0])
    for s in (a, b):
        s.block_table = pool.allocate(-(-len(s.token_ids) // BS))
    pool.cache_blocks(a.block_table, a.token_ids, a.block_hashes, a.cursor, len(a.token_ids))
    pool.cache_blocks(b.block_table, b.token_ids, b.block_hashes, b.cursor, len(b.token_ids))
    assert not b.cursor.broken and b.cursor.num_blocks == 2
    c = Seq([4] * BS + [5] * BS + [1])
    hits = pool.lookup(c.token_ids, c.block_hashes, c.cursor)
    assert hits == [a.block_table[0], b.block_table[1]]


def test_out_of_memory_and_can_allocate():
    pool = make_pool(num_blocks=4)
    a = Seq(list(range(3 * BS)))
    admit(pool, a)  # 3 full blocks, all indexed once computed
    assert not pool.can_allocate(2)
    assert pool.can_allocate(1)
    with pytest.raises(MemoryError, match="KV pool exhausted"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.free(a.block_table)
    # reviving cached blocks costs free blocks too
    b = Seq(list(range(3 * BS)) + [1])
    hits = pool.lookup(b.token_ids, b.block_hashes, b.cursor)
    assert len(hits) == 3
    assert pool.can_allocate(1, hits) and not pool.can_allocate(2, hits)


def test_admit_takes_nothing_when_it_does_not_fit():
    pool = make_pool(num_blocks=4)
    a = Seq(list(range(3 * BS)))
    admit(pool, a)  # 3 of 4 blocks held
    b = Seq([7] * (BS + 1))  # 2 blocks, no hit
    queue, refs = list(pool.free_queue), [pool.ref_count(i) for i in range(4)]
    metrics = (pool.num_query_tokens, pool.num_hit_tokens)
    prefix = pool.find_cached_prefix(b.token_ids, b.block_hashes, b.cursor)
    assert prefix.block_ids == [] and prefix.num_cached_tokens == 0
    assert pool.admit(prefix, len(b.token_ids), len(b.token_ids)) is None
    assert list(pool.free_queue) == queue and [pool.ref_count(i) for i in range(4)] == refs
    assert (pool.num_query_tokens, pool.num_hit_tokens) == metrics
    # only the step's chunk needs blocks: 1 token of b fits the free block
    blocks = pool.admit(prefix, 1, len(b.token_ids))
    assert blocks.block_ids == [3] and blocks.num_cached_tokens == 0 and blocks.copy is None
    # reviving cached blocks costs free blocks too
    pool.free(a.block_table)
    pool.free(blocks.block_ids)
    c = Seq(list(range(3 * BS)) + [1] * (BS + 1))  # 3 hits + 2 fresh > 4 blocks
    prefix = pool.find_cached_prefix(c.token_ids, c.block_hashes, c.cursor)
    assert prefix.block_ids == [0, 1, 2] and prefix.num_cached_tokens == 3 * BS
    assert pool.admit(prefix, len(c.token_ids), len(c.token_ids)) is None
    blocks = pool.admit(prefix, 3 * BS + 1, len(c.token_ids))
    assert blocks.block_ids == [0, 1, 2, 3] and blocks.num_cached_tokens == 3 * BS
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 1, 1]
    assert (pool.num_query_tokens, pool.num_hit_tokens) == (48 + 17 + 65, 48)


def test_admit_partial_hit_copies_the_donor_slots_and_pins_the_donor():
    pool = make_pool()
    a = Seq(list(range(2 * BS)) + [0])  # blocks 0, 1 full (indexed), 2 partial
    admit(pool, a)
    b = Seq(list(range(BS + 5)) + [999, 998])  # block 0 hits; block 1 holds b's next 5 ids
    prefix = pool.find_cached_prefix(b.token_ids, b.block_hashes, b.cursor, partial=True)
    assert prefix.block_ids == [0] and prefix.donor == (1, 5)
    assert prefix.num_cached_tokens == BS + 5
    assert pool.find_cached_prefix(b.token_ids, [], ChainCursor()).donor is None  # partial off
    blocks = pool.admit(prefix, len(b.token_ids), len(b.token_ids))
    assert blocks.block_ids == [0, 3] and blocks.num_cached_tokens == BS + 5
    assert blocks.copy == (1, 3, 5)  # block 1's first 5 slots -> b's fresh block 3
    assert [pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]  # the donor is pinned
    assert (pool.num_query_tokens, pool.num_hit_tokens) == (33 + 23, BS + 5)
    pool.free([1])  # the scheduler's release_pins after the step
    assert pool.ref_count(1) == 1


def test_disabled_prefix_cache_never_hits():
    pool = make_pool(enable_prefix_cache=False)
    admit(pool, Seq(range(40)))
    s = Seq(range(40))
    admit(pool, s)
    assert s.num_cached == 0 and len(pool.index) == 0
    assert pool.num_hit_tokens == 0


@pytest.mark.parametrize("weak_hash", [False, True], ids=["xxh64", "colliding-hash"])
def test_random_workload_never_serves_foreign_kv(weak_hash):
    """Simulated KV: each slot holds the token prefix that produced it. Under random admissions,
    frees, evictions, partial hits and (optionally) a hash that collides all the time, every
    served slot must hold exactly the admitted sequence's own prefix."""
    import random

    rng = random.Random(0)
    hash_fn = (lambda parent, ids: (parent + sum(ids)) % 5) if weak_hash else None
    pool = make_pool(num_blocks=24, hash_fn=hash_fn)
    slots: dict[int, tuple[int, ...]] = {}
    stems = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    live: list[Seq] = []
    served = partial_hits = 0
    for _ in range(400):
        if live and (rng.random() < 0.4 or pool.num_free_blocks < 6):
            s = live.pop(rng.randrange(len(live)))
            pool.free(s.block_table)
            continue
        stem = rng.choice(stems)
        s = Seq(stem[:rng.randrange(1, 40)] + [rng.randrange(3) for _ in range(rng.randrange(8))])
        prefix = pool.find_cached_prefix(s.token_ids, s.block_hashes, s.cursor, partial=True)
        cached = prefix.num_cached_tokens
        assert cached <= len(s.token_ids) - 1
        blocks = pool.admit(prefix, len(s.token_ids), len(s.token_ids))
        if blocks is None:
            continue
        s.block_table = blocks.block_ids
        served += cached
        if blocks.copy is not None:
            partial_hits += 1
            src, dst, m = blocks.copy
            for j in range(m):
                slots[dst * BS + j] = slots[src * BS + j]
            pool.free([src])
        for p in range(cached):  # what the cache served must be this sequence's own prefix
            b = s.block_table[p // BS]
            assert slots[b * BS + p % BS] == tuple(s.token_ids[:p + 1])
        for p in range(cached, len(s.token_ids)):  # "compute" the rest
            slots[s.block_table[p // BS] * BS + p % BS] = tuple(s.token_ids[:p + 1])
        pool.cache_blocks(s.block_table, s.token_ids, s.block_hashes, s.cursor,
                          len(s.token_ids))
        live.append(s)
        # pool invariants
        assert set(pool.free_queue) == {b for b in range(24) if pool.ref_count(b) == 0}
        for h, b in pool.index.entries.items():
            assert pool.blocks[b].block_hash == h
    for s in live:
        pool.free(s.block_table)
    assert pool.num_free_blocks == 24
    assert served > 1000 and partial_hits > 20  # the cache was exercised, not bypassed
