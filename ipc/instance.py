"""The instance segment: how a front end finds an engine core by name.

`ringllm serve` prints the instance name; `Client.connect(name)` attaches this segment,
reads the engine's facts once (JSON, written before the name is published; not on any
per-request path) and then talks only through the rings it names.

    0      u64 info length in bytes
    64     info JSON: request ring name, engine pid, model facts (max_model_len, ...)
    NOTE   u64 length | the core's last words (JSON, written just before it exits on
           purpose: why it ended, for a front end that sees it gone; length 0: none)
    LIVE   u64 num_running | u64 num_waiting | u64 steps   (updated every step, read by
           the data-parallel coordinator to route new requests to the least-loaded core)
"""

from __future__ import annotations

import json
from typing import Any

from ringllm.ipc import _atomics
from ringllm.ipc.errors import RingLayoutError
from ringllm.ipc.shm import Segment

SEGMENT_BYTES = 16384
INFO_OFFSET = 64
LIVE_OFFSET = SEGMENT_BYTES - 64
NOTE_OFFSET = LIVE_OFFSET - 1024
_RUNNING, _WAITING, _STEPS = LIVE_OFFSET, LIVE_OFFSET + 8, LIVE_OFFSET + 16


class InstanceSegment:
    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, info: dict[str, Any]) -> InstanceSegment:
        data = json.dumps(info).encode()
        if INFO_OFFSET + len(data) > NOTE_OFFSET:
            raise ValueError(
                f"engine info is {len(data)} bytes; the instance segment holds {NOTE_OFFSET - INFO_OFFSET}"
            )
        segment = Segment.create("engine", SEGMENT_BYTES)
        segment.buf[INFO_OFFSET : INFO_OFFSET + len(data)] = data
        _atomics.store_u64(segment.buf, 0, len(data))  # published last: readers see all of it
        return cls(segment)

    @classmethod
    def attach(cls, name: str) -> InstanceSegment:
        try:
            segment = Segment.attach(name)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no ringllm engine instance named {name!r} (is `ringllm serve` running? it prints the name)"
            ) from None
        return cls(segment)

    def info(self) -> dict[str, Any]:
        length = _atomics.load_u64(self.segment.buf, 0)
        if not 0 < length <= NOTE_OFFSET - INFO_OFFSET:
            raise RingLayoutError(f"instance segment {self.name!r} holds no engine info yet")
        return json.loads(bytes(self.segment.buf[INFO_OFFSET : INFO_OFFSET + length]))

    def publish_note(self, note: dict[str, Any]) -> None:
        """The core's last words (a few short fields: each cut to 200 characters if they do
        not fit whole)."""
        limit = LIVE_OFFSET - NOTE_OFFSET - 8
        data = json.dumps(note).encode()
        if len(data) > limit:
            data = json.dumps({k: str(v)[:200] for k, v in note.items()}).encode()
        if len(data) > limit:
            raise ValueError(f"note: {len(data)} bytes even cut; the segment holds {limit}")
        start = NOTE_OFFSET + 8
        self.segment.buf[start : start + len(data)] = data
        _atomics.store_u64(self.segment.buf, NOTE_OFFSET, len(data))  # published last

    def note(self) -> dict[str, Any] | None:
        """The core's last words, if it left any."""
        length = _atomics.load_u64(self.segment.buf, NOTE_OFFSET)
        if not 0 < length <= LIVE_OFFSET - NOTE_OFFSET - 8:  # none (or not one written here)
            return None
        start = NOTE_OFFSET + 8
        try:
            return json.loads(bytes(self.segment.buf[start : start + length]))
        except ValueError:
            return None

    def publish_load(self, num_running: int, num_waiting: int) -> None:
        buf = self.segment.buf
        _atomics.store_u64(buf, _RUNNING, num_running)
        _atomics.store_u64(buf, _WAITING, num_waiting)
        _atomics.fetch_add_u64(buf, _STEPS, 1)

    def load(self) -> tuple[int, int]:
        """(num_running, num_waiting) as of the core's last step."""
        buf = self.segment.buf
        return _atomics.load_u64(buf, _RUNNING), _atomics.load_u64(buf, _WAITING)

    def close(self) -> None:
        self.segment.close()
