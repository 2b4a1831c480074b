"""Shared-memory segment lifecycle: unique names, mode 0600, unlinked on every exit path.

A `Segment` is one POSIX shared-memory object (a file in /dev/shm) mapped into this
process, either *owned* (created here; this process unlinks it) or *attached* (a peer's).

Names are `ringllm_<owner pid>_<random hex>_<kind>`: unique per instance (two engines never
collide, unlike one fixed name) and carrying the owner's pid, which is how
`cleanup_stale()` knows a segment whose owner was `kill -9`'d and removes it.

An owned segment is unlinked on every exit path of its owner:
  - `close()` / the context manager (the normal path),
  - interpreter exit, including an uncaught exception and SIGINT's KeyboardInterrupt
    (atexit),
  - SIGTERM and SIGINT with the default disposition: the handler unlinks, then re-raises
    the signal with the default action, so the exit status still says "killed by signal";
    a handler installed before ours is called instead (chained), and atexit unlinks if that
    handler makes the process exit,
  - `kill -9`: nothing runs in the victim, so the next instance cleans up: the first
    segment a process creates runs `cleanup_stale()` (the engine may also call it).

NOTE: Python 3.11's multiprocessing.resource_tracker registers every SharedMemory, warns
about "leaked" segments at exit and may unlink a segment that another process owns. This
module unregisters each segment right after opening it and unlinks through `_posixshmem`
directly, so the tracker never holds a ringllm name.
"""

from __future__ import annotations

import _posixshmem
import atexit
import contextlib
import logging
import os
import re
import secrets
import signal
import threading
from multiprocessing import resource_tracker, shared_memory

from ringllm.ipc import _atomics
from ringllm.ipc.liveness import is_process_alive

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ringllm_"
SEGMENT_MODE = 0o600
_KIND_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_NAME_PATTERN = re.compile(r"^ringllm_(\d+)_[0-9a-f]+_[a-z0-9-]+$")


def make_segment_name(kind: str) -> str:
    if not _KIND_PATTERN.match(kind):
        raise ValueError(
            f"segment kind {kind!r} must be 1-32 characters of a-z, 0-9 and '-' "
            "(it becomes part of a /dev/shm file name)"
        )
    return f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(6)}_{kind}"


def _owner_pid(name: str) -> int:
    match = _NAME_PATTERN.match(name)
    return int(match.group(1)) if match else 0


def _unlink_name(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


class _ExitCleanup:
    """The owned segments of this process, unlinked at exit and on SIGTERM/SIGINT.

    NOTE: signal dispositions and atexit hooks are per process, so this registry is too
    (the one module-level instance below). Each name is stored with its owner's pid: a
    forked child inherits the registry and the handlers but must never unlink its parent's
    segments.
    """

    def __init__(self) -> None:
        self._owner_pid_by_name: dict[str, int] = {}
        self._lock = threading.Lock()
        self._installed_pid = 0

    def is_first_in_this_process(self) -> bool:
        return self._installed_pid != os.getpid()

    def add(self, name: str) -> None:
        with self._lock:
            self._owner_pid_by_name[name] = os.getpid()
            if self._installed_pid != os.getpid():
                self._install()

    def discard(self, name: str) -> None:
        with self._lock:
            self._owner_pid_by_name.pop(name, None)

    def unlink_all(self) -> None:
        pid = os.getpid()
        for name, owner_pid in list(self._owner_pid_by_name.items()):
            if owner_pid == pid:
                _unlink_name(name)
                self._owner_pid_by_name.pop(name, None)

    def _install(self) -> None:
        self._installed_pid = os.getpid()
        atexit.register(self.unlink_all)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still runs
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if previous is None or previous == signal.SIG_IGN:
                continue  # set outside Python, or ignored: the process will not die of it
            signal.signal(signum, self._make_handler(previous))

    def _make_handler(self, previous):
        def on_signal(signum, frame):
            if callable(previous):
                previous(signum, frame)  # it decides; atexit unlinks if the process exits
                return
            self.unlink_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        return on_signal


_EXIT_CLEANUP = _ExitCleanup()


class Segment:
    """One mapped shared-memory segment; `buf` is its writable memoryview."""

    def __init__(self, shm: shared_memory.SharedMemory, name: str, owned: bool) -> None:
        self._shm = shm
        self.name = name
        self.owned = owned
        self.buf: memoryview = shm.buf
        self.size_bytes = shm.size

    @classmethod
    def create(cls, kind: str, size_bytes: int) -> Segment:
        """Create a new zero-filled segment of `size_bytes`, owned by this process."""
        if size_bytes < 1:
            raise ValueError(f"size_bytes must be >= 1, got {size_bytes}")
        if _EXIT_CLEANUP.is_first_in_this_process():
            cleanup_stale()  # a new instance removes what a kill -9'd one left behind
        name = make_segment_name(kind)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size_bytes)
        _EXIT_CLEANUP.add(name)
        _untrack(shm)
        os.fchmod(shm._fd, SEGMENT_MODE)  # the umask could have widened nothing, but be explicit
        return cls(shm, name, owned=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map a peer's segment; it stays the peer's to unlink."""
        try:
            shm = shared_memory.SharedMemory(name=name, create=False)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} does not exist in {SHM_DIR}: its owner "
                "has not created it yet, or exited and removed it"
            ) from None
        _untrack(shm)
        return cls(shm, name, owned=False)

    def store_u64(self, offset: int, value: int) -> None:
        """Release-store an aligned 8-byte word: a reader that loads it sees every write made
        to the segment before it (a flag published after its payload)."""
        _atomics.store_u64(self.buf, offset, value)

    def load_u64(self, offset: int) -> int:
        """Acquire-load an aligned 8-byte word (the other half of `store_u64`)."""
        return _atomics.load_u64(self.buf, offset)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views still held elsewhere keep the mapping alive."""
        if self.owned:
            _unlink_name(self.name)
            _EXIT_CLEANUP.discard(self.name)
        self.buf = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:
            pass  # numpy views are still alive; the mapping goes when they do

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    resource_tracker.unregister(shm._name, "shared_memory")


def list_segments() -> list[str]:
    """Names of all ringllm segments in /dev/shm (any owner)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []


def cleanup_stale() -> list[str]:
    """Unlink ringllm segments whose owner process is dead; return their names.

    Only this user's own segments: another user's (or another pid namespace's, whose pids
    mean nothing here) are never touched, and one that cannot be removed is skipped."""
    removed = []
    uid = os.geteuid()
    for name in list_segments():
        owner_pid = _owner_pid(name)
        if not owner_pid:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid != uid:
                continue
        except OSError:
            continue  # gone already
        if is_process_alive(owner_pid):
            continue
        try:
            _unlink_name(name)
        except OSError as exc:  # not ours to remove after all (a sticky /dev/shm)
            logger.warning("stale segment %s left in place: %s", name, exc)
            continue
        removed.append(name)
    return removed
