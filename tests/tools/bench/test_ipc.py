"""`ringllm bench ipc` runs end to end with tiny counts and reports every figure.

Behaviour only: the figures themselves are timings and are not checked (noisy machine).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from ringllm.ipc.shm import list_segments
from ringllm.tools.bench import ipc as bench_ipc


def test_bench_ipc_runs_and_writes_every_metric(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_ipc.add_parser(parser.add_subparsers())
    json_path = tmp_path / "ipc.json"
    args = parser.parse_args(
        ["ipc", "--round-trips", "200", "--wakeups", "5", "--wakeup-gap-s", "0.001"]
        + ["--single-records", "500", "--batched-records", "1280", "--batch", "64"]
        + ["--load-processes", "1", "--spin-probe-s", "0.05", "--json", str(json_path)]
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
    probes = results["machine"]["probes"]
    for name in ("spin_with_pause", "spin_plain_loads"):
        assert probes[name]["iterations"] > probes[name]["gaps_over_5us"] >= 0
    if len(os.sched_getaffinity(0)) >= 2:
        trip = probes["cacheline_round_trip"]
        assert 0 < trip["p50_us"] <= trip["p99_us"] and trip["samples"] > 0
    table = capsys.readouterr().out
    assert "round trip p50, idle (us)" in table and "records/s, 64 per publish" in table
    assert "spin with pause" in table
    # the benchmark removed its rings (other sessions' segments may come and go meanwhile)
    assert not [name for name in list_segments() if name.startswith(f"ringllm_{os.getpid()}_")]


def test_probes_refuse_what_they_cannot_measure():
    from ringllm.ipc import probes

    with pytest.raises(ValueError, match="must differ"):
        probes.cacheline_round_trips(0, 0, 10)
    with pytest.raises(OSError, match="CPU 4095"):
        probes.cacheline_round_trips(0, 4095, 10)
    with pytest.raises(ValueError, match="seconds"):
        probes.spin_gaps(0.0, True)
    with pytest.raises(ValueError, match="count"):
        probes.cacheline_round_trips(0, 1, 0)


def test_ring_encoder_writes_the_same_bytes_as_numpy():
    requests = [bench_ipc.make_request(i) for i in range(7)]
    encoded = np.frombuffer(bench_ipc.encode_requests(requests), bench_ipc.REQUEST)
    expected = np.array(requests, bench_ipc.REQUEST)  # numpy's own tuple conversion
    assert encoded.tobytes() == expected.tobytes()
    assert encoded["token_ids"][3].tolist() == requests[3][3]
    assert bench_ipc.encode_request(requests[2]) == expected[2:3].tobytes()
