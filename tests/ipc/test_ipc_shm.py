"""Segment lifecycle in real processes: removed on every exit path, stale ones cleaned up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ringllm.ipc.shm import Segment, cleanup_stale, list_segments, make_segment_name

WAIT_FOREVER = "for _ in range(1200): time.sleep(0.05)"
# NOTE: the owner first takes Python's own SIGINT handler, as an interactive program has:
# a test run started in the background by a non-interactive shell (nohup ... &) inherits
# SIGINT ignored, Python then keeps it ignored, and the owner would never die of SIGINT.
_OWNER_SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
from ringllm.ipc.ring import Ring
{before}
ring = Ring.create("life", np.dtype([("x", "<u8")]), 16)
print(ring.name, flush=True)
{after}
"""


def _start_owner(before: str = "", after: str = "") -> tuple[subprocess.Popen, str]:
    script = _OWNER_SCRIPT.format(before=textwrap.dedent(before), after=textwrap.dedent(after))
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    name = owner.stdout.readline().strip()
    assert name.startswith("ringllm_"), owner.stderr.read()
    return owner, name


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_segment_is_removed_on_normal_exit_without_close():
    owner, name = _start_owner()
    assert owner.wait(30) == 0
    assert not _exists(name)


def test_segment_is_removed_when_an_exception_escapes():
    owner, name = _start_owner(after="raise RuntimeError('boom')")
    assert owner.wait(30) == 1
    assert "boom" in owner.stderr.read()
    assert not _exists(name)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_segment_is_removed_on_signal_and_the_process_still_dies_of_it(signum):
    owner, name = _start_owner(after=WAIT_FOREVER)
    assert _exists(name)
    owner.send_signal(signum)
    assert owner.wait(30) == -signum  # default action re-raised after the unlink
    assert not _exists(name)


def test_previous_sigterm_handler_is_chained():
    before = """
    def previous(signum, frame):
        print("previous handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, previous)
    """
    owner, name = _start_owner(before=before, after=WAIT_FOREVER)
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(30) == 3
    assert "previous handler ran" in owner.stdout.read()
    assert not _exists(name)


def test_cleanup_stale_removes_a_killed_owners_segment_only():
    owner, name = _start_owner(after=WAIT_FOREVER)
    owner.kill()  # SIGKILL: nothing runs in the owner
    owner.wait(30)
    assert _exists(name)
    with Segment.create("live", 64) as live:
        removed = cleanup_stale()  # (Segment.create may have cleaned already, the first time)
        assert not _exists(name)
        assert live.name not in removed and _exists(live.name)  # our own owner is alive
    assert not _exists(live.name)


def test_cleanup_stale_leaves_another_users_segments_alone():
    """A dead pid in the name of a segment this user does not own (another user's, or one
    from another pid namespace sharing /dev/shm): never unlinked."""
    if os.geteuid() != 0:
        pytest.skip("making a segment owned by another user needs root")
    dead_pid = _dead_pid()
    name = f"ringllm_{dead_pid}_0123456789ab_decoy"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    try:
        os.chown(path, 4242, 4242)
        assert name not in cleanup_stale() and _exists(name)
        os.chown(path, os.geteuid(), os.getegid())  # the same file as this user's: reaped
        assert name in cleanup_stale() and not _exists(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_new_instance_removes_what_a_killed_one_left():
    owner, name = _start_owner(after=WAIT_FOREVER)
    owner.kill()
    owner.wait(30)
    assert _exists(name)
    successor, successor_name = _start_owner()  # a fresh process: its first create cleans
    assert successor.wait(30) == 0
    assert not _exists(name) and not _exists(successor_name)


def test_attached_segment_is_not_unlinked_by_its_user_and_names_are_unique():
    with Segment.create("mine", 128) as owned:
        assert os.stat(f"/dev/shm/{owned.name}").st_mode & 0o777 == 0o600
        peer = Segment.attach(owned.name)
        peer.buf[:4] = b"ping"
        assert bytes(owned.buf[:4]) == b"ping"
        peer.close()
        assert _exists(owned.name)
    assert owned.name not in list_segments()
    assert make_segment_name("x") != make_segment_name("x")
    with pytest.raises(ValueError, match="segment kind 'Bad_Kind'"):
        make_segment_name("Bad_Kind")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Segment.attach("ringllm_1_00_missing")
