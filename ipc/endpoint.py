"""What a ring's writer and readers share: the slot views, the copies, the wake-up words.

Records are copied in and out as raw bytes (`_bytes`, a flat uint8 view of the slots):
numpy copies a structured dtype with sub-array fields field by field, several times
slower than the memcpy a byte copy is. The record layout is fixed by the dtype, so the
bytes are the record.
"""

from __future__ import annotations

import time

import numpy as np

from ringllm.ipc.layout import RingLayout
from ringllm.ipc.wait import WaitPolicy


class RingEndpoint:
    """Base of `RingWriter` and `RingReader`: one ring region seen from one process."""

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
        self._slot_bytes = layout.slot_bytes
        self._policy = policy
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._slots = np.ndarray((layout.capacity,), layout.dtype, buf, layout.slots_offset)
        self._bytes = self._slots.view(np.uint8)
        self._empty = np.empty(0, layout.dtype)
        self._data_sleepers, self._data_futex = data_wait_offsets or (
            layout.data_sleepers_offset,
            layout.data_futex_offset,
        )
        self._space_sleepers = layout.space_sleepers_offset
        self._space_futex = layout.space_futex_offset
        self._last_check_ns = 0

    def _copy_in(self, first_record: int, records: np.ndarray) -> None:
        """Copy contiguous `records` into the slots of record numbers first_record, ... (wraps)."""
        slot_bytes = self._slot_bytes
        start, count = first_record % self.capacity, len(records)
        source = records.view(np.uint8)
        if start + count <= self.capacity:
            self._bytes[start * slot_bytes : (start + count) * slot_bytes] = source
            return
        split_byte = (self.capacity - start) * slot_bytes
        self._bytes[start * slot_bytes :] = source[:split_byte]
        self._bytes[: count * slot_bytes - split_byte] = source[split_byte:]

    def _copy_out(self, first_record: int, count: int) -> np.ndarray:
        """A private copy of `count` records starting at record number `first_record`."""
        start = first_record % self.capacity
        first = min(count, self.capacity - start)
        begin = start * self._slot_bytes
        data = bytearray(self._bytes[begin : begin + first * self._slot_bytes])
        if first < count:
            data += memoryview(self._bytes[: (count - first) * self._slot_bytes])
        return np.frombuffer(data, self.dtype)  # writable: it owns the bytearray

    def _check_rate_limited(self) -> None:
        """Run the liveness check at most once per wait slice (for non-blocking polls)."""
        now_ns = time.monotonic_ns()
        if now_ns - self._last_check_ns >= self._policy.slice_s * 1e9:
            self._last_check_ns = now_ns
            self._on_slice()

    def _on_slice(self) -> None:
        raise NotImplementedError

    def _drop_views(self) -> None:
        self._slots = self._bytes = None  # type: ignore[assignment]
