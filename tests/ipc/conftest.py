"""Shared fixtures of the ipc tests: no test may leave a ringllm segment in /dev/shm."""

from __future__ import annotations

import os

import pytest

from ringllm.ipc.liveness import is_process_alive
from ringllm.ipc.shm import _owner_pid, cleanup_stale, list_segments


def _parent_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _is_ours(owner_pid: int) -> bool:
    """Owned by this test process, a live descendant of it, or a dead process."""
    if not is_process_alive(owner_pid):
        return True  # a killed owner's leftover: cleanup_stale() should have removed it
    pid = owner_pid
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent_pid(pid)
    return False


@pytest.fixture(scope="session", autouse=True)
def no_segments_left_behind():
    # Other engineers' test sessions may own live segments while these tests run (the
    # machine is shared): only segments that appeared during this session and belong to
    # this process tree, or to a dead owner, are ours to account for.
    cleanup_stale()
    before = set(list_segments())
    yield
    new = set(list_segments()) - before
    left = sorted(name for name in new if _is_ours(_owner_pid(name)))
    assert not left, f"ringllm segments left in /dev/shm after the ipc tests: {left}"
