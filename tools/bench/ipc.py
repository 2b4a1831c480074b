"""`ringllm bench ipc`: the shared-memory rings against pyzmq + msgpack, side by side.

Both transports carry the same realistic request (40 int32 token ids + 12 sampling
fields + ids and a send timestamp) between two processes, codec included:

    rings        encode: `RecordPacker.pack` of the Python request tuples (ipc/packer.py:
                         one C call per batch writes the values as REQUEST records), then
                         `write_bytes`: one C call copies the bytes into the slots and
                         publishes them
                 decode: `read()` copies the records out as a numpy structured array,
                         the form the engine consumes (columns, no per-request objects);
                         the echo process writes that array back with `write()
    zmq+msgpack  encode: msgpack.packb of the request list; PAIR socket over ipc://
                 decode: msgpack.unpackb back to Python lists

Measured: round-trip latency p50/p99 (ping-pong, idle machine and with two CPU-bound
processes running), idle wake-up latency (receiver asleep: futex / zmq poll), and
records/s one record per publish and `--batch` records per publish. Then the machine under
the rings (ipc/probes.c): a cache line bounced between two pinned threads (the floor of any
round trip between those CPUs), and how often a spinning thread loses its CPU for more than
5 us, spinning with a CPU pause and with plain loads (a hypervisor that exits on pause
loops shows as more gaps with the pause). Timings use
CLOCK_MONOTONIC (`time.perf_counter_ns`), which all processes share.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time

import numpy as np

from ringllm.ipc.packer import RecordPacker
from ringllm.ipc.ring import Ring
from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import write_result_json

REQUEST = np.dtype(
    [
        ("request_id", "<u8"),
        ("send_ns", "<u8"),
        ("num_tokens", "<u4"),
        ("token_ids", "<i4", 40),
        ("temperature", "<f4"),
        ("top_p", "<f4"),
        ("top_k", "<i4"),
        ("min_p", "<f4"),
        ("presence_penalty", "<f4"),
        ("frequency_penalty", "<f4"),
        ("repetition_penalty", "<f4"),
        ("max_tokens", "<i4"),
        ("min_tokens", "<i4"),
        ("seed", "<i8"),
        ("n", "<i4"),
        ("logprobs", "<i4"),
    ]
)
SPAWN = multiprocessing.get_context("spawn")
SEND_NS = 1  # position of send_ns in the request tuple
# NOTE: a freshly spawned echo process is not done starting when it answers: importing
# numpy starts OpenBLAS's worker thread, which busy-waits for ~0.1 s before it sleeps, a
# third runnable task on a 2-core machine (it tripled the first 3,000 ring round trips).
# Both transports wait this long after their echo's first answer before timing.
SETTLE_S = 0.3
REQUEST_PACKER = RecordPacker(REQUEST)


def encode_request(request: tuple) -> bytes:
    """The bytes of one REQUEST record."""
    return REQUEST_PACKER.pack((request,))


def encode_requests(requests: list[tuple]) -> bytes:
    """The bytes of consecutive REQUEST records, ready for `RingWriter.write_bytes`."""
    return REQUEST_PACKER.pack(requests)


def make_request(request_id: int) -> tuple:
    token_ids = [(request_id * 31 + i) % 50_000 for i in range(40)]
    sampling = (0.7, 0.9, 50, 0.05, 0.0, 0.1, 1.1, 256, 1, 1234 + request_id, 1, 5)
    return (request_id, time.perf_counter_ns(), 40, token_ids, *sampling)


# -- child processes (module level so that spawn can import them) -------------------------
def _burn_cpu() -> None:
    while True:
        pass


def _ring_echo(ping_name: str, pong_name: str, count: int) -> None:
    ping, pong = Ring.attach(ping_name, REQUEST), Ring.attach(pong_name, REQUEST)
    reader, writer = ping.reader(), pong.writer()
    for _ in range(count):
        writer.write(reader.read(1, timeout_s=None))
    ping.close()
    pong.close()


def _ring_sink(name: str, total: int, batch: int, result) -> None:
    ring = Ring.attach(name, REQUEST)
    reader = ring.reader()
    received, latencies_ns = 0, []
    # The consumer takes whatever is there, as the engine core does; `batch` only sizes
    # the producer's publishes.
    while received < total:
        records = reader.read(4096, timeout_s=None)
        received += len(records)
        if total <= 1000:  # wake-up mode: one record at a time, latency per record
            latencies_ns.append(time.perf_counter_ns() - int(records["send_ns"][-1]))
    result.send((time.perf_counter_ns(), latencies_ns))
    ring.close()


def _zmq_echo(address: str, count: int) -> None:
    import msgpack
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    for _ in range(count):
        socket.send(msgpack.packb(msgpack.unpackb(socket.recv())))
    socket.close(linger=1000)
    context.term()


def _zmq_sink(address: str, total: int, batch: int, decode: bool, result) -> None:
    import msgpack
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    received, latencies_ns = 0, []
    while received < total:
        message = socket.recv()
        if not decode:  # transport only: every message but the first holds `batch` records
            received += batch if len(message) > 1 else 0
            continue
        requests = msgpack.unpackb(message)
        received += len(requests)
        if total <= 1000 and requests:
            latencies_ns.append(time.perf_counter_ns() - requests[-1][SEND_NS])
    result.send((time.perf_counter_ns(), latencies_ns))
    socket.close()
    context.term()


# -- the parent side of each measurement ---------------------------------------------------
class RingTransport:
    name = "rings"

    def round_trips_ns(self, count: int) -> list[int]:
        with (
            Ring.create("bench-ping", REQUEST, 64) as ping,
            Ring.create("bench-pong", REQUEST, 64) as pong,
        ):
            writer, reader = ping.writer(), pong.reader()
            echo = SPAWN.Process(target=_ring_echo, args=(ping.name, pong.name, count + 1))
            echo.start()
            samples, requests = [], [make_request(i) for i in range(count + 1)]
            write_bytes, read = writer.write_bytes, reader.read
            write_bytes(encode_request(requests[0]))  # untimed: the echo process is up
            read(1, timeout_s=60)
            time.sleep(SETTLE_S)
            for request_id in range(1, count + 1):
                start_ns = time.perf_counter_ns()
                write_bytes(encode_request(requests[request_id]))
                reply = read(1, timeout_s=30)
                samples.append(time.perf_counter_ns() - start_ns)
                if len(reply) != 1 or reply["request_id"][0] != request_id:
                    raise RuntimeError(f"ring echo process gave {reply} for request {request_id}")
            echo.join(30)
        return samples

    def stream(
        self, total: int, batch: int, gap_s: float = 0.0, pre_encoded: bool = False
    ) -> tuple[float, list[int]]:
        with Ring.create("bench-stream", REQUEST, 4096) as ring:
            writer = ring.writer(full_timeout_s=60)
            parent_end, child_end = SPAWN.Pipe()
            sink = SPAWN.Process(target=_ring_sink, args=(ring.name, total, batch, child_end))
            sink.start()
            _wait_attached(ring)
            requests = [make_request(i) for i in range(batch)]
            encoded = np.array(requests, REQUEST)
            start_ns = time.perf_counter_ns()
            for _ in range(total // batch):
                if pre_encoded:
                    writer.write(encoded)
                    continue
                if gap_s:
                    time.sleep(gap_s)
                    requests[-1] = make_request(0)  # fresh send_ns
                writer.write_bytes(encode_requests(requests))  # wraps in the C copy
            end_ns, latencies_ns = parent_end.recv()
            sink.join(30)
        return total / ((end_ns - start_ns) / 1e9), latencies_ns


class ZmqTransport:
    name = "zmq+msgpack"

    def __init__(self) -> None:
        import msgpack
        import zmq

        self._msgpack, self._zmq = msgpack, zmq
        self._folder = tempfile.mkdtemp(prefix="ringllm-bench-")

    def _bind(self):
        context = self._zmq.Context()
        socket = context.socket(self._zmq.PAIR)
        address = f"ipc://{self._folder}/sock-{time.monotonic_ns()}"
        socket.bind(address)
        return context, socket, address

    def round_trips_ns(self, count: int) -> list[int]:
        context, socket, address = self._bind()
        echo = SPAWN.Process(target=_zmq_echo, args=(address, count + 1))
        echo.start()
        packb, unpackb, samples = self._msgpack.packb, self._msgpack.unpackb, []
        requests = [make_request(i) for i in range(count + 1)]
        socket.send(packb(requests[0]))  # untimed: the echo process is up
        unpackb(socket.recv())
        time.sleep(SETTLE_S)
        for request_id in range(1, count + 1):
            start_ns = time.perf_counter_ns()
            socket.send(packb(requests[request_id]))
            reply = unpackb(socket.recv())
            samples.append(time.perf_counter_ns() - start_ns)
            if reply[0] != request_id:
                raise RuntimeError(f"zmq echo process gave {reply} for request {request_id}")
        echo.join(30)
        socket.close()
        context.term()
        return samples

    def stream(
        self, total: int, batch: int, gap_s: float = 0.0, pre_encoded: bool = False
    ) -> tuple[float, list[int]]:
        context, socket, address = self._bind()
        parent_end, child_end = SPAWN.Pipe()
        sink_args = (address, total, batch, not pre_encoded, child_end)
        sink = SPAWN.Process(target=_zmq_sink, args=sink_args)
        sink.start()
        socket.send(self._msgpack.packb([]))  # returns once connected...
        requests = [make_request(i) for i in range(batch)]
        packb = self._msgpack.packb
        encoded = packb(requests)
        start_ns = time.perf_counter_ns()
        for _ in range(total // batch):
            if pre_encoded:
                socket.send(encoded)
                continue
            if gap_s:
                time.sleep(gap_s)
                requests[-1] = make_request(0)
            socket.send(packb(requests))
        end_ns, latencies_ns = parent_end.recv()
        sink.join(30)
        socket.close()
        context.term()
        return total / ((end_ns - start_ns) / 1e9), latencies_ns

    def close(self) -> None:
        for name in os.listdir(self._folder):
            os.unlink(os.path.join(self._folder, name))
        os.rmdir(self._folder)


def _wait_attached(ring: Ring) -> None:
    reader_pid_offset = ring.layout.reader_party_offset(0)
    deadline = time.monotonic() + 30
    while not int.from_bytes(ring.segment.buf[reader_pid_offset : reader_pid_offset + 8], "little"):
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark reader did not attach within 30 s")
        time.sleep(0.01)


# -- the run ------------------------------------------------------------------------------
def _percentiles_us(samples_ns: list[int], warmup_fraction: float = 0.05) -> dict[str, float]:
    kept = np.asarray(samples_ns[int(len(samples_ns) * warmup_fraction) :], dtype=np.float64)
    p50, p99 = np.percentile(kept, [50, 99]) / 1e3
    return {"p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2), "samples": len(kept)}


def _with_cpu_load(num_burners: int, measure):
    burners = [SPAWN.Process(target=_burn_cpu, daemon=True) for _ in range(num_burners)]
    for burner in burners:
        burner.start()
    try:
        time.sleep(0.5)  # let them start spinning
        return measure()
    finally:
        for burner in burners:
            burner.terminate()
            burner.join(10)


def measure_transport(transport, args: argparse.Namespace) -> dict:
    results = {"round_trip_idle": _percentiles_us(transport.round_trips_ns(args.round_trips))}
    results["round_trip_loaded"] = _percentiles_us(
        _with_cpu_load(args.load_processes, lambda: transport.round_trips_ns(args.round_trips))
    )
    _, wake_ns = transport.stream(args.wakeups, 1, gap_s=args.wakeup_gap_s)
    results["wakeup"] = _percentiles_us(wake_ns, warmup_fraction=0.0)
    rate, _ = transport.stream(args.single_records, 1)
    results["records_per_s_single"] = round(rate)
    rate, _ = transport.stream(args.batched_records, args.batch)
    results["records_per_s_batched"] = round(rate)
    rate, _ = transport.stream(args.batched_records, args.batch, pre_encoded=True)
    results["records_per_s_batched_transport_only"] = round(rate)
    return results


# (label, result key, sub-key, higher is better, target from the issue)
_TABLE = [
    ("round trip p50, idle (us)", "round_trip_idle", "p50_us", False, ">= 10x"),
    ("round trip p99, idle (us)", "round_trip_idle", "p99_us", False, "rings <= 10 us"),
    ("round trip p50, loaded (us)", "round_trip_loaded", "p50_us", False, ""),
    ("round trip p99, loaded (us)", "round_trip_loaded", "p99_us", False, "rings <= 10 us"),
    ("idle wake-up p50 (us)", "wakeup", "p50_us", False, ""),
    ("idle wake-up p99 (us)", "wakeup", "p99_us", False, ""),
    ("records/s, 1 per publish", "records_per_s_single", None, True, ""),
    ("records/s, {batch} per publish", "records_per_s_batched", None, True, ">= 2x"),
    ("  same, pre-encoded (transport)", "records_per_s_batched_transport_only", None, True, ""),
]


def _value(results: dict, key: str, sub: str | None) -> float:
    return results[key][sub] if sub else results[key]


def _rows(ring: dict, zmq: dict | None, batch: int) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for label, key, sub, higher_is_better, target in _TABLE:
        ring_value = _value(ring, key, sub)
        zmq_cell = ratio_cell = "-"
        if zmq is not None:
            zmq_value = _value(zmq, key, sub)
            zmq_cell = f"{zmq_value:,}"
            ratio = ring_value / zmq_value if higher_is_better else zmq_value / ring_value
            ratio_cell = f"{ratio:.1f}x"
        label = label.format(batch=batch)
        rows.append((label, f"{ring_value:,}", zmq_cell, ratio_cell, target))
    return rows


def print_table(ring: dict, zmq: dict | None, batch: int) -> None:
    header = ("metric", "rings", "zmq+msgpack", "rings vs zmq", "target")
    rows = [header, *_rows(ring, zmq, batch)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        print("  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def measure_machine(args: argparse.Namespace) -> dict:
    """What a round trip is made of here (ipc/probes.c): one cache line bounced between the
    first two CPUs this process may use, and how often a spinning thread loses the CPU,
    spinning with a CPU pause and without (a hypervisor's pause-loop exits show as more gaps
    with the pause)."""
    from ringllm.ipc import probes

    measured: dict = {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        samples = probes.cacheline_round_trips(cpus[0], cpus[1], args.round_trips)
        measured["cacheline_round_trip"] = {"cpus": cpus[:2], **_percentiles_us(samples)}
    for name, pause in (("spin_with_pause", True), ("spin_plain_loads", False)):
        iterations, gaps, max_gap_ns = probes.spin_gaps(args.spin_probe_s, pause)
        measured[name] = {
            "seconds": args.spin_probe_s,
            "iterations": iterations,
            "gaps_over_5us": gaps,
            "max_gap_us": round(max_gap_ns / 1e3, 1),
        }
    return measured


def print_machine(probes: dict) -> None:
    trip = probes.get("cacheline_round_trip")
    if trip:
        print(
            f"cache line CPU {trip['cpus'][0]} <-> {trip['cpus'][1]}, round trip: "
            f"p50 {trip['p50_us']} us, p99 {trip['p99_us']} us (the floor under any round trip)"
        )
    for name, label in (("spin_with_pause", "with pause"), ("spin_plain_loads", "plain loads")):
        p = probes[name]
        print(
            f"spin {label:<11} {p['seconds']} s: {p['gaps_over_5us']} gaps > 5 us, "
            f"longest {p['max_gap_us']} us"
        )


def run_bench(args: argparse.Namespace) -> int:
    transports = [RingTransport()]
    try:
        transports.append(ZmqTransport())
    except ImportError:
        print("pyzmq/msgpack not installed (pip install 'ringllm[bench]'): rings only")
    results = {"machine": {"cpus": os.cpu_count(), "load_processes": args.load_processes}}
    try:
        for transport in transports:
            print(f"measuring {transport.name} ...", flush=True)
            results[transport.name] = measure_transport(transport, args)
    finally:
        for transport in transports[1:]:
            transport.close()
    results["machine"]["probes"] = measure_machine(args)
    print_table(results["rings"], results.get("zmq+msgpack"), args.batch)
    print_machine(results["machine"]["probes"])
    if args.json:
        write_result_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register `ipc` under `ringllm bench`."""
    parser = add_command(
        bench_subparsers,
        "ipc",
        help="shared-memory rings vs pyzmq+msgpack: latency, wake-up, throughput",
        description=None,
        run=run_bench,
    )
    parser.add_argument("--round-trips", type=int, default=20_000, help="ping-pongs per run")
    parser.add_argument(
        "--load-processes", type=int, default=2, help="CPU-bound processes in the loaded run"
    )
    parser.add_argument(
        "--wakeups", type=int, default=200, help="records sent to a sleeping receiver"
    )
    parser.add_argument(
        "--wakeup-gap-s", type=float, default=0.005, help="pause before each of those (s)"
    )
    parser.add_argument(
        "--single-records", type=int, default=100_000, help="records sent one per publish"
    )
    parser.add_argument(
        "--batched-records", type=int, default=640_000, help="records sent in batches"
    )
    parser.add_argument(
        "--batch", type=int, default=64, help="records per publish in the batched run"
    )
    parser.add_argument(
        "--spin-probe-s", type=float, default=0.5, help="seconds of each spin-gap probe"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser
