"""The writer end of a ring: reserve or copy, then publish with one release store.

The writer is the only process that stores `tail`, so it keeps its own copy and never
reads it back; it caches the slowest reader's head and reloads it only when the cached
value says the ring lacks room. Publishing is the release store of `tail`, a fence, and
a futex wake only when a reader announced that it sleeps (see wait.py), so a busy reader
costs the writer no system call. `write` and `write_bytes` copy the records in and
publish them in one C call (`_atomics.write_slots`).
"""

from __future__ import annotations

import functools
import struct

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.endpoint import RingEndpoint
from ringllm.ipc.errors import RingFullError
from ringllm.ipc.layout import RingLayout
from ringllm.ipc.liveness import PartyRecord
from ringllm.ipc.wait import WaitPolicy, wait_until

DEFAULT_FULL_TIMEOUT_S = 10.0
_INT_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}


def _int_struct_code(field_type: np.dtype) -> str:
    """The struct code of an integer field (layout.py checked that it is one)."""
    code = _INT_CODES[field_type.itemsize]
    return (">" if field_type.byteorder == ">" else "<") + (
        code.upper() if field_type.kind == "u" else code
    )


class RingWriter(RingEndpoint):
    """The one writer of a ring; make it with `Ring.writer()` or `MpscRing.producer()`."""

    def __init__(
        self,
        buf: memoryview,
        layout: RingLayout,
        ring_name: str,
        policy: WaitPolicy,
        full_timeout_s: float = DEFAULT_FULL_TIMEOUT_S,
        heartbeat_timeout_s: float | None = None,
        data_wait_offsets: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(buf, layout, ring_name, policy, heartbeat_timeout_s, data_wait_offsets)
        self.full_timeout_s = full_timeout_s
        self.party = PartyRecord(buf, layout.writer_party_offset, "writer")
        self.producer_index: int | None = None  # set by MpscRing.producer()
        self._tail_offset = layout.tail_offset
        self._head_offsets = [layout.head_offset(i) for i in range(layout.num_readers)]
        self._reader_parties = [
            PartyRecord(buf, layout.reader_party_offset(i), f"reader {i}")
            for i in range(layout.num_readers)
        ]
        self._tail = _atomics.load_u64(buf, layout.tail_offset)
        self._head_min = self._load_head_min()
        self._has_blobs = layout.blob_bytes_field is not None
        # Copy in + publish in one C call; only (tail, data) change per call.
        self._write_slots = functools.partial(
            _atomics.write_slots,
            buf,
            layout.slots_offset,
            layout.slot_bytes,
            layout.capacity,
            self._tail_offset,
            self._data_sleepers,
            self._data_futex,
            layout.writer_cpu_offset,
        )
        self._cpu_offset = layout.writer_cpu_offset

    # -- space -----------------------------------------------------------------------
    def _load_head_min(self) -> int:
        load, buf = _atomics.load_u64, self._buf
        return min(load(buf, offset) for offset in self._head_offsets)

    def free_slots(self) -> int:
        self._head_min = self._load_head_min()
        return self.capacity - (self._tail - self._head_min)

    def slots_for(self, num_records: int, blob_nbytes: int = 0) -> int:
        """Slots that `num_records` plain records take, or (blob_nbytes > 0) one record
        and its blob."""
        if blob_nbytes:
            return 1 + -(-blob_nbytes // self._slot_bytes)
        return num_records

    def has_room(self, num_slots: int) -> bool:
        """True when `num_slots` slots are free now, so that a write of that size returns
        without waiting: for a caller that must never block on a slow reader (it keeps
        what does not fit, and checks the reader with `check_readers`)."""
        if self.capacity - (self._tail - self._head_min) >= num_slots:
            return True
        return self.free_slots() >= num_slots

    def check_readers(self) -> None:
        """PeerDeadError / PeerClosedError when a reader died or closed the ring."""
        for party in self._reader_parties:
            party.check(self.ring_name, self._heartbeat_timeout_s)

    def _on_slice(self) -> None:
        self.party.stamp_heartbeat()
        for party in self._reader_parties:
            party.check(self.ring_name, self._heartbeat_timeout_s)

    def _free_at_least(self, wanted: int, timeout_s: float | None, num_written: int) -> int:
        """Free slots, waiting until there is at least one; up to date if below `wanted`."""
        free = self.capacity - (self._tail - self._head_min)
        if free < wanted:
            free = self.free_slots()  # the cached head may be stale: look again
            if free < 1:
                free = self._wait_for_space(1, timeout_s, num_written)
        return free

    def _wait_for_space(self, min_free: int, timeout_s: float | None, num_written: int) -> int:
        """Free slot count once it is >= min_free; RingFullError after the timeout."""
        free = self.free_slots()
        if free >= min_free:
            return free
        timeout_s = self.full_timeout_s if timeout_s is None else timeout_s
        ready = lambda: self.free_slots() >= min_free  # noqa: E731
        if not wait_until(
            ready,
            self._buf,
            self._space_sleepers,
            self._space_futex,
            timeout_s,
            self._policy,
            self._on_slice,
        ):
            self._on_slice()  # a dead reader is the better explanation than "full"
            raise RingFullError(
                f"ring {self.ring_name!r} stayed full for {timeout_s:.3g} s (capacity "
                f"{self.capacity} records, needed {min_free} free); its reader is not keeping "
                f"up. {num_written} records of this call were written; retry the rest, or "
                "make the ring larger",
                num_written=num_written,
            )
        return self.free_slots()

    # -- publishing ------------------------------------------------------------------
    def publish(self, num_records: int) -> None:
        """Make the next `num_records` filled slots visible to readers (one release store)."""
        self._tail += num_records
        _atomics.publish_u64(
            self._buf,
            self._tail_offset,
            self._tail,
            self._data_sleepers,
            self._data_futex,
            self._cpu_offset,
        )

    def reserve(self, max_records: int, timeout_s: float | None = None) -> np.ndarray:
        """A view of 1..max_records free contiguous slots to fill before `publish`.

        The view stops at the end of the slot array; call again after publishing for the
        slots that wrap to the front. Waits (up to the timeout) while the ring is full.
        """
        free = self._free_at_least(max_records, timeout_s, 0)
        start = self._tail % self.capacity
        return self._slots[start : start + min(max_records, free, self.capacity - start)]

    def write(self, records: np.ndarray, timeout_s: float | None = None) -> None:
        """Copy `records` into the ring and publish them; waits while the ring is full.

        A batch larger than the free space is published in pieces as readers free slots.
        """
        if (
            records.dtype is not self.dtype and records.dtype != self.dtype
        ):  # `is`: 20 ns, `!=`: 0.5 us
            raise ValueError(
                f"ring {self.ring_name!r} holds {self.dtype}, got records of {records.dtype}"
            )
        if records.ndim != 1 or not records.flags.c_contiguous:
            records = np.ascontiguousarray(records).reshape(-1)
        field = self._layout.blob_bytes_field
        if field is not None and records[field].any():
            raise ValueError(
                f"ring {self.ring_name!r}: plain records must carry 0 in {field!r} "
                "(it announces a blob); use write_with_blob()"
            )
        self._write_bytes(records, len(records), timeout_s)

    def write_bytes(self, data, timeout_s: float | None = None) -> None:
        """Write records already encoded as bytes (whole records of the ring's dtype).

        The fast path for a caller that packs its records itself (`struct.Struct.pack`
        of a format equal to the dtype): no numpy array is made on the way in.
        """
        num_records, rest = divmod(len(data), self._slot_bytes)
        if rest or self._has_blobs:
            self._refuse_bytes(data)
        if self.capacity - (self._tail - self._head_min) >= num_records:  # the common case
            self._tail = self._write_slots(self._tail, data)
            return
        self._write_bytes(data, num_records, timeout_s)

    def _refuse_bytes(self, data) -> None:
        if self._has_blobs:
            raise ValueError(
                f"ring {self.ring_name!r} carries blobs: use write() or write_with_blob(), "
                "which check the blob field"
            )
        raise ValueError(
            f"ring {self.ring_name!r}: write_bytes takes bytes of whole "
            f"{self._slot_bytes}-byte records, got {type(data).__name__} of {len(data)} bytes"
        )

    def _write_bytes(self, data, num_records: int, timeout_s: float | None) -> None:
        if self.capacity - (self._tail - self._head_min) >= num_records:  # the common case
            self._tail = self._write_slots(self._tail, data)
            return
        source = data.view(np.uint8) if isinstance(data, np.ndarray) else memoryview(data)
        done = 0
        while done < num_records:
            free = self._free_at_least(num_records - done, timeout_s, done)
            count = min(free, num_records - done)
            chunk = source[done * self._slot_bytes : (done + count) * self._slot_bytes]
            self._tail = self._write_slots(self._tail, chunk)
            done += count

    def write_with_blob(
        self, record: np.ndarray, blob: np.ndarray, timeout_s: float | None = None
    ) -> None:
        """Write one record followed by the bytes of `blob` in continuation slots.

        A blob that fits the ring is written all at once or not at all; a larger one is
        streamed as the reader frees slots (a timeout then leaves it half-sent: close the
        ring).
        """
        field = self._layout.blob_bytes_field
        if field is None:
            raise ValueError(f"ring {self.ring_name!r} was made without blob_bytes_field")
        # NOTE: bytes, not a numpy record: copying or converting one structured record
        # costs numpy 4 us (field by field); tobytes() is a memcpy.
        if isinstance(record, np.ndarray) and record.dtype is self.dtype and record.size == 1:
            header_bytes = bytearray(record.tobytes())
        else:
            header_bytes = bytearray(np.array(record, dtype=self.dtype).reshape(1).tobytes())
        payload = np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
        field_type, field_offset = self.dtype.fields[field][:2]
        try:
            struct.pack_into(
                _int_struct_code(field_type), header_bytes, field_offset, payload.nbytes
            )
        except struct.error:
            raise ValueError(
                f"blob of {payload.nbytes} bytes does not fit field {field!r} ({field_type})"
            ) from None
        total_slots = 1 + -(-payload.nbytes // self._slot_bytes)
        if total_slots <= self.capacity - (self._tail - self._head_min):  # the common case
            padding = bytes((total_slots - 1) * self._slot_bytes - payload.nbytes)
            data = b"".join((header_bytes, payload.tobytes(), padding))
            self._tail = self._write_slots(self._tail, data)  # one copy, one publish
            return
        header = np.frombuffer(header_bytes, self.dtype)
        self._wait_for_space(min(total_slots, self.capacity), timeout_s, 0)
        self._copy_in(self._tail, header)
        pending = 1  # copied, not yet published: goes out with the first bytes
        sent_bytes = 0
        while sent_bytes < payload.nbytes:
            free = self.capacity - (self._tail + pending - self._head_min)
            if free < 1:
                self.publish(pending)
                pending = 0
                free = self._wait_for_space(1, timeout_s, 0)
            num_bytes, num_slots = self._copy_blob_chunk(
                self._tail + pending, payload[sent_bytes:], free
            )
            sent_bytes += num_bytes
            pending += num_slots
        self.publish(pending)

    def _copy_blob_chunk(
        self, first_record: int, remaining: np.ndarray, free: int
    ) -> tuple[int, int]:
        """Copy what fits contiguously of `remaining`; return (bytes, slots) used."""
        start = first_record % self.capacity
        count = min(free, self.capacity - start, -(-remaining.nbytes // self._slot_bytes))
        num_bytes = min(count * self._slot_bytes, remaining.nbytes)
        begin = start * self._slot_bytes
        self._bytes[begin : begin + num_bytes] = remaining[:num_bytes]
        return num_bytes, count

    def close(self) -> None:
        """Tell readers nothing more will come (they drain what is there first)."""
        if self._slots is None:
            return
        self.party.mark_closed()
        self.publish(0)  # wake sleeping readers so they see CLOSED now
        self._drop_views()
