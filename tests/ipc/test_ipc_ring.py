"""SPSC and broadcast rings across real processes: order, wrap-around, blobs, backpressure."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

from ringllm.ipc.errors import PeerClosedError, RingFullError, RingLayoutError
from ringllm.ipc.ring import Ring

RECORD = np.dtype([("seq", "<u8"), ("blob_bytes", "<u4"), ("value", "<f4"), ("tag", "S8")])
FORK = multiprocessing.get_context("fork")


def _records(first_seq: int, count: int) -> np.ndarray:
    records = np.zeros(count, RECORD)
    records["seq"] = np.arange(first_seq, first_seq + count)
    records["value"] = records["seq"] * 0.5
    records["tag"] = [f"r{s % 1000}".encode() for s in records["seq"]]
    return records


def _write_in_batches(ring_name: str, num_records: int, batch: int) -> None:
    ring = Ring.attach(ring_name, RECORD)
    writer = ring.writer()
    for first in range(0, num_records, batch):
        writer.write(_records(first, min(batch, num_records - first)))
    ring.close()


def _read_all(reader, num_records: int, max_batch: int = 1000) -> np.ndarray:
    parts, total = [], 0
    while total < num_records:
        part = reader.read(max_batch, timeout_s=20)
        assert len(part), "reader timed out waiting for records"
        parts.append(part)
        total += len(part)
    return np.concatenate(parts)


def test_spsc_across_processes_keeps_order_through_many_wraps():
    with Ring.create("t-spsc", RECORD, capacity=16) as ring:
        reader = ring.reader()
        writer = FORK.Process(target=_write_in_batches, args=(ring.name, 5000, 7))
        writer.start()
        received = _read_all(reader, 5000, max_batch=5)  # 5000 records through 16 slots
        writer.join(10)
        assert writer.exitcode == 0
    np.testing.assert_array_equal(received, _records(0, 5000))


def test_wraparound_copy_and_views_within_one_process():
    with Ring.create("t-wrap", RECORD, capacity=8) as ring:
        writer, reader = ring.writer(), ring.reader()
        writer.write(_records(0, 6))
        np.testing.assert_array_equal(reader.read(6, timeout_s=0), _records(0, 6))
        writer.write(_records(6, 5))  # slots 6, 7, then 0, 1, 2: the copy wraps
        np.testing.assert_array_equal(reader.read(100, timeout_s=0), _records(6, 5))
        # reserve/peek views stop at the end of the slot array; the rest comes next call
        view = writer.reserve(8)
        assert len(view) == 5  # tail is at slot 3
        view[:] = _records(11, 5)
        writer.publish(5)
        view = writer.reserve(8)
        assert len(view) == 3
        view[:] = _records(16, 3)
        writer.publish(3)
        assert writer.free_slots() == 0
        first = reader.peek(8)
        np.testing.assert_array_equal(first, _records(11, 5))
        reader.release(len(first))
        np.testing.assert_array_equal(reader.peek(8), _records(16, 3))
        reader.release(3)
        assert reader.available() == 0


def test_full_ring_blocks_then_times_out_with_clear_error_and_loses_nothing():
    with Ring.create("t-full", RECORD, capacity=8) as ring:
        writer, reader = ring.writer(), ring.reader()
        writer.write(_records(0, 5))
        with pytest.raises(
            RingFullError, match=r"stayed full for 0.2 s \(capacity 8 records"
        ) as err:
            writer.write(_records(5, 10), timeout_s=0.2)
        assert err.value.num_written == 3  # what fitted went in; the caller retries the rest
        assert ring.name in str(err.value)
        np.testing.assert_array_equal(reader.read(100, timeout_s=0), _records(0, 8))
        writer.write(_records(8, 7))
        np.testing.assert_array_equal(reader.read(100, timeout_s=0), _records(8, 7))


def test_has_room_tells_a_writer_that_must_not_wait_what_fits_now():
    with Ring.create("t-room", RECORD, capacity=8, blob_bytes_field="blob_bytes") as ring:
        writer, reader = ring.writer(), ring.reader()
        assert writer.slots_for(5) == 5
        assert writer.slots_for(1, blob_nbytes=1) == 2  # the record, one slot of blob
        assert writer.slots_for(1, blob_nbytes=RECORD.itemsize + 1) == 3
        assert writer.has_room(8) and not writer.has_room(9)
        writer.write(_records(0, 6))
        assert writer.has_room(2) and not writer.has_room(3)
        assert not writer.has_room(writer.slots_for(1, blob_nbytes=2 * RECORD.itemsize))
        reader.read_with_blobs(4, timeout_s=0)
        assert writer.has_room(6)  # the head is looked at again when the cached one says no
        writer.check_readers()
        reader.close()
        with pytest.raises(PeerClosedError):
            writer.check_readers()


def test_wrong_dtype_and_layout_mismatch_are_rejected():
    with Ring.create("t-layout", RECORD, capacity=8) as ring:
        writer = ring.writer()
        with pytest.raises(ValueError, match="holds"):
            writer.write(np.zeros(2, np.dtype([("seq", "<u8")])))
        other = np.dtype([("seq", "<u8"), ("blob_bytes", "<u4"), ("value", "<i4"), ("tag", "S8")])
        with pytest.raises(RingLayoutError, match="record dtype hash"):
            Ring.attach(ring.name, other)  # same size, different field type
        with pytest.raises(RingLayoutError, match="slot bytes is 24, expected 8"):
            Ring.attach(ring.name, np.dtype([("seq", "<u8")]))
    with pytest.raises(ValueError, match="capacity must be in"):
        Ring.create("t-bad", RECORD, capacity=1)


def _blob(num_ints: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**31, num_ints, dtype=np.int32)


def _write_blobs(ring_name: str, sizes: list[int]) -> None:
    ring = Ring.attach(ring_name, RECORD, blob_bytes_field="blob_bytes")
    writer = ring.writer()
    for seq, size in enumerate(sizes):
        if size:
            writer.write_with_blob(_records(seq, 1)[0], _blob(size, seq))
        else:
            writer.write(_records(seq, 1))
    ring.close()


def test_records_larger_than_a_slot_and_than_the_ring_arrive_whole():
    # 100k token ids (400 kB) through a ring of 64 slots x 24 bytes (1.5 kB)
    sizes = [0, 5, 0, 100_000, 1, 0, 6, 3000]
    with Ring.create("t-blob", RECORD, capacity=64, blob_bytes_field="blob_bytes") as ring:
        reader = ring.reader()
        writer = FORK.Process(target=_write_blobs, args=(ring.name, sizes))
        writer.start()
        records, blobs = [], []
        while len(blobs) < len(sizes):
            part, part_blobs = reader.read_with_blobs(3, timeout_s=20)
            assert len(part) == len(part_blobs) > 0
            records.append(part)
            blobs.extend(part_blobs)
        writer.join(10)
    records = np.concatenate(records)
    np.testing.assert_array_equal(records["seq"], np.arange(len(sizes)))
    for seq, (size, blob) in enumerate(zip(sizes, blobs, strict=True)):
        if size == 0:
            assert blob is None and records["blob_bytes"][seq] == 0
        else:
            assert records["blob_bytes"][seq] == 4 * size
            np.testing.assert_array_equal(blob.view(np.int32), _blob(size, seq))


def test_plain_record_with_blob_field_set_is_rejected():
    with Ring.create("t-blobchk", RECORD, capacity=8, blob_bytes_field="blob_bytes") as ring:
        records = _records(0, 2)
        records["blob_bytes"][1] = 4
        with pytest.raises(ValueError, match="must carry 0 in 'blob_bytes'"):
            ring.writer().write(records)


def _read_broadcast(ring_name: str, index: int, num_records: int, result) -> None:
    ring = Ring.attach(ring_name, RECORD)
    reader = ring.reader(index)
    received = _read_all(reader, num_records, max_batch=3 + index)
    result.send((index, received["seq"].tobytes()))
    ring.close()


def test_broadcast_every_reader_sees_every_record_and_writer_waits_for_slowest():
    num_readers, num_records = 3, 3000
    with Ring.create("t-bcast", RECORD, capacity=32, num_readers=num_readers) as ring:
        writer = ring.writer()
        results = []
        children = []
        for index in range(num_readers):
            parent_end, child_end = FORK.Pipe()
            results.append(parent_end)
            child = FORK.Process(
                target=_read_broadcast, args=(ring.name, index, num_records, child_end)
            )
            child.start()
            children.append(child)
        for first in range(0, num_records, 50):
            writer.write(_records(first, 50))
        seen = dict(result.recv() for result in results)
        for child in children:
            child.join(10)
    for index in range(num_readers):
        np.testing.assert_array_equal(
            np.frombuffer(seen[index], np.uint64), np.arange(num_records, dtype=np.uint64)
        )


def test_reader_drains_then_sees_writer_closed():
    with Ring.create("t-close", RECORD, capacity=8) as ring:
        writer, reader = ring.writer(), ring.reader()
        writer.write(_records(0, 3))
        writer.close()
        np.testing.assert_array_equal(reader.read(10, timeout_s=1), _records(0, 3))
        with pytest.raises(PeerClosedError, match="writer of ring .* closed it"):
            reader.read(10, timeout_s=5)


def test_segment_is_private_to_its_user():
    with Ring.create("t-mode", RECORD, capacity=8) as ring:
        assert os.stat(f"/dev/shm/{ring.name}").st_mode & 0o777 == 0o600
        assert ring.name.startswith(f"ringllm_{os.getpid()}_")
