"""BlockManager: a hypothesis state machine over allocate / append / fork / free / evict, plus unit tests.

The state machine keeps a model of what each physical block's K/V holds (the token prefix written
into it when its owner computed it, and the cache salt of that owner) so that every prefix-cache hit is
checked against real content, not just against the manager's own bookkeeping: a hit under another salt
would be a leak between requests that asked to be kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagoda.services.scheduler import block_manager
from pagoda.services.scheduler.block_manager import (
    ROOT_HASH,
    BlockManager,
    BlockTable,
    NoFreeBlocksError,
    salted_root,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 12
TOKENS = st.integers(0, 1)  # a tiny alphabet so prefixes repeat and the cache hits
SALTS = ("", "a", "b")  # cache salts ("": none)


@dataclass
class Live:
    """A sequence the machine holds: its table, its tokens and how many of them have K/V written."""

    table: BlockTable
    token_ids: list[int]
    num_computed: int
    salt: str = ""


def chain_hashes(token_ids: list[int], num_blocks: int, salt: str = "") -> list[int]:
    hashes, parent = [], salted_root(salt)
    for index in range(num_blocks):
        parent = block_manager.hash_block(parent, tuple(token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]))
        hashes.append(parent)
    return hashes


class BlockManagerMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    exact_prefix_hits = True  # a hit's block holds exactly the looked-up prefix (no hash collisions)

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_prefix_caching)
        self.live: list[Live] = []
        # block id -> (its writer's salt, the token prefix whose last block it holds)
        self.contents: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.seen: list[list[int]] = []  # every sequence allocated so far, to draw shared prefixes from
        self.num_hits = 0

    # ------------------------------------------------------------ helpers

    def holders(self, block_id: int) -> int:
        return sum(live.table.block_ids.count(block_id) for live in self.live)

    def owned_ids(self) -> set[int]:
        return {block_id for live in self.live for block_id in live.table.block_ids}

    def grow(self, live: Live, num_tokens: int) -> None:
        owned_before = self.owned_ids()
        new_ids = self.bm.grow(live.table, num_tokens)
        assert len(live.table.block_ids) == self.bm.num_blocks_for(num_tokens)
        assert not set(new_ids) & owned_before, "allocate handed out a block someone holds"
        assert len(set(new_ids)) == len(new_ids)
        for block_id in new_ids:
            self.contents.pop(block_id, None)  # a reused block's old K/V is garbage to its new owner

    def compute(self, live: Live, num_computed: int) -> None:
        """Write K/V for tokens [live.num_computed, num_computed), then commit like the scheduler does."""
        assert live.num_computed <= num_computed <= len(live.token_ids)
        assert num_computed <= len(live.table.block_ids) * BLOCK_SIZE
        first, last = live.num_computed // BLOCK_SIZE, self.bm.num_blocks_for(num_computed)
        for index in range(first, last):
            block_id = live.table.block_ids[index]
            assert self.holders(block_id) == 1, "a sequence writes into a block another one holds"
            if (index + 1) * BLOCK_SIZE <= num_computed:
                self.contents[block_id] = (live.salt, tuple(live.token_ids[:(index + 1) * BLOCK_SIZE]))
        live.num_computed = num_computed
        self.bm.commit(live.table, live.token_ids, num_computed, salted_root(live.salt))
        num_hashed = num_computed // BLOCK_SIZE if self.enable_prefix_caching else 0
        assert live.table.block_hashes == chain_hashes(live.token_ids, num_hashed, live.salt)

    # ------------------------------------------------------------ rules

    @rule(data=st.data(), tail=st.lists(TOKENS, max_size=3 * BLOCK_SIZE), salt=st.sampled_from(SALTS))
    def allocate(self, data: st.DataObject, tail: list[int], salt: str) -> None:
        """A new sequence: often a prefix of an earlier one plus a tail, so the cache has something to hit; under
        one of a few cache salts, so that the same tokens must not hit under another salt."""
        prefix: list[int] = []
        if self.seen and data.draw(st.booleans()):
            earlier = data.draw(st.sampled_from(self.seen))
            prefix = earlier[:data.draw(st.integers(0, len(earlier)) | st.just(len(earlier)))]
        token_ids = (prefix + tail)[:6 * BLOCK_SIZE] or [0]
        self.seen.append(token_ids)
        max_blocks = (len(token_ids) - 1) // BLOCK_SIZE
        hit_ids, hit_hashes = self.bm.lookup_prefix(token_ids, max_blocks, salted_root(salt))
        assert len(hit_ids) == len(hit_hashes) <= max_blocks
        if not self.enable_prefix_caching:
            assert hit_ids == []
        assert hit_hashes == chain_hashes(token_ids, len(hit_ids), salt)
        for index, block_id in enumerate(hit_ids):
            expected, written = tuple(token_ids[:(index + 1) * BLOCK_SIZE]), self.contents.get(block_id)
            if self.exact_prefix_hits:
                assert written == (salt, expected), "a hit on stale K/V, or on another salt's"
            else:  # the stored key vouches for the block's own tokens only (and for the salt of a first block)
                assert written is not None and written[1][-BLOCK_SIZE:] == expected[-BLOCK_SIZE:], "a hit on stale K/V"
                assert index > 0 or written[0] == salt, "a first block hit under another salt"
        self.num_hits += len(hit_ids)
        needed = self.bm.num_blocks_for(len(token_ids)) - len(hit_ids)
        available = self.bm.num_free_blocks - self.bm.num_unreferenced(hit_ids)
        table = BlockTable()
        self.bm.acquire(hit_ids)
        table.block_ids.extend(hit_ids)
        table.block_hashes.extend(hit_hashes)
        assert self.bm.num_free_blocks == available
        if needed > available:
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(table, len(token_ids))
            assert table.block_ids == hit_ids
            self.bm.free(table)
            return
        live = Live(table, list(token_ids), len(hit_ids) * BLOCK_SIZE, salt)
        self.grow(live, len(token_ids))
        self.live.append(live)
        self.compute(live, data.draw(st.integers(live.num_computed, len(token_ids)) | st.just(len(token_ids))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=2 * BLOCK_SIZE + 1))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        live = data.draw(st.sampled_from(self.live))
        num_tokens = len(live.token_ids) + len(extra)
        needed = self.bm.num_blocks_for(num_tokens) - len(live.table.block_ids)
        if needed > self.bm.num_free_blocks:
            before = list(live.table.block_ids)
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(live.table, num_tokens)
            assert live.table.block_ids == before
            return
        live.token_ids.extend(extra)
        self.grow(live, num_tokens)
        self.compute(live, data.draw(st.integers(live.num_computed, num_tokens) | st.just(num_tokens)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live))
        num_tokens = data.draw(st.integers(0, parent.num_computed))
        free_before = self.bm.num_free_blocks
        child = self.bm.fork(parent.table, num_tokens)
        num_shared = num_tokens // BLOCK_SIZE
        assert child.block_ids == parent.table.block_ids[:num_shared]
        assert child.block_hashes == parent.table.block_hashes[:num_shared]
        assert self.bm.num_free_blocks == free_before, "forking a held block takes nothing from the pool"
        self.live.append(Live(child, parent.token_ids[:num_tokens], num_shared * BLOCK_SIZE, parent.salt))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        live = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        only_here = {block_id for block_id in live.table.block_ids if self.holders(block_id) == 0}
        free_before = self.bm.num_free_blocks
        self.bm.free(live.table)
        assert live.table.block_ids == [] and live.table.block_hashes == []
        assert self.bm.num_free_blocks == free_before + len(only_here)

    @rule(count=st.integers(0, NUM_BLOCKS + 2))
    def evict(self, count: int) -> None:
        free_before, cached_before = self.bm.num_free_blocks, self.bm.num_cached_blocks
        evicted = self.bm.evict(count)
        assert 0 <= evicted <= count
        assert self.bm.num_free_blocks == free_before, "eviction moves cached blocks to free, no more"
        assert self.bm.num_cached_blocks == cached_before - evicted
        if evicted < count:
            assert self.bm.evict(1) == 0, "evict stopped early while unreferenced cached blocks remained"

    @rule()
    def free_everything(self) -> None:
        while self.live:
            self.bm.free(self.live.pop().table)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        self.bm.check_integrity(tables=[])

    # ------------------------------------------------------------ invariants

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity(tables=[live.table for live in self.live])
        assert self.bm.num_free_blocks == NUM_BLOCKS - len(self.owned_ids()), "a block leaked"
        for live in self.live:
            assert live.num_computed <= min(len(live.token_ids), len(live.table.block_ids) * BLOCK_SIZE)
            assert len(live.table.block_ids) <= self.bm.num_blocks_for(max(len(live.token_ids), 1))
        if not self.enable_prefix_caching:
            assert self.bm.num_cached_blocks == 0

    def teardown(self) -> None:
        self.free_everything()


class NoPrefixCachingMachine(BlockManagerMachine):
    enable_prefix_caching = False


class TinyHashMachine(BlockManagerMachine):
    """Hashes squeezed into 3 values: collisions everywhere; the stored key must catch each one.

    The key is (parent hash, the block's tokens), so it vouches for the block's own tokens; a collision
    one level up (two different parents with one hash) is out of its reach, hence no exact-prefix check.
    """

    exact_prefix_hits = False

    def __init__(self) -> None:
        super().__init__()
        self._real_hash_block = block_manager.hash_block
        block_manager.hash_block = lambda parent, token_ids: hash((parent, token_ids)) % 3

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            block_manager.hash_block = self._real_hash_block


MACHINE_SETTINGS = settings(max_examples=200, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = MACHINE_SETTINGS
TestNoPrefixCachingMachine = NoPrefixCachingMachine.TestCase
TestNoPrefixCachingMachine.settings = settings(MACHINE_SETTINGS, max_examples=60)
TestTinyHashMachine = TinyHashMachine.TestCase
TestTinyHashMachine.settings = settings(MACHINE_SETTINGS, max_examples=100)


# ---------------------------------------------------------------- unit tests


def filled(bm: BlockManager, token_ids: list[int]) -> BlockTable:
    """A table holding `token_ids`, all computed and committed."""
    table = BlockTable()
    bm.grow(table, len(token_ids))
    bm.commit(table, token_ids, len(token_ids))
    return table


def test_prefix_hit_after_commit_and_free_returns_the_same_blocks() -> None:
    bm = BlockManager(8, 4)
    token_ids = list(range(10))  # 2 full blocks and a partial one
    table = filled(bm, token_ids)
    block_ids, hashes = list(table.block_ids), list(table.block_hashes)
    assert len(block_ids) == 3 and len(hashes) == 2
    bm.free(table)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.check_integrity(tables=[])

    assert bm.lookup_prefix(token_ids, max_blocks=10) == (block_ids[:2], hashes)
    assert bm.lookup_prefix(token_ids, max_blocks=1) == (block_ids[:1], hashes[:1])
    assert bm.lookup_prefix(token_ids[:7], max_blocks=10) == (block_ids[:1], hashes[:1])  # only full blocks
    assert bm.lookup_prefix([0, 1, 2, 3, 4, 99, 6, 7], max_blocks=10) == (block_ids[:1], hashes[:1])
    assert bm.lookup_prefix([99] + token_ids[1:], max_blocks=10) == ([], [])
    # the same tokens after a different first block are a different chain
    assert bm.lookup_prefix([9, 9, 9, 9] + token_ids[4:8], max_blocks=10) == ([], [])

    hit_ids, hit_hashes = bm.lookup_prefix(token_ids, max_blocks=10)
    bm.acquire(hit_ids)  # a hit takes the blocks out of the evictable pool
    assert bm.num_free_blocks == 6
    other = BlockTable(list(hit_ids), list(hit_hashes))
    bm.grow(other, 10)
    bm.check_integrity(tables=[other])
    bm.free(other)
    assert bm.num_free_blocks == 8


def test_a_cache_salt_changes_every_block_hash_and_only_the_same_salt_hits() -> None:
    """vLLM's cache_salt: mixed into the first block's hash, so every hash of the chain differs through its parent;
    a lookup finds the blocks under the salt they were committed with, and under no other (nor unsalted)."""
    assert salted_root("") == ROOT_HASH
    assert len({salted_root(salt) for salt in ("", "a", "b", "ab")}) == 4
    bm = BlockManager(16, 4)
    token_ids = list(range(12))  # 3 full blocks
    unsalted, salted = filled(bm, token_ids), BlockTable()
    bm.grow(salted, len(token_ids))
    bm.commit(salted, token_ids, len(token_ids), salted_root("tenant-a"))
    assert salted.block_hashes == chain_hashes(token_ids, 3, "tenant-a")
    assert all(ours != theirs for ours, theirs in zip(salted.block_hashes, unsalted.block_hashes, strict=True))
    assert unsalted.block_hashes == chain_hashes(token_ids, 3)  # no salt: the chain as it always was
    salted_ids, unsalted_ids = list(salted.block_ids), list(unsalted.block_ids)
    bm.free(salted)
    bm.free(unsalted)
    assert bm.num_cached_blocks == 6
    assert bm.lookup_prefix(token_ids, 10, salted_root("tenant-a"))[0] == salted_ids
    assert bm.lookup_prefix(token_ids, 10)[0] == unsalted_ids
    assert bm.lookup_prefix(token_ids, 10, salted_root("tenant-b")) == ([], [])
    bm.check_integrity(tables=[])


def test_lru_eviction_order() -> None:
    bm = BlockManager(4, 2)
    seq_a, seq_b = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a, table_b = filled(bm, seq_a), filled(bm, seq_b)
    a_root, a_tail = table_a.block_ids
    b_root, b_tail = table_b.block_ids
    bm.free(table_a)  # released first: least recently used
    bm.free(table_b)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4

    # a sequence's tail goes before its root, and A (released first) before B
    assert bm.allocate(1) == [a_tail]
    assert bm.lookup_prefix(seq_a, 10)[0] == [a_root]
    assert bm.lookup_prefix(seq_b, 10)[0] == [b_root, b_tail]
    assert bm.allocate(1) == [a_root]
    assert bm.lookup_prefix(seq_a, 10)[0] == []
    assert bm.num_evictions == 2
    assert bm.evict(1) == 1
    assert bm.lookup_prefix(seq_b, 10)[0] == [b_root]
    bm.check_integrity()


def test_a_hit_makes_blocks_most_recently_used() -> None:
    bm = BlockManager(4, 2)
    seq_a, seq_b = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a, table_b = filled(bm, seq_a), filled(bm, seq_b)
    a_ids, b_ids = list(table_a.block_ids), list(table_b.block_ids)
    bm.free(table_a)
    bm.free(table_b)
    hit_ids, hit_hashes = bm.lookup_prefix(seq_a, 10)
    assert hit_ids == a_ids
    bm.acquire(hit_ids)
    bm.free(BlockTable(hit_ids, hit_hashes))  # A is now the most recently released
    assert bm.evict(2) == 2
    assert bm.lookup_prefix(seq_b, 10)[0] == []
    assert bm.lookup_prefix(seq_a, 10)[0] == a_ids
    assert sorted(bm.allocate(2)) == sorted(b_ids)  # evicted blocks are plain free blocks now
    bm.check_integrity(tables=[BlockTable(sorted(b_ids))])


def test_allocate_prefers_never_cached_blocks() -> None:
    bm = BlockManager(4, 2)
    token_ids = [1, 2, 3, 4]
    table = filled(bm, token_ids)
    cached_ids = list(table.block_ids)
    bm.free(table)
    fresh = bm.allocate(2)
    assert not set(fresh) & set(cached_ids)
    assert bm.num_evictions == 0
    assert bm.lookup_prefix(token_ids, 10)[0] == cached_ids  # the cache survived
    assert bm.allocate(1) == [cached_ids[1]]  # now only cached blocks are left: the LRU one (the tail) goes
    assert bm.num_evictions == 1
    assert bm.lookup_prefix(token_ids, 10)[0] == cached_ids[:1]
    bm.check_integrity(tables=[BlockTable(fresh + [cached_ids[1]])])


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, token_ids: 42)
    bm = BlockManager(8, 2)
    seq_a = [1, 2, 3, 4]
    table_a = filled(bm, seq_a)
    root = table_a.block_ids[0]
    assert bm.num_cached_blocks == 1  # A's second block collides with its first: it stays unhashed
    bm.check_integrity(tables=[table_a])
    bm.free(table_a)
    bm.check_integrity(tables=[])
    hit_ids, _ = bm.lookup_prefix(seq_a, 10)
    assert hit_ids == [root]  # the root matches by key; the colliding second block does not
    assert bm.lookup_prefix([1, 2, 9, 9], 10)[0] == hit_ids
    assert bm.lookup_prefix([7, 7, 3, 4], 10) == ([], [])  # same hash as A's root, other tokens: a miss
    # a colliding sequence computes its own blocks and never reads A's
    table_c = BlockTable()
    new_ids = bm.grow(table_c, 4)
    assert not set(new_ids) & set(hit_ids)
    bm.commit(table_c, [7, 7, 3, 4], 4)
    bm.check_integrity(tables=[table_c])
    bm.free(table_c)
    assert bm.num_free_blocks == 8


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    token_ids = [1, 2, 3, 4, 5]
    table = filled(bm, token_ids)
    assert table.block_hashes == []
    assert bm.lookup_prefix(token_ids, 10) == ([], [])  # not even while the blocks are held
    bm.free(table)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert bm.lookup_prefix(token_ids, 10) == ([], [])
    assert bm.evict(4) == 0
    bm.check_integrity(tables=[])


def test_allocate_beyond_capacity_raises() -> None:
    bm = BlockManager(4, 2)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(5)
    assert bm.num_free_blocks == 4
    table = filled(bm, [1, 2, 3, 4])  # 2 blocks, cached while held
    bm.free(table)  # cached blocks count as free
    held = bm.allocate(3)
    assert bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    assert bm.num_free_blocks == 1  # a refused allocation takes nothing
    other = BlockTable()
    with pytest.raises(NoFreeBlocksError):
        bm.grow(other, 3)
    assert other.block_ids == []
    bm.check_integrity(tables=[BlockTable(held)])
    assert bm.allocate(0) == []


def test_fork_shares_full_blocks_and_survives_the_parent() -> None:
    bm = BlockManager(8, 4)
    parent = filled(bm, list(range(10)))
    child = bm.fork(parent, 9)  # 2 full blocks cover 8 of the 9 tokens
    assert child.block_ids == parent.block_ids[:2]
    assert child.block_hashes == parent.block_hashes[:2]
    bm.check_integrity(tables=[parent, child])
    bm.free(parent)
    assert bm.num_free_blocks == 6  # the shared blocks stay owned by the child
    bm.check_integrity(tables=[child])
    bm.free(child)
    assert bm.num_free_blocks == 8
    with pytest.raises(AssertionError):
        bm.release([0])  # released more often than taken


@pytest.mark.parametrize("seed", range(6))
def test_refork_matches_free_then_fork_for_write(seed: int) -> None:
    """A beam changing line (release_tail to the prefix it shares, then refork_for_write) leaves the manager, the
    new table and the copy exactly as free + fork_for_write do: reference counts, free list, cache, hashes."""
    import random

    def scenario(reforked: bool) -> tuple[object, ...]:
        blocks = BlockManager(num_blocks=40, block_size=BLOCK_SIZE)
        local = random.Random(seed)
        prompt = [local.randrange(3) for _ in range(4 * BLOCK_SIZE + 2)]
        root = BlockTable()
        blocks.grow(root, len(prompt))
        blocks.commit(root, prompt, len(prompt))
        tables, tokens = [root], [prompt]
        for _ in range(3):  # beams forked from the root, then grown apart by a few tokens each
            parent = local.randrange(len(tables))
            count = len(tokens[parent]) - local.randrange(0, 3)
            child, copy = blocks.fork_for_write(tables[parent], count) or (None, None)
            assert child is not None
            tables.append(child)
            tokens.append(tokens[parent][:count])
        for table, ids in zip(tables, tokens, strict=True):
            ids.extend(local.randrange(3) for _ in range(local.randrange(0, 6)))
            blocks.grow(table, len(ids) + 1)
            blocks.commit(table, ids, len(ids))
        slot, parent = 3, local.randrange(3)
        num_tokens = len(tokens[parent])
        if reforked:
            blocks.release_tail(tables[slot], blocks.shared_prefix(tables[slot], tables[parent], num_tokens))
            table, copy = blocks.refork_for_write(tables[slot], tables[parent], num_tokens)
        else:
            blocks.free(tables[slot])
            forked = blocks.fork_for_write(tables[parent], num_tokens)
            assert forked is not None
            table, copy = forked
        blocks.check_integrity([t for i, t in enumerate(tables) if i != slot] + [table])
        return table.block_ids, table.block_hashes, blocks._ref_counts, blocks._free_ids, list(blocks._evictable), copy

    assert scenario(True) == scenario(False)
