"""The reader end of a ring: wait for records, copy or view them, release their slots.

Each reader owns its `head` (the broadcast ring has one per reader) and keeps a private
copy of it; it reloads the writer's `tail` only when its cached copy says the ring is
empty, and waits for it to move with `wait_for_change` (one C call spins, then sleeps).
Releasing is the same publish as the writer's, on the other pair of wake-up words: a
writer blocked on a full ring sleeps on those. `read` copies the records out and
releases their slots in one C call (`_atomics.read_slots`).
"""

from __future__ import annotations

import functools

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.endpoint import RingEndpoint
from ringllm.ipc.errors import IpcError
from ringllm.ipc.layout import RingLayout
from ringllm.ipc.liveness import PartyRecord
from ringllm.ipc.wait import WaitPolicy, wait_for_change


class RingReader(RingEndpoint):
    """Reader `index` of a ring; make it with `Ring.reader(index)`."""

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
        self._tail_offset = layout.tail_offset
        self._head_offset = layout.head_offset(index)
        self._head = _atomics.load_u64(buf, self._head_offset)
        self._tail = self._head
        self._blob_field = layout.blob_bytes_field
        self._cpu_offset = layout.reader_cpu_offset(index)
        self._peer_cpu_offset = layout.writer_cpu_offset
        self._wait_tail = functools.partial(
            _atomics.wait_u64,
            buf,
            self._tail_offset,
            self._data_sleepers,
            self._data_futex,
            self._peer_cpu_offset,
        )
        # Copy out + release in one C call; only (head, count) change per call.
        self._read_slots = functools.partial(
            _atomics.read_slots,
            buf,
            layout.slots_offset,
            layout.slot_bytes,
            layout.capacity,
            self._head_offset,
            self._space_sleepers,
            self._space_futex,
            self._cpu_offset,
        )

    def available(self) -> int:
        """Published records not yet released by this reader."""
        self._tail = _atomics.load_u64(self._buf, self._tail_offset)
        return self._tail - self._head

    def _on_slice(self) -> None:
        self.party.stamp_heartbeat()
        if self.available() == 0:
            self.writer_party.check(self.ring_name, self._heartbeat_timeout_s)

    def wait_for_data(self, timeout_s: float | None) -> bool:
        """True once a record is available; False after `timeout_s` (0: do not wait)."""
        head = self._head
        if self._tail != head:
            return True
        if timeout_s is not None and timeout_s <= 0:
            if self.available():
                return True
            self._check_rate_limited()
            return False
        policy = self._policy
        if policy.yield_iters:
            first_s = 0.0  # the general loop below runs the yield phase
        elif timeout_s is None or timeout_s > policy.slice_s:
            first_s = policy.slice_s
        else:
            first_s = timeout_s
        # The common case in one C call: spin (unless the peer shares this CPU), then sleep
        # one slice.
        tail = self._wait_tail(head, policy.spin_s, first_s)
        if tail == head and first_s != timeout_s:
            if first_s:
                self._on_slice()
            tail = wait_for_change(
                self._wait_tail,
                head,
                None if timeout_s is None else timeout_s - first_s,
                policy,
                self._on_slice,
                spin=False,  # spun already
            )
        self._tail = tail
        return tail != head

    def release(self, num_records: int) -> None:
        """Free the next `num_records` slots for the writer."""
        self._head += num_records
        _atomics.publish_u64(
            self._buf,
            self._head_offset,
            self._head,
            self._space_sleepers,
            self._space_futex,
            self._cpu_offset,
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
        if self._blob_field is not None:
            raise ValueError(f"ring {self.ring_name!r} carries blobs: use read_with_blobs()")
        head = self._head
        if self._tail == head and not self.wait_for_data(timeout_s):
            return self._empty
        count = min(max_records, self._tail - head)
        data = self._read_slots(head, count)  # copies, then stores head + count
        self._head = head + count
        return np.frombuffer(data, self.dtype)  # writable: it owns the bytearray

    def read_with_blobs(
        self, max_records: int, timeout_s: float | None = None
    ) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """Up to `max_records` records and, aligned with them, their blobs (uint8) or None."""
        field = self._blob_field
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
                parts.append(self._copy_out(self._head, plain))
                blobs.extend([None] * plain)
                self._head += plain
                continue
            header = self._copy_out(self._head, 1)
            self._head += 1
            parts.append(header)
            blobs.append(self._gather_blob(int(header[field][0]), timeout_s))
        self.release(0)
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), blobs

    def _gather_blob(self, num_bytes: int, timeout_s: float | None) -> np.ndarray:
        blob = np.empty(num_bytes, np.uint8)
        done_bytes = 0
        while done_bytes < num_bytes:
            if self._tail == self._head and not self.available():
                self.release(0)  # hand the copied slots back: the writer may be waiting
                if not self.wait_for_data(timeout_s):
                    raise IpcError(
                        f"ring {self.ring_name!r}: blob incomplete after {timeout_s} s "
                        f"({done_bytes} of {num_bytes} bytes); its writer stalled mid-blob"
                    )
            start = self._head % self.capacity
            want_slots = -(-(num_bytes - done_bytes) // self._slot_bytes)
            count = min(self._tail - self._head, self.capacity - start, want_slots)
            chunk_bytes = min(count * self._slot_bytes, num_bytes - done_bytes)
            begin = start * self._slot_bytes
            blob[done_bytes : done_bytes + chunk_bytes] = self._bytes[begin : begin + chunk_bytes]
            done_bytes += chunk_bytes
            self._head += count
        return blob

    def close(self) -> None:
        """Stop reading: a writer waiting for this reader gets PeerClosedError."""
        if self._slots is None:
            return
        self.party.mark_closed()
        self.release(0)  # wake a writer waiting for space so it sees CLOSED now
        self._drop_views()
