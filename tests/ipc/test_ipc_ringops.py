"""The ring hot path in C (_ringops.c): wait_u64, write_slots, read_slots.

Checked through real shared memory between two real processes, and against bad input:
every wrong argument is a clear Python error, never a write outside the buffer.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time

import numpy as np
import pytest

from ringllm.ipc import _atomics
from ringllm.ipc.ring import Ring

RECORD = np.dtype([("seq", "<u8"), ("payload", "<i4", 5)])  # 28 bytes: slots not 8-aligned
SPAWN = multiprocessing.get_context("spawn")

# One ring laid out by hand in a 1 KiB buffer: tail + writer CPU hint, sleepers + futex,
# head + reader CPU hint, then slots.
TAIL, WRITER_CPU, SLEEPERS, FUTEX, HEAD, READER_CPU, SLOTS = 0, 8, 64, 72, 128, 136, 192
SLOT_BYTES, CAPACITY = 28, 8


def _shared_buffer(num_bytes: int = 1024) -> memoryview:
    return memoryview(mmap.mmap(-1, num_bytes))  # anonymous MAP_SHARED: survives fork


def _records(first_seq: int, count: int) -> np.ndarray:
    records = np.zeros(count, RECORD)
    records["seq"] = np.arange(first_seq, first_seq + count)
    records["payload"] = records["seq"][:, None] * 10 + np.arange(5)
    return records


def _write(buf, tail: int, data) -> int:
    return _atomics.write_slots(
        buf, SLOTS, SLOT_BYTES, CAPACITY, TAIL, SLEEPERS, FUTEX, WRITER_CPU, tail, data
    )


def _read(buf, head: int, count: int) -> bytearray:
    return _atomics.read_slots(
        buf, SLOTS, SLOT_BYTES, CAPACITY, HEAD, SLEEPERS, FUTEX, READER_CPU, head, count
    )


def test_write_then_read_wraps_around_and_publishes_both_counters():
    buf = _shared_buffer()
    tail = _write(buf, 6, _records(6, 4).tobytes())  # slots 6, 7, then 0, 1
    assert tail == 10
    assert _atomics.load_u64(buf, TAIL) == 10
    data = _read(buf, 6, 4)
    assert isinstance(data, bytearray)
    np.testing.assert_array_equal(np.frombuffer(data, RECORD), _records(6, 4))
    assert _atomics.load_u64(buf, HEAD) == 10
    assert _read(buf, 10, 0) == bytearray()  # nothing: only the head is stored again


def test_bad_arguments_are_clear_errors():
    buf = _shared_buffer()
    with pytest.raises(ValueError, match=r"not 0\.\.8 whole records of 28 bytes"):
        _write(buf, 0, b"x" * 30)
    with pytest.raises(ValueError, match=r"not 0\.\.8 whole records"):
        _write(buf, 0, bytes(28 * 9))  # more than the ring holds
    with pytest.raises(ValueError, match=r"count must be in \[0, 8\] records, got 9"):
        _read(buf, 0, 9)
    with pytest.raises(ValueError, match="do not fit the buffer of 1024 bytes"):
        _atomics.read_slots(
            buf, 1000, SLOT_BYTES, CAPACITY, HEAD, SLEEPERS, FUTEX, READER_CPU, 0, 1
        )
    with pytest.raises(ValueError, match="do not fit"):
        _atomics.write_slots(buf, SLOTS, 0, CAPACITY, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, b"")
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        _atomics.write_slots(
            buf, SLOTS, SLOT_BYTES, CAPACITY, 4, SLEEPERS, FUTEX, WRITER_CPU, 0, b""
        )
    with pytest.raises(IndexError, match="outside the buffer"):
        _atomics.read_slots(
            buf, SLOTS, SLOT_BYTES, CAPACITY, 1024, SLEEPERS, FUTEX, READER_CPU, 0, 0
        )
    with pytest.raises(BufferError):
        _atomics.read_slots(
            bytes(1024), SLOTS, SLOT_BYTES, CAPACITY, HEAD, SLEEPERS, FUTEX, READER_CPU, 0, 0
        )
    with pytest.raises(TypeError, match="takes 10 arguments, got 9"):
        _atomics.write_slots(buf, SLOTS, SLOT_BYTES, CAPACITY, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        _atomics.write_slots(buf, SLOTS, SLOT_BYTES, CAPACITY, TAIL, SLEEPERS, FUTEX, 12, 0, b"")
    with pytest.raises(TypeError):
        _write(buf, 0, 12345)  # not a buffer
    with pytest.raises(ValueError, match=r"spin_s must be in \[0, 86400\] s, got -1.0"):
        _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, -1.0, 0.0)
    with pytest.raises(ValueError, match="timeout_s must be .*, got nan"):
        _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, 0.0, float("nan"))
    assert _atomics.load_u64(buf, TAIL) == 0 and _atomics.load_u64(buf, HEAD) == 0


def test_wait_returns_the_new_value_at_once_or_the_known_one_after_the_timeout():
    buf = _shared_buffer()
    _atomics.store_u64(buf, TAIL, 3)
    assert _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, 1e-3, 10.0) == 3
    start = time.monotonic()
    assert _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 3, 20e-6, 0.05) == 3
    assert 0.04 < time.monotonic() - start < 5.0
    assert _atomics.load_u64(buf, SLEEPERS) == 0  # the sleeper count is back to zero
    assert isinstance(_atomics.cores_are_free(), bool)


@pytest.fixture
def on_one_cpu():
    """Pin this process to one CPU for the test (so sched_getcpu() is known), then unpin."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    os.sched_setaffinity(0, {cpu})
    yield cpu
    os.sched_setaffinity(0, allowed)


def test_publishing_and_releasing_record_the_cpu_they_ran_on(on_one_cpu):
    buf = _shared_buffer()
    assert _atomics.load_u64(buf, WRITER_CPU) == 0  # 0: not known yet
    _write(buf, 0, _records(0, 2).tobytes())
    assert _atomics.load_u64(buf, WRITER_CPU) == on_one_cpu + 1
    assert _atomics.load_u64(buf, READER_CPU) == 0
    _read(buf, 0, 2)
    assert _atomics.load_u64(buf, READER_CPU) == on_one_cpu + 1
    _atomics.store_u64(buf, READER_CPU, 0)
    _atomics.publish_u64(buf, HEAD, 2, SLEEPERS, FUTEX, READER_CPU)  # the reserve/peek paths
    assert _atomics.load_u64(buf, READER_CPU) == on_one_cpu + 1


def test_no_spin_while_the_peer_last_ran_on_this_cpu(on_one_cpu):
    """A spinner would hold the core its peer is queued for: it goes to sleep at once.

    With `timeout_s` 0 the wait is the spin alone: 10 ms of it when the peer's hint names
    another CPU or none, and one load when it names this one.
    """
    buf = _shared_buffer()
    spin_s = 0.01
    for hint in (0, on_one_cpu + 2):  # unknown, another CPU
        _atomics.store_u64(buf, WRITER_CPU, hint)
        start = time.monotonic()
        assert _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, spin_s, 0.0) == 0
        assert time.monotonic() - start >= spin_s
    _atomics.store_u64(buf, WRITER_CPU, on_one_cpu + 1)
    start = time.monotonic()
    assert _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, 0, spin_s, 0.0) == 0
    assert time.monotonic() - start < spin_s / 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_waiter_that_keeps_finding_its_peer_on_its_cpu_steps_to_another():
    """16 waits in a row with the peer's hint on this CPU: the thread moves off the CPU,
    and its affinity mask is what it was (it may come back later; it was moved once)."""
    buf = _shared_buffer()
    allowed = os.sched_getaffinity(0)
    for attempt in range(3):  # rate-limited to once per 100 ms per thread: an earlier wait
        _write(buf, attempt, b"")  # in this thread may have used it; the hint: where we run
        here = _atomics.load_u64(buf, WRITER_CPU)
        _atomics.store_u64(buf, READER_CPU, here)  # the peer's hint names our CPU
        for _ in range(16):
            _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, READER_CPU, attempt, 1e-3, 0.0)
        _write(buf, attempt, b"")
        if _atomics.load_u64(buf, WRITER_CPU) != here:
            break
        time.sleep(0.15)
    assert _atomics.load_u64(buf, WRITER_CPU) != here
    assert os.sched_getaffinity(0) == allowed


def _echo_with_c_calls(buf: memoryview, num_records: int) -> None:
    """Child: wait for each record, read it, write it back into the ring's second half."""
    head = 0
    while head < num_records:
        tail = head
        while tail == head:
            tail = _atomics.wait_u64(buf, TAIL, SLEEPERS, FUTEX, WRITER_CPU, head, 50e-6, 0.1)
        count = min(tail - head, 3)
        data = _read(buf, head, count)
        back = np.frombuffer(data, RECORD).copy()
        back["payload"] *= -1
        reply_tail = _atomics.load_u64(buf, 512)
        _atomics.store_u64(buf, 512, reply_tail + count)
        buf[576 + 28 * reply_tail : 576 + 28 * (reply_tail + count)] = back.tobytes()
        head += count


def test_records_cross_processes_through_the_c_calls_with_sleeps_and_wakes():
    buf = _shared_buffer(8192)
    num_records = 40
    child = multiprocessing.get_context("fork").Process(
        target=_echo_with_c_calls, args=(buf, num_records)
    )
    child.start()
    tail = 0
    while tail < num_records:
        while tail - _atomics.load_u64(buf, HEAD) > CAPACITY - 3:  # the ring is small: wait
            time.sleep(0.001)
        if tail % 7 == 0:
            time.sleep(0.02)  # let the child fall asleep on the futex: the write must wake it
        tail = _write(buf, tail, _records(tail, 3).tobytes())
    child.join(30)
    assert child.exitcode == 0
    echoed = np.frombuffer(bytes(buf[576 : 576 + 28 * 42]), RECORD)
    np.testing.assert_array_equal(echoed["seq"], np.arange(42))
    np.testing.assert_array_equal(echoed["payload"], -_records(0, 42)["payload"])


def _ring_echo(ping_name: str, pong_name: str, count: int) -> None:
    ping, pong = Ring.attach(ping_name, RECORD), Ring.attach(pong_name, RECORD)
    reader, writer = ping.reader(), pong.writer()
    echoed = 0
    while echoed < count:
        records = reader.read(4, timeout_s=10)
        writer.write(records)
        echoed += len(records)
    ping.close()
    pong.close()


def test_write_bytes_and_read_round_trip_between_two_spawned_processes():
    with Ring.create("test-ping", RECORD, 8) as ping, Ring.create("test-pong", RECORD, 8) as pong:
        writer, reader = ping.writer(), pong.reader()
        count = 300  # many trips around 8 slots, in batches that straddle the wrap
        echo = SPAWN.Process(target=_ring_echo, args=(ping.name, pong.name, count))
        echo.start()
        sent, received = 0, []
        while sent < count:
            batch = min(5, count - sent)
            writer.write_bytes(_records(sent, batch).tobytes(), timeout_s=10)
            sent += batch
            while sum(map(len, received)) < sent:  # both rings drain before the next batch
                received.append(reader.read(count, timeout_s=10))
        echo.join(30)
        assert echo.exitcode == 0
        np.testing.assert_array_equal(np.concatenate(received), _records(0, count))


def test_write_bytes_refuses_partial_records_and_blob_rings():
    with Ring.create("test-bytes", RECORD, 8) as ring:
        writer = ring.writer()
        with pytest.raises(ValueError, match="whole 28-byte records, got bytes of 30 bytes"):
            writer.write_bytes(bytes(30))
    blob_record = np.dtype([("seq", "<u8"), ("blob_bytes", "<u4"), ("pad", "<u4")])
    with Ring.create("test-bytes", blob_record, 8, blob_bytes_field="blob_bytes") as ring:
        with pytest.raises(ValueError, match="carries blobs: use write"):
            ring.writer().write_bytes(bytes(16))


def test_write_with_blob_takes_any_record_form_and_refuses_a_blob_its_field_cannot_count():
    small = np.dtype([("seq", "<u8"), ("blob_bytes", "u1"), ("pad", "u1", 7)])
    with Ring.create("test-blob", small, 64, blob_bytes_field="blob_bytes") as ring:
        writer, reader = ring.writer(), ring.reader()
        writer.write_with_blob((7, 0, [0] * 7), np.arange(5, dtype=np.int32))  # a tuple
        writer.write_with_blob(np.zeros(1, small), np.arange(3, dtype=np.uint8))  # an array
        records, blobs = reader.read_with_blobs(10, timeout_s=1)
        assert records["seq"].tolist() == [7, 0] and records["blob_bytes"].tolist() == [20, 3]
        assert blobs[0].view(np.int32).tolist() == [0, 1, 2, 3, 4]
        assert blobs[1].tolist() == [0, 1, 2]
        with pytest.raises(ValueError, match="blob of 300 bytes does not fit field 'blob_bytes'"):
            writer.write_with_blob(np.zeros(1, small), np.zeros(300, np.uint8))
        assert reader.available() == 0  # nothing half-written


def test_wait_policy_validates_its_spin_time():
    from ringllm.ipc.wait import WaitPolicy

    with pytest.raises(ValueError, match=r"spin_s must be in \[0, 0.01\] s, got -1"):
        WaitPolicy(spin_s=-1)
    assert WaitPolicy(spin_s=0).spin_s == 0


def _write_late(name: str, delay_s: float) -> None:
    ring = Ring.attach(name, RECORD)
    writer = ring.writer()
    time.sleep(delay_s)
    writer.write(_records(0, 1))
    ring.close()


@pytest.mark.parametrize("policy_kwargs", [{}, {"spin_s": 0.0, "yield_iters": 3}])
def test_reader_waits_over_several_slices_for_a_late_writer(policy_kwargs):
    from ringllm.ipc.wait import WaitPolicy

    policy = WaitPolicy(slice_s=0.05, **policy_kwargs)
    with Ring.create("test-late", RECORD, 8, policy=policy) as ring:
        reader = ring.reader()
        assert len(reader.read(1, timeout_s=0.12)) == 0  # a timeout across slices: empty
        late = SPAWN.Process(target=_write_late, args=(ring.name, 0.3))
        late.start()
        records = reader.read(1, timeout_s=20)
        late.join(20)
        assert records["seq"].tolist() == [0]
