"""`KVCacheManager`: which blocks each request owns, and the prefix cache over them.

Block identity for prefix caching: block i of a request is the BLAKE2b hash of
(hash of block i-1, its block_size token ids, extra keys), so two requests share block i
only if they agree on every token before it too. The extra keys are the content hashes of
the images whose placeholder positions fall in the block (`_image_keys`):

    tokens:  [t0 .. t15] [t16 .. t31] [t32 .. t40]
    hashes:   h0=H(s, b0)  h1=H(h0, b1)  (partial: not cached)

The first block's parent `s` is the request's cache salt (its 16-byte digest; 0 without
one), as in vLLM: every later block chains from it, so requests with different salts
share no block, in the device cache or in the host and disk tiers (keyed by these hashes).

A new request reuses the longest chain of cached full blocks of its tokens, but always
leaves at least one token to compute (the step needs a query to sample from). Full blocks
are hashed when they are allocated for a step (their tokens are known then); the keys
and values land in them within that same step, before any later step reads them.

Block tables live in one preallocated array [max_num_seqs, max_blocks_per_seq]; each
running request owns one row (`rows`), released when it stops running.

Speculative decoding: a step also computes a request's drafts, whose tokens are not its
own yet. Only verified tokens are ever hashed into the prefix cache (`num_cached_of_row`
counts a row's blocks identified so far), lookahead slots (a draft model writes its drafts'
keys and values ahead) are allocated past the scheduled tokens, and after verification the
blocks that hold nothing still needed are freed (`trim`, by scheduler_output.spec_blocks_kept, the rule the
worker applies to its copy of the block table too).

Sliding-window layers (`KVGroups`, pipeline/core/kv_groups.py): with G groups a row holds
G columns per logical block (block i of group g in column i * G + g), each group's blocks
cached under the block's hash mixed with the group (`_key`). Before a request's blocks
grow, a sliding group's blocks wholly before the window of its next query are freed and
their columns set to the null block (`_free_outside_windows`); they stay in the prefix
cache until reused. A prefix hit must hold, in every group, what that group reads after
it: every block before it in a global group, the blocks of its window in a sliding one
(`_hybrid_hit`, vLLM's rule: the global groups' run of hits first, then each sliding
group's longest hit within it, until they agree). The tiers behind hold a group's blocks
under the same keys: a block counts as held when the device or a tier has it, and a hit's
column found only in a tier is loaded into a new block in that column. A swapped row's
host blocks keep its null columns as -1 (`swap_out`, `swap_in`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ringllm.pipeline.core.block_pool import BlockPool
from ringllm.pipeline.core.kv_groups import NULL_BLOCK, KVGroups, single_group
from ringllm.pipeline.core.kv_tiers import HostTier
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import KVTransfers
from ringllm.pipeline.stats import PrefixCacheStats

TIER_BLOCK = -1  # a prefix hit's column found in the host tier or on disk, not yet loaded


class PrefixHit(list):
    """The columns a request starts from (a list of block ids, G per logical block): cached
    device blocks, the null block before a sliding window, and `TIER_BLOCK` where the
    block is found in a slower tier; `tier_hashes`: those blocks' keys, in column order
    (each loaded into a new device block when the request is admitted)."""

    def __init__(self, blocks=(), tier_hashes=()) -> None:
        super().__init__(blocks)
        self.tier_hashes = list(tier_hashes)


def block_hash(parent: int, token_ids: list[int], extra: bytes = b"") -> int:
    """128-bit BLAKE2b of (parent hash, token ids).

    NOTE: not Python's hash(): that is 64-bit and unkeyed for ints, so a crafted prompt
    could collide with another user's prefix and read its KV. A 128-bit cryptographic
    digest makes that infeasible, for about a microsecond per full block.
    """
    digest = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def _image_keys(images, start: int, end: int) -> bytes:
    """A block's extra hash key: the content hash and the offset (from the block's start)
    of every image with a placeholder position in [start, end). Placeholder positions all
    hold the same token id, so without it two prompts that differ only in their images
    would share KV."""
    keys = [
        image.hash + (image.offset - start).to_bytes(8, "little", signed=True)
        for image in images
        if image.offset < end and start < image.end
    ]
    return b"".join(keys)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        enable_caching: bool = True,
        host: HostTier | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups or single_group(1)
        self.num_groups = num_groups = self.groups.num_groups
        # (group, window) of the sliding groups; with any, block 0 is the null block
        self._sliding = [(g, w) for g, w in enumerate(self.groups.windows) if w]
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=bool(self._sliding))
        self._group_keys = [_group_key(g) for g in range(num_groups)]
        self.host = host  # the KV tiers behind this one (kv_tiers.py), None: none
        self.transfers = KVTransfers()  # this step's copies between tiers
        if host is not None and enable_caching:
            self.pool.on_evict = self._offload  # a group's block under its own key
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_tables = np.zeros(
            (max_num_seqs, self.max_blocks_per_seq * num_groups), dtype=np.int32
        )
        self.num_blocks_of_row = np.zeros(max_num_seqs, dtype=np.int32)  # columns
        self.num_cached_of_row = np.zeros(max_num_seqs, dtype=np.int32)  # blocks identified
        # logical blocks of each sliding group freed (their columns hold the null block)
        self.num_skipped_of_row = np.zeros((max_num_seqs, num_groups), dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.rows: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def max_request_tokens(self, chunk: int) -> int:
        """Tokens one request can hold with the whole pool to itself, prefilled in chunks
        of up to `chunk` tokens (a multiple of the block size)."""
        usable = self.pool.num_blocks - bool(self._sliding)
        bs = self.block_size
        lo, hi = 0, self.max_blocks_per_seq
        while lo < hi:  # the most blocks of tokens whose peak need fits
            mid = (lo + hi + 1) // 2
            if self.groups.peak_blocks(mid * bs, bs, chunk) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo * bs

    def block_ids(self, request_id: str) -> np.ndarray:
        row = self.rows.get(request_id)
        if row is None:
            return self.block_tables[0, :0]
        return self.block_tables[row, : self.num_blocks_of_row[row]]

    # ---- prefix cache lookups -----------------------------------------------------

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Extends request.block_hashes to cover every full block among its first num_tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        images = request.mm_inputs
        salt = int.from_bytes(request.cache_salt, "little")
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else salt
            extra = _image_keys(images, i * bs, (i + 1) * bs) if images else b""
            hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], extra))

    def _uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, and mean and cls
        # pooling its hidden states (pipeline/pooling.py): compute them all.
        params = request.sampling_params
        return (
            self.enable_caching
            and params.prompt_logprobs is None
            and params.pooling_type not in ("mean", "cls")
        )

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """Cached blocks a request can start from, and how many tokens they hold: device
        blocks, then (`PrefixHit.tier_hashes`) the blocks after them found in host memory
        or on disk.

        A pure lookup: `allocate_slots` counts the query in `prefix_stats` once it admits
        the request (a request left waiting is looked up again every step).
        """
        if not self._uses_prefix_cache(request):
            return PrefixHit(), 0
        max_hit_tokens = request.num_tokens - 1
        self._hash_full_blocks(request, max_hit_tokens)
        hashes = request.block_hashes[: max_hit_tokens // self.block_size]
        if self.num_groups > 1 or self._sliding:
            hit = self._hybrid_hit(hashes)
            return hit, len(hit) // self.num_groups * self.block_size
        blocks = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        tier = self._tier_hits(hashes[len(blocks) :])
        hit = PrefixHit(blocks + [TIER_BLOCK] * len(tier), tier)
        return hit, len(hit) * self.block_size

    def _key(self, group: int, block_hash: int) -> int:
        """A group's prefix-cache key of a block (group 0: the block's hash)."""
        return block_hash ^ self._group_keys[group]

    def _first_needed(self, position: int, window: int) -> int:
        """The first block a query at `position` of a layer with this window reads."""
        return max(0, position - window + 1) // self.block_size

    def _has(self, key: int) -> bool:
        """Whether the block under `key` is cached on the device or in a tier behind it."""
        return self.pool.get_cached_block(key) is not None or self._in_tier(key)

    def _in_tier(self, key: int) -> bool:
        host = self.host
        if host is None:
            return False
        return host.lookup(key) is not None or (host.disk is not None and key in host.disk)

    def _hybrid_hit(self, hashes: list[int]) -> PrefixHit:
        """The columns (G per block, the null block before a sliding window) of the
        longest prefix every group holds what it reads after, on the device or in a tier
        behind it (a device copy is taken before a tier's)."""
        has, key = self._has, self._key
        windows = self.groups.windows
        length = len(hashes)
        for g, window in enumerate(windows):
            if not window:  # a global group: its leading run of hits
                n = 0
                while n < length and has(key(g, hashes[n])):
                    n += 1
                length = n
        changed = True
        while changed and length:
            changed = False
            for g, window in self._sliding:
                n = self._sliding_hit(g, window, hashes, length)
                if n < length:
                    length, changed = n, True
        get = self.pool.get_cached_block
        columns, tier = [], []
        position = length * self.block_size  # the first query after the hit
        for i in range(length):
            for g, window in enumerate(windows):
                if window and i < self._first_needed(position, window):
                    columns.append(NULL_BLOCK)
                    continue
                block = get(key(g, hashes[i]))
                if block is None:
                    block = TIER_BLOCK
                    tier.append(key(g, hashes[i]))
                columns.append(block)
        return PrefixHit(columns, tier)

    def _sliding_hit(self, group: int, window: int, hashes: list[int], limit: int) -> int:
        """The longest hit of at most `limit` blocks whose window the group holds."""
        has, key = self._has, self._key
        n = limit
        while n > 0:
            start = self._first_needed(n * self.block_size, window)
            i = n - 1
            while i >= start and has(key(group, hashes[i])):
                i -= 1
            if i < start:
                return n
            n = i  # block i is missing: a hit ends before it
        return 0

    def _tier_hits(self, keys: list[int]) -> list[int]:
        """The leading run of `keys` in the host tier or on disk."""
        hits = []
        for key in keys:
            if not self._in_tier(key):
                break
            hits.append(key)
        return hits

    # ---- allocation ----------------------------------------------------------------

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request's first `num_tokens` would find blocks (and a row) now,
        not counting prefix-cache hits."""
        blocks = -(-num_tokens // self.block_size) * self.num_groups
        return bool(self._free_rows) and blocks <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        num_lookahead_slots: int = 0,
    ) -> list[int] | None:
        """Makes room for num_new_tokens more tokens after those already computed (drafts
        included), and `num_lookahead_slots` past them.

        `computed_blocks` (first call only): a `PrefixHit`, whose device blocks take a
        reference and whose tier blocks are loaded into new ones. Returns the newly
        allocated block ids (the tier loads' first), or None when the pool is short or a
        tier hit is gone since the lookup (nothing changes).
        """
        tier_hashes = getattr(computed_blocks, "tier_hashes", [])
        if len(self._tier_hits(tier_hashes)) < len(tier_hashes):
            return None  # evicted since (a swap-out between): the next lookup is shorter
        computed_blocks = list(computed_blocks or [])
        row = self.rows.get(request.request_id)
        if row is not None and self._sliding:
            self._free_outside_windows(row, request.num_computed_tokens)
        held = int(self.num_blocks_of_row[row]) if row is not None else 0
        num_groups = self.num_groups
        num_hit_blocks = len(computed_blocks) // num_groups
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        total_tokens = num_computed + num_new_tokens
        slots = total_tokens + num_lookahead_slots
        needed = -(-slots // self.block_size) * num_groups - held - len(computed_blocks)
        needed += len(tier_hashes)  # a block for each tier load
        no_block = (TIER_BLOCK, NULL_BLOCK) if self._sliding else (TIER_BLOCK,)
        hits = [b for b in computed_blocks if b not in no_block]
        reusable_free = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if max(needed, 0) + reusable_free > self.pool.num_free_blocks:
            return None
        if row is None:
            if not self._free_rows:
                return None
            row = self._free_rows.pop()
            self.rows[request.request_id] = row
            # the blocks cached already: those before the first tier load
            first_load = computed_blocks.index(TIER_BLOCK) if tier_hashes else None
            cached = len(computed_blocks) if first_load is None else first_load
            self.num_cached_of_row[row] = cached // num_groups
            self.num_skipped_of_row[row] = 0
            if self._uses_prefix_cache(request):
                self.prefix_stats.queries += request.num_tokens
                self.prefix_stats.hits += num_hit_blocks * self.block_size
                self._count_tier_queries(request, num_hit_blocks, tier_hashes)
        self.pool.touch(hits)
        # The tier hits are pinned before the allocation: the device blocks it evicts are
        # offloaded to the host tier, whose own evictions go to disk, and either may
        # otherwise take a hit's host block or disk slot before it is read.
        sources = [self._pin(block_hash) for block_hash in tier_hashes]
        new_blocks = self.pool.get_new_blocks(max(needed, 0))
        loaded = new_blocks[: len(tier_hashes)]
        for (tier, source), key, device_block in zip(sources, tier_hashes, loaded, strict=True):
            if tier == "host":
                self.transfers.to_device.append((source, device_block))
            else:
                self.transfers.from_disk.append((source, device_block, key))
        if tier_hashes:
            taken = iter(loaded)
            computed_blocks = [next(taken) if b == TIER_BLOCK else b for b in computed_blocks]
        start = held
        for block in (*computed_blocks, *new_blocks[len(tier_hashes) :]):
            self.block_tables[row, start] = block
            start += 1
        self.num_blocks_of_row[row] = start
        self._cache_full_blocks(request, row, min(total_tokens, request.num_tokens))
        return new_blocks

    def _free_outside_windows(self, row: int, num_computed: int) -> None:
        """Frees each sliding group's blocks wholly before the window of the row's next
        query (at position `num_computed`), oldest first: the first evicted."""
        num_groups = self.num_groups
        held = int(self.num_blocks_of_row[row]) // num_groups
        table, skipped = self.block_tables[row], self.num_skipped_of_row[row]
        freed = []
        for g, window in self._sliding:
            end = min(self._first_needed(num_computed, window), held)
            for i in range(int(skipped[g]), end):
                column = i * num_groups + g
                if table[column] != NULL_BLOCK:
                    freed.append(int(table[column]))
                    table[column] = NULL_BLOCK
            skipped[g] = max(int(skipped[g]), end)
        if freed:
            self.pool.free_blocks(freed)

    # ---- the tiers behind (kv_tiers.py) -----------------------------------------------

    def _offload(self, block: int, block_hash: int) -> None:
        """BlockPool.on_evict: a cached block about to be reused keeps its contents in the
        host tier."""
        self.host.offload(block, block_hash, self.transfers)

    def _pin(self, key: int) -> tuple[str, int]:
        """A prefix hit in the host tier or on disk, to be read this step: ("host", its
        host block) or ("disk", its slot), kept from eviction until the step is over."""
        if self.host.lookup(key) is not None:
            return "host", self.host.load(key)
        return "disk", self.host.disk.load(key)

    def _count_tier_queries(self, request: Request, num_hit_blocks: int, tier_keys) -> None:
        """Blocks looked up in the tiers: each tier hit, and each full block past the hit
        (one group: every block missed on the device)."""
        host = self.host
        if host is None:
            return
        looked_up = len(tier_keys) + len(request.block_hashes) - num_hit_blocks
        host_hits = sum(1 for key in tier_keys if host.lookup(key) is not None)
        host.stats.queries += looked_up
        host.stats.hits += host_hits
        if host.disk is not None:
            host.disk.stats.queries += looked_up - host_hits
            host.disk.stats.hits += len(tier_keys) - host_hits

    def swap_out(self, request: Request) -> list[int] | None:
        """Moves the request's computed KV to host blocks (copied this step) and frees its
        device blocks; the host blocks, or None (nothing changes) when the tier is short."""
        row = self.rows.get(request.request_id)
        if self.host is None or row is None:
            return None
        count = -(-request.num_computed_tokens // self.block_size) * self.num_groups
        columns = self.block_tables[row, :count].tolist()
        device = self._held(columns)
        host_blocks = self.host.allocate(len(device), self.transfers)
        if host_blocks is None:
            return None
        self.transfers.to_host.extend(zip(device, host_blocks, strict=True))
        self.transfers.swapped_out.append(request.request_id)
        self.free(request)
        if not self._sliding:
            return host_blocks
        taken = iter(host_blocks)  # a null column stays one, as -1
        return [next(taken) if c != NULL_BLOCK else -1 for c in columns]

    def swap_in(self, request: Request, host_blocks: list[int]) -> bool:
        """Device blocks (and a table row) for a swapped-out request's KV, copied back this
        step; False (nothing changes) when they are not there now."""
        # its blocks and one more: its next token may start a block (back without room to
        # run, it would only be preempted again)
        held = [b for b in host_blocks if b >= 0]
        if not self._free_rows or len(held) + self.num_groups > self.pool.num_free_blocks:
            return False
        row = self._free_rows.pop()
        self.rows[request.request_id] = row
        blocks = self.pool.get_new_blocks(len(held))
        taken = iter(blocks)
        columns = [next(taken) if b >= 0 else NULL_BLOCK for b in host_blocks]
        self.block_tables[row, : len(columns)] = columns
        self.num_blocks_of_row[row] = len(columns)
        self.num_cached_of_row[row] = 0
        for g, _ in self._sliding:  # its leading null blocks are freed ones
            skipped = 0
            while skipped * self.num_groups + g < len(columns) and (
                columns[skipped * self.num_groups + g] == NULL_BLOCK
            ):
                skipped += 1
            self.num_skipped_of_row[row, g] = skipped
        self.transfers.to_device.extend(zip(held, blocks, strict=True))
        self.host.release_swapped(held)
        self._cache_full_blocks(request, row, request.num_computed_tokens)
        return True

    def release_swapped(self, host_blocks: list[int]) -> None:
        """A swapped-out request that ends (aborted) gives its host blocks back."""
        self.host.release_swapped([b for b in host_blocks if b >= 0])

    def take_transfers(self) -> KVTransfers | None:
        """This step's copies (None: none), and the tiers' step is over."""
        transfers, self.transfers = self.transfers, KVTransfers()
        if self.host is not None:
            self.host.end_step()
        return None if transfers.is_empty else transfers

    def transfers_failed(self, transfers: KVTransfers) -> None:
        """The step that was to make these copies failed: what they were to write into the
        host tier and the disk is not there, nor what they were to load into device blocks
        (prefix hits, swap-ins: no later hit may find those). A disk block it loaded may be
        what failed (it did not verify): it is dropped from the disk's index too."""
        for block_hash in transfers.offloaded:
            self.host.forget(block_hash)
            if self.host.disk is not None:
                self.host.disk.forget(block_hash)
        for _, device_block in transfers.to_device:
            self.pool.uncache(device_block)
        for _, device_block, key in transfers.from_disk:
            self.pool.uncache(device_block)
            self.host.disk.forget(key)

    def _cache_full_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        """Identifies the blocks this step fills with the request's own (verified) tokens.

        NOTE: blocks identified by an earlier call (or prefix hits) are not visited again
        (`num_cached_of_row`): a decode step costs O(1), not O(length of the sequence).
        """
        if not self.enable_caching:
            return
        self._hash_full_blocks(request, num_tokens)
        first = int(self.num_cached_of_row[row])
        num_groups = self.num_groups
        if num_groups == 1 and not self._sliding:
            for i in range(first, num_tokens // self.block_size):
                self.pool.cache_block(int(self.block_tables[row, i]), request.block_hashes[i])
        else:
            table = self.block_tables[row]
            for i in range(first, num_tokens // self.block_size):
                block_hash = request.block_hashes[i]
                for g in range(num_groups):
                    block = int(table[i * num_groups + g])
                    if block != NULL_BLOCK:
                        self.pool.cache_block(block, self._key(g, block_hash))
        self.num_cached_of_row[row] = max(first, num_tokens // self.block_size)

    def trim(self, request: Request, num_blocks: int) -> None:
        """Frees the request's blocks past its first `num_blocks` (last first): after a
        verification rejected drafts, those hold nothing it needs (none is cached: only
        verified tokens are)."""
        row = self.rows.get(request.request_id)
        columns = num_blocks * self.num_groups
        if row is None or columns >= self.num_blocks_of_row[row]:
            return
        blocks = self.block_tables[row, columns : self.num_blocks_of_row[row]].tolist()
        self.pool.free_blocks(self._held(blocks[::-1]))
        self.num_blocks_of_row[row] = columns

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """The request's blocks holding positions num_tokens on were never written (the
        step computing them failed): they leave the prefix cache, hashes included."""
        row = self.rows.get(request.request_id)
        if row is None:
            return
        first = num_tokens // self.block_size * self.num_groups
        for block in self._held(self.block_tables[row, first : self.num_blocks_of_row[row]]):
            self.pool.uncache(int(block))

    def free(self, request: Request) -> None:
        """Releases every block of the request (last block first) and its table row."""
        row = self.rows.pop(request.request_id, None)
        if row is None:
            return
        blocks = self.block_tables[row, : self.num_blocks_of_row[row]].tolist()
        self.pool.free_blocks(self._held(blocks[::-1]))
        self.num_blocks_of_row[row] = 0
        self.num_cached_of_row[row] = 0
        self.num_skipped_of_row[row] = 0
        self._free_rows.append(row)

    def _held(self, blocks):
        """`blocks` without the null block's columns (sliding groups)."""
        if not self._sliding:
            return blocks
        return [b for b in blocks if b != NULL_BLOCK]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.clear()
            if self.host.disk is not None:
                self.host.disk.clear()


def _group_key(group: int) -> int:
    """What a group's prefix-cache keys are XORed with (0 for group 0): 128 bits, so a
    crafted prompt can no more make one group's key another's than collide the hashes."""
    if group == 0:
        return 0
    digest = hashlib.blake2b(b"ringllm KV group %d" % group, digest_size=16).digest()
    return int.from_bytes(digest, "little")
