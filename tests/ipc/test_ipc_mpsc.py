"""Many producers -> one consumer: no record lost, duplicated or torn; departures reported."""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

from ringllm.ipc.errors import IpcError
from ringllm.ipc.liveness import PartyRecord, PartyState
from ringllm.ipc.mpsc import MpscRing

STRESS_RECORD = np.dtype(
    [
        ("producer", "<u4"),
        ("blob_bytes", "<u4"),
        ("seq", "<u8"),
        ("payload", "<u8", 5),
        ("checksum", "<u8"),
    ]
)
FORK = multiprocessing.get_context("fork")
SPAWN = multiprocessing.get_context("spawn")
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _payload(producer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    lanes = np.arange(1, 6, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (seq[:, None] * _MIX * lanes) ^ (
            producer[:, None].astype(np.uint64) << np.uint64(40)
        )


def _checksum(records: np.ndarray) -> np.ndarray:
    words = records["payload"]
    return np.bitwise_xor.reduce(words, axis=1) ^ records["seq"] ^ records["producer"]


def _make_batch(producer: int, first_seq: int, count: int) -> np.ndarray:
    records = np.zeros(count, STRESS_RECORD)
    records["producer"] = producer
    records["seq"] = np.arange(first_seq, first_seq + count, dtype=np.uint64)
    records["payload"] = _payload(records["producer"], records["seq"])
    records["checksum"] = _checksum(records)
    return records


def _produce(ring_name: str, producer_id: int, num_records: int, batch: int) -> None:
    ring = MpscRing.attach(ring_name, STRESS_RECORD)
    writer = ring.producer()
    for first in range(0, num_records, batch):
        writer.write(_make_batch(producer_id, first, min(batch, num_records - first)))
    ring.close()


def _consume(consumer, total: int) -> dict[int, list[np.ndarray]]:
    by_producer: dict[int, list[np.ndarray]] = {}
    received = 0
    deadline = time.monotonic() + 30
    while received < total:
        # [] also when the only news was a producer's departure (MpscConsumer.read)
        batches = consumer.read(8192, timeout_s=max(0.0, deadline - time.monotonic()))
        if not batches:
            assert time.monotonic() < deadline, "consumer timed out: records were lost"
            continue
        deadline = time.monotonic() + 30
        for _, records in batches:
            # A directory entry is reused once its producer closed and was drained, so one
            # entry may carry several producers in turn, but never two in one batch.
            producer_id = int(records["producer"][0])
            np.testing.assert_array_equal(records["producer"], producer_id)
            # not torn: every record's payload and checksum match its (producer, seq)
            np.testing.assert_array_equal(
                records["payload"], _payload(records["producer"], records["seq"])
            )
            np.testing.assert_array_equal(records["checksum"], _checksum(records))
            by_producer.setdefault(producer_id, []).append(records["seq"])
            received += len(records)
    return by_producer


@pytest.mark.parametrize("context", [FORK, SPAWN], ids=["fork", "spawn"])
def test_mpsc_delivers_every_record_once_in_producer_order(context):
    num_producers, per_producer = 3, 20_000 if context is SPAWN else 2_000
    with MpscRing.create("t-mpsc", STRESS_RECORD, capacity=256, max_producers=4) as ring:
        consumer = ring.consumer()
        children = [
            context.Process(target=_produce, args=(ring.name, producer_id, per_producer, 97))
            for producer_id in range(num_producers)
        ]
        for child in children:
            child.start()
        by_producer = _consume(consumer, num_producers * per_producer)
        for child in children:
            child.join(30)
            assert child.exitcode == 0
    assert sorted(by_producer) == list(range(num_producers))
    for seqs in by_producer.values():
        np.testing.assert_array_equal(np.concatenate(seqs), np.arange(per_producer))


def test_stress_one_million_records_from_four_producers():
    num_producers, per_producer = 4, 250_000
    with MpscRing.create("t-stress", STRESS_RECORD, capacity=4096, max_producers=4) as ring:
        consumer = ring.consumer()
        children = [
            FORK.Process(target=_produce, args=(ring.name, producer_id, per_producer, 2000))
            for producer_id in range(num_producers)
        ]
        for child in children:
            child.start()
        by_producer = _consume(consumer, num_producers * per_producer)
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        assert consumer.read(10, timeout_s=0.2) == []  # nothing duplicated past the total
    assert sorted(by_producer) == list(range(num_producers))
    for seqs in by_producer.values():
        np.testing.assert_array_equal(np.concatenate(seqs), np.arange(per_producer))


def test_closed_producer_is_drained_then_its_entry_is_reused():
    with MpscRing.create("t-reuse", STRESS_RECORD, capacity=16, max_producers=1) as ring:
        consumer = ring.consumer()
        attached = MpscRing.attach(ring.name, STRESS_RECORD)
        first = attached.producer()
        first.write(_make_batch(0, 0, 5))
        with pytest.raises(IpcError, match="all 1 producer entries are in use"):
            attached.producer()
        first.close()
        [(index, records)] = consumer.read(100, timeout_s=1)
        assert index == 0 and len(records) == 5  # drained before the entry is freed
        assert consumer.read(100, timeout_s=0.3) == []
        assert consumer.take_departed() == [0]
        assert consumer.take_departed() == []
        second = attached.producer()
        assert second.producer_index == 0
        second.write(_make_batch(0, 100, 3))
        [(_, records)] = consumer.read(100, timeout_s=1)
        np.testing.assert_array_equal(records["seq"], [100, 101, 102])
        attached.close()


def test_producer_blobs_arrive_through_the_consumer():
    with MpscRing.create(
        "t-mblob", STRESS_RECORD, capacity=8, max_producers=2, blob_bytes_field="blob_bytes"
    ) as ring:
        consumer = ring.consumer()
        attached = MpscRing.attach(ring.name, STRESS_RECORD, blob_bytes_field="blob_bytes")
        producer = attached.producer()
        token_ids = np.arange(100, dtype=np.int32)  # 400 bytes, 7 slots of 64 bytes
        producer.write_with_blob(_make_batch(0, 0, 1)[0], token_ids)
        [(index, records, blobs)] = consumer.read_with_blobs(10, timeout_s=1)
        assert index == 0 and records["blob_bytes"][0] == 400
        np.testing.assert_array_equal(blobs[0].view(np.int32), token_ids)
        attached.close()


def test_departure_reaches_the_caller_before_records_of_the_entrys_next_producer():
    with MpscRing.create("t-order", STRESS_RECORD, capacity=16, max_producers=1) as ring:
        consumer = ring.consumer()
        attached = MpscRing.attach(ring.name, STRESS_RECORD)
        entry = PartyRecord(attached.segment.buf, attached.layouts[0].writer_party_offset, "p")

        def successor() -> None:  # claims the entry the moment the consumer frees it
            while entry.state() != PartyState.ABSENT:
                time.sleep(0.0005)
            attached.producer().write(_make_batch(7, 0, 2))

        attached.producer().close()
        thread = threading.Thread(target=successor)
        thread.start()
        # this call frees the entry (at its first wait slice); the successor's records
        # must not come out of the same call, before the caller has seen the departure
        assert consumer.read(10, timeout_s=1) == []
        thread.join(5)
        assert consumer.take_departed() == [0]
        [(index, records)] = consumer.read(10, timeout_s=1)
        assert index == 0 and records["producer"].tolist() == [7, 7]
        attached.close()
