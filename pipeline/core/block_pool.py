"""`BlockPool`: every KV-cache block, its reference count, and the prefix-cache index.

Free blocks sit in one doubly linked queue kept in two preallocated int arrays (no
Python object per block, nothing allocated per step):

    head -> b7 <-> b2 <-> b9 <-> ... <-> b4 <- tail
            (evicted first)             (freed last)

- Allocation pops from the head. A free block may still hold a cached prefix (its hash
  is in `_cached`); popping it evicts that entry, so the least recently freed cached
  block is evicted first (LRU).
- A freed block goes to the tail; a request frees its blocks last-to-first, so the tail
  of a prompt (least likely to be shared) is evicted before its head.
- A prefix hit on a free block takes it out of the queue (ref count 0 -> 1) in O(1).

Invariant: a block is in the free queue iff its ref count is 0.

With `reserve_null` block 0 is never handed out (it stands for a sliding-window group's
blocks that were freed: pipeline/core/kv_groups.py), so one block fewer is usable.
"""

from __future__ import annotations

import numpy as np

_NONE = -1


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False
    ) -> None:
        if num_blocks < 1 + reserve_null:
            need = "2 KV blocks (one is the null block)" if reserve_null else "1 KV block"
            raise ValueError(f"num_blocks: need at least {need}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Free queue links; index num_blocks is the sentinel (head = next[s], tail = prev[s]).
        self._next = np.arange(1, num_blocks + 2, dtype=np.int64)
        self._prev = np.arange(-1, num_blocks, dtype=np.int64)
        sentinel = num_blocks
        self._next[num_blocks - 1] = sentinel
        self._next[sentinel] = 0
        self._prev[0] = sentinel
        self._prev[sentinel] = num_blocks - 1
        self.num_free_blocks = num_blocks
        # called with (block, hash) when a cached block is about to be reused (a KV tier
        # behind this pool keeps its contents: pipeline/core/kv_tiers.py)
        self.on_evict = None
        self.num_reserved = int(reserve_null)
        if reserve_null:
            self._unlink(0)
            self.ref_counts[0] = 1

    # ---- free queue --------------------------------------------------------------

    def _unlink(self, block: int) -> None:
        p, n = self._prev[block], self._next[block]
        self._next[p] = n
        self._prev[n] = p
        self.num_free_blocks -= 1

    def _append(self, block: int) -> None:
        s = self.num_blocks
        tail = self._prev[s]
        self._next[tail] = block
        self._prev[block] = tail
        self._next[block] = s
        self._prev[s] = block
        self.num_free_blocks += 1

    # ---- allocation ----------------------------------------------------------------

    def get_new_blocks(self, count: int) -> list[int]:
        """Takes `count` blocks from the head of the free queue (evicting their cache entries)."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.num_free_blocks} free")
        blocks = []
        s = self.num_blocks
        for _ in range(count):
            block = int(self._next[s])
            self._unlink(block)
            if self.on_evict is not None:
                block_hash = self.block_hashes[block]
                if block_hash is not None and self._cached.get(block_hash) == block:
                    self.on_evict(block, block_hash)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference on cached blocks a new request reuses."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                self._unlink(block)
            self.ref_counts[block] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        """Drops one reference on each block, in the order given; unreferenced ones become free."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._append(block)
            elif self.ref_counts[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")

    # ---- prefix cache --------------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: int, block_hash: int) -> None:
        """Records that `block` holds the full block identified by `block_hash`."""
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        self.block_hashes[block] = block_hash
        self._cached.setdefault(block_hash, block)

    def uncache(self, block: int) -> None:
        """`block` does not hold what its hash says (its step failed): no hit may find it."""
        self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]
            self.block_hashes[block] = None

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (blocks in use stay allocated, just no longer shared)."""
        self._cached.clear()
        self.block_hashes = [None] * self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - self.num_reserved)
