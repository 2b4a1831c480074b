"""The engine core in its own process: a busy loop between the request ring and the
front ends' output rings.

    front end 0 ──┐ request ring (MPSC)                      ┌──> output ring of front end 0
    front end 1 ──┼──────────────> [ EngineCoreProc loop ] ──┼──> output ring of front end 1
    ...           ┘   HELLO/ADD/ABORT/BYE records  step()    └──> ...

Each loop turn: take every waiting record (blocking on the futex only when the core has
nothing to do), run one step, publish each front end's outputs of that step with one
counter store, and update the live load counters of the instance segment. A front end
that closes or dies has its requests aborted (their blocks freed). SIGTERM / SIGINT end
the loop; every segment this process made is unlinked on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field

import numpy as np

from ringllm.ipc.errors import IpcError
from ringllm.ipc.instance import InstanceSegment
from ringllm.ipc.mpsc import MpscRing
from ringllm.ipc.ring import Ring, RingWriter
from ringllm.ipc.shm import cleanup_stale
from ringllm.pipeline.child_process import die_with_parent, forbid_pickle_if_asked
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine import records
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

REQUEST_RING_CAPACITY = 4096
MAX_FRONTENDS = 64
OUTPUT_FULL_TIMEOUT_S = 5.0


@dataclass
class FrontEnd:
    """One connected front end: its output ring, and its requests by the seq it tags them
    with (ABORT records name the seq)."""

    ring: Ring
    writer: RingWriter
    ids_by_seq: dict[int, str] = field(default_factory=dict)


class EngineCoreProc:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.requests = MpscRing.create(
            "req",
            records.REQUEST,
            REQUEST_RING_CAPACITY,
            MAX_FRONTENDS,
            blob_bytes_field="blob_bytes",
        )
        self.consumer = self.requests.consumer()
        self.instance = InstanceSegment.create(
            {
                "version": 2,
                "request_ring": self.requests.name,
                "engine_pid": os.getpid(),
                "engine": self.core.info.to_json(),
            }
        )
        self.frontends: dict[int, FrontEnd] = {}
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (front end, seq)
        self.stopping = False

    @property
    def instance_name(self) -> str:
        return self.instance.name

    def run(self) -> None:
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            batches = self.consumer.read_with_blobs(1024, timeout_s=0 if busy else 0.5)
            for producer, recs, blobs in batches:
                self._handle(producer, recs, blobs)
            departed = self.consumer.take_departed()
            for producer in departed:
                self._drop_frontend(producer)
            if self.core.has_unfinished_requests():
                self._publish(self.core.step())
            elif batches or departed:
                self._broadcast_stats()  # aborts can leave the core idle: say so
            else:
                continue
            self.instance.publish_load(*self.core.scheduler.load())

    # ---- requests in -----------------------------------------------------------------

    def _handle(self, producer: int, recs: np.ndarray, blobs: list) -> None:
        for record, blob in zip(recs, blobs, strict=True):
            kind = int(record["kind"])
            if kind == records.KIND_ADD:
                self._add(producer, record, blob)
            elif kind == records.KIND_ABORT:
                frontend = self.frontends.get(producer)
                rid = frontend.ids_by_seq.get(int(record["seq"])) if frontend else None
                if rid is not None:
                    self._forget(rid)
                    self.core.abort_requests([rid])
            elif kind == records.KIND_HELLO:
                self._attach_frontend(producer, record["name"].decode())
            elif kind == records.KIND_BYE:
                self._drop_frontend(producer)
            elif (
                kind == records.KIND_CONTROL
                and int(record["control"]) == records.CONTROL_RESET_PREFIX_CACHE
            ):
                self.core.reset_prefix_cache()

    def _add(self, producer: int, record, blob) -> None:
        seq = int(record["seq"])
        frontend = self.frontends.get(producer)
        if frontend is None:
            return  # no HELLO yet: nowhere to answer
        try:
            request = records.decode_add(record, blob)
            if request.request_id in self.owner:
                raise ValueError(f"request_id: {request.request_id!r} is already in use")
            self.core.add_request(request)
        except ValueError as exc:
            rec, message = records.encode_error(seq, str(exc))
            self._write(producer, lambda w: w.write_with_blob(rec, message))
            return
        self.owner[request.request_id] = (producer, seq)
        frontend.ids_by_seq[seq] = request.request_id

    def _attach_frontend(self, producer: int, ring_name: str) -> None:
        ring = Ring.attach(ring_name, records.OUTPUT, blob_bytes_field="blob_bytes")
        self.frontends[producer] = FrontEnd(ring, ring.writer(full_timeout_s=OUTPUT_FULL_TIMEOUT_S))

    def _drop_frontend(self, producer: int) -> None:
        frontend = self.frontends.pop(producer, None)
        if frontend is None:
            return
        self.core.abort_requests(list(frontend.ids_by_seq.values()))
        for rid in frontend.ids_by_seq.values():
            self.owner.pop(rid, None)
        try:
            frontend.ring.close()
        except IpcError:
            pass

    def _forget(self, rid: str) -> None:
        owner = self.owner.pop(rid, None)
        if owner is not None and owner[0] in self.frontends:
            self.frontends[owner[0]].ids_by_seq.pop(owner[1], None)

    # ---- outputs out -----------------------------------------------------------------

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        by_frontend: dict[int, tuple[list[int], list[EngineCoreOutput]]] = {}
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue
            seqs, outs = by_frontend.setdefault(owner[0], ([], []))
            seqs.append(owner[1])
            outs.append(out)
            if out.finished:
                self._forget(out.request_id)
        stats = records.encode_stats(self.core.make_stats())
        for producer, (seqs, outs) in by_frontend.items():
            recs, blobs = records.encode_outputs(seqs, outs)
            self._write(producer, lambda w, r=recs, b=blobs: _write_step(w, r, b, stats))

    def _broadcast_stats(self) -> None:
        stats = records.encode_stats(self.core.make_stats())
        for producer in list(self.frontends):
            self._write(producer, lambda w: w.write(stats))

    def _write(self, producer: int, action) -> None:
        frontend = self.frontends.get(producer)
        if frontend is None:
            return
        try:
            action(frontend.writer)
        except IpcError as exc:  # full for too long, or the front end is gone
            logger.warning("dropping front end %d: %s", producer, exc)
            self._drop_frontend(producer)

    def close(self) -> None:
        for producer in list(self.frontends):
            self._drop_frontend(producer)
        self.consumer.close()
        self.requests.close()
        self.instance.close()
        self.core.shutdown()  # the tensor-parallel worker processes, if any


def _write_step(writer: RingWriter, recs: np.ndarray, blobs: list, stats: np.ndarray) -> None:
    """All plain records of a step in one publish; records with a blob each carry theirs."""
    plain = [i for i, b in enumerate(blobs) if b is None]
    writer.write(np.concatenate([recs[plain], stats]))
    for i, blob in enumerate(blobs):
        if blob is not None:
            writer.write_with_blob(recs[i], blob)


def run_engine_core(config: EngineConfig, ready_fd: int) -> None:
    """Process entry point: build the engine, report the instance name, loop until told to stop."""
    die_with_parent()
    holder: dict[str, EngineCoreProc | bool] = {"stop": False}

    def on_signal(signum, frame):
        holder["stop"] = True
        proc = holder.get("proc")
        if isinstance(proc, EngineCoreProc):
            proc.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with os.fdopen(ready_fd, "w") as ready:
        try:
            cleanup_stale()
            proc = EngineCoreProc(config)
        except BaseException as exc:
            ready.write(f"error {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n")
            raise SystemExit(1) from None
        holder["proc"] = proc
        ready.write(f"ready {proc.instance_name}\n")
    forbid_pickle_if_asked("the engine core")
    try:
        proc.stopping = bool(holder["stop"])
        proc.run()
    finally:
        proc.close()


if __name__ == "__main__":
    import json
    import sys

    logging.basicConfig(level=os.environ.get("RINGLLM_LOG_LEVEL", "INFO"))
    run_engine_core(EngineConfig.from_kwargs(**json.loads(sys.argv[1])), int(sys.argv[2]))
