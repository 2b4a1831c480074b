"""The head's side of the other hosts (pipeline/executor/placement.py): the rendezvous
store, one `NodeLink` per host, the batch records sent to each, the answers taken back.

    head (engine core process)                                  host n (ringllm serve --headless)
      MultiprocExecutor._send ──> batch ring (its own ranks)       node agent (host_agent.py)
                      └──> NodeLink n: BATCH frames ───────────>  ──> its batch ring ──> its ranks
      result ring <── receiver thread <── RESULT frames ────────  <── its result ring (if its
                                                                       rank answers)

Start-up (`RemoteNodes.start`): the TCPStore master on master_addr:master_port, a relay
listener on master_addr (its port chosen by the OS), and in the store the spec every host
starts its ranks from (the head's engine arguments, a token, the relay's address). Then
`wait_ready` accepts one connection per other host (HELLO: node rank and token) and reads
each host's READY (the KV blocks its ranks can hold) while the head's own ranks start.

After start-up a thread per host reads its frames: RESULT records go onto the head's result
ring (the executor reads them as it reads its own ranks' answers); ERROR and a closed or
silent link make `check()` name the end. Two ends differ in what comes next:

    a rank died there (ERROR)            the host is still up: its agent serves the next
                                         engine at once (a restart of the group)
    the host is lost (link closed or     nothing runs there now: `lost` names the host and
    silent, a send failed, BYE)          when ("host 1 was lost at ..."), and the executor
                                         raises HostLostError, so nobody waits for it

A heartbeat thread keeps each link alive.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time

import numpy as np

from ringllm.pipeline.executor import host_link as nl
from ringllm.pipeline.executor.placement import NodeLayout, store_address

logger = logging.getLogger(__name__)

SPEC_KEY = "ringllm/spec"
ACCEPT_POLL_S = 0.1


class RemoteNodes:
    def __init__(self, layout: NodeLayout, parallel) -> None:
        self.layout = layout
        self.parallel = parallel
        self.address = store_address(parallel)  # what the ranks join their groups through
        self.links: dict[int, nl.NodeLink] = {}
        self._store = None
        self._listener: socket.socket | None = None
        self._token = secrets.token_hex(16)
        self.relay_address = ""
        self._ready: dict[int, str] = {}
        self._dead: str | None = None
        self.lost: str | None = None  # "host N was lost at ..." once a host is gone
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._result_writer = None

    def start(self, engine_args: dict) -> None:
        """The store, the relay listener and the spec: the other hosts may start now."""
        import torch.distributed as dist

        parallel = self.parallel
        timeout = datetime.timedelta(seconds=parallel.distributed_timeout_s)
        try:
            self._store = dist.TCPStore(
                parallel.master_addr,
                parallel.master_port,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise ValueError(
                f"master_addr / master_port: cannot listen on {parallel.master_addr}:"
                f"{parallel.master_port} for the rendezvous ({exc}); is it this host's "
                "address, and is the port free?"
            ) from None
        listener = socket.create_server((parallel.master_addr, 0))
        listener.setblocking(False)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self.relay_address = f"{host}:{port}"
        spec = {
            "engine_args": engine_args,
            "token": self._token,
            "relay": self.relay_address,
            "nnodes": self.layout.nnodes,
        }
        self._store.set(SPEC_KEY, json.dumps(spec))
        # heartbeats from the first connection on: a host whose ranks are ready waits
        # for the head's, and must not take that wait for a dead head
        beat = threading.Thread(target=self._heartbeat, name="ringllm-heartbeat", daemon=True)
        beat.start()
        self._threads.append(beat)

    # ---- start-up ----------------------------------------------------------------------

    def poll_start(self) -> None:
        """Accepts the hosts that dialled in and reads the READY lines that came (call it
        in the executor's start-up loop); raises RuntimeError on a host's error."""
        self._accept()
        for node, link in list(self.links.items()):
            if node in self._ready:
                continue
            frame = link.recv(0.0)
            if frame is None:
                continue
            kind, record, _ = frame
            text = record.decode(errors="replace")
            if kind == nl.READY and text.startswith("ready "):
                self._ready[node] = text
            elif kind in (nl.READY, nl.ERROR):
                message = text.removeprefix("error ")
                if message.startswith("ValueError: "):
                    raise ValueError(message.removeprefix("ValueError: "))
                raise RuntimeError(f"host {node} ({link.peer}) failed to start: {message}")

    def ready_blocks(self) -> list[int] | None:
        """Each other host's KV block count once all are ready, else None."""
        if len(self._ready) < self.layout.nnodes - 1:
            return None
        return [int(self._ready[n].split()[1]) for n in sorted(self._ready)]

    @property
    def token(self) -> str:
        return self._token

    def missing(self) -> list[int]:
        return [n for n in range(1, self.layout.nnodes) if n not in self._ready]

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            link = nl.NodeLink(sock, f"{peer[0]}:{peer[1]}")
            link.heartbeat_timeout_s = self.parallel.host_heartbeat_timeout_s
            try:
                self._hello(link)
            except (nl.LinkClosedError, ValueError) as exc:
                logger.warning("refused a connection from %s: %s", link.peer, exc)
                link.close()

    def _hello(self, link: nl.NodeLink) -> None:
        frame = link.recv(link.heartbeat_timeout_s)
        if frame is None or frame[0] != nl.HELLO:
            raise ValueError("it did not say HELLO")
        node_text, _, token = frame[1].decode(errors="replace").partition(" ")
        if token != self._token:
            raise ValueError("its token is not this engine's (another engine's host?)")
        node = int(node_text)
        if not 0 < node < self.layout.nnodes or node in self.links:
            raise ValueError(f"node rank {node} is not one this engine waits for")
        link.peer = f"host {node} ({link.peer})"
        self.links[node] = link

    def run(self, result_writer) -> None:
        """After start-up: the receiver threads (RESULT onto `result_writer`, the head's
        result ring)."""
        self._result_writer = result_writer
        for node, link in self.links.items():
            thread = threading.Thread(
                target=self._receive, args=(node, link), name=f"ringllm-node{node}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    # ---- steps -------------------------------------------------------------------------

    def send(self, record: np.ndarray, blob: np.ndarray | None) -> None:
        head, data = record.tobytes(), b"" if blob is None else blob.tobytes()
        for node, link in self.links.items():
            try:
                link.send(nl.BATCH, head, data)
            except nl.LinkClosedError as exc:
                self._lose(node, str(exc))
                raise

    def check(self) -> str | None:
        """Why a host is gone, or its rank (None: all are there)."""
        if self._dead is None:
            for node, link in self.links.items():
                if link.is_silent():
                    self._lose(
                        node,
                        f"{link.peer}: nothing heard for {link.silent_for():.1f} s (its host "
                        "died, or the network between them dropped)",
                    )
        return self._dead

    def _lose(self, node: int, reason: str) -> None:
        """Host `node` is gone, not only a rank of it (the first end is the one named)."""
        if self._dead is not None:
            return
        self._dead = reason
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.lost = f"host {node} was lost at {when} (its link to the head closed or went silent)"

    def _receive(self, node: int, link: nl.NodeLink) -> None:
        from ringllm.pipeline.executor import batch_records as br

        try:
            while not self._stop.is_set():
                frame = link.recv(nl.HEARTBEAT_S)
                if frame is None:
                    continue
                kind, record, blob = frame
                if kind == nl.RESULT:
                    nl.republish(self._result_writer, br.RESULT, record, blob)
                elif kind == nl.ERROR:
                    self._dead = self._dead or f"{link.peer}: {record.decode(errors='replace')}"
                    return
                elif kind == nl.BYE:
                    self._lose(node, f"{link.peer} left")
                    return
        except Exception as exc:  # noqa: BLE001 - the link's end is the host's end
            if not self._stop.is_set():
                self._lose(node, str(exc))

    def _heartbeat(self) -> None:
        while not self._stop.wait(nl.HEARTBEAT_S / 2):
            for node, link in list(self.links.items()):
                try:
                    link.heartbeat_if_idle()
                except nl.LinkClosedError as exc:
                    self._lose(node, str(exc))

    # ---- the end -----------------------------------------------------------------------

    def close(self, shutdown_record: np.ndarray | None = None) -> None:
        """Tells every host to stop its ranks (the SHUTDOWN record, then BYE) and closes."""
        self._stop.set()
        for link in self.links.values():
            if shutdown_record is not None and not link.closed:
                try:
                    link.send(nl.BATCH, shutdown_record.tobytes())
                except nl.LinkClosedError:
                    pass
            link.close(bye=True)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None  # the TCPStore master stops with its last reference
