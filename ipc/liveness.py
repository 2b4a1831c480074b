"""Liveness of the parties of a ring: who is attached, whether they still exist.

Each party (a ring's writer, each reader, an MPSC producer or consumer) owns one *party
record* of four 8-byte words in the segment header, on a cache line of its own:

    +0  pid            0 = nobody attached yet
    +8  start_ticks    the process start time from /proc/<pid>/stat (field 22), so a pid
                       that was reused by an unrelated process is not mistaken for the peer
    +16 heartbeat_ns   time.monotonic_ns() (CLOCK_MONOTONIC, one clock for all processes)
                       stamped on attach and every time the party wakes up while waiting
    +24 state          ABSENT / ATTACHED / CLOSED

Death is decided by the process, not by the heartbeat: `os.kill(pid, 0)` fails, or /proc
shows the pid as a zombie, or its start time changed. The heartbeat says how long ago the
peer last stirred (it goes into the error message) and, where the caller sets
`heartbeat_timeout_s`, declares a peer dead whose pid cannot be checked from here (another
pid namespace). A busy peer that does not touch the ring for seconds (a long forward pass)
is not dead, which is why the heartbeat is not the primary signal.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass

from ringllm.ipc import _atomics
from ringllm.ipc.errors import PeerClosedError, PeerDeadError

PARTY_RECORD_BYTES = 32
_PID, _START, _HEARTBEAT, _STATE = 0, 8, 16, 24


class PartyState(enum.IntEnum):
    ABSENT = 0
    ATTACHED = 1
    CLOSED = 2


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot, or 0 when /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0


def is_process_alive(pid: int, start_ticks: int = 0) -> bool:
    """True while `pid` runs and is the same process that recorded `start_ticks`.

    A killed child that its parent has not reaped yet is a zombie: `os.kill(pid, 0)` still
    succeeds for it, so /proc decides.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc here: os.kill said it exists
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields and fields[0] in (b"Z", b"X"):
        return False
    return not (start_ticks and len(fields) > 19 and int(fields[19]) != start_ticks)


@dataclass(frozen=True)
class PartyRecord:
    """One party's liveness record at `offset` in a segment buffer; `role` names it in errors."""

    buf: memoryview
    offset: int
    role: str

    def register(self) -> None:
        """Claim the record for this process (the caller already owns the role)."""
        pid = os.getpid()
        _atomics.store_u64(self.buf, self.offset + _START, process_start_ticks(pid))
        _atomics.store_u64(self.buf, self.offset + _HEARTBEAT, time.monotonic_ns())
        _atomics.store_u64(self.buf, self.offset + _PID, pid)
        _atomics.store_u64(self.buf, self.offset + _STATE, PartyState.ATTACHED)

    def stamp_heartbeat(self) -> None:
        _atomics.store_u64(self.buf, self.offset + _HEARTBEAT, time.monotonic_ns())

    def mark_closed(self) -> None:
        _atomics.store_u64(self.buf, self.offset + _STATE, PartyState.CLOSED)

    def reset(self) -> None:
        """Return the record to ABSENT so that a new party can claim it."""
        for field in (_PID, _START, _HEARTBEAT):
            _atomics.store_u64(self.buf, self.offset + field, 0)
        _atomics.store_u64(self.buf, self.offset + _STATE, PartyState.ABSENT)

    def state(self) -> PartyState:
        return PartyState(_atomics.load_u64(self.buf, self.offset + _STATE))

    def pid(self) -> int:
        return _atomics.load_u64(self.buf, self.offset + _PID)

    def claim(self) -> bool:
        """Atomically take an ABSENT record (MPSC producers race for directory entries)."""
        state_offset = self.offset + _STATE
        return _atomics.compare_exchange_u64(
            self.buf, state_offset, PartyState.ABSENT, PartyState.ATTACHED
        )

    def heartbeat_age_s(self) -> float:
        heartbeat_ns = _atomics.load_u64(self.buf, self.offset + _HEARTBEAT)
        return (time.monotonic_ns() - heartbeat_ns) / 1e9 if heartbeat_ns else float("inf")

    def is_dead(self, heartbeat_timeout_s: float | None = None) -> bool:
        """True when an attached party's process is gone (ABSENT and CLOSED are not dead)."""
        if self.state() != PartyState.ATTACHED:
            return False
        pid = self.pid()
        if pid == 0:
            return False  # claimed, pid not written yet
        start_ticks = _atomics.load_u64(self.buf, self.offset + _START)
        if not is_process_alive(pid, start_ticks):
            return True
        return heartbeat_timeout_s is not None and self.heartbeat_age_s() > heartbeat_timeout_s

    def check(
        self,
        ring_name: str,
        heartbeat_timeout_s: float | None = None,
        error: type[PeerDeadError] = PeerDeadError,
    ) -> None:
        """Raise `error` if the party died, `PeerClosedError` if it closed the ring."""
        state = self.state()
        if state == PartyState.CLOSED:
            raise PeerClosedError(
                f"{self.role} of ring {ring_name!r} closed it; nothing more will come"
            )
        if self.is_dead(heartbeat_timeout_s):
            pid = self.pid()
            age_s = self.heartbeat_age_s()
            raise error(
                f"{self.role} of ring {ring_name!r} (pid {pid}) is dead: the process is gone or "
                f"was replaced; its last heartbeat was {age_s:.2f} s ago. Restart it; the ring "
                "cannot make progress without it.",
                peer=self.role,
                pid=pid,
                last_heartbeat_age_s=age_s,
            )
