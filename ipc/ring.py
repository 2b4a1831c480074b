"""Shared-memory rings of fixed-layout records: one writer, one or N readers.

`Ring.create` makes a segment holding one ring region (layout.py); the writer and each
reader are endpoints (`RingWriter`, `RingReader`) that any process attaches by name:

    SPSC       num_readers=1
    broadcast  num_readers=N: every reader sees every record; each reader has its own
               head and the writer waits for the slowest one (min over heads)

Writer: `write(records)` copies with wrap-around and publishes the whole batch with one
8-byte release store of `tail`; or `reserve(n)` -> a view of free slots, fill it,
`publish(k)`. Reader: `read(max_n)` copies records out and advances `head`; or
`peek(max_n)` -> a view, then `release(k)`. A full ring is backpressure: the writer
waits (spin, yield, futex; wait.py) up to its timeout, then raises `RingFullError`
naming the ring and its capacity. Nothing is dropped or overwritten.

Blobs (a prompt of 100k token ids does not fit a slot): when the ring is made with
`blob_bytes_field`, `write_with_blob(record, blob)` sets that field to the blob's byte
count and streams the bytes through the slots that follow the record:

    ... | record (blob_bytes=N) | N bytes in ceil(N / slot_bytes) continuation slots | ...

The reader (`read_with_blobs`) recognises the header by the non-zero field and gathers
the bytes, releasing slots as it copies, so a blob may be larger than the whole ring.
Plain records must carry 0 in that field.

Liveness: an endpoint that waits wakes at least every `WaitPolicy.slice_s` (100 ms),
stamps its heartbeat and checks its peers (liveness.py); a dead peer becomes
`PeerDeadError`, a peer that closed becomes `PeerClosedError` once nothing is left to read.
"""

from __future__ import annotations

import time

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.errors import IpcError, RingFullError
from ringllm.ipc.layout import RingKind, RingLayout
from ringllm.ipc.liveness import PartyRecord
from ringllm.ipc.shm import Segment
from ringllm.ipc.wait import WaitPolicy, wait_until

DEFAULT_FULL_TIMEOUT_S = 10.0


class _Endpoint:
    """State shared by writer and reader: the slot views and the wake-up words."""

    def __init__(
        self,
        buf: memoryview,
        layout: RingLayout,
        ring_name: str,
        policy: WaitPolicy,
        heartbeat_timeout_s: float | None,
        data_wait_offsets: tuple[int, int] | None,
    ) -> None:
        self._buf = buf
        self._layout = layout
        self.ring_name = ring_name
        self.capacity = layout.capacity
        self.dtype = layout.dtype
        self._policy = policy
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._slots = np.ndarray((layout.capacity,), layout.dtype, buf, layout.slots_offset)
        self._raw = self._slots.view(np.uint8).reshape(layout.capacity, layout.slot_bytes)
        self._empty = np.empty(0, layout.dtype)
        self._data_wait = data_wait_offsets or (
            layout.data_sleepers_offset,
            layout.data_futex_offset,
        )
        self._space_wait = (layout.space_sleepers_offset, layout.space_futex_offset)
        self._last_check_ns = 0

    def _check_rate_limited(self) -> None:
        """Run the liveness check at most once per wait slice (for non-blocking polls)."""
        now_ns = time.monotonic_ns()
        if now_ns - self._last_check_ns >= self._policy.slice_s * 1e9:
            self._last_check_ns = now_ns
            self._on_slice()

    def _on_slice(self) -> None:
        raise NotImplementedError

    def _drop_views(self) -> None:
        self._slots = self._raw = None  # type: ignore[assignment]


class RingWriter(_Endpoint):
    """The one writer of a ring; create it through `Ring.writer()` or `MpscRing.producer()`."""

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
        self._head_offsets = [layout.head_offset(i) for i in range(layout.num_readers)]
        self._reader_parties = [
            PartyRecord(buf, layout.reader_party_offset(i), f"reader {i}")
            for i in range(layout.num_readers)
        ]
        self._tail = _atomics.load_u64(buf, layout.tail_offset)
        self._head_min = self._load_head_min()

    # -- space -----------------------------------------------------------------------
    def _load_head_min(self) -> int:
        load, buf = _atomics.load_u64, self._buf
        return min(load(buf, offset) for offset in self._head_offsets)

    def free_slots(self) -> int:
        self._head_min = self._load_head_min()
        return self.capacity - (self._tail - self._head_min)

    def _on_slice(self) -> None:
        self.party.stamp_heartbeat()
        for party in self._reader_parties:
            party.check(self.ring_name, self._heartbeat_timeout_s)

    def _wait_for_space(self, min_free: int, timeout_s: float | None, num_written: int) -> int:
        """Free slot count once it is >= min_free; RingFullError after the timeout."""
        free = self.free_slots()
        if free >= min_free:
            return free
        timeout_s = self.full_timeout_s if timeout_s is None else timeout_s
        ready = lambda: self.free_slots() >= min_free  # noqa: E731
        sleepers_offset, futex_offset = self._space_wait
        if not wait_until(
            ready, self._buf, sleepers_offset, futex_offset, timeout_s, self._policy, self._on_slice
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
            self._buf, self._layout.tail_offset, self._tail, self._data_wait[0], self._data_wait[1]
        )

    def reserve(self, max_records: int, timeout_s: float | None = None) -> np.ndarray:
        """A view of 1..max_records free contiguous slots to fill before `publish`.

        The view stops at the end of the slot array; call again after publishing for the
        slots that wrap to the front.
        """
        free = self.capacity - (self._tail - self._head_min)
        if free < max_records:
            free = self.free_slots()  # the cached head may be stale: look again
            if free < 1:
                free = self._wait_for_space(1, timeout_s, 0)
        start = self._tail % self.capacity
        return self._slots[start : start + min(max_records, free, self.capacity - start)]

    def write(self, records: np.ndarray, timeout_s: float | None = None) -> None:
        """Copy `records` into the ring and publish them; waits while the ring is full.

        A batch larger than the free space is published in pieces as readers free slots.
        """
        if records.dtype != self.dtype:
            raise ValueError(
                f"ring {self.ring_name!r} holds {self.dtype}, got records of {records.dtype}"
            )
        if records.ndim == 0:
            records = records.reshape(1)
        field = self._layout.blob_bytes_field
        if field is not None and records[field].any():
            raise ValueError(
                f"ring {self.ring_name!r}: plain records must carry 0 in {field!r} "
                "(it announces a blob); use write_with_blob()"
            )
        num_records, done = len(records), 0
        while done < num_records:
            free = self.capacity - (self._tail - self._head_min)
            if free < num_records - done:
                free = self.free_slots()
                if free < 1:
                    free = self._wait_for_space(1, timeout_s, done)
            count = min(free, num_records - done)
            self._copy_in(records[done : done + count])
            self.publish(count)
            done += count

    def _copy_in(self, records: np.ndarray) -> None:
        start, count = self._tail % self.capacity, len(records)
        first = min(count, self.capacity - start)
        self._slots[start : start + first] = records[:first]
        if first < count:
            self._slots[: count - first] = records[first:]

    def write_with_blob(
        self, record: np.ndarray, blob: np.ndarray, timeout_s: float | None = None
    ) -> None:
        """Write one record followed by the bytes of `blob` in continuation slots."""
        field = self._layout.blob_bytes_field
        if field is None:
            raise ValueError(f"ring {self.ring_name!r} was made without blob_bytes_field")
        header = np.array(record, dtype=self.dtype).reshape(1)
        payload = np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
        header[field] = payload.nbytes
        if header[field][0] != payload.nbytes:
            raise ValueError(f"blob of {payload.nbytes} bytes does not fit field {field!r}")
        slot_bytes = self._layout.slot_bytes
        total_slots = 1 + -(-payload.nbytes // slot_bytes)
        # All or nothing when it fits: a timeout then leaves no half-written blob behind.
        self._wait_for_space(min(total_slots, self.capacity), timeout_s, 0)
        self._copy_in(header)
        self._tail += 1  # published together with the first chunk of bytes
        sent_bytes, pending = 0, 1
        while sent_bytes < payload.nbytes:
            free = self.capacity - (self._tail - self._head_min)
            if free < 1:
                self._tail -= pending
                self.publish(pending)
                pending = 0
                free = self._wait_for_space(1, timeout_s, 0)
            start = self._tail % self.capacity
            count = min(
                free, self.capacity - start, -(-(payload.nbytes - sent_bytes) // slot_bytes)
            )
            chunk = payload[sent_bytes : sent_bytes + count * slot_bytes]
            self._raw[start : start + count].reshape(-1)[: chunk.nbytes] = chunk
            sent_bytes += chunk.nbytes
            self._tail += count
            pending += count
        self._tail -= pending
        self.publish(pending)

    def close(self) -> None:
        """Tell readers nothing more will come (they drain what is there first)."""
        if self._slots is None:
            return
        self.party.mark_closed()
        self.publish(0)  # wake sleeping readers so they see CLOSED now
        self._drop_views()


class RingReader(_Endpoint):
    """Reader `index` of a ring; create it through `Ring.reader(index)`."""

    def __init__(
        self,
        buf: memoryview,
        layout: RingLayout,
        ring_name: str,
        policy: WaitPolicy,
        index: int = 0,
        heartbeat_timeout_s: float | None = None,
        data_wait_offsets: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(buf, layout, ring_name, policy, heartbeat_timeout_s, data_wait_offsets)
        if not 0 <= index < layout.num_readers:
            raise ValueError(
                f"reader index {index} out of range: ring {ring_name!r} has "
                f"{layout.num_readers} readers"
            )
        self.index = index
        self.party = PartyRecord(buf, layout.reader_party_offset(index), f"reader {index}")
        self.writer_party = PartyRecord(buf, layout.writer_party_offset, "writer")
        self._head_offset = layout.head_offset(index)
        self._head = _atomics.load_u64(buf, self._head_offset)
        self._tail = self._head

    def available(self) -> int:
        """Published records not yet released by this reader."""
        self._tail = _atomics.load_u64(self._buf, self._layout.tail_offset)
        return self._tail - self._head

    def _on_slice(self) -> None:
        self.party.stamp_heartbeat()
        if self.available() == 0:
            self.writer_party.check(self.ring_name, self._heartbeat_timeout_s)

    def wait_for_data(self, timeout_s: float | None) -> bool:
        """True once a record is available; False after `timeout_s` (0: do not wait)."""
        if self._tail != self._head or self.available():
            return True
        if timeout_s == 0:
            self._check_rate_limited()
            return False
        sleepers_offset, futex_offset = self._data_wait
        return wait_until(
            self.available,
            self._buf,
            sleepers_offset,
            futex_offset,
            timeout_s,
            self._policy,
            self._on_slice,
        )

    def release(self, num_records: int) -> None:
        """Free the next `num_records` slots for the writer."""
        self._head += num_records
        sleepers_offset, futex_offset = self._space_wait
        _atomics.publish_u64(
            self._buf, self._head_offset, self._head, sleepers_offset, futex_offset
        )

    def peek(self, max_records: int, timeout_s: float | None = 0) -> np.ndarray:
        """A view of up to `max_records` unread records (contiguous; may be fewer)."""
        if not self.wait_for_data(timeout_s):
            return self._empty
        start = self._head % self.capacity
        count = min(max_records, self._tail - self._head, self.capacity - start)
        return self._slots[start : start + count]

    def read(self, max_records: int, timeout_s: float | None = None) -> np.ndarray:
        """Copy out and release up to `max_records` records; empty after `timeout_s`."""
        if self._layout.blob_bytes_field is not None:
            raise ValueError(f"ring {self.ring_name!r} carries blobs: use read_with_blobs()")
        if not self.wait_for_data(timeout_s):
            return self._empty
        count = min(max_records, self._tail - self._head)
        records = self._copy_out(count)
        self.release(count)
        return records

    def _copy_out(self, count: int) -> np.ndarray:
        start = self._head % self.capacity
        first = min(count, self.capacity - start)
        if first == count:
            return self._slots[start : start + count].copy()
        records = np.empty(count, self.dtype)
        records[:first] = self._slots[start:]
        records[first:] = self._slots[: count - first]
        return records

    def read_with_blobs(
        self, max_records: int, timeout_s: float | None = None
    ) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """Up to `max_records` records and, aligned with them, their blobs (uint8) or None."""
        field = self._layout.blob_bytes_field
        if field is None:
            raise ValueError(f"ring {self.ring_name!r} was made without blob_bytes_field")
        if not self.wait_for_data(timeout_s):
            return self._empty, []
        parts: list[np.ndarray] = []
        blobs: list[np.ndarray | None] = []
        while len(blobs) < max_records and self.available():
            start = self._head % self.capacity
            count = min(self._tail - self._head, self.capacity - start, max_records - len(blobs))
            blob_headers = np.flatnonzero(self._slots[field][start : start + count])
            plain = count if blob_headers.size == 0 else int(blob_headers[0])
            if plain:
                parts.append(self._slots[start : start + plain].copy())
                blobs.extend([None] * plain)
                self._head += plain
                continue
            header = self._slots[start : start + 1].copy()
            self._head += 1
            parts.append(header)
            blobs.append(self._gather_blob(int(header[field][0]), timeout_s))
        self.release(0)
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), blobs

    def _gather_blob(self, num_bytes: int, timeout_s: float | None) -> np.ndarray:
        blob = np.empty(num_bytes, np.uint8)
        slot_bytes, done_bytes = self._layout.slot_bytes, 0
        while done_bytes < num_bytes:
            if self._tail == self._head and not self.available():
                self.release(0)  # hand the copied slots back: the writer may be waiting
                if not self.wait_for_data(timeout_s):
                    raise IpcError(
                        f"ring {self.ring_name!r}: blob incomplete after {timeout_s} s "
                        f"({done_bytes} of {num_bytes} bytes); its writer stalled mid-blob"
                    )
            start = self._head % self.capacity
            want_slots = -(-(num_bytes - done_bytes) // slot_bytes)
            count = min(self._tail - self._head, self.capacity - start, want_slots)
            chunk_bytes = min(count * slot_bytes, num_bytes - done_bytes)
            blob[done_bytes : done_bytes + chunk_bytes] = self._raw[start : start + count].reshape(
                -1
            )[:chunk_bytes]
            done_bytes += chunk_bytes
            self._head += count
        return blob

    def close(self) -> None:
        """Stop reading: the writer no longer waits for this reader (it gets PeerClosedError)."""
        if self._slots is None:
            return
        self.party.mark_closed()
        self.release(0)  # wake a writer waiting for space so it sees CLOSED now
        self._drop_views()


class Ring:
    """A ring in a segment of its own: SPSC (num_readers=1) or broadcast (num_readers=N)."""

    def __init__(self, segment: Segment, layout: RingLayout, policy: WaitPolicy) -> None:
        self.segment = segment
        self.layout = layout
        self.policy = policy
        self._endpoints: list[_Endpoint] = []

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(
        cls,
        kind: str,
        dtype: np.dtype,
        capacity: int,
        num_readers: int = 1,
        blob_bytes_field: str | None = None,
        policy: WaitPolicy | None = None,
    ) -> Ring:
        """Make the segment (owned by this process); `kind` becomes part of its name."""
        layout = RingLayout(dtype, capacity, num_readers, blob_bytes_field)
        segment = Segment.create(kind, layout.region_bytes)
        layout.initialize(segment.buf, _ring_kind(num_readers))
        return cls(segment, layout, policy or WaitPolicy())

    @classmethod
    def attach(
        cls,
        name: str,
        dtype: np.dtype,
        blob_bytes_field: str | None = None,
        policy: WaitPolicy | None = None,
    ) -> Ring:
        """Map the ring a peer created; capacity and reader count come from its header."""
        segment = Segment.attach(name)
        try:
            _, capacity, num_readers = RingLayout.read_shape(segment.buf)
            layout = RingLayout(dtype, capacity, num_readers, blob_bytes_field)
            layout.validate(segment.buf, _ring_kind(num_readers), name)
        except BaseException:
            segment.close()
            raise
        return cls(segment, layout, policy or WaitPolicy())

    def writer(
        self,
        full_timeout_s: float = DEFAULT_FULL_TIMEOUT_S,
        heartbeat_timeout_s: float | None = None,
    ) -> RingWriter:
        writer = RingWriter(
            self.segment.buf,
            self.layout,
            self.name,
            self.policy,
            full_timeout_s,
            heartbeat_timeout_s,
        )
        writer.party.register()
        self._endpoints.append(writer)
        return writer

    def reader(self, index: int = 0, heartbeat_timeout_s: float | None = None) -> RingReader:
        reader = RingReader(
            self.segment.buf, self.layout, self.name, self.policy, index, heartbeat_timeout_s
        )
        reader.party.register()
        self._endpoints.append(reader)
        return reader

    def close(self) -> None:
        """Close this process's endpoints and unmap; the creator also unlinks the segment."""
        for endpoint in self._endpoints:
            endpoint.close()
        self._endpoints.clear()
        self.segment.close()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _ring_kind(num_readers: int) -> RingKind:
    return RingKind.SPSC if num_readers == 1 else RingKind.BROADCAST
