"""One TCP connection between the head and another host: the batch records out, the
answers back, heartbeats both ways.

Why a socket of its own, not the process group or the store: the records are a stream
(ordered, one writer, one reader per host), a few hundred bytes to a few MB each; a TCP
stream carries them as they are, with no per-message rendezvous (a gloo send needs the
receiver to know the size first) and no polling (a store is key-value). Only records
travel, never pickle: a frame is

    header   <B kind, I record bytes, I blob bytes>   (9 bytes, little-endian)
    record   the fixed-layout record's bytes (pipeline/executor/batch_records.py)
    blob     its blob's bytes (may be empty)

Kinds: HELLO (node -> head: record = utf-8 "node_rank token"), BATCH (head -> node: a
batch-ring record, republished there), RESULT (node -> head: a result-ring record of the
answering rank), READY (node -> head: "ready <num_blocks>" or "error <message>", once
its ranks started), ERROR (node -> head: a rank died or failed, utf-8 text), HEARTBEAT,
BYE (either side: a clean end).

Liveness: each side sends a HEARTBEAT every HEARTBEAT_S while it has nothing else to
send, and counts the other side dead when nothing arrived for `heartbeat_timeout_s` (the
engine's --host-heartbeat-timeout-s, HEARTBEAT_TIMEOUT_S by default: a host that died, or
whose network dropped, without closing the connection) or the connection closed. A send
that cannot go on for SEND_TIMEOUT_S fails too: nothing waits forever on a peer that
stopped reading.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

HELLO, BATCH, RESULT, READY, ERROR, HEARTBEAT, BYE = range(1, 8)
KIND_NAMES = {1: "HELLO", 2: "BATCH", 3: "RESULT", 4: "READY", 5: "ERROR", 6: "HEARTBEAT", 7: "BYE"}
HEADER = struct.Struct("<BII")
MAX_FRAME_BYTES = 1 << 30
HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 10.0


def republish(writer, dtype, record: bytes, blob: bytes):
    """A frame's record (of `dtype`) and blob written on a ring, as the sender's ring held
    them; the record, as an array."""
    import numpy as np

    rec = np.frombuffer(record, dtype).copy()
    if blob:
        writer.write_with_blob(rec, np.frombuffer(blob, np.uint8))
    else:
        writer.write(rec)
    return rec


class LinkClosedError(ConnectionError):
    """The other side closed the connection, broke it, or stopped answering."""


class NodeLink:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)  # sends; receives wait in select first
        self.sock = sock
        self.peer = peer  # for messages: "node 1 (10.77.0.2:41234)"
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self.last_heard = time.monotonic()
        self.last_sent = time.monotonic()
        self.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        self.closed = False

    @classmethod
    def dial(cls, host: str, port: int, peer: str, timeout_s: float) -> NodeLink:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        return cls(sock, peer)

    def send(self, kind: int, record: bytes = b"", blob: bytes = b"") -> None:
        frame = HEADER.pack(kind, len(record), len(blob))
        with self._send_lock:
            if self.closed:
                raise LinkClosedError(f"{self.peer}: the connection is closed")
            try:
                if len(blob) < 1 << 16:  # one write for the usual small frame
                    self.sock.sendall(frame + record + blob)
                else:
                    self.sock.sendall(frame + record)
                    self.sock.sendall(blob)
            except OSError as exc:  # socket.timeout included: the peer stopped reading
                raise LinkClosedError(f"{self.peer}: sending failed ({exc})") from exc
            self.last_sent = time.monotonic()

    def recv(self, timeout_s: float | None) -> tuple[int, bytes, bytes] | None:
        """The next frame, or None when none came within `timeout_s` (None: wait)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            frame = self._take_frame()
            if frame is not None:
                self.last_heard = time.monotonic()
                return frame
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                return None
            try:
                data = self.sock.recv(1 << 20)
            except OSError as exc:
                raise LinkClosedError(f"{self.peer}: the connection broke ({exc})") from exc
            if not data:
                raise LinkClosedError(f"{self.peer}: the other side closed the connection")
            self._buffer += data
            self.last_heard = time.monotonic()

    def _take_frame(self) -> tuple[int, bytes, bytes] | None:
        buffer = self._buffer
        if len(buffer) < HEADER.size:
            return None
        kind, record_bytes, blob_bytes = HEADER.unpack_from(buffer)
        if kind not in KIND_NAMES or record_bytes + blob_bytes > MAX_FRAME_BYTES:
            raise LinkClosedError(
                f"{self.peer}: a malformed frame (kind {kind}, {record_bytes} + {blob_bytes} "
                "bytes): not a ringllm node link"
            )
        end = HEADER.size + record_bytes + blob_bytes
        if len(buffer) < end:
            return None
        record = bytes(buffer[HEADER.size : HEADER.size + record_bytes])
        blob = bytes(buffer[HEADER.size + record_bytes : end])
        del buffer[:end]
        return kind, record, blob

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def is_silent(self) -> bool:
        """Nothing heard for longer than a live peer's heartbeats allow."""
        return self.silent_for() > self.heartbeat_timeout_s

    def heartbeat_if_idle(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(HEARTBEAT)

    def close(self, bye: bool = False) -> None:
        if bye and not self.closed:
            try:
                self.send(BYE)
            except LinkClosedError:
                pass
        with self._send_lock:
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
