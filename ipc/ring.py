"""Shared-memory rings of fixed-layout records: one writer, one or N readers.

`Ring.create` makes a segment holding one ring region (layout.py); the writer and each
reader are endpoints (`RingWriter`, `RingReader`) that any process attaches by name:

    SPSC       num_readers=1
    broadcast  num_readers=N: every reader sees every record; each reader has its own
               head and the writer waits for the slowest one (min over heads). A
               reader that has not attached yet holds its slots from record 0, so
               nothing is published past it before it arrives.

Writer: `write(records)` copies with wrap-around and publishes the whole batch with one
8-byte release store of `tail`; or `reserve(n)` -> a view of free slots, fill it,
`publish(k)`. Reader: `read(max_n)` copies records out and advances `head`; or
`peek(max_n)` -> a view, then `release(k)`. A full ring is backpressure: the writer
waits (a few spins, then a futex; wait.py) up to its timeout, then raises `RingFullError`
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

import numpy as np

from ringllm.ipc.endpoint import RingEndpoint
from ringllm.ipc.layout import RingKind, RingLayout
from ringllm.ipc.reader import RingReader
from ringllm.ipc.shm import Segment
from ringllm.ipc.wait import WaitPolicy
from ringllm.ipc.writer import DEFAULT_FULL_TIMEOUT_S, RingWriter

__all__ = ["Ring", "RingReader", "RingWriter", "DEFAULT_FULL_TIMEOUT_S"]


class Ring:
    """A ring in a segment of its own: SPSC (num_readers=1) or broadcast (num_readers=N)."""

    def __init__(self, segment: Segment, layout: RingLayout, policy: WaitPolicy) -> None:
        self.segment = segment
        self.layout = layout
        self.policy = policy
        self._endpoints: list[RingEndpoint] = []

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
