"""KV block allocation with automatic prefix caching: ref counts, a hash chain over full blocks, LRU eviction.

Every block is in exactly one of three states (check_integrity asserts it):

    free       ref 0, no hash        -> in `_free_ids` (a stack: cheapest to take)
    cached     ref 0, hash           -> in `_evictable` (LRU order: oldest first), found by hash
    owned      ref > 0, hash or not  -> in some sequence's BlockTable (hashed once full and computed)

    allocate: free -> owned, else evict the LRU cached block (drop its hash) -> owned
    acquire (prefix hit, fork): cached -> owned, or owned ref += 1
    release: owned ref -= 1; at 0: hashed -> cached (most recent end), unhashed -> free

A chain starts at ROOT_HASH, or at salted_root(cache_salt) for a request with a cache_salt: requests with different
salts never find each other's blocks (vLLM's per-request cache isolation).

HostBlocks is the second pool: host-memory slots the worker copies a preempted sequence's blocks into (swap) and
back from when it runs again, instead of recomputing them.

No torch, no zmq: plain Python so the scheduler's policy is testable with plain objects.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.shared.messages import cache_salt_bytes

ROOT_HASH = 0x5A6F_D1E5  # parent of a sequence's first block (no cache_salt)


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when asked for more blocks than can be freed; callers check first."""


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks: logical block i holds tokens [i * block_size, (i + 1) * block_size)."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the leading full, computed blocks


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chain hash (128-bit BLAKE2b): equal hashes mean the same tokens after the same whole prefix.

    A cryptographic hash, because a collision anywhere up the chain would hand one request another
    prompt's K/V (the stored key check below only covers the last link).
    """
    digest = hashlib.blake2b(parent_hash.to_bytes(16, "little") + array("q", token_ids).tobytes(), digest_size=16)
    return int.from_bytes(digest.digest(), "little")


def salted_root(cache_salt: str) -> int:
    """The parent of a sequence's first block: ROOT_HASH without a salt; with one (vLLM's cache_salt), a hash of
    it, so that the first block's hash mixes the salt in and every later one differs through the chain: requests
    share cached blocks only when their salts are equal. A different BLAKE2b personalization keeps a salted root
    apart from any block hash (the stored key check compares parents too)."""
    if not cache_salt:
        return ROOT_HASH
    digest = hashlib.blake2b(cache_salt_bytes(cache_salt), digest_size=16, person=b"pagoda-salt")
    return int.from_bytes(digest.digest(), "little")


class BlockManager:
    """Owns the pool of KV blocks; sequences hold ids in their BlockTable."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._keys: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # to verify hits
        self._block_by_hash: dict[int, int] = {}
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # ---------------------------------------------------------------- counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence could take: free plus unreferenced cached ones."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_by_hash)

    def usage_ratio(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks sit in the cache with no holder (acquiring them shrinks the free pool)."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- block level

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks with ref 1, preferring never-cached ones, then the LRU cached ones."""
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        taken: list[int] = []
        for _ in range(count):
            if self._free_ids:
                block_id = self._free_ids.pop()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget_hash(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks another sequence already holds or the cache keeps."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert self._hashes[block_id] is not None, "only cached blocks can be acquired at ref 0"
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; release tail-first so prefix roots are evicted last."""
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            assert count >= 0, f"block {block_id} released more often than taken"
            self._ref_counts[block_id] = count
            if count == 0:
                if self._hashes[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free_ids.append(block_id)

    def evict(self, count: int) -> int:
        """Drop up to `count` unreferenced cached blocks from the cache (LRU first); return how many."""
        evicted = 0
        while evicted < count and self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
            self._free_ids.append(block_id)
            evicted += 1
        self.num_evictions += evicted
        return evicted

    def reset_prefix_cache(self) -> int:
        return self.evict(len(self._evictable))

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._block_by_hash[block_hash]
            self._hashes[block_id] = None
            self._keys[block_id] = None

    # ---------------------------------------------------------------- sequence level

    def lookup_prefix(self, token_ids: Sequence[int], max_blocks: int,
                      root: int = ROOT_HASH) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks that starts `token_ids` under the chain `root` (salted_root of the
        request's cache_salt): (block ids, their hashes).

        Takes no references; the caller acquires what it keeps.
        """
        if not self.enable_prefix_caching:
            return [], []
        size = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = root
        for index in range(min(max_blocks, len(token_ids) // size)):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            block_hash = hash_block(parent, tokens)
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None or self._keys[block_id] != (parent, tokens):
                break  # a miss, or a hash collision that the stored key exposes
            block_ids.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return block_ids, hashes

    def grow(self, table: BlockTable, num_tokens: int) -> list[int]:
        """Give `table` enough blocks for `num_tokens` slots; return the new ids ([] when none needed)."""
        missing = self.num_blocks_for(num_tokens) - len(table.block_ids)
        if missing <= 0:
            return []
        new_ids = self.allocate(missing)
        table.block_ids.extend(new_ids)
        return new_ids

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int,
               root: int = ROOT_HASH) -> None:
        """Hash the blocks that became full of computed tokens so later requests (of the same chain `root`) can
        reuse them."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(num_computed_tokens // size, len(table.block_ids))
        parent = table.block_hashes[-1] if table.block_hashes else root
        for index in range(len(table.block_hashes), num_full):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            block_hash = hash_block(parent, tokens)
            block_id = table.block_ids[index]
            if block_hash not in self._block_by_hash and self._hashes[block_id] is None:
                self._block_by_hash[block_hash] = block_id
                self._hashes[block_id] = block_hash
                self._keys[block_id] = (parent, tokens)
            # else: the same content is cached in another block already; this one stays unhashed
            table.block_hashes.append(block_hash)
            parent = block_hash

    def fork(self, parent: BlockTable, num_tokens: int) -> BlockTable:
        """A child that shares the parent's first full blocks covering at most `num_tokens` tokens."""
        num_shared = min(num_tokens // self.block_size, len(parent.block_ids))
        shared = parent.block_ids[:num_shared]
        self.acquire(shared)
        return BlockTable(list(shared), list(parent.block_hashes[:num_shared]))

    def fork_for_write(self, parent: BlockTable, num_tokens: int) -> tuple[BlockTable, tuple[int, int] | None] | None:
        """A child that continues the parent's first `num_tokens` tokens and writes its own next ones (a beam):
        the full blocks are shared by reference, a last partial block is copied into a block of the child's own
        (copy-on-write: the (source, destination) pair the worker copies). None when no block is free for it."""
        num_full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        assert num_full + partial <= len(parent.block_ids), "the parent holds the tokens it shares"
        if partial and self.num_free_blocks == 0:
            return None
        child = self.fork(parent, num_full * self.block_size)
        if not partial:
            return child, None
        (own,) = self.allocate(1)
        child.block_ids.append(own)
        return child, (parent.block_ids[num_full], own)

    def shared_prefix(self, table: BlockTable, parent: BlockTable, num_tokens: int) -> int:
        """How many leading blocks `table` holds in common with the parent's full blocks covering `num_tokens`
        tokens (beams of one search share their prompt's blocks and whatever they forked since)."""
        limit = min(num_tokens // self.block_size, len(table.block_ids), len(parent.block_ids))
        ours, theirs = table.block_ids, parent.block_ids
        if ours[:limit] == theirs[:limit]:
            return limit
        return next(i for i in range(limit) if ours[i] != theirs[i])

    def release_tail(self, table: BlockTable, keep: int) -> None:
        """Drop the table's blocks after its first `keep` (free() when keep is 0)."""
        self.release(table.block_ids[keep:])
        del table.block_ids[keep:]
        del table.block_hashes[keep:]

    def refork_for_write(self, table: BlockTable, parent: BlockTable,
                         num_tokens: int) -> tuple[BlockTable, tuple[int, int] | None]:
        """fork_for_write(parent, num_tokens) for a table that kept (release_tail) only blocks it shares with the
        parent: the same table and copy, without releasing and acquiring again the blocks both hold (a beam that
        changes line keeps its prompt's blocks: ~40 reference changes fewer for a 640-token beam)."""
        num_full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        keep = len(table.block_ids)
        assert keep <= num_full and table.block_ids == parent.block_ids[:keep], "the table keeps a shared prefix"
        assert num_full + partial <= len(parent.block_ids), "the parent holds the tokens it shares"
        extra = parent.block_ids[keep:num_full]
        self.acquire(extra)
        child = BlockTable(table.block_ids + extra, list(parent.block_hashes[:num_full]))
        table.block_ids.clear()
        table.block_hashes.clear()
        if not partial:
            return child, None
        (own,) = self.allocate(1)
        child.block_ids.append(own)
        return child, (parent.block_ids[num_full], own)

    def free(self, table: BlockTable) -> None:
        self.release(table.block_ids)
        table.block_ids.clear()
        table.block_hashes.clear()

    # ---------------------------------------------------------------- checks

    def check_integrity(self, tables: Sequence[BlockTable] | None = None) -> None:
        """Assert the three-state invariant; with `tables`, also that ref counts match their holders."""
        free = set(self._free_ids)
        assert len(free) == len(self._free_ids), "a block is on the free list twice"
        evictable = set(self._evictable)
        assert not free & evictable, "a block is both free and cached"
        for block_id in range(self.num_blocks):
            refs, block_hash = self._ref_counts[block_id], self._hashes[block_id]
            if block_id in free:
                assert refs == 0 and block_hash is None, f"free block {block_id} is referenced or hashed"
            elif block_id in evictable:
                assert refs == 0 and block_hash is not None, f"cached block {block_id} has refs or no hash"
            else:
                assert refs > 0, f"block {block_id} leaked: unreferenced yet neither free nor cached"
            if block_hash is not None:
                assert self._block_by_hash[block_hash] == block_id, f"hash index wrong for block {block_id}"
        assert len(self._block_by_hash) == sum(h is not None for h in self._hashes)
        if tables is not None:
            holders = [0] * self.num_blocks
            for table in tables:
                for block_id in table.block_ids:
                    holders[block_id] += 1
                assert len(table.block_hashes) <= len(table.block_ids)
            assert holders == self._ref_counts, "ref counts differ from the tables holding the blocks"


class HostBlocks:
    """The worker's host-memory KV slots for swapped-out sequences: a free list, no sharing, no hashes.

    A slot freed by a swap-in is read by that step's host-to-device copy, so it becomes free only at the next
    step (`release_later`, then `settle` when the next plan is built): a swap-out in the same plan, whose
    device-to-host copy the worker runs first, must not overwrite it."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0
        self.num_blocks = num_blocks
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._settling: list[int] = []  # read by the plan being built: free from the next one on

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def allocate(self, count: int) -> list[int] | None:
        """`count` slots, or None when fewer are free."""
        if count > len(self._free_ids):
            return None
        taken = self._free_ids[-count:] if count else []
        del self._free_ids[len(self._free_ids) - count:]
        return taken[::-1]

    def free(self, block_ids: Sequence[int]) -> None:
        """Slots nothing reads any more (a swapped sequence that finished or was aborted)."""
        self._free_ids.extend(block_ids)

    def release_later(self, block_ids: Sequence[int]) -> None:
        """Slots the plan being built copies back to the device: free once that plan is sent."""
        self._settling.extend(block_ids)

    def settle(self) -> None:
        self._free_ids.extend(self._settling)
        self._settling.clear()

    def check_integrity(self, held: Sequence[Sequence[int]]) -> None:
        """Every slot is free, settling or held by exactly one swapped sequence."""
        slots = [*self._free_ids, *self._settling, *(block_id for ids in held for block_id in ids)]
        assert sorted(slots) == list(range(self.num_blocks)), "a host slot is lost or held twice"
