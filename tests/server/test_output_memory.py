"""Streams nobody reads make way for the clients that read, and cannot push the server's memory.

Raw sockets that read nothing send long streaming requests. Each asks for a small segment
size (TCP_MAXSEG) and a 2 KiB receive window, so the server's kernel takes only some tens
of KiB of its stream before its writes stall (with loopback's 64 KiB segments it takes
about 2 MiB: thousands of tokens), and echoes a long prompt with its logprobs, so that
its first chunk stalls it. Then the stream's outputs wait in the front end's queue,
and once they pass the pause watermark (pipeline/frontend/output_queue.py) its request is
paused in the engine: it holds no sequence slot and no KV block, and its unread outputs
stay at about the watermark. The byte caps here are far and the write timeout long: what
stops a silent stream in these tests is the pause alone, so none is dropped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import openai
import pytest

from ringllm.pipeline.frontend.output_queue import PAUSE_BYTES
from tests.server.conftest import ENGINE_KWARGS, _flags, launched
from tests.server.test_hostile_clients import RUNNING, Guarded

WAITING = "ringllm:num_requests_waiting"
GENERATED = "ringllm:generation_tokens_total"
RESTARTS = "ringllm:engine_restarts_total"
MODEL = "tiny-llama"

MAX_NUM_SEQS = 4
NUM_SILENT = MAX_NUM_SEQS  # each stream's first sequence runs at once (fair share)
N = 8
LOGPROBS = 20
MAX_TOKENS = 1200
# its prompt echoed with logprobs: the first chunk fills the kernel's and aiohttp's buffers
ECHO = {"prompt": "hello " * 80, "echo": True}  # 400 tokens
# far above what a paused stream holds, below what an unpaused one would reach
PER_REQUEST_BYTES = 16 << 20
# Above the resident memory the server had before the flood: per silent stream its unread
# outputs (the pause watermark and what comes before the pause takes effect) and its first
# chunk waiting in aiohttp's write buffer (N echoed prompts with their logprobs, 1.4 MB of
# JSON); and the allocator's slack.
RSS_BOUND_BYTES = NUM_SILENT * (2 * PAUSE_BYTES + (4 << 20)) + (48 << 20)
# A reader started after silent streams that hold every slot: served once they are paused
# (each after some tens of tokens), long before one of them ends (MAX_TOKENS).
READER_BOUND_S = 20
FLOOD_TIMEOUT_S = 60
SEGMENT_BYTES = 536


def log(server: Guarded) -> str:
    return server.log_path.read_text(errors="replace")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.02)


def silent_stream(port: int, n: int, max_tokens: int = MAX_TOKENS, **fields) -> socket.socket:
    """A streaming completion whose client reads no byte (until it reads: `read_stream`)."""
    body = json.dumps(
        {"prompt": "x", "n": n, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
         "logprobs": LOGPROBS, **fields}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SEGMENT_BYTES)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + body)
    return sock


def read_stream(sock: socket.socket) -> list[dict]:
    """The rest of a stream's response, read to its end: its events' JSON payloads."""
    received = bytearray()
    while chunk := sock.recv(1 << 16):
        received += chunk
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    data = bytearray()
    while True:  # chunked transfer encoding
        size, _, body = body.partition(b"\r\n")
        if not int(size, 16):
            break
        data += body[: int(size, 16)]
        body = body[int(size, 16) + 2 :]
    events = [e.removeprefix(b"data: ") for e in bytes(data).split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def wait_for(condition, server: Guarded, what: str) -> None:
    deadline = time.monotonic() + FLOOD_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, (
            f"{what}: not within {FLOOD_TIMEOUT_S} s\n" + log(server)[-3000:]
        )
        time.sleep(0.2)


def engine_idle(server: Guarded) -> bool:
    """Nothing running or waiting in the engine (paused requests are neither)."""
    return server.metric(RUNNING) + server.metric(WAITING) == 0


@pytest.fixture(scope="module")
def capped(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--engine-process", "--served-model-name", MODEL,
        "--stream-write-timeout-s", "300",  # what stops them here is the pause, not this
        "--max-queued-output-bytes", str(PER_REQUEST_BYTES),
        *_flags({**ENGINE_KWARGS, "max_num_seqs": MAX_NUM_SEQS}),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("capped")) as (proc, url, log_path):
        yield Guarded(url, proc.pid, server_model, log_path)


def openai_client(server: Guarded) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def streamed_tokens(client: openai.OpenAI, n: int) -> int:
    """A reader's 16-token stream of `n` choices, with logprobs: the tokens it got."""
    chunks = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=16,
        stream=True,
        n=n,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    return sum(len(ch.logprobs.tokens) for c in chunks for ch in c.choices)


def test_unread_streams_are_paused_and_memory_stays_bounded(capped):
    with openai_client(capped) as client:
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=4)
        baseline, aborted = rss_bytes(capped.pid), capped.aborted()
        generated = capped.metric(GENERATED)
        peak = PeakRss(capped.pid)
        peak.start()
        socks = [silent_stream(capped.port, N, **ECHO) for _ in range(NUM_SILENT)]
        try:
            wait_for(lambda: capped.metric(GENERATED) > generated, capped, "the streams run")
            # each one paused once its socket and then its queue filled: all wait for
            # their clients, holding nothing in the engine
            wait_for(lambda: engine_idle(capped), capped, "every silent stream paused")
            assert streamed_tokens(client, n=2) == 32
        finally:
            peak.done.set()
            peak.join()
            for sock in socks:
                sock.close()
        grown = peak.peak - baseline
        assert grown < RSS_BOUND_BYTES, f"resident memory grew {grown >> 20} MiB"
        assert "stopped reading" not in log(capped)  # paused, none dropped at a cap
        # closed, their handlers end and abort the paused requests in the engine
        wait_for(
            lambda: capped.aborted() >= aborted + NUM_SILENT * N, capped, "the streams aborted"
        )
        assert engine_idle(capped)
        assert "Traceback" not in log(capped)
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).usage


def test_a_reader_is_served_while_silent_streams_hold_every_slot(capped):
    """Silent n=1 streams fill every sequence slot (fair share preempts none: each holds
    one); without pauses a reader started after them waits until one of them ends."""
    aborted, generated = capped.aborted(), capped.metric(GENERATED)
    socks = [silent_stream(capped.port, 1, **ECHO) for _ in range(2 * MAX_NUM_SEQS)]

    def slots_held_or_paused() -> bool:
        # every slot held by a silent stream, or the streams already ran and were all
        # paused: on a fast machine each pauses within tens of tokens, and the moments
        # when four hold the slots can fall between two polls (CI, 2026-12-07)
        if capped.metric(RUNNING) == MAX_NUM_SEQS:
            return True
        return capped.metric(GENERATED) > generated and engine_idle(capped)

    try:
        wait_for(slots_held_or_paused, capped, "the silent streams run")
        with openai_client(capped) as client:
            start = time.monotonic()
            assert streamed_tokens(client, n=1) == 16
            served_s = time.monotonic() - start
        assert served_s < READER_BOUND_S, f"the reader took {served_s:.1f} s"
        assert "stopped reading" not in log(capped)
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: capped.aborted() >= aborted + len(socks), capped, "the streams aborted")


# far past what a stream runs before its pause takes effect (the watermark's outputs,
# those its socket took, and the tokens of the grace and of the pause's way to the core)
PAUSED_MAX_TOKENS = 600


def check_paused_stream_reads_exactly(server: Guarded, while_paused=None) -> None:
    """A greedy silent stream, paused once its client has read nothing for long enough;
    `while_paused()` runs then; read at last, it must give the tokens of a stream that
    was never paused (none lost or repeated) and end at its length."""
    with openai_client(server) as client:
        expected = client.completions.create(
            model=MODEL, logprobs=LOGPROBS, max_tokens=PAUSED_MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True}, **ECHO,
        ).choices[0]  # fmt: skip
    generated = server.metric(GENERATED)
    sock = silent_stream(server.port, 1, PAUSED_MAX_TOKENS, temperature=0.0, **ECHO)
    with sock:
        wait_for(lambda: server.metric(GENERATED) > generated, server, "the stream runs")
        wait_for(lambda: engine_idle(server), server, "the stream paused")
        if while_paused is not None:
            while_paused()
        assert server.metric(GENERATED) - generated < PAUSED_MAX_TOKENS  # paused, not finished
        events = read_stream(sock)
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == expected.text
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == expected.logprobs.tokens
    assert choices[-1]["finish_reason"] == "length"


def test_a_stream_that_stops_reading_and_reads_again_gets_its_exact_answer(capped):
    """Paused while its client reads nothing, resumed once it reads: the same tokens as a
    stream that was never paused (greedy), none lost or repeated."""
    check_paused_stream_reads_exactly(capped)


def test_a_paused_stream_is_paused_again_by_a_restarted_core_and_ends_exactly(capped):
    """kill -9 of the engine core while a silent stream is paused: the new core gets the
    request replayed (its prompt and the tokens the front end has), and since its client
    still reads nothing it is paused again there; read at last, the stream gives the tokens
    of one never paused and never restarted."""

    def restart_the_core() -> None:
        restarts = capped.metric(RESTARTS)
        paused_at = capped.metric(GENERATED)
        os.kill(capped.engine_pid(), signal.SIGKILL)
        wait_for(lambda: capped.metric(RESTARTS) > restarts, capped, "the core restarted")
        wait_for(lambda: capped.metric(GENERATED) > paused_at, capped, "the replay runs")
        wait_for(lambda: engine_idle(capped), capped, "the stream paused again")

    check_paused_stream_reads_exactly(capped, restart_the_core)
