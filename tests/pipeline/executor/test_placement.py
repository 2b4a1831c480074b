"""Several hosts, the parts that need no second host: placement, the config's refusals, the
node link's frames and liveness, the head refusing a stranger, and --headless's flags."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ringllm.pipeline.config import EngineConfig, ParallelConfig
from ringllm.pipeline.executor import host_link as nl
from ringllm.pipeline.executor.placement import NodeLayout, local_address, parse_store_address


def test_placement_keeps_tp_groups_inside_a_host():
    layout = NodeLayout.of(
        ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2)
    )
    assert [layout.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4  # stage 0 | stage 1
    assert layout.local_ranks == [0, 1, 2, 3] and not layout.answers_here
    assert layout.for_node(1).local_ranks == [4, 5, 6, 7] and layout.for_node(1).answers_here
    uneven = layout.with_sizes([3, 5])
    assert uneven.local_count == 3 and uneven.for_node(1).local_ranks == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="ranks per host"):
        layout.with_sizes([4, 3])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nnodes=2, tensor_parallel_size=3), "do not share out evenly between 2 hosts"),
        (dict(nnodes=2, node_rank=2, tensor_parallel_size=2), "node_rank: must be in"),
        (dict(nnodes=2, tensor_parallel_size=2, data_parallel_size=2), "data_parallel_size"),
        (dict(nnodes=0), "nnodes: must be >= 1"),
        (dict(master_port=70000), "not a TCP port"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s"),
        (dict(host_heartbeat_timeout_s=0.5), "host_heartbeat_timeout_s: must be >= 1 second"),
        (dict(distributed_executor_backend="slurm"), "is not one of"),
        (dict(distributed_executor_backend="ray", nnodes=2, tensor_parallel_size=2), "Ray places"),
    ],
)
def test_bad_host_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_addresses():
    assert parse_store_address("tcp://10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_store_address("/tmp/ringllm-tp-x/store") is None
    assert local_address("127.0.0.1") == "127.0.0.1"


def _pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    return nl.NodeLink(client, "client"), nl.NodeLink(accepted, "server")


def test_frames_arrive_whole_and_in_order():
    a, b = _pair()
    try:
        big = np.arange(1 << 18, dtype=np.int32).tobytes()  # 1 MiB: several recv calls
        a.send(nl.BATCH, b"r1", b"")
        a.send(nl.BATCH, b"r2", big)
        a.send(nl.RESULT, b"", b"x")
        assert b.recv(5.0) == (nl.BATCH, b"r1", b"")
        assert b.recv(5.0) == (nl.BATCH, b"r2", big)
        assert b.recv(5.0) == (nl.RESULT, b"", b"x")
        assert b.recv(0.05) is None  # nothing more: a timeout, not an error
    finally:
        a.close()
        b.close()


def test_a_closed_or_garbled_peer_is_an_error_and_silence_is_counted():
    a, b = _pair()
    a.close(bye=True)
    assert b.recv(5.0)[0] == nl.BYE
    with pytest.raises(nl.LinkClosedError, match="closed the connection"):
        b.recv(5.0)
    b.close()
    a, b = _pair()
    a.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a ringllm node link
    with pytest.raises(nl.LinkClosedError, match="malformed frame"):
        b.recv(5.0)
    a.close()
    b.close()
    a, b = _pair()
    try:
        time.sleep(0.2)
        assert b.silent_for() >= 0.2
        with pytest.raises(nl.LinkClosedError, match="closed"):
            a.close()
            a.send(nl.HEARTBEAT)
    finally:
        b.close()


def test_the_head_refuses_a_host_without_its_token():
    from ringllm.pipeline.executor.remote_hosts import RemoteNodes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    parallel = ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=port)
    remote = RemoteNodes(NodeLayout.of(parallel), parallel)
    remote.start({"model": "unused"})
    try:
        host, _, relay_port = remote.relay_address.rpartition(":")
        stranger = nl.NodeLink.dial(host, int(relay_port), "head", 5.0)
        stranger.send(nl.HELLO, b"1 not-the-token")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not stranger.closed:
            remote.poll_start()
            try:
                if stranger.recv(0.05) is None:
                    continue
            except nl.LinkClosedError:
                break
        assert not remote.links and remote.missing() == [1]
        stranger.close()
        friend = nl.NodeLink.dial(host, int(relay_port), "head", 5.0)
        friend.send(nl.HELLO, f"1 {remote.token}".encode())
        friend.send(nl.READY, b"ready 12")
        while remote.ready_blocks() is None and time.monotonic() < deadline + 5:
            remote.poll_start()
            time.sleep(0.01)
        assert remote.ready_blocks() == [12]
        friend.close()
    finally:
        remote.close()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--headless"], "--headless: a host that runs ranks only needs --nnodes"),
        (["--headless", "--nnodes", "2", "--node-rank", "0", "--tensor-parallel-size", "2"],
         "node rank 0 is the head"),
    ],
)  # fmt: skip
def test_headless_flags_are_checked(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "ringllm.server.cli", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def test_a_headless_host_waits_for_its_head_and_stops_on_sigterm():
    """No head yet: it says it waits, and SIGTERM ends it at once with exit 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringllm.server.cli", "--headless", "--nnodes", "2",
         "--node-rank", "1", "--tensor-parallel-size", "2", "--master-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("waiting for the head" in x for x in lines):
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    reader.join(timeout=5)
    assert any("waiting for the head" in x for x in lines), lines
