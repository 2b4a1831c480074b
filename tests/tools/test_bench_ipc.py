"""`ringllm bench ipc` runs end to end with tiny counts and reports every figure.

Behaviour only: the figures themselves are timings and are not checked (noisy machine).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from ringllm.ipc.shm import list_segments
from ringllm.tools import bench_ipc


def test_bench_ipc_runs_and_writes_every_metric(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_ipc.add_parser(parser.add_subparsers())
    json_path = tmp_path / "ipc.json"
    args = parser.parse_args(
        ["ipc", "--round-trips", "200", "--wakeups", "5", "--wakeup-gap-s", "0.001"]
        + ["--single-records", "500", "--batched-records", "1280", "--batch", "64"]
        + ["--load-processes", "1", "--json", str(json_path)]
    )
    assert args.func(args) == 0
    results = json.loads(json_path.read_text())
    transports = [name for name in ("rings", "zmq+msgpack") if name in results]
    assert transports[0] == "rings"
    for name in transports:
        measured = results[name]
        for key in ("round_trip_idle", "round_trip_loaded", "wakeup"):
            assert 0 < measured[key]["p50_us"] <= measured[key]["p99_us"]
        assert 1 <= measured["wakeup"]["samples"] <= 5  # records that arrive together: one sample
        for key in ("single", "batched", "batched_transport_only"):
            assert measured[f"records_per_s_{key}"] > 0
    table = capsys.readouterr().out
    assert "round trip p50, idle (us)" in table and "records/s, 64 per publish" in table
    # the benchmark removed its rings (other sessions' segments may come and go meanwhile)
    assert not [name for name in list_segments() if name.startswith(f"ringllm_{os.getpid()}_")]


def test_ring_encoder_writes_the_same_bytes_as_numpy():
    requests = [bench_ipc.make_request(i) for i in range(7)]
    encoded = np.frombuffer(bench_ipc.encode_requests(requests), bench_ipc.REQUEST)
    expected = np.array(requests, bench_ipc.REQUEST)  # numpy's own tuple conversion
    assert encoded.tobytes() == expected.tobytes()
    assert encoded["token_ids"][3].tolist() == requests[3][3]
    assert bench_ipc.encode_request(requests[2]) == expected[2:3].tobytes()
