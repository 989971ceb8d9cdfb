"""The paged KV block pool and the prefix cache keyed on token ids.

BlockPool hands out block ids of the KV pool (batch.KVCache holds the tensors), counts references,
and keeps the free blocks in eviction order. PrefixIndex maps the chained hash of a *full* block to
the block holding its K/V, so a later prompt with the same token-id prefix reuses that K/V.

The scheduler is the only caller; the runner sees only block ids, through the block tables.
Admission is two calls, as vLLM's get_computed_blocks / allocate_slots: find_cached_prefix (the
verified hit, nothing referenced yet: CachedPrefix) then admit (the hit referenced, fresh blocks
for the step, the metrics: KVCacheBlocks, or None when they do not fit). A running sequence grows
with can_allocate / allocate; finished or preempted ones give their blocks back with free.

Key:  h_0 = xxh64(fingerprint);  h_i = xxh64(h_{i-1} as 8 bytes LE || block i's ids as int32 LE).
Hits are verified: an index entry stores its block's token ids and its parent block (id and
allocation generation), and a walk accepts block i only if its ids equal the query's and its
parent is the block accepted at i-1. By induction a hit's whole prefix equals the query's, so a
hash collision can cost a miss but never serve another prompt's K/V.

Eviction order (the free queue, head evicted first):
  * a block whose last reference goes away returns to the tail (LRU), still indexed, so a later
    prompt can revive it; the blocks of one sequence are freed in reverse, so a chain's tail is
    evicted before its head (a child never outlives its parent's index entry);
  * a freed block that holds no index entry goes to the head: it has nothing worth keeping.
Reallocating an indexed block drops its entry and bumps its generation, which invalidates any
entry naming it as a parent.

Partial-block reuse (find_partial): where the chain of full-block hits ends, an indexed child of
the last hit whose first m ids equal the query's next m ids can lend those m slots: the caller
copies their K/V (and hidden states) into the query's fresh block. K/V at a position depends only
on the tokens up to it, so the copy is exactly what a cold run would compute. This makes the
cache token-granular at the end of a shared prefix (a 175-token shared instruction reuses 175
tokens, not 160), without a radix tree.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

HashFn = Callable[[int, Sequence[int]], int]


def chain_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """xxh64(parent as 8 bytes little-endian || token ids as int32 little-endian)."""
    ids = array("i", token_ids)  # 4-byte int on every platform torch supports
    if sys.byteorder != "little":  # pragma: no cover
        ids.byteswap()
    h = xxhash.xxh64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(ids.tobytes())
    return h.intdigest()


def root_hash(fingerprint: bytes) -> int:
    """The parent hash of block 0: a process serving another model never shares an entry."""
    return xxhash.xxh64(b"freetoken-prefix-v1|" + fingerprint).intdigest()


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    gen: int = 0                              # bumped on every allocation
    block_hash: int | None = None             # set while this block is the index entry
    token_ids: tuple[int, ...] | None = None  # the ids it holds, for verify-on-hit
    parent: tuple[int, int] | None = None     # (block_id, gen) of the parent entry; None = root


@dataclass(slots=True)
class ChainCursor:
    """How far one sequence's blocks are known to the index (kept by the sequence).

    num_blocks: its leading blocks that are indexed or equal to an indexed entry;
    parent: (block_id, gen) of the entry for block num_blocks - 1; broken: a hash collision
    stopped the chain, so none of its later blocks may be indexed.
    """
    num_blocks: int = 0
    parent: tuple[int, int] | None = None
    broken: bool = False


@dataclass(slots=True)
class CachedPrefix:
    """A sequence's verified cached prefix, not yet referenced (BlockPool.find_cached_prefix)."""
    block_ids: list[int]                 # full-block hits, in order
    num_cached_tokens: int               # the hits' tokens plus the donor's m
    donor: tuple[int, int] | None = None  # (block id, m): a partial hit lends its first m slots


@dataclass(slots=True)
class KVCacheBlocks:
    """One admission's blocks: what the scheduler reads back from BlockPool.admit."""
    block_ids: list[int]                 # the sequence's block table: the hits, then fresh blocks
    num_cached_tokens: int               # its tokens whose K/V is already there (or copied in)
    # partial hit: the runner copies the first m slots of block src into block dst before the
    # forward; src stays referenced (pinned) until the scheduler releases it after the step
    copy: tuple[int, int, int] | None = None


class PrefixIndex:
    """hash -> block id, with the hash function and the chain root in one place."""

    def __init__(self, fingerprint: bytes = b"", hash_fn: HashFn | None = None):
        self.root = root_hash(fingerprint)
        self.hash_fn: HashFn = hash_fn or chain_hash
        self.entries: dict[int, int] = {}

    def block_hashes(self, token_ids: Sequence[int], block_size: int, known: list[int],
                     num_blocks: int) -> list[int]:
        """Extend `known` (the hashes of the leading full blocks) to num_blocks entries."""
        for i in range(len(known), num_blocks):
            parent = known[i - 1] if i else self.root
            known.append(self.hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size]))
        return known

    def __len__(self) -> int:
        return len(self.entries)


class BlockPool:
    """Block ids 0..num_blocks-1, reference counts, the free queue and the prefix index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 fingerprint: bytes = b"", hash_fn: HashFn | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.index = PrefixIndex(fingerprint, hash_fn)
        # (parent key, first token id) -> indexed blocks: the candidates for a partial hit
        self.children: dict[tuple[tuple[int, int] | None, int], set[int]] = {}
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0    # of those, served from it

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def can_allocate(self, num_new_blocks: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks fit after reviving `cached_block_ids`."""
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return num_new_blocks + revived <= len(self.free_queue)

    def allocate(self, num_new_blocks: int) -> list[int]:
        """Pop blocks from the head of the free queue; raises MemoryError when they do not fit."""
        if num_new_blocks > len(self.free_queue):
            raise MemoryError(f"KV pool exhausted: {num_new_blocks} blocks wanted, "
                              f"{len(self.free_queue)} free")
        out = []
        for _ in range(num_new_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.gen += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), reviving those with none."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a block table, tail first (see module doc)."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[b] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(b, last=False)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def _evict(self, block: _Block) -> None:
        if block.block_hash is not None:
            if self.index.entries.get(block.block_hash) == block.block_id:
                del self.index.entries[block.block_hash]
            key = (block.parent, block.token_ids[0])
            kids = self.children.get(key)
            if kids is not None:
                kids.discard(block.block_id)
                if not kids:
                    del self.children[key]
            block.block_hash = None
            block.token_ids = None
            block.parent = None

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], block_hashes: list[int],
               cursor: ChainCursor) -> list[int]:
        """The longest verified cached prefix of token_ids, as block ids (not yet referenced).

        NOTE: the hit is capped at len(token_ids) - 1 tokens, rounded down to full blocks, so at
        least the last token is computed and its logits exist (the max_tokens=1 classify case).
        `block_hashes` (the sequence's own list) is extended with the hashes computed; `cursor`
        is set to the end of the hit. The caller records the admission with record_query.
        """
        cursor.num_blocks, cursor.parent, cursor.broken = 0, None, False
        if not self.enable_prefix_cache or len(token_ids) < 2:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        self.index.block_hashes(token_ids, bs, block_hashes, max_blocks)
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            b = self.index.entries.get(block_hashes[i])
            if b is None:
                break
            block = self.blocks[b]
            if block.parent != parent or block.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: verified, and refused
            hits.append(b)
            parent = (b, block.gen)
        cursor.num_blocks, cursor.parent = len(hits), parent
        return hits

    def find_partial(self, token_ids: Sequence[int], num_hit_blocks: int,
                     cursor: ChainCursor) -> tuple[int, int] | None:
        """After `num_hit_blocks` full-block hits: (donor block id, m) where the donor, an
        indexed child of the last hit, holds the query's next m ids in its first m slots; None
        if no m >= 1. Still capped so the last token is computed."""
        if not self.enable_prefix_cache:
            return None
        start = num_hit_blocks * self.block_size
        limit = min(self.block_size, len(token_ids) - 1 - start)
        if limit < 1:
            return None
        query = token_ids[start:start + limit]
        best: tuple[int, int] | None = None
        for b in self.children.get((cursor.parent, query[0]), ()):
            ids = self.blocks[b].token_ids
            m = 0
            while m < limit and ids[m] == query[m]:
                m += 1
            if best is None or m > best[1] or (m == best[1] and b < best[0]):
                best = (b, m)
        return best

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: list[int],
                           cursor: ChainCursor, partial: bool = False) -> CachedPrefix:
        """lookup, then (with `partial`) find_partial after its hits: a waiting sequence's cached
        prefix. Nothing is referenced yet; `block_hashes` and `cursor` are updated as lookup
        does."""
        hits = self.lookup(token_ids, block_hashes, cursor)
        donor = self.find_partial(token_ids, len(hits), cursor) if partial else None
        num_cached = len(hits) * self.block_size + (donor[1] if donor else 0)
        return CachedPrefix(hits, num_cached, donor)

    def admit(self, prefix: CachedPrefix, num_tokens: int,
              num_query_tokens: int) -> KVCacheBlocks | None:
        """Admit a sequence: reference the prefix's blocks (the donor's too, as a pin) and
        allocate fresh ones up to `num_tokens` (cached + computed this step). None, with nothing
        taken, when they do not fit. Records num_query_tokens (the sequence's length) and the
        hit in the prefix-cache metrics."""
        bs = self.block_size
        need = -(-num_tokens // bs) - len(prefix.block_ids)
        donor = prefix.donor
        pins = prefix.block_ids + [donor[0]] if donor else prefix.block_ids
        if not self.can_allocate(need, pins):
            return None
        self.touch(pins)
        fresh = self.allocate(need)
        self.record_query(num_query_tokens, prefix.num_cached_tokens)
        copy = (donor[0], fresh[0], donor[1]) if donor else None
        return KVCacheBlocks(prefix.block_ids + fresh, prefix.num_cached_tokens, copy)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Metrics: one admission looked up num_query_tokens and was served num_hit_tokens."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_blocks(self, block_table: Sequence[int], token_ids: Sequence[int],
                     block_hashes: list[int], cursor: ChainCursor,
                     num_computed_tokens: int) -> None:
        """Index the sequence's full blocks whose K/V is computed (up to num_computed_tokens).

        A block equal to an existing entry (same ids, same parent) is left unindexed and the
        chain continues from the existing entry; a collision (same hash, other content) breaks
        the chain for this sequence.
        """
        if not self.enable_prefix_cache or cursor.broken:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_table))
        if num_full <= cursor.num_blocks:
            return
        self.index.block_hashes(token_ids, bs, block_hashes, num_full)
        parent = cursor.parent
        for i in range(cursor.num_blocks, num_full):
            h = block_hashes[i]
            ids = tuple(token_ids[i * bs:(i + 1) * bs])
            existing = self.index.entries.get(h)
            if existing is not None:
                e = self.blocks[existing]
                if e.parent == parent and e.token_ids == ids:
                    parent = (existing, e.gen)
                    cursor.num_blocks, cursor.parent = i + 1, parent
                    continue
                cursor.broken = True
                return
            block = self.blocks[block_table[i]]
            if block.block_hash is not None:  # already an entry under another chain: keep it
                cursor.broken = True
                return
            block.block_hash, block.token_ids, block.parent = h, ids, parent
            self.index.entries[h] = block.block_id
            self.children.setdefault((parent, ids[0]), set()).add(block.block_id)
            parent = (block.block_id, block.gen)
            cursor.num_blocks, cursor.parent = i + 1, parent

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced entry (referenced blocks keep theirs)."""
        for b in list(self.free_queue):
            self._evict(self.blocks[b])
