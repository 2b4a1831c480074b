"""Streams nobody reads cannot push the server's memory: unread outputs are capped in bytes.

Raw sockets that read nothing send long streaming requests (n=8, logprobs=20). The kernel
takes a stream's first megabytes (the server's send buffer grows to tcp_wmem's maximum,
4 MiB by default); then its writes stall and its outputs wait in the front end's queues,
and once they pass --max-queued-output-bytes (or all requests' together pass
--max-queued-output-bytes-total) the request is aborted, long before
--stream-write-timeout-s. Each stream is sized to send several times what the kernel can
take, so every one of them must pass the cap. Meanwhile a reading client, one request
after another, is served in full, and the server's resident memory stays within a bound.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest

from tests.server.conftest import ENGINE_KWARGS, _flags, launched
from tests.server.test_hostile_clients import RUNNING, Guarded

WAITING = "ringllm:num_requests_waiting"
MODEL = "tiny-llama"

NUM_SILENT = 10
N = 8
LOGPROBS = 20
MAX_TOKENS = 2000
PER_REQUEST_BYTES = 256 << 10
# below what the silent streams reach together under the per-request cap: both caps act
TOTAL_BYTES = 2 << 20
# Above the resident memory the server had before the flood: the unread outputs' cap (one
# output may pass it), per silent stream aiohttp's write buffer (64 KiB) and the chunk
# waiting on it, and the allocator's slack.
RSS_BOUND_BYTES = TOTAL_BYTES + NUM_SILENT * (256 << 10) + (48 << 20)
FLOOD_TIMEOUT_S = 90


def log(server: Guarded) -> str:
    return server.log_path.read_text(errors="replace")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def kernel_send_buffer_bytes() -> int:
    """The most a TCP socket's send buffer grows to."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        return int(f.read().split()[2])


class PeakRss(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.02)


def stream_request(port: int, max_tokens: int, rcvbuf: int | None) -> socket.socket:
    body = json.dumps(
        {"prompt": "x", "n": N, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
         "logprobs": LOGPROBS}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + body)
    return sock


def stream_bytes(port: int, max_tokens: int) -> int:
    """What a silent stream's request sends in all, measured on a short one read in full."""
    with stream_request(port, max_tokens, rcvbuf=None) as sock:
        received = bytearray()
        while not received.endswith(b"\r\n0\r\n\r\n"):  # the body's last chunk
            chunk = sock.recv(1 << 16)
            assert chunk, "the stream ended early"
            received += chunk
    return len(received)


@pytest.fixture(scope="module")
def capped(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--engine-process", "--served-model-name", MODEL,
        "--stream-write-timeout-s", "300",  # what drops them here is the cap, not this
        "--max-queued-output-bytes", str(PER_REQUEST_BYTES),
        "--max-queued-output-bytes-total", str(TOTAL_BYTES),
        *_flags({**ENGINE_KWARGS, "max_num_seqs": NUM_SILENT * N + 8}),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("capped")) as (proc, url, log_path):
        yield Guarded(url, proc.pid, server_model, log_path)


def test_unread_streams_are_aborted_and_memory_stays_bounded(capped):
    sent = stream_bytes(capped.port, 20) * MAX_TOKENS // 20
    if sent < 2 * kernel_send_buffer_bytes():
        pytest.skip(f"a silent stream's {sent} bytes would not fill this kernel's buffers twice")
    with openai.OpenAI(base_url=capped.url + "/v1", api_key="none", max_retries=0) as client:
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=4)
        baseline = rss_bytes(capped.pid)
        peak = PeakRss(capped.pid)
        peak.start()
        socks = [stream_request(capped.port, MAX_TOKENS, rcvbuf=2048) for _ in range(NUM_SILENT)]
        try:
            # a reading client, one request after another, is served in full meanwhile:
            # never taken for one that stopped reading
            deadline = time.monotonic() + FLOOD_TIMEOUT_S
            served = 0
            while log(capped).count("stopped reading") < NUM_SILENT:
                assert time.monotonic() < deadline, log(capped)[-3000:]
                chunks = client.completions.create(
                    model=MODEL,
                    prompt="hello",
                    max_tokens=16,
                    stream=True,
                    n=2,
                    logprobs=5,
                    extra_body={"ignore_eos": True},
                )
                assert sum(len(ch.logprobs.tokens) for c in chunks for ch in c.choices) == 32
                served += 1
            # every silent request was aborted in the engine (its handler still waits on
            # the stalled socket: the stream itself is the write timeout's to drop); the
            # gauges move with the engine's next step
            while capped.metric(RUNNING) + capped.metric(WAITING):
                assert time.monotonic() < deadline, log(capped)[-3000:]
                time.sleep(0.05)
        finally:
            peak.done.set()
            peak.join()
            for sock in socks:
                sock.close()
        grown = peak.peak - baseline
        assert grown < RSS_BOUND_BYTES, f"resident memory grew {grown >> 20} MiB"
        assert log(capped).count("stopped reading") == NUM_SILENT
        assert "Traceback" not in log(capped)
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).usage
