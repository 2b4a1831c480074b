"""The C extension: bounds and alignment checks, atomic semantics, cross-process futex."""

from __future__ import annotations

import mmap
import multiprocessing

import pytest

from ringllm.ipc import _atomics


def _shared_buffer(num_bytes: int = 64) -> memoryview:
    return memoryview(mmap.mmap(-1, num_bytes))  # anonymous MAP_SHARED: survives fork


def test_offset_outside_buffer_is_rejected_with_the_limit():
    buf = _shared_buffer()
    with pytest.raises(IndexError, match=r"offset 64 is outside .* <= 56 \(buffer of 64 bytes\)"):
        _atomics.load_u64(buf, 64)
    with pytest.raises(IndexError):
        _atomics.store_u64(buf, -8, 1)


def test_unaligned_offset_is_rejected():
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        _atomics.fetch_add_u64(_shared_buffer(), 12, 1)


def test_read_only_buffer_is_rejected():
    with pytest.raises(BufferError):
        _atomics.load_u64(bytes(64), 0)


def test_store_load_fetch_add_and_compare_exchange():
    buf = _shared_buffer()
    _atomics.store_u64(buf, 8, 2**64 - 1)
    assert _atomics.load_u64(buf, 8) == 2**64 - 1
    assert _atomics.fetch_add_u64(buf, 8, 1) == 2**64 - 1  # wraps to 0
    assert _atomics.load_u64(buf, 8) == 0
    assert _atomics.fetch_add_u64(buf, 8, 5) == 0
    assert _atomics.fetch_add_u64(buf, 8, -2) == 5
    assert _atomics.load_u64(buf, 8) == 3
    assert _atomics.compare_exchange_u64(buf, 8, 4, 9) is False
    assert _atomics.compare_exchange_u64(buf, 8, 3, 9) is True
    assert _atomics.load_u64(buf, 8) == 9
    assert int.from_bytes(buf[8:16], "little") == 9  # little-endian in memory, as layout assumes


def test_futex_wait_reports_mismatch_and_timeout():
    buf = _shared_buffer()
    _atomics.store_u64(buf, 0, 7)
    assert _atomics.futex_wait(buf, 0, 6, 1.0) == 1  # value differs: returns at once
    assert _atomics.futex_wait(buf, 0, 7, 0.01) == 2  # equal: sleeps until the timeout
    with pytest.raises(ValueError, match="timeout_s"):
        _atomics.futex_wait(buf, 0, 7, -1.0)


def _sleep_on_futex(buf: memoryview, result) -> None:
    # Wait up to 20 s: only a wake from the other process ends this early.
    result.send(_atomics.futex_wait(buf, 0, 0, 20.0))


def test_futex_wake_crosses_processes():
    buf = _shared_buffer()
    parent_end, child_end = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_sleep_on_futex, args=(buf, child_end)
    )
    child.start()
    woken = 0
    while not parent_end.poll(0.01):  # the child may not be asleep yet: wake until it answers
        _atomics.fetch_add_u64(buf, 8, 0)
        woken += _atomics.futex_wake(buf, 0, 1)
    assert parent_end.recv() == 0  # woken, not timed out
    assert woken == 1
    child.join(5)


def test_publish_wakes_only_when_someone_sleeps():
    buf = _shared_buffer()
    assert _atomics.publish_u64(buf, 0, 11, 8, 16) is False
    assert _atomics.load_u64(buf, 0) == 11
    assert _atomics.load_u64(buf, 16) == 0
    _atomics.store_u64(buf, 8, 1)  # one sleeper announced
    assert _atomics.publish_u64(buf, 0, 12, 8, 16) is True
    assert _atomics.load_u64(buf, 16) == 1  # the futex word moved, so a late sleeper won't block
