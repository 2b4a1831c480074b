"""Every error the shared-memory transport raises, in one place.

All derive from `IpcError`, so a caller can catch the transport as a whole. Messages name
the ring, the value that was wrong and the limit, and say what to do.
"""

from __future__ import annotations


class IpcError(RuntimeError):
    """Base class of the ringllm.ipc errors."""


class RingLayoutError(IpcError):
    """A segment does not hold the ring the caller expected (magic, version, dtype, sizes)."""


class RingFullError(IpcError):
    """The writer waited for free slots past its timeout: the readers are not keeping up.

    `num_written` records how many of the records in the failed call were published before
    the timeout (they are in the ring and will be read; the rest were not written).
    """

    def __init__(self, message: str, num_written: int = 0) -> None:
        super().__init__(message)
        self.num_written = num_written


class PeerDeadError(IpcError):
    """The process on the other side of a ring is gone (its pid is dead or was reused)."""

    def __init__(
        self, message: str, peer: str = "", pid: int = 0, last_heartbeat_age_s: float = 0.0
    ):
        super().__init__(message)
        self.peer = peer
        self.pid = pid
        self.last_heartbeat_age_s = last_heartbeat_age_s


class PeerClosedError(IpcError):
    """The other side closed the ring on purpose and nothing more will arrive."""
