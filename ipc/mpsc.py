"""Many producers -> one consumer: one SPSC ring per producer, one futex word to sleep on.

Front ends (producers) send requests to the engine core (the consumer). Each producer
claims its own SPSC sub-ring, so producers never contend on a shared tail (no CAS loop
on the hot path, and a batch is still published by one store); the consumer sleeps on a
single futex word in the segment header that every producer's publish wakes.

    segment (created by the consumer)
    +-------------------------------------------------------------------------+
    | line 0  magic | version | MPSC | max_producers | capacity | slot_bytes  |
    |         | dtype_hash                                                    |
    | line 1  data_sleepers | data_futex | producers_epoch   <- consumer sleeps|
    | line 2  consumer party record (pid, start, heartbeat, state)            |
    +-------------------------------------------------------------------------+
    | sub-ring 0: SPSC region (layout.py); its writer party record is the     |
    |   directory entry of producer 0: ABSENT = free, ATTACHED, CLOSED        |
    | sub-ring 1 ...                                                          |
    | sub-ring max_producers-1                                                |
    +-------------------------------------------------------------------------+

A producer claims the first ABSENT entry with a compare-and-swap, registers its pid and
bumps `producers_epoch`, which tells a waiting consumer to rescan the directory. Records
of one producer arrive in order; across producers the consumer reads round-robin.

A producer that closes is drained, then its entry is freed. A producer that dies has its
unread records discarded (nobody is left to answer them) and its entry freed. Either way
the consumer reports the index through `take_departed()`, so the engine can abort that
front end's requests. A freed entry may be claimed again at once by a new producer; the
consumer delivers nothing from an entry in the read call that freed it, so a caller that
takes departures after each read always sees a departure before the records of the
producer that reuses the entry. A dead consumer is a `PeerDeadError` for every producer.
"""

from __future__ import annotations

import time

import numpy as np

from ringllm.ipc import _atomics
from ringllm.ipc.errors import IpcError, PeerClosedError, PeerDeadError, RingLayoutError
from ringllm.ipc.layout import CACHE_LINE_BYTES, LAYOUT_VERSION, MAGIC, RingKind, RingLayout
from ringllm.ipc.layout import dtype_hash as compute_dtype_hash
from ringllm.ipc.liveness import PartyRecord, PartyState
from ringllm.ipc.reader import RingReader
from ringllm.ipc.shm import Segment
from ringllm.ipc.wait import WaitPolicy, wait_until
from ringllm.ipc.writer import DEFAULT_FULL_TIMEOUT_S, RingWriter

MAX_PRODUCERS = 256
_SLEEPERS = CACHE_LINE_BYTES
_FUTEX = CACHE_LINE_BYTES + 8
_EPOCH = CACHE_LINE_BYTES + 16
_CONSUMER_PARTY = 2 * CACHE_LINE_BYTES
_SUB_RINGS = 3 * CACHE_LINE_BYTES


class MpscRing:
    """The segment of a many-producer ring; make endpoints with `consumer()` / `producer()`."""

    def __init__(
        self,
        segment: Segment,
        dtype: np.dtype,
        capacity: int,
        max_producers: int,
        blob_bytes_field: str | None,
        policy: WaitPolicy,
    ) -> None:
        self.segment = segment
        self.max_producers = max_producers
        self.policy = policy
        first = RingLayout(dtype, capacity, 1, blob_bytes_field, _SUB_RINGS)
        self.layouts = [
            RingLayout(dtype, capacity, 1, blob_bytes_field, _SUB_RINGS + i * first.region_bytes)
            for i in range(max_producers)
        ]
        self._endpoints: list[MpscConsumer | RingWriter] = []

    @property
    def name(self) -> str:
        return self.segment.name

    def _constants(self) -> list[int]:
        layout = self.layouts[0]
        hash_value = compute_dtype_hash(layout.dtype, layout.blob_bytes_field)
        return [
            MAGIC,
            LAYOUT_VERSION,
            RingKind.MPSC,
            self.max_producers,
            layout.capacity,
            layout.slot_bytes,
            hash_value,
        ]

    @staticmethod
    def _segment_bytes(layout: RingLayout, max_producers: int) -> int:
        return _SUB_RINGS + max_producers * layout.region_bytes

    @classmethod
    def create(
        cls,
        kind: str,
        dtype: np.dtype,
        capacity: int,
        max_producers: int,
        blob_bytes_field: str | None = None,
        policy: WaitPolicy | None = None,
    ) -> MpscRing:
        """Make the segment (owned by this process, normally the consumer's)."""
        if not 1 <= max_producers <= MAX_PRODUCERS:
            raise ValueError(f"max_producers must be in [1, {MAX_PRODUCERS}], got {max_producers}")
        layout = RingLayout(dtype, capacity, 1, blob_bytes_field, _SUB_RINGS)
        segment = Segment.create(kind, cls._segment_bytes(layout, max_producers))
        ring = cls(
            segment, dtype, capacity, max_producers, blob_bytes_field, policy or WaitPolicy()
        )
        for index, value in enumerate(ring._constants()):
            _atomics.store_u64(segment.buf, 8 * index, value)
        for sub_layout in ring.layouts:
            sub_layout.initialize(segment.buf, RingKind.SPSC)
        return ring

    @classmethod
    def attach(
        cls,
        name: str,
        dtype: np.dtype,
        blob_bytes_field: str | None = None,
        policy: WaitPolicy | None = None,
    ) -> MpscRing:
        """Map a consumer's ring by name; capacity and producer count come from its header."""
        segment = Segment.attach(name)
        try:
            load = _atomics.load_u64
            if load(segment.buf, 0) != MAGIC or load(segment.buf, 16) != RingKind.MPSC:
                raise RingLayoutError(f"segment {name!r} does not hold a ringllm MPSC ring")
            max_producers, capacity = load(segment.buf, 24), load(segment.buf, 32)
            ring = cls(
                segment, dtype, capacity, max_producers, blob_bytes_field, policy or WaitPolicy()
            )
            for index, want in enumerate(ring._constants()):
                got = load(segment.buf, 8 * index)
                if got != want:
                    raise RingLayoutError(
                        f"MPSC ring {name!r}: header word {index} is {got}, "
                        f"expected {want}; both sides must use the same version and record dtype"
                    )
        except BaseException:
            segment.close()
            raise
        return ring

    def consumer(self, heartbeat_timeout_s: float | None = None) -> MpscConsumer:
        consumer = MpscConsumer(self, heartbeat_timeout_s)
        self._endpoints.append(consumer)
        return consumer

    def producer(
        self,
        full_timeout_s: float = DEFAULT_FULL_TIMEOUT_S,
        heartbeat_timeout_s: float | None = None,
    ) -> RingWriter:
        """Claim a free producer entry; the writer's `ring_name` ends with `[index]`."""
        buf = self.segment.buf
        for index, layout in enumerate(self.layouts):
            if not PartyRecord(buf, layout.writer_party_offset, "producer").claim():
                continue
            writer = RingWriter(
                buf,
                layout,
                f"{self.name}[{index}]",
                self.policy,
                full_timeout_s,
                heartbeat_timeout_s,
                data_wait_offsets=(_SLEEPERS, _FUTEX),
            )
            writer.producer_index = index
            writer.party.register()
            _atomics.fetch_add_u64(buf, _EPOCH, 1)
            self._endpoints.append(writer)
            return writer
        raise IpcError(
            f"MPSC ring {self.name!r}: all {self.max_producers} producer entries are in use; "
            "create the ring with a larger max_producers"
        )

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.close()
        self._endpoints.clear()
        self.segment.close()

    def __enter__(self) -> MpscRing:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class MpscConsumer:
    """The one consumer: reads every producer's sub-ring round-robin."""

    def __init__(self, ring: MpscRing, heartbeat_timeout_s: float | None) -> None:
        self._ring = ring
        self._buf = ring.segment.buf
        self._policy = ring.policy
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.party = PartyRecord(self._buf, _CONSUMER_PARTY, "consumer")
        self.party.register()
        self._readers = []
        for index, layout in enumerate(ring.layouts):
            reader = RingReader(
                self._buf,
                layout,
                f"{ring.name}[{index}]",
                ring.policy,
                0,
                heartbeat_timeout_s,
                data_wait_offsets=(_SLEEPERS, _FUTEX),
            )
            reader.party.register()  # producers watch the consumer through their sub-ring
            reader.writer_party = PartyRecord(
                self._buf, layout.writer_party_offset, f"producer {index}"
            )
            self._readers.append(reader)
        self._epoch = -1
        self._active: list[int] = []
        self._next_index = 0
        self._departed: list[int] = []
        # Entries freed during the current read call: a new producer may claim one at once,
        # and its records must not reach the caller before the departure does (the caller
        # takes departures after each read), so they wait for the next call.
        self._freed_this_call: set[int] = set()
        self._last_reap_ns = 0

    # -- directory -------------------------------------------------------------------
    def _refresh_active(self) -> None:
        epoch = _atomics.load_u64(self._buf, _EPOCH)
        if epoch != self._epoch:
            self._epoch = epoch
            self._active = [
                index
                for index, reader in enumerate(self._readers)
                if reader.writer_party.state() != PartyState.ABSENT
            ]

    def _any_available(self) -> bool:
        self._refresh_active()
        return any(self._readers[index].available() for index in self._active)

    def reap(self) -> None:
        """Free the entries of producers that closed (once drained) or died."""
        self.party.stamp_heartbeat()
        for index in list(self._active):
            reader = self._readers[index]
            state = reader.writer_party.state()
            if state == PartyState.CLOSED and reader.available() == 0:
                self._free_entry(index)
            elif reader.writer_party.is_dead(self._heartbeat_timeout_s):
                self._free_entry(index)

    def _free_entry(self, index: int) -> None:
        """Discard what producer `index` left unread (nobody is left to answer it), free it."""
        reader = self._readers[index]
        reader.release(reader.available())
        reader.writer_party.reset()
        self._active.remove(index)
        self._departed.append(index)
        self._freed_this_call.add(index)

    def take_departed(self) -> list[int]:
        """Producer indices that closed or died since the last call (each reported once)."""
        departed, self._departed = self._departed, []
        return departed

    # -- reading ---------------------------------------------------------------------
    def read(
        self, max_records: int, timeout_s: float | None = None
    ) -> list[tuple[int, np.ndarray]]:
        """Up to `max_records` records as (producer index, records) pairs; [] on timeout,
        or when what woke the wait was only a producer's departure (`take_departed`)."""
        self._freed_this_call.clear()
        batches = self._poll(max_records, with_blobs=False)
        if batches or timeout_s == 0:
            self._reap_rate_limited()
            return batches
        if not self._wait(timeout_s):
            return []
        return self._poll(max_records, with_blobs=False)

    def read_with_blobs(
        self, max_records: int, timeout_s: float | None = None
    ) -> list[tuple[int, np.ndarray, list[np.ndarray | None]]]:
        """Like `read`, with each record's blob (or None) as in `RingReader.read_with_blobs`."""
        self._freed_this_call.clear()
        batches = self._poll(max_records, with_blobs=True)
        if batches or timeout_s == 0:
            self._reap_rate_limited()
            return batches
        if not self._wait(timeout_s):
            return []
        return self._poll(max_records, with_blobs=True)

    def _wait(self, timeout_s: float | None) -> bool:
        return wait_until(
            self._any_available, self._buf, _SLEEPERS, _FUTEX, timeout_s, self._policy, self.reap
        )

    def _reap_rate_limited(self) -> None:
        now_ns = time.monotonic_ns()
        if now_ns - self._last_reap_ns >= self._policy.slice_s * 1e9:
            self._last_reap_ns = now_ns
            self.reap()

    def _poll(self, max_records: int, with_blobs: bool) -> list:
        self._refresh_active()
        batches: list = []
        active = self._active
        if not active:
            return batches
        start = self._next_index % len(active)
        self._next_index += 1
        remaining = max_records
        for index in active[start:] + active[:start]:
            reader = self._readers[index]
            if remaining <= 0 or index in self._freed_this_call or not reader.available():
                continue
            if with_blobs:
                try:
                    records, blobs = reader.read_with_blobs(remaining, timeout_s=None)
                except (PeerDeadError, PeerClosedError):
                    self._free_entry(index)  # it went away in the middle of a blob
                    continue
                batches.append((index, records, blobs))
            else:
                records = reader.read(remaining, timeout_s=0)
                batches.append((index, records))
            remaining -= len(records)
        return batches

    def close(self) -> None:
        if self._readers is None:
            return
        self.party.mark_closed()
        for reader in self._readers:
            reader.close()
        self._readers = None  # type: ignore[assignment]
