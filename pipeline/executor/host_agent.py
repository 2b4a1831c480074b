"""The headless agent of `ringllm serve --headless --nnodes N --node-rank R --master-addr HEAD`
(entry: pipeline/engine/headless.py):
a host that runs worker ranks only, for the engine core on the head (pipeline/executor/placement.py).

    connect to the head's TCPStore (retrying until the head is up), read the spec it
    published (the head's engine arguments: the same model path must exist here)
    dial the head's relay and say HELLO (node rank, the spec's token)
    make this host's batch ring (and, if its ranks include the answering one, a result
    ring); start its ranks, which join their groups through the same store
    say READY with the least KV block count of its ranks (or the error one reported)
    relay until the head says BYE (or SHUTDOWN passes), the head goes silent, or a rank
    dies (said to the head as an ERROR): BATCH frames onto the batch ring, the result
    ring's records back as RESULT frames
    stop the ranks, remove the rings; then wait for the head's next engine (a restarted
    engine core publishes a new spec) until SIGTERM / SIGINT

Nothing is pickled and nothing but the records crosses: the ranks read the same fixed-layout
records on this host's ring as the head's ranks read on theirs.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import threading
import time

from ringllm.ipc.errors import IpcError
from ringllm.ipc.ring import Ring
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.executor import batch_records as br
from ringllm.pipeline.executor import host_link as nl
from ringllm.pipeline.executor.launch import (
    POLL_S,
    START_TIMEOUT_S,
    pipe_lines,
    start_rank,
    wait_ready,
)
from ringllm.pipeline.executor.placement import NodeLayout, store_address
from ringllm.pipeline.executor.rank_process import RankSpec, threads_per_rank
from ringllm.pipeline.executor.remote_hosts import SPEC_KEY

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 0.5
SHUTDOWN_WAIT_S = 5.0
RING_CAPACITY = 1024
RESULT_CAPACITY = 4096


class NodeAgent:
    def __init__(self, parallel) -> None:
        if parallel.nnodes < 2 or parallel.node_rank == 0:
            raise ValueError(
                "--headless: a host that runs ranks only needs --nnodes N > 1 and a "
                "--node-rank between 1 and N - 1 (node rank 0 is the head, which serves)"
            )
        self.parallel = parallel
        self.stopping = threading.Event()
        self._served: set[str] = set()  # the tokens of the engines served already

    def run(self) -> None:
        """Serves the head's engines one after another until told to stop."""
        while not self.stopping.is_set():
            store = self._connect_store()
            if store is None:
                return
            try:
                self._serve_one(store)
            except Exception:  # noqa: BLE001 - this engine is over; wait for the next one
                logger.exception("host %d: the engine's ranks here ended", self.parallel.node_rank)
            finally:
                del store
            self.stopping.wait(CONNECT_RETRY_S)

    def _connect_store(self):
        import torch.distributed as dist

        parallel = self.parallel
        logged = False
        while not self.stopping.is_set():
            try:
                # a plain connect first: a TCPStore that finds no head logs a C++ trace
                socket.create_connection((parallel.master_addr, parallel.master_port), 1.0).close()
                store = dist.TCPStore(
                    parallel.master_addr,
                    parallel.master_port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=2),
                )
                store.wait([SPEC_KEY], datetime.timedelta(seconds=2))
                store.set_timeout(datetime.timedelta(seconds=parallel.distributed_timeout_s))
                return store
            except (RuntimeError, OSError):
                if not logged:
                    logger.warning(
                        "host %d: waiting for the head at %s:%d",
                        parallel.node_rank,
                        parallel.master_addr,
                        parallel.master_port,
                    )
                    logged = True
                self.stopping.wait(CONNECT_RETRY_S)
        return None

    def _serve_one(self, store) -> None:
        spec = json.loads(store.get(SPEC_KEY))
        if spec["token"] in self._served:
            return  # that engine is ending: wait for the next one
        self._served.add(spec["token"])
        engine_args = spec["engine_args"]
        config = EngineConfig.from_kwargs(**engine_args)
        node_rank = self.parallel.node_rank
        if spec["nnodes"] != self.parallel.nnodes:
            raise ValueError(
                f"the head runs {spec['nnodes']} hosts, this one was told {self.parallel.nnodes}"
            )
        layout = NodeLayout.of(config.parallel, node_rank)
        host, _, port = spec["relay"].rpartition(":")
        link = nl.NodeLink.dial(host, int(port), "the head", timeout_s=10.0)
        link.heartbeat_timeout_s = config.parallel.host_heartbeat_timeout_s
        link.send(nl.HELLO, f"{node_rank} {spec['token']}".encode())
        host_ranks = _HostRanks(layout)
        try:
            try:
                host_ranks.start(engine_args, store_address(config.parallel), link)
            except Exception as exc:
                text = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
                link.send(nl.READY, text.encode())
                raise
            link.send(nl.READY, f"ready {host_ranks.num_blocks}".encode())
            logger.info("host %d: ranks %s ready", node_rank, layout.local_ranks)
            host_ranks.relay(link, self.stopping)
        finally:
            host_ranks.stop()
            link.close(bye=True)


class HostRelay:
    """A host's rings for one engine and the relay between them and the head: BATCH frames
    onto its batch ring, its result ring's records back (if its ranks include the
    answering one). The ranks are started by whoever owns it: the headless agent
    (`_HostRanks`) or, with Ray, the rank actors (pipeline/executor/ray_executor.py)."""

    def __init__(self, layout: NodeLayout) -> None:
        self.layout = layout
        self.batch_ring = Ring.create(
            "node-batch",
            br.BATCH,
            RING_CAPACITY,
            layout.local_count,
            blob_bytes_field="blob_bytes",
        )
        self.result_ring = (
            Ring.create("node-result", br.RESULT, RESULT_CAPACITY, 1, blob_bytes_field="blob_bytes")
            if layout.answers_here
            else None
        )
        self.writer = self.batch_ring.writer()
        self.shutdown_seen = False

    def relay(self, link: nl.NodeLink, stopping: threading.Event) -> None:
        """Until the head says BYE or goes silent, `stopping` is set, or `_dead_rank()`
        names a rank that died (told to the head as an ERROR)."""
        done = threading.Event()
        failure: list[str] = []
        threads = [threading.Thread(target=self._inbound, args=(link, done, failure), daemon=True)]
        if self.result_ring is not None:
            threads.append(
                threading.Thread(target=self._outbound, args=(link, done, failure), daemon=True)
            )
        for thread in threads:
            thread.start()
        try:
            while not done.is_set() and not stopping.is_set():
                dead = self._dead_rank()
                if dead:
                    if not self.shutdown_seen:
                        link.send(nl.ERROR, f"host {self.layout.node_rank}: {dead}".encode())
                    return
                if link.is_silent():
                    logger.error(
                        "host %d: the head has been silent for %.1f s",
                        self.layout.node_rank,
                        link.silent_for(),
                    )
                    return
                link.heartbeat_if_idle()
                done.wait(POLL_S)
        finally:
            done.set()
            for thread in threads:
                thread.join(timeout=2.0)
            if failure:
                logger.warning("host %d: %s", self.layout.node_rank, failure[0])

    def _dead_rank(self) -> str:
        return ""  # the relay's owner knows its ranks

    def close_rings(self) -> None:
        for ring in (self.batch_ring, self.result_ring):
            if ring is not None:
                ring.close()

    def _inbound(self, link: nl.NodeLink, done: threading.Event, failure: list) -> None:
        try:
            while not done.is_set():
                frame = link.recv(POLL_S)
                if frame is None:
                    continue
                kind, record, blob = frame
                if kind == nl.BATCH:
                    rec = nl.republish(self.writer, br.BATCH, record, blob)
                    if int(rec["kind"][0]) == br.KIND_SHUTDOWN:
                        self.shutdown_seen = True
                elif kind == nl.BYE:
                    return
        except (nl.LinkClosedError, IpcError) as exc:
            failure.append(str(exc))
        finally:
            done.set()

    def _outbound(self, link: nl.NodeLink, done: threading.Event, failure: list) -> None:
        reader = self.result_ring.reader(0)
        try:
            while not done.is_set():
                records, blobs = reader.read_with_blobs(16, timeout_s=POLL_S)
                for record, blob in zip(records, blobs, strict=True):
                    link.send(nl.RESULT, record.tobytes(), b"" if blob is None else blob.tobytes())
        except (nl.LinkClosedError, IpcError) as exc:
            failure.append(str(exc))
        finally:
            done.set()


class _HostRanks(HostRelay):
    """The headless agent's: the relay, and this host's ranks as child processes."""

    def __init__(self, layout: NodeLayout) -> None:
        super().__init__(layout)
        self.procs: list = []
        self.num_blocks = 0

    def start(self, engine_args: dict, rendezvous: str, link: nl.NodeLink) -> None:
        env = dict(os.environ)
        requested = engine_args.get("num_threads")
        env["OMP_NUM_THREADS"] = str(threads_per_rank(self.layout.local_count, requested))
        pipes = []
        try:
            for local, rank in enumerate(self.layout.local_ranks):
                spec = RankSpec(
                    engine_args,
                    rank,
                    rendezvous,
                    self.batch_ring.name,
                    self.result_ring.name if self.result_ring is not None else "",
                    local_rank=local,
                )
                proc, pipe = start_rank(spec, env)
                self.procs.append(proc)
                pipes.append(pipe)
            self.num_blocks = min(self._wait_ready(pipes, link))
        finally:
            for pipe in pipes:
                pipe.close()

    def _wait_ready(self, pipes: list, link: nl.NodeLink) -> list[int]:
        """This host's ranks' KV block counts (executor/launch.py), the link to the head kept
        alive meanwhile."""

        def keep_link(read_any: bool) -> None:
            link.heartbeat_if_idle()
            frame = link.recv(0.0)  # the head's heartbeats while its own ranks start
            if frame is not None and frame[0] == nl.BYE:
                raise nl.LinkClosedError("the head ended the engine while this host started")

        return wait_ready(
            pipe_lines(pipes),
            len(pipes),
            lambda missing: f"this host's ranks did not start within {START_TIMEOUT_S:.0f} s",
            rank_of=lambda index: self.layout.local_ranks[index],
            after=keep_link,
        )

    def _dead_rank(self) -> str:
        for local, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"rank {self.layout.local_ranks[local]} (pid {proc.pid}) died ({how})"
        return ""

    def stop(self) -> None:
        if not self.shutdown_seen:
            try:
                self.writer.write(br.encode_shutdown(), timeout_s=1.0)
            except IpcError:
                pass
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it goes now
                proc.kill()
                proc.wait()
        self.close_rings()
