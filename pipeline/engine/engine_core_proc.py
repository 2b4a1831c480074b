"""The engine core in its own process: a busy loop between the request ring and the
front ends' output rings.

    front end 0 ──┐ request ring (MPSC)                      ┌──> output ring of front end 0
    front end 1 ──┼──────────────> [ EngineCoreProc loop ] ──┼──> output ring of front end 1
    ...           ┘   HELLO/ADD/ABORT/PAUSE/BYE    step()    └──> ...

Each loop turn: take every waiting record (blocking on the futex only when the core has
nothing to do), run one step, publish each front end's outputs of that step with one
counter store, and update the live load counters of the instance segment. A front end
that closes or dies has its requests aborted (their blocks freed). SIGTERM / SIGINT end
the loop; every segment this process made is unlinked on the way out.

No front end can stop the loop or take it down:
- writes to an output ring never wait: what does not fit now waits in that front end's
  backlog, sent first on later turns (a stats-only record is skipped while one waits).
  A backlog of which nothing could be sent for BACKLOG_TIMEOUT_S, or that grows past
  MAX_BACKLOG_RECORDS, aborts that front end's requests and replaces its backlog with one
  error per request: its KV blocks are freed, its memory here bounded, and it learns why
  once it reads again. It stays connected (a slow server is not a dead engine);
- a HELLO naming an output ring that cannot be opened, or a malformed record, costs only
  that producer (logged; its records are ignored until it says HELLO again);
- a request the core refuses, or one that fails while being computed, ends with an ERROR
  record for that request alone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np

from ringllm.ipc.errors import IpcError
from ringllm.ipc.instance import InstanceSegment
from ringllm.ipc.mpsc import MpscRing
from ringllm.ipc.ring import Ring, RingWriter
from ringllm.ipc.shm import cleanup_stale
from ringllm.ipc.tensor_slab import TensorSlab, TensorSlabPeer
from ringllm.pipeline import wire
from ringllm.pipeline.child_process import (
    die_with_parent,
    forbid_pickle_if_asked,
    freeze_heap,
)
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine import records
from ringllm.pipeline.errors import STEP_FAILED_MESSAGE, EngineDeadError, HostLostError
from ringllm.pipeline.executor import launch
from ringllm.pipeline.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

REQUEST_RING_CAPACITY = 4096
MAX_FRONTENDS = 64
# A front end whose output ring stays full this long, or whose backlog grows past this
# many records, has its requests aborted (see the module docstring).
# (RINGLLM_OUTPUT_BACKLOG_TIMEOUT_S overrides the first: the tests wait 1 s, not 10.)
BACKLOG_TIMEOUT_S = float(os.environ.get("RINGLLM_OUTPUT_BACKLOG_TIMEOUT_S", "10"))
MAX_BACKLOG_RECORDS = 1 << 16
# A backlogged front end that took something this recently holds the engine's steps.
HOLD_S = min(1.0, BACKLOG_TIMEOUT_S / 2)


@dataclass
class FrontEnd:
    """One connected front end: its output ring, its requests by the seq it tags them with
    (ABORT records name the seq), and what did not fit its ring yet."""

    ring: Ring
    writer: RingWriter
    ids_by_seq: dict[int, str] = field(default_factory=dict)
    slab: TensorSlabPeer | None = None  # its images' pixel values (HELLO named it)
    # (records, blob): plain records (blob None) or one record and its blob, in order
    backlog: collections.deque = field(default_factory=collections.deque)
    backlog_records: int = 0
    full_since: float | None = None  # since when nothing of the backlog could be sent

    def send(self, recs: np.ndarray, blob: np.ndarray | None = None) -> None:
        """Writes now if it all fits, else queues behind what is queued (never waits)."""
        if self.backlog or not self._try(recs, blob):
            self.backlog.append((recs, blob))
            self.backlog_records += len(recs)
            if self.full_since is None:
                self.full_since = time.monotonic()

    def flush(self) -> None:
        sent = False
        while self.backlog and self._try(*self.backlog[0]):
            recs, _ = self.backlog.popleft()
            self.backlog_records -= len(recs)
            sent = True
        if not self.backlog:
            self.full_since = None
        elif sent:
            self.full_since = time.monotonic()  # it reads, slowly: stuck only without progress

    def _try(self, recs: np.ndarray, blob: np.ndarray | None) -> bool:
        w = self.writer
        if blob is None:
            if not w.has_room(w.slots_for(len(recs))):
                w.check_readers()  # a dead reader is an IpcError, not a backlog
                return False
            w.write(recs, timeout_s=0)
            return True
        slots = w.slots_for(1, blob.nbytes)
        if not w.has_room(min(slots, w.capacity)):
            w.check_readers()
            return False
        w.write_with_blob(recs, blob)  # a blob larger than the whole ring streams
        return True


_CONTROL_COMMANDS = {
    records.CONTROL_SLEEP: "sleep",
    records.CONTROL_WAKE_UP: "wake_up",
    records.CONTROL_ADD_LORA: "add_lora",
    records.CONTROL_REMOVE_LORA: "remove_lora",
}


def _engine_core_class() -> type:
    """EngineCore. NOTE: imported when a core starts (or a standby warms up), not with this
    module: `ringllm serve`'s front end imports `check_model` from here, and the engine's
    modules would bring torch (about 200 MiB resident) into a process that runs no model."""
    from ringllm.pipeline.engine.engine_core import EngineCore

    return EngineCore


class EngineCoreProc:
    def __init__(self, config: EngineConfig, startup_s: dict[str, float] | None = None) -> None:
        self.core = _engine_core_class()(config)
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
                "startup": {**(startup_s or {}), **self.core.startup_s},
            }
        )
        self.frontends: dict[int, FrontEnd] = {}
        self._load_changed = False  # requests dropped outside a step: publish the load
        self._stats_load = (0, 0)  # the scheduler's load in the stats last sent
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (front end, seq)
        self.stopping = False

    @property
    def instance_name(self) -> str:
        return self.instance.name

    def run(self) -> None:
        while not self.stopping:
            backlogged = self._flush_backlogs()
            held = backlogged and self._held()
            busy = self.core.has_work() and not held
            wait_s = 0 if busy else (0.001 if held else 0.01 if backlogged else 0.5)
            batches = self.consumer.read_with_blobs(1024, timeout_s=wait_s)
            for producer, recs, blobs in batches:
                self._handle(producer, recs, blobs)
            departed = self.consumer.take_departed()
            for producer in departed:
                self._drop_frontend(producer)
            if self.core.has_work() and not (held and self._held()):
                outputs = self.core.step()
                if outputs:
                    self._publish(outputs)
                elif batches or self.core.scheduler.load() != self._stats_load:
                    # pauses can leave nothing running (with async scheduling, a step or
                    # two after they came in): say so
                    self._broadcast_stats()
            elif batches or departed or self._load_changed:
                self._broadcast_stats()  # aborts can leave the core idle: say so
            elif held:
                continue  # a front end drains its ring before the next step
            else:
                self._check_executor()
                continue
            self._load_changed = False
            self.instance.publish_load(*self.core.scheduler.load())

    def _held(self) -> bool:
        """Whether a front end with requests here has outputs waiting that it still takes
        (something within HOLD_S): the next step waits for it (see the module docstring)."""
        now = time.monotonic()
        return any(
            f.backlog and f.ids_by_seq and now - f.full_since < HOLD_S
            for f in self.frontends.values()
        )

    def _check_executor(self) -> None:
        """Idle: a rank or another host lost now ends the engine now (EngineDeadError), not
        at the next request (the in-process worker has nothing to lose)."""
        check_alive = getattr(self.core.executor, "check_alive", None)
        if check_alive is not None:
            check_alive()

    # ---- requests in -----------------------------------------------------------------

    def _handle(self, producer: int, recs: np.ndarray, blobs: list) -> None:
        for record, blob in zip(recs, blobs, strict=True):
            try:
                self._handle_one(producer, record, blob)
            except EngineDeadError:
                raise  # a dead worker rank (in a sleep or wake-up): the engine ends
            except Exception:  # a malformed record costs its producer only
                logger.exception("front end %d: dropped after a record it sent failed", producer)
                self._drop_frontend(producer)

    def _handle_one(self, producer: int, record, blob) -> None:
        kind = int(record["kind"])
        if kind == records.KIND_ADD:
            self._add(producer, record, blob)
        elif kind == records.KIND_ABORT:
            frontend = self.frontends.get(producer)
            rid = frontend.ids_by_seq.get(int(record["seq"])) if frontend else None
            if rid is not None:
                self._forget(rid)
                self.core.abort_requests([rid])
        elif kind == records.KIND_PAUSE:
            frontend = self.frontends.get(producer)
            rid = frontend.ids_by_seq.get(int(record["seq"])) if frontend else None
            if rid is not None and int(record["control"]):
                self.core.pause_requests([rid])
            elif rid is not None:
                self.core.resume_requests([rid])
        elif kind == records.KIND_HELLO:
            self._attach_frontend(producer, *records.decode_hello(record, blob))
        elif kind == records.KIND_BYE:
            self._drop_frontend(producer)
        elif kind == records.KIND_CONTROL:
            self._control(producer, int(record["control"]), int(record["seq"]), record, blob)

    def _control(self, producer: int, code: int, ticket: int, record, blob=None) -> None:
        if code == records.CONTROL_RESET_PREFIX_CACHE:
            self.core.reset_prefix_cache()
            return
        command = _CONTROL_COMMANDS.get(code)
        if command is None:
            logger.warning("front end %d: control code %d ignored (unknown)", producer, code)
            return
        text = bytes(np.asarray(blob)).decode(errors="replace") if blob is not None else ""
        error = self.core.control(command, int(record["priority"]), text)
        reply = records.encode_reply(ticket, self.core.sleep_level, error)
        self._write(producer, lambda f: f.send(*reply))
        self._load_changed = True

    def _add(self, producer: int, record, blob) -> None:
        seq = int(record["seq"])
        frontend = self.frontends.get(producer)
        if frontend is None:  # no HELLO, or its ring could not be opened: nowhere to answer
            logger.warning("front end %d: request seq %d ignored (no output ring)", producer, seq)
            return
        try:
            request, refs = records.decode_add_with_refs(record, blob)
            if request.request_id in self.owner:
                raise ValueError(f"request_id: {request.request_id!r} is already in use")
            if refs:
                images = wire.images_with_pixels(request.mm_inputs, refs, frontend.slab)
                request = dataclasses.replace(request, mm_inputs=images)
            self.core.add_request(request)
        except ValueError as exc:
            frontend.send(*records.encode_error(seq, str(exc)))
            return
        except Exception:
            logger.exception("front end %d: adding request seq %d failed", producer, seq)
            frontend.send(*records.encode_error(seq, STEP_FAILED_MESSAGE, refused=False))
            return
        self.owner[request.request_id] = (producer, seq)
        frontend.ids_by_seq[seq] = request.request_id

    def _attach_frontend(self, producer: int, ring_name: str, slab_name: str = "") -> None:
        self._drop_frontend(producer)  # a second HELLO replaces the first
        try:
            ring = Ring.attach(ring_name, records.OUTPUT, blob_bytes_field="blob_bytes")
        except (IpcError, OSError, ValueError) as exc:
            logger.warning("front end %d: its output ring cannot be opened (%s)", producer, exc)
            return  # its ADDs are ignored: there is nowhere to answer them
        slab = None
        if slab_name:
            try:
                slab = TensorSlab.attach(slab_name)
            except (IpcError, OSError, ValueError) as exc:  # its images are refused
                logger.warning("front end %d: its tensor slab cannot be opened (%s)", producer, exc)
        self.frontends[producer] = FrontEnd(ring, ring.writer(), slab=slab)

    def _drop_frontend(self, producer: int) -> None:
        frontend = self.frontends.pop(producer, None)
        if frontend is None:
            return
        self.core.abort_requests(list(frontend.ids_by_seq.values()))
        for rid in frontend.ids_by_seq.values():
            self.owner.pop(rid, None)
        try:
            frontend.ring.close()
            if frontend.slab is not None:
                frontend.slab.close()
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
        self._stats_load = self.core.scheduler.load()
        for producer, (seqs, outs) in by_frontend.items():
            self._write(producer, lambda f, s=seqs, o=outs: _send_step(f, s, o, stats))

    def _broadcast_stats(self) -> None:
        stats = records.encode_stats(self.core.make_stats())
        self._stats_load = self.core.scheduler.load()
        for producer in list(self.frontends):
            self._write(producer, lambda f: f.backlog or f.send(stats))

    def _write(self, producer: int, action) -> None:
        frontend = self.frontends.get(producer)
        if frontend is None:
            return
        try:
            action(frontend)
        except IpcError as exc:  # the front end is gone (closed its ring, or died)
            logger.warning("dropping front end %d: %s", producer, exc)
            self._drop_frontend(producer)

    def _flush_backlogs(self) -> bool:
        """Sends what waits; a front end that stays full has its requests aborted. True
        while some backlog is left."""
        left = False
        now = time.monotonic()
        for producer, frontend in list(self.frontends.items()):
            if not frontend.backlog:
                continue
            self._write(producer, FrontEnd.flush)
            if not frontend.backlog or producer not in self.frontends:
                continue
            left = True
            stuck_s = now - frontend.full_since
            if stuck_s > BACKLOG_TIMEOUT_S or frontend.backlog_records > MAX_BACKLOG_RECORDS:
                self._abort_stuck(producer, frontend, stuck_s)
        return left

    def _abort_stuck(self, producer: int, frontend: FrontEnd, stuck_s: float) -> None:
        """Its running requests aborted; of its backlog, what they had produced is replaced
        by one error record each (what it reads next says why), and what requests that had
        already ended produced is kept whole (finished, it is bounded)."""
        ids = dict(frontend.ids_by_seq)
        frontend.full_since = time.monotonic()  # the next give-up is a full timeout away
        if not ids:
            if frontend.backlog_records > MAX_BACKLOG_RECORDS:
                logger.warning("front end %d: %d records unread; dropping it", producer,
                               frontend.backlog_records)  # fmt: skip
                self._drop_frontend(producer)
            return
        message = (
            f"aborted: this client read none of its outputs for {stuck_s:.0f} s "
            f"({frontend.backlog_records} records waiting); the engine dropped its requests"
        )
        logger.warning("front end %d: %s", producer, message)
        self.core.abort_requests(list(ids.values()))
        for rid in ids.values():
            self._forget(rid)
        self._load_changed = True
        live = np.fromiter(ids, np.int64, len(ids))
        kept = collections.deque()
        for recs, blob in frontend.backlog:
            recs = recs[~np.isin(recs["seq"], live) & (recs["kind"] != records.KIND_STATS)]
            if len(recs):
                kept.append((recs, blob))
        kept.extend(records.encode_error(seq, message, refused=False) for seq in ids)
        frontend.backlog = kept
        frontend.backlog_records = sum(len(recs) for recs, _ in kept)

    def close(self) -> None:
        for producer in list(self.frontends):
            self._drop_frontend(producer)
        self.consumer.close()
        self.requests.close()
        self.instance.close()
        self.core.shutdown()  # the tensor-parallel worker processes, if any


def _send_step(
    frontend: FrontEnd, seqs: list[int], outs: list[EngineCoreOutput], stats: np.ndarray
) -> None:
    """All plain records of a step in one publish; records with a blob each carry theirs;
    requests that ended with an error, an ERROR record each."""
    errors = [(seq, out) for seq, out in zip(seqs, outs, strict=True) if out.error is not None]
    if errors:
        pairs = [(seq, out) for seq, out in zip(seqs, outs, strict=True) if out.error is None]
        seqs, outs = [p[0] for p in pairs], [p[1] for p in pairs]
    recs, blobs = records.encode_outputs(seqs, outs)
    plain = [i for i, b in enumerate(blobs) if b is None]
    frontend.send(np.concatenate([recs[plain], stats]))
    for i, blob in enumerate(blobs):
        if blob is not None:
            frontend.send(recs[i : i + 1], blob)
    for seq, out in errors:
        frontend.send(*records.encode_error(seq, out.error, refused=out.refused))


def run_engine_core(
    config: EngineConfig, ready_fd: int, startup_s: dict[str, float] | None = None
) -> None:
    """Process entry point: build the engine, report the instance name, loop until told to
    stop. `startup_s`: what start-up cost before this (published in the instance info)."""
    die_with_parent()
    holder: dict[str, EngineCoreProc | bool] = {"stop": False}

    def on_signal(signum, frame):
        holder["stop"] = True
        proc = holder.get("proc")
        if isinstance(proc, EngineCoreProc):
            proc.stopping = True
        elif not holder.get("abandoned"):
            # A start-up that waits (for a lost host, say) is abandoned, what it made
            # removed. Once only: the parent's SIGTERM is followed by the kernel's when the
            # parent exits (die_with_parent), and a second SystemExit raised inside the
            # executor's teardown would leave its rings behind.
            holder["abandoned"] = True
            raise SystemExit(f"stopped by {signal.Signals(signum).name} while starting")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with os.fdopen(ready_fd, "w") as ready:
        try:
            cleanup_stale()
            proc = EngineCoreProc(config, startup_s)
        except BaseException as exc:
            try:
                ready.write(
                    f"error {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n"
                )
                ready.flush()
            except BrokenPipeError:  # nobody waits for the answer: its parent stopped
                os._exit(1)  # what it made is removed already
            raise SystemExit(1) from None
        holder["proc"] = proc
        ready.write(f"ready {proc.instance_name}\n")
    forbid_pickle_if_asked("the engine core")
    freeze_heap()
    try:
        proc.stopping = bool(holder["stop"])
        proc.run()
    except HostLostError as exc:  # the front end reads why, and waits for the host
        proc.instance.publish_note({"error": "HostLostError", "message": str(exc)})
        raise SystemExit(1) from None  # the executor logged it
    finally:
        proc.close()


def check_model(model: str | None, tensor_parallel_size: int = 1) -> None:
    """The ranks' model check (executor/launch.py), for a caller to make before it starts
    the core: `ringllm serve` says a model it cannot run in one line."""
    launch.check_model(model, tensor_parallel_size)


def process_age_s() -> float:
    """Seconds since this process started (the kernel's clock: interpreter start-up and
    imports included); 0 where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, round(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 3))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str]) -> None:
    """`CONFIG_JSON READY_FD`: start now. `--standby READY_FD`: a warm spare (standby.py):
    import everything, then wait for the config on stdin (EOF: leave, never used)."""
    import json
    import sys

    logging.basicConfig(level=os.environ.get("RINGLLM_LOG_LEVEL", "INFO"))
    if argv[0] == "--standby":
        die_with_parent()
        _engine_core_class()  # warm: the engine's imports done before a restart needs them
        line = sys.stdin.readline()
        if not line.strip():
            return
        config_json, startup_s = line, {"process_s": 0.0, "standby": 1.0}
    else:
        config_json, startup_s = argv[0], {"process_s": process_age_s()}
    run_engine_core(EngineConfig.from_kwargs(**json.loads(config_json)), int(argv[1]), startup_s)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
