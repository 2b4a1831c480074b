"""Waiting and liveness: an idle reader sleeps, wakes on publish; a killed peer is an error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

from ringllm.ipc import _atomics
from ringllm.ipc.errors import PeerDeadError
from ringllm.ipc.liveness import is_process_alive, process_start_ticks
from ringllm.ipc.mpsc import MpscRing
from ringllm.ipc.ring import Ring

RECORD = np.dtype([("seq", "<u8"), ("stamp_ns", "<u8")])
FORK = multiprocessing.get_context("fork")


def _idle_reader(ring_name: str, result) -> None:
    ring = Ring.attach(ring_name, RECORD)
    reader = ring.reader()
    cpu_before_s = time.process_time()
    idle = reader.read(1, timeout_s=1.0)
    cpu_idle_s = time.process_time() - cpu_before_s
    result.send((len(idle), cpu_idle_s))
    woken = reader.read(1, timeout_s=30)  # the parent publishes after our report
    result.send(woken["seq"].tolist())
    ring.close()


def test_idle_reader_sleeps_in_the_futex_and_wakes_on_publish():
    with Ring.create("t-idle", RECORD, capacity=8) as ring:
        writer = ring.writer()
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_idle_reader, args=(ring.name, child_end))
        child.start()
        num_idle, cpu_idle_s = parent_end.recv()
        assert num_idle == 0
        # a bound, not a timing: 1 s blocked may cost well under 2% of a core
        assert cpu_idle_s < 0.02, f"idle reader used {cpu_idle_s:.4f} s of CPU in 1 s"
        time.sleep(0.3)  # the child is asleep in futex_wait with a 30 s timeout again
        record = np.zeros(1, RECORD)
        record["seq"] = 42
        writer.write(record)
        assert parent_end.poll(10), "reader asleep on the futex was not woken by publish"
        assert parent_end.recv() == [42]
        child.join(5)


def _attach_and_hang(ring_name: str, role: str, ready) -> None:
    ring = Ring.attach(ring_name, RECORD)
    ring.writer() if role == "writer" else ring.reader()
    ready.send(True)
    time.sleep(60)


def _kill_soon(pid: int, killed_at: list[float]) -> threading.Timer:
    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.3, kill)
    timer.start()
    return timer


@pytest.mark.parametrize("dead_side", ["writer", "reader"])
def test_killed_peer_becomes_peer_dead_error_within_a_second(dead_side):
    with Ring.create("t-dead", RECORD, capacity=4) as ring:
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_attach_and_hang, args=(ring.name, dead_side, child_end))
        child.start()
        assert parent_end.recv()
        killed_at: list[float] = []
        timer = _kill_soon(child.pid, killed_at)
        with pytest.raises(
            PeerDeadError, match=f"{dead_side}.* \\(pid {child.pid}\\) is dead"
        ) as err:
            if dead_side == "writer":
                ring.reader().read(1, timeout_s=10)  # blocked waiting for records
            else:
                writer = ring.writer()
                writer.write(np.zeros(4, RECORD))
                writer.write(np.zeros(1, RECORD), timeout_s=10)  # blocked on a full ring
        noticed_after_s = time.monotonic() - killed_at[0]
        timer.join()
        child.join(5)  # the child was a zombie until now: /proc said so
        assert err.value.pid == child.pid
        assert noticed_after_s < 1.5, f"noticed the death after {noticed_after_s:.2f} s"


def _consume_then_hang(ring_name: str, ready) -> None:
    ring = MpscRing.attach(ring_name, RECORD)
    ring.producer().write(np.zeros(3, RECORD))
    ready.send(True)
    time.sleep(60)


def test_mpsc_dead_producer_is_reported_and_dead_consumer_is_an_error():
    with MpscRing.create("t-mdead", RECORD, capacity=4, max_producers=2) as ring:
        consumer = ring.consumer()
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_consume_then_hang, args=(ring.name, child_end))
        child.start()
        assert parent_end.recv()
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)
        deadline = time.monotonic() + 5
        while not (departed := consumer.take_departed()) and time.monotonic() < deadline:
            consumer.read(10, timeout_s=0.2)
        assert departed == [0]
    # the consumer dies: a producer blocked on its full sub-ring finds out
    with MpscRing.create("t-mdead2", RECORD, capacity=4, max_producers=1) as ring:
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_mpsc_consumer_hangs, args=(ring.name, child_end))
        child.start()
        assert parent_end.recv()
        producer = MpscRing.attach(ring.name, RECORD)
        writer = producer.producer()
        writer.write(np.zeros(4, RECORD))
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)
        with pytest.raises(PeerDeadError, match="reader 0 of ring .*\\[0\\]"):
            writer.write(np.zeros(1, RECORD), timeout_s=10)
        producer.close()


def _mpsc_consumer_hangs(ring_name: str, ready) -> None:
    ring = MpscRing.attach(ring_name, RECORD)
    ring.consumer()
    ready.send(True)
    time.sleep(60)


def test_process_identity_checks():
    assert is_process_alive(os.getpid(), process_start_ticks(os.getpid()))
    assert not is_process_alive(os.getpid(), process_start_ticks(os.getpid()) + 1)  # pid reused
    assert not is_process_alive(0)
    child = FORK.Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    assert not is_process_alive(child.pid)


BLOB_RECORD = np.dtype([("seq", "<u8"), ("blob_bytes", "<u8")])


def _send_huge_blob(ring_name: str) -> None:
    ring = MpscRing.attach(ring_name, BLOB_RECORD, blob_bytes_field="blob_bytes")
    ring.producer().write_with_blob(np.zeros((), BLOB_RECORD), np.ones(10_000, np.uint8))


def test_mpsc_producer_killed_mid_blob_is_freed_not_fatal_to_the_consumer():
    with MpscRing.create(
        "t-midblob", BLOB_RECORD, capacity=8, max_producers=2, blob_bytes_field="blob_bytes"
    ) as ring:
        consumer = ring.consumer()
        child = FORK.Process(target=_send_huge_blob, args=(ring.name,))
        child.start()
        tail_offset = ring.layouts[0].tail_offset
        deadline = time.monotonic() + 10
        while _atomics.load_u64(ring.segment.buf, tail_offset) < 8:  # header + 7 slots sent
            assert time.monotonic() < deadline, "producer never filled its sub-ring"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)
        assert consumer.read_with_blobs(10, timeout_s=0.5) == []  # partial blob discarded
        assert consumer.take_departed() == [0]
        producer = MpscRing.attach(ring.name, BLOB_RECORD, blob_bytes_field="blob_bytes")
        writer = producer.producer()
        assert writer.producer_index == 0  # the entry is free again
        writer.write_with_blob(np.zeros((), BLOB_RECORD), np.arange(20, dtype=np.uint8))
        [(index, records, blobs)] = consumer.read_with_blobs(10, timeout_s=5)
        np.testing.assert_array_equal(blobs[0], np.arange(20, dtype=np.uint8))
        producer.close()


def test_heartbeat_timeout_declares_a_silent_peer_dead_when_asked_to():
    with Ring.create("t-hb", RECORD, capacity=4) as ring:
        parent_end, child_end = FORK.Pipe()
        child = FORK.Process(target=_attach_and_hang, args=(ring.name, "writer", child_end))
        child.start()
        assert parent_end.recv()
        reader = ring.reader(heartbeat_timeout_s=0.3)
        # the writer's pid is alive, but it never stamps a heartbeat: only the age can tell
        with pytest.raises(PeerDeadError, match=r"last heartbeat was \d+\.\d\d s ago") as err:
            reader.read(1, timeout_s=10)
        assert err.value.last_heartbeat_age_s >= 0.3
        assert is_process_alive(child.pid)
        default_reader_ring = Ring.attach(ring.name, RECORD)
        assert len(default_reader_ring.reader().read(1, timeout_s=0.5)) == 0  # no timeout: waits
        default_reader_ring.close()
        child.kill()
        child.join(5)
