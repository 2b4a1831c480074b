"""Byte layout of one ring region inside a shared-memory segment.

A region is a header of 64-byte cache lines followed by `capacity` slots of
`slot_bytes` each. Counters that different processes write live on separate cache
lines, so a writer publishing never invalidates the line a reader is writing its head on.

    line 0   magic | version | kind | slot_bytes | capacity | num_readers | dtype_hash | 0
    line 1   tail | writer_cpu         (written by the writer only)
    line 2   data_sleepers | data_futex     readers sleep here for records
    line 3   space_sleepers | space_futex   the writer sleeps here for free slots
    line 4   writer party record (pid, start_ticks, heartbeat_ns, state; see liveness.py)
    line 5+i reader i: head | party record | reader_cpu  (written by reader i only)
    ...      slots[0 .. capacity-1], each `slot_bytes`, viewed through the caller's dtype

`tail` and `head` are monotonically increasing 64-bit record counts (never wrapped; the
slot of record k is k % capacity), so `tail - head` is the fill level and a full ring
(`tail - min(head) == capacity`) is told apart from an empty one without a spare slot.
`writer_cpu` / `reader_cpu` are CPU hints: the CPU number + 1 that the party last
published (tail) or released (head) from, 0 before its first. A waiter reads its peer's
hint to choose between spinning and sleeping at once (_ringops.c). Each sits on the line
its peer already reads for the counter, so it costs no extra cache-line transfer.
The header constants are written once before the segment name is handed to anyone.
`dtype_hash` covers the slot dtype and the blob field name, so two sides that disagree
on the record layout fail at attach time instead of reading garbage.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.errors import RingLayoutError
from ringllm.ipc.liveness import PARTY_RECORD_BYTES

CACHE_LINE_BYTES = 64
MAGIC = int.from_bytes(b"RINGLLM1", "little")
LAYOUT_VERSION = 2  # 2: CPU hints beside tail and head
MAX_READERS = 64
MAX_CAPACITY = 1 << 24
MAX_SLOT_BYTES = 1 << 20


class RingKind(enum.IntEnum):
    SPSC = 1
    BROADCAST = 2
    MPSC = 3


def dtype_hash(dtype: np.dtype, blob_bytes_field: str | None) -> int:
    text = f"{np.dtype(dtype).descr!r}|{np.dtype(dtype).itemsize}|{blob_bytes_field}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class RingLayout:
    """Offsets of one ring region whose header starts at byte `base` of the segment."""

    dtype: np.dtype
    capacity: int
    num_readers: int = 1
    blob_bytes_field: str | None = None
    base: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if not 2 <= self.capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in [2, {MAX_CAPACITY}] slots, got {self.capacity}")
        if not 1 <= self.num_readers <= MAX_READERS:
            raise ValueError(f"num_readers must be in [1, {MAX_READERS}], got {self.num_readers}")
        if not 1 <= self.dtype.itemsize <= MAX_SLOT_BYTES:
            raise ValueError(
                f"record dtype is {self.dtype.itemsize} bytes; slots must be 1..{MAX_SLOT_BYTES} "
                "bytes (carry larger data as a blob)"
            )
        if self.dtype.hasobject:
            raise ValueError(
                f"record dtype {self.dtype} holds Python objects; use fixed-size fields"
            )
        if self.blob_bytes_field is not None:
            field = self.dtype.fields.get(self.blob_bytes_field) if self.dtype.fields else None
            if field is None or field[0].kind not in "ui" or field[0].shape != ():
                raise ValueError(
                    f"blob_bytes_field {self.blob_bytes_field!r} must name a scalar integer "
                    f"field of the record dtype {self.dtype}"
                )
        if self.base % CACHE_LINE_BYTES:
            raise ValueError(f"base offset {self.base} must be a multiple of {CACHE_LINE_BYTES}")

    @property
    def slot_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def tail_offset(self) -> int:
        return self.base + 1 * CACHE_LINE_BYTES

    @property
    def writer_cpu_offset(self) -> int:
        return self.tail_offset + 8

    @property
    def data_sleepers_offset(self) -> int:
        return self.base + 2 * CACHE_LINE_BYTES

    @property
    def data_futex_offset(self) -> int:
        return self.data_sleepers_offset + 8

    @property
    def space_sleepers_offset(self) -> int:
        return self.base + 3 * CACHE_LINE_BYTES

    @property
    def space_futex_offset(self) -> int:
        return self.space_sleepers_offset + 8

    @property
    def writer_party_offset(self) -> int:
        return self.base + 4 * CACHE_LINE_BYTES

    def head_offset(self, reader_index: int) -> int:
        return self.base + (5 + reader_index) * CACHE_LINE_BYTES

    def reader_party_offset(self, reader_index: int) -> int:
        return self.head_offset(reader_index) + 8

    def reader_cpu_offset(self, reader_index: int) -> int:
        return self.reader_party_offset(reader_index) + PARTY_RECORD_BYTES

    @property
    def slots_offset(self) -> int:
        return self.base + (5 + self.num_readers) * CACHE_LINE_BYTES

    @property
    def region_bytes(self) -> int:
        slots_end = self.slots_offset + self.capacity * self.slot_bytes
        return _round_up(slots_end - self.base, CACHE_LINE_BYTES)

    def _constants(self, kind: RingKind) -> list[int]:
        return [
            MAGIC,
            LAYOUT_VERSION,
            int(kind),
            self.slot_bytes,
            self.capacity,
            self.num_readers,
            dtype_hash(self.dtype, self.blob_bytes_field),
        ]

    def initialize(self, buf: memoryview, kind: RingKind) -> None:
        """Write the header constants (the counters start at zero in a fresh segment)."""
        for index, value in enumerate(self._constants(kind)):
            _atomics.store_u64(buf, self.base + 8 * index, value)

    def validate(self, buf: memoryview, kind: RingKind, ring_name: str) -> None:
        """Raise RingLayoutError unless the region at `base` holds exactly this ring."""
        names = ("magic", "layout version", "ring kind", "slot bytes", "capacity", "num_readers")
        names += ("record dtype hash",)
        expected = self._constants(kind)
        for index, (name, want) in enumerate(zip(names, expected, strict=True)):
            got = _atomics.load_u64(buf, self.base + 8 * index)
            if got != want:
                raise RingLayoutError(
                    f"ring {ring_name!r}: header {name} is {got}, expected {want}; both sides "
                    "must use the same ringllm version, ring kind, dtype and capacity"
                )

    @classmethod
    def read_shape(cls, buf: memoryview, base: int = 0) -> tuple[int, int, int]:
        """(kind, capacity, num_readers) stored in a region's header, for attaching by name."""
        magic = _atomics.load_u64(buf, base)
        if magic != MAGIC:
            raise RingLayoutError(f"segment has magic {magic:#x}, not a ringllm ring ({MAGIC:#x})")
        load = _atomics.load_u64
        return load(buf, base + 16), load(buf, base + 32), load(buf, base + 40)
