"""The disk tier of the KV cache: full prefix-cache blocks in one memory-mapped file per rank.

The store owns the file and its integrity, nothing else: which block goes to which slot,
and the LRU over slots, live in the engine core (its index hash -> slot starts from
`valid_entries()` after a restart). One slot holds one block's keys and values of every
layer, copied from / to the host tier's caches (pipeline/ops/interface.py's layout).

File `ringllm-kv-rank{rank}.bin` in the directory, allocated whole at open
(`posix_fallocate`: a disk that cannot hold it fails now, not with a SIGBUS later):

    offset 0            header, one 4 KiB page
                          magic "RLLMKVD\\0" | layout version u32 | header bytes u32
                          fingerprint digest [32] (BLAKE2b-256 of the canonical JSON of
                            the caller's fingerprint + this store's layout and rank)
                          num_slots u64 | slot_bytes u64 | table_offset u64 | data_offset u64
                          ... zeros ... | crc32 of bytes [0, 4092) in the last 4 bytes
    table_offset        slot table: num_slots entries of 32 bytes, padded to a page
                          hash_lo u64 | hash_hi u64 | seq u64 | checksum u32 | state u32
    data_offset         slot 0 | slot 1 | ... | slot num_slots-1   (slot_bytes each)

    slot s ─┬─ layer 0 ─┬─ key   [num_kv_heads, block_size, head_size]  (dtype)
            │           └─ value [num_kv_heads, block_size, head_size]
            ├─ layer 1 ...      (int8: each followed by the block's scales, float32
            │                    [num_kv_heads], as bytes: pipeline/ops/kv_int8.py)
            └─ zero padding up to slot_bytes (a multiple of 4 KiB: no page holds two slots)

    file bytes = 4096 + table bytes + num_slots * slot_bytes  <=  max_bytes

A slot's state is EMPTY, WRITING or VALID. A write goes: WRITING, the data, hash + seq +
checksum, VALID. `checksum` is zlib.crc32 of the entry's hash and seq followed by the slot's
data (padding excluded). NOTE: crc32 because it runs at memory speed (about 6.6 GB/s here,
~60 us for a 368 KiB block; BLAKE2b is ~1.2 GB/s) and the threat is torn or damaged pages,
not an adversary: a torn slot passes with probability 2^-32. The block's own identity is the
128-bit hash, compared on every read.

What is loaded, and what is never trusted:
  - a header whose crc, magic, version, fingerprint, slot count or slot size differs from
    this open's, or a file of the wrong length: the whole file is discarded (a warning) and
    recreated empty. A changed size cap recreates it too.
  - at open every WRITING slot (a write torn by a crash) becomes EMPTY, every VALID slot's
    checksum is verified (`verify_at_open`; the scan reads the whole tier: see
    `valid_entries`), and of two VALID slots with one hash only the newest stays.
  - `read` loads a slot only if its state is VALID, its stored hash is the expected one and
    (`verify_reads`) its checksum verifies; a checksum failure marks the slot EMPTY.

Durability: every write is in the shared mapping at once, so a crash of the process loses
nothing written (the kernel writes the pages back) and a write it interrupted stays
WRITING. A crash of the machine loses what was not yet written back, in any page order;
the checksum turns such a slot into a miss. `flush()` (msync) makes everything before it
durable. A file that another process holds open (an advisory lock) is refused.

Thread-safety: one lock serialises write / read / invalidate / flush; zlib.crc32 and torch's
copies release the GIL, so a worker may run them on a background thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ringllm.pipeline.ops import kv_int8
from ringllm.pipeline.ops.torch_ref import bit_view
from ringllm.pipeline.worker.kv_disk_file import (
    EMPTY,
    FILE_NAME,
    MASK64,
    PREFETCH_BYTES,
    SIGNED_BYTES,
    TABLE_DTYPE,
    VALID,
    WRITING,
    DiskLayout,
    allocate_file,
    check_block_shape,
    create_file,
    fingerprint_digest,
    open_directory,
    open_locked,
    why_not_reusable,
)

logger = logging.getLogger(__name__)


class DiskKVStore:
    """Slots of whole KV blocks in a file; use `DiskKVStore.open`."""

    def __init__(self, path: Path, fd: int, layout: DiskLayout, verify_reads: bool):
        self.path = path
        self.layout = layout
        self.verify_reads = verify_reads
        self._fd = fd
        self._lock = threading.Lock()
        self._mm = mmap.mmap(
            fd, layout.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._bytes = memoryview(self._mm)
        self._table = np.frombuffer(
            self._mm, TABLE_DTYPE, count=layout.num_slots, offset=layout.table_offset
        )
        raw = torch.frombuffer(
            self._mm,
            dtype=torch.uint8,
            count=layout.num_slots * layout.slot_bytes,
            offset=layout.data_offset,
        )
        stride = layout.slot_bytes // layout.dtype.itemsize
        used = layout.slot_data_bytes // layout.dtype.itemsize
        self._data = (  # [num_slots, num_layers, 2 (key, value), elems]: a view of the file
            bit_view(raw.view(layout.dtype))
            .view(layout.num_slots, stride)[:, :used]
            .view(layout.num_slots, layout.num_layers, 2, layout.elems_per_cache_block)
        )
        self._next_seq = 1

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike,
        fingerprint: dict,
        block_shape: tuple[int, int, int],
        num_layers: int,
        dtype: torch.dtype,
        max_bytes: int,
        rank: int = 0,
        *,
        verify_at_open: bool = True,
        verify_reads: bool = True,
    ) -> DiskKVStore:
        """Opens this rank's file in `directory` (created if missing), or creates it empty.

        Raises ValueError (naming the path and the numbers) when the directory cannot be
        used (or another user could replace the file in it: kv_disk_file.open_directory),
        the file is a link or not this user's own, the disk cannot hold `max_bytes`,
        `max_bytes` holds no block, or another process holds the file.
        """
        check_block_shape(block_shape, num_layers, dtype, rank)
        layout = DiskLayout.plan(num_layers, block_shape, dtype, max_bytes)
        digest = fingerprint_digest(fingerprint, layout, rank)
        path = Path(directory) / FILE_NAME.format(rank=rank)
        dir_fd = open_directory(path.parent)
        try:
            fd = open_locked(dir_fd, path)
            try:
                reason = why_not_reusable(fd, layout, digest)
                if reason is None:
                    allocate_file(fd, path, layout.file_bytes)
                else:
                    if os.fstat(fd).st_size:
                        logger.warning("disk KV tier: discarding %s: %s", path, reason)
                    create_file(fd, dir_fd, path, layout, digest)
                store = cls(path, fd, layout, verify_reads)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(dir_fd)
        store._recover(verify_at_open)
        return store

    # -- what the engine core's index starts from

    def valid_entries(self) -> dict[int, int]:
        """block hash -> slot of every VALID slot, oldest write first (the LRU's order).

        Live: reflects writes and invalidations since open. At open every VALID slot's
        checksum was verified (`verify_at_open`), which reads the whole tier: measured
        0.3-0.45 s per GiB from the page cache, 0.65-1.1 s per GiB from a cold virtual disk
        (with read-ahead; 2.4 s without). Without it, the first read of a slot verifies it.
        """
        with self._lock:
            return self._index()[0]

    def _index(self) -> tuple[dict[int, int], list[int]]:
        """(hash -> slot, oldest write first; the older slots of a hash written twice)."""
        valid = np.flatnonzero(self._table["state"] == VALID)
        entries: dict[int, int] = {}
        shadowed = []
        for slot in valid[np.argsort(self._table["seq"][valid], kind="stable")].tolist():
            older = entries.pop(block_hash := self._hash_of(slot), None)
            if older is not None:
                shadowed.append(older)
            entries[block_hash] = slot
        return entries, shadowed

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    # -- copies between the host tier's caches and the slots

    def write(
        self,
        slots: Sequence[int],
        hashes: Sequence[int],
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        src_blocks: Sequence[int],
    ) -> None:
        """Block src_blocks[i] of every layer -> slot slots[i], which then holds hashes[i]."""
        slots_np, hashes, src_t = self._check_batch(
            slots, hashes, key_caches, value_caches, src_blocks
        )
        if not len(slots_np):
            return
        with self._lock:
            self._table["state"][slots_np] = WRITING
            slots_t = torch.from_numpy(slots_np)
            for layer, (key, value) in enumerate(zip(key_caches, value_caches, strict=True)):
                for kv, cache in enumerate((key, value)):
                    rows = bit_view(cache).index_select(0, src_t).view(len(slots_np), -1)
                    if kv_int8.is_int8(cache):  # the block's scales after its values
                        scales = kv_int8.kv_scales(cache).index_select(0, src_t)
                        rows = torch.cat([rows, scales.view(torch.int8)], dim=1)
                    self._data[:, layer, kv].index_copy_(0, slots_t, rows)
            self._seal(slots_np, hashes)

    def _seal(self, slots: np.ndarray, hashes: Sequence[int]) -> None:
        """The data is in: hash, seq and checksum, then VALID."""
        table = self._table
        table["hash_lo"][slots] = [h & MASK64 for h in hashes]
        table["hash_hi"][slots] = [h >> 64 for h in hashes]
        table["seq"][slots] = np.arange(self._next_seq, self._next_seq + len(slots))
        self._next_seq += len(slots)
        table["checksum"][slots] = [self._checksum(int(s)) for s in slots]
        self._mark_valid(slots)

    def _mark_valid(self, slots: np.ndarray) -> None:
        self._table["state"][slots] = VALID

    def read(
        self,
        slots: Sequence[int],
        hashes: Sequence[int],
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        dst_blocks: Sequence[int],
    ) -> np.ndarray:
        """Slot slots[i] -> block dst_blocks[i] of every layer, if it holds hashes[i].

        Returns a bool per slot: loaded. A slot not loaded leaves its block untouched; one
        whose checksum fails is marked EMPTY. NOTE: a slot holding another hash keeps it
        (the caller's index is stale there, the slot's block may still be wanted).
        """
        slots_np, hashes, dst_t = self._check_batch(
            slots, hashes, key_caches, value_caches, dst_blocks
        )
        with self._lock:
            entries = self._table[slots_np]
            loaded = (
                (entries["state"] == VALID)
                & (entries["hash_lo"] == np.array([h & MASK64 for h in hashes], np.uint64))
                & (entries["hash_hi"] == np.array([h >> 64 for h in hashes], np.uint64))
            )
            if self.verify_reads:  # NOTE: cold, the read-ahead halves its time
                self._prefetch(slots_np[loaded])
                for i in np.flatnonzero(loaded):
                    loaded[i] = self._verify(int(slots_np[i]))
            chosen = torch.from_numpy(np.flatnonzero(loaded))
            if len(chosen):
                slots_t, dst_t = torch.from_numpy(slots_np)[chosen], dst_t[chosen]
                for layer, (key, value) in enumerate(zip(key_caches, value_caches, strict=True)):
                    for kv, cache in enumerate((key, value)):
                        entry = self._data[slots_t, layer, kv]
                        values = cache[0].numel()
                        rows = entry[:, :values].reshape(len(chosen), *cache.shape[1:])
                        bit_view(cache).index_copy_(0, dst_t, rows)
                        if kv_int8.is_int8(cache):
                            scales = entry[:, values:].contiguous().view(torch.float32)
                            kv_int8.kv_scales(cache).index_copy_(0, dst_t, scales)
        return loaded

    def invalidate(self, slots: Sequence[int]) -> None:
        """The slots hold nothing (the engine core evicted them)."""
        slots_np = self._check_slots(slots)
        with self._lock:
            self._table["state"][slots_np] = EMPTY

    def flush(self) -> None:
        """msync: everything written before this call survives a crash of the machine."""
        with self._lock:
            self._mm.flush()

    def close(self) -> None:
        """Unmaps and closes the file (releasing its lock); no flush: see `flush`."""
        if self._fd < 0:
            return
        with self._lock:
            del self._data, self._table
            self._bytes.release()
            self._mm.close()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- integrity

    def _hash_of(self, slot: int) -> int:
        entry = self._table[slot]
        return int(entry["hash_hi"]) << 64 | int(entry["hash_lo"])

    def _checksum(self, slot: int) -> int:
        start = self.layout.table_offset + slot * TABLE_DTYPE.itemsize
        signed = zlib.crc32(self._bytes[start : start + SIGNED_BYTES])
        offset = self.layout.data_offset + slot * self.layout.slot_bytes
        return zlib.crc32(self._bytes[offset : offset + self.layout.slot_data_bytes], signed)

    def _verify(self, slot: int) -> bool:
        if self._checksum(slot) == int(self._table["checksum"][slot]):
            return True
        logger.warning("disk KV tier %s: slot %d fails its checksum; dropped", self.path, slot)
        self._table["state"][slot] = EMPTY
        return False

    def _prefetch(self, slots: np.ndarray) -> None:
        """Asks the kernel to read the slots ahead (a cold scan: ~3x faster than faulting)."""
        for slot in slots.tolist():
            offset = self.layout.data_offset + slot * self.layout.slot_bytes
            start = offset - offset % mmap.PAGESIZE  # the file's pages may be larger
            self._mm.madvise(mmap.MADV_WILLNEED, start, offset + self.layout.slot_bytes - start)

    def _recover(self, verify: bool) -> None:
        """After open: torn and unknown states -> EMPTY, checksums, one slot per hash."""
        started = time.perf_counter()
        state = self._table["state"]
        torn = int(np.count_nonzero(state == WRITING))
        state[(state != VALID) & (state != EMPTY)] = EMPTY
        failed = 0
        if verify:
            valid = np.flatnonzero(state == VALID)
            ahead = max(1, PREFETCH_BYTES // self.layout.slot_bytes)
            self._prefetch(valid[:ahead])
            for i, slot in enumerate(valid):
                if i % ahead == 0:
                    self._prefetch(valid[i + ahead : i + 2 * ahead])
                failed += not self._verify(int(slot))
        entries, shadowed = self._index()
        state[shadowed] = EMPTY
        self._next_seq = int(self._table["seq"].max(initial=0)) + 1
        logger.info(
            "disk KV tier %s: %d blocks of %d slots (%d torn, %d failed checksum), %.2f s",
            self.path,
            len(entries),
            self.num_slots,
            torn,
            failed,
            time.perf_counter() - started,
        )

    # -- argument checks

    def _check_slots(self, slots: Sequence[int]) -> np.ndarray:
        slots_np = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots_np) and (slots_np.min() < 0 or slots_np.max() >= self.num_slots):
            raise ValueError(f"slots {slots_np.tolist()} outside [0, {self.num_slots})")
        if len(np.unique(slots_np)) != len(slots_np):
            raise ValueError(f"slots {slots_np.tolist()} name one slot twice")
        return slots_np

    def _check_batch(self, slots, hashes, key_caches, value_caches, blocks):
        if self._fd < 0:
            raise ValueError(f"disk KV tier {self.path} is closed")
        slots_np = self._check_slots(slots)
        if not len(slots_np) == len(hashes) == len(blocks):
            raise ValueError(f"{len(slots_np)} slots, {len(hashes)} hashes, {len(blocks)} blocks")
        hashes = [int(h) for h in hashes]
        if any(not 0 <= h < 1 << 128 for h in hashes):
            raise ValueError("block hashes must be 128-bit unsigned ints")
        layout = self.layout
        for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
            if len(caches) != layout.num_layers:
                raise ValueError(f"{len(caches)} {name}, the store has {layout.num_layers} layers")
            want = ("cpu", layout.dtype, layout.block_shape)
            for cache in caches:
                if (cache.device.type, cache.dtype, tuple(cache.shape[1:])) != want:
                    raise ValueError(
                        f"{name}: a {cache.device} {cache.dtype} {tuple(cache.shape)} cache, the "
                        f"store takes cpu {layout.dtype} [num_blocks, *{layout.block_shape}]"
                    )
        blocks_t = torch.as_tensor(np.asarray(blocks, dtype=np.int64).reshape(-1))
        num_blocks = key_caches[0].shape[0]
        if len(blocks_t) and (blocks_t.min() < 0 or blocks_t.max() >= num_blocks):
            raise ValueError(f"blocks {blocks_t.tolist()} outside the caches' [0, {num_blocks})")
        return slots_np, hashes, blocks_t
