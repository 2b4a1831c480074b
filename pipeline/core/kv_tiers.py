"""The KV tiers behind the device's KV cache, as the engine core accounts for them.

    device KV cache (BlockPool)  --evicted cached block-->  host tier (HostTier)
          ^   |  swap out (a preempted request's blocks)       |   ^
          |   +----------------------------------------------->|   | prefix hit: loaded back
          +--------------- swap in / prefix load --------------+   |
                                                   evicted cached  v   |
                                                         disk tier (DiskTier)

The workers hold the bytes (pipeline/worker/kv_tiers.py); the engine core decides which
block goes where and tells them in each step's `KVTransfers` (scheduler_output.py), which
they carry out before the step's forward pass, in this order:

    1. to_disk    host blocks evicted from the host tier's prefix cache -> disk slots
    2. to_host    device blocks -> host blocks (swap-outs, prefix-cache offloads)
    3. to_device  host blocks -> device blocks (swap-ins, prefix hits in host memory)
    4. from_disk  disk slots -> device blocks (prefix hits on disk; a GPU worker stages
                  them through pinned memory of its own)

The order is what makes one step's copies safe together: a block is read before anything
in the same step can overwrite it. The accounting keeps it so: a device block evicted this
step is copied out (2) before a load (3, 4) or the forward writes it; a host block evicted
to disk (1) is read before it is reused as a destination (2); host blocks and disk slots
read this step are `protected` (never evicted or reused until the step is over), and host
blocks given back this step come free only at the next (`end_step`).

Host blocks are either free, held by a swapped-out request, or cached (a full prefix
block by its 128-bit hash, unreferenced, evicted least recently used first). Swaps take
host blocks before the cache does: a swap may evict cached blocks, an offload only takes
a free or cached block and is dropped when there is none.
"""

from __future__ import annotations

import collections

from ringllm.pipeline.core.scheduler_output import KVTransfers
from ringllm.pipeline.stats import TierStats


class DiskTier:
    """The disk tier's index: block hash -> slot, least recently used first; the slots'
    bytes are the workers' (pipeline/worker/kv_disk.py). `entries`: what a restarted
    engine finds valid in the files."""

    def __init__(self, num_slots: int, entries: dict[int, int] | None = None) -> None:
        self.num_slots = num_slots
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()
        used = set()
        for block_hash, slot in (entries or {}).items():
            if 0 <= slot < num_slots and slot not in used:
                self._lru[block_hash] = slot
                used.add(slot)
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self._protected: set[int] = set()
        self.stats = TierStats(num_blocks=num_slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: int) -> int | None:
        return self._lru.get(block_hash)

    def load(self, block_hash: int) -> int:
        """The slot of a hit about to be read this step (kept from eviction until then)."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self._protected.add(slot)
        self.stats.blocks_out += 1
        return slot

    def put(self, block_hash: int) -> int | None:
        """A slot to write `block_hash` into (the least recently used entry's if none is
        free); None when it is there already or every slot is being read this step."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._protected), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
        self._lru[block_hash] = slot
        self.stats.blocks_in += 1
        return slot

    def forget(self, block_hash: int) -> None:
        slot = self._lru.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for block_hash in list(self._lru):
            self.forget(block_hash)

    def end_step(self) -> None:
        self._protected.clear()

    def take_stats(self) -> TierStats:
        self.stats.blocks_used = len(self._lru)
        return self.stats.take()


class HostTier:
    """The host tier's blocks: free, held by swapped-out requests, or cached by hash."""

    def __init__(self, num_blocks: int, disk: DiskTier | None = None) -> None:
        self.num_blocks = num_blocks
        self.disk = disk
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> block
        self._cached_blocks: set[int] = set()  # its values, for O(1) accounting
        self._protected: set[int] = set()
        self._pending_free: list[int] = []
        self.num_swapped_blocks = 0
        self.stats = TierStats(num_blocks=num_blocks)

    @property
    def num_available(self) -> int:
        """Blocks a swap could have now: free ones, and cached ones not read this step."""
        pinned = sum(1 for b in self._protected if b in self._cached_blocks)  # a step's few
        return len(self._free) + len(self._cached) - pinned

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def load(self, block_hash: int) -> int:
        """The block of a hit about to be read this step (kept from eviction until then)."""
        block = self._cached[block_hash]
        self._cached.move_to_end(block_hash)
        self._protected.add(block)
        self.stats.blocks_out += 1
        return block

    def allocate(self, count: int, transfers: KVTransfers) -> list[int] | None:
        """`count` blocks for a swap-out (the least recently used cached blocks evicted if
        need be, to disk when there is a disk tier); None (nothing taken) if short."""
        if count > self.num_available:
            return None
        blocks = [self._take(transfers) for _ in range(count)]
        self._protected.update(blocks)  # written this step
        self.num_swapped_blocks += count
        self.stats.blocks_in += count
        return blocks

    def release_swapped(self, blocks: list[int]) -> None:
        """A swapped request's blocks: free from the next step on (read this step)."""
        self._pending_free.extend(blocks)
        self._protected.update(blocks)
        self.num_swapped_blocks -= len(blocks)

    def offload(self, device_block: int, block_hash: int, transfers: KVTransfers) -> bool:
        """A cached device block about to be reused: its contents go to a host block (a free
        one, else the least recently used cached one); False when there is none, or the
        hash is here already."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)
            return False
        if self.disk is not None and block_hash in self.disk:
            return False  # kept already: a hit loads it from disk
        if self.num_available == 0:
            return False
        block = self._take(transfers)
        self._cached[block_hash] = block
        self._cached_blocks.add(block)
        self._protected.add(block)  # written this step: not to be evicted before that
        transfers.to_host.append((device_block, block))
        transfers.offloaded.append(block_hash)
        self.stats.blocks_in += 1
        return True

    def _take(self, transfers: KVTransfers) -> int:
        if self._free:
            return self._free.pop()
        victim = next(h for h, b in self._cached.items() if b not in self._protected)
        block = self._cached.pop(victim)
        self._cached_blocks.discard(block)
        if self.disk is not None:
            slot = self.disk.put(victim)
            if slot is not None:
                transfers.to_disk.append((block, slot, victim))
                transfers.offloaded.append(victim)
        return block

    def forget(self, block_hash: int) -> None:
        block = self._cached.pop(block_hash, None)
        if block is not None:
            self._cached_blocks.discard(block)
            self._free.append(block)

    def clear(self) -> None:
        """Forgets every cached block (swapped requests keep theirs)."""
        self._free.extend(self._cached.values())
        self._cached.clear()
        self._cached_blocks.clear()

    def end_step(self) -> None:
        self._free.extend(self._pending_free)
        self._pending_free = []
        self._protected.clear()
        if self.disk is not None:
            self.disk.end_step()

    def take_stats(self) -> TierStats:
        self.stats.blocks_used = len(self._cached) + self.num_swapped_blocks
        return self.stats.take()
