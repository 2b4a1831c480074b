"""`RingCoreClient`: a front end's connection to an engine core process over the rings.

    start(config)   spawns the engine core process, waits until it is ready, connects
    connect(name)   attaches to a running core by its instance name (another front end)

It owns one producer entry of the core's request ring and one output ring of its own
(created here, so it disappears with this process). Requests are numbered per client
(`seq`); the core answers by number, and this client maps numbers back to request ids.
A dead core surfaces as `EngineDeadError` within a wait slice (~100 ms): from the output
ring's liveness check, or from the spawned process having exited.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import select
import subprocess
import sys
import time

import numpy as np

from ringllm.ipc.errors import IpcError, PeerClosedError, PeerDeadError, RingFullError
from ringllm.ipc.instance import InstanceSegment
from ringllm.ipc.mpsc import MpscRing
from ringllm.ipc.ring import Ring
from ringllm.ipc.shm import cleanup_stale
from ringllm.ipc.tensor_slab import TensorSlab, TensorSlabFullError, TensorTooLargeError
from ringllm.pipeline.child_process import child_env, start_child, stop_process
from ringllm.pipeline.config import EngineConfig, config_to_dict
from ringllm.pipeline.core.admission import check_admissible
from ringllm.pipeline.engine import records
from ringllm.pipeline.errors import EngineBusyError, EngineDeadError, HostLostError
from ringllm.pipeline.messages import (
    ControlReply,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
)
from ringllm.pipeline.stats import SchedulerStats

logger = logging.getLogger(__name__)

OUTPUT_RING_CAPACITY = 16384
ENGINE_COMMAND = (sys.executable, "-m", "ringllm.pipeline.engine.engine_core_proc")
_CONTROL_CODES = {
    "sleep": records.CONTROL_SLEEP,
    "wake_up": records.CONTROL_WAKE_UP,
    "add_lora": records.CONTROL_ADD_LORA,
    "remove_lora": records.CONTROL_REMOVE_LORA,
}
STARTUP_TIMEOUT_S = 900.0
DEFAULT_MM_TRANSFER_BYTES = 256 << 20


class RingCoreClient:
    def __init__(
        self,
        instance: InstanceSegment,
        process: subprocess.Popen | None = None,
        mm_transfer_bytes: int = DEFAULT_MM_TRANSFER_BYTES,
    ) -> None:
        self.instance = instance
        self.process = process
        info = instance.info()
        self.engine_pid = int(info["engine_pid"])
        self.info = EngineInfo.from_json(info["engine"])
        self.startup_s: dict[str, float] = info.get("startup", {})  # what its start cost
        self.request_ring = MpscRing.attach(
            info["request_ring"], records.REQUEST, blob_bytes_field="blob_bytes"
        )
        self.producer = self.request_ring.producer()
        self.output_ring = Ring.create(
            "out", records.OUTPUT, OUTPUT_RING_CAPACITY, blob_bytes_field="blob_bytes"
        )
        self.reader = self.output_ring.reader(0)
        # a model that takes images: their pixel values go by reference through a segment
        # of this client's own, freed when their request ends here (or this process dies)
        self.slab = (
            TensorSlab.create(mm_transfer_bytes, kind="mm") if self.info.takes_images else None
        )
        hello, slab_name = records.encode_hello(
            self.output_ring.name, self.slab.name if self.slab is not None else ""
        )
        if slab_name.size:
            self.producer.write_with_blob(hello, slab_name)
        else:
            self.producer.write(hello)
        self._seqs = itertools.count(1)
        self._seq_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}
        self._pending: dict[int, EngineCoreOutput] = {}  # outputs split over several records
        self._pending_aborts: list[int] = []  # seqs whose ABORT found the ring full
        self._pending_pauses: list[tuple[int, bool]] = []  # (seq, paused) not sent yet
        self._dead: str | None = None
        self._host_lost = False  # the core ended as a host of its ranks was lost: _dead says which
        self._closed = False

    @property
    def instance_name(self) -> str:
        return self.instance.name

    # ---- lifecycle ---------------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig) -> RingCoreClient:
        """Spawns `python -m ringllm.pipeline.engine.engine_core_proc` (a fresh interpreter: the
        caller's __main__ is never re-imported) and connects once it reports ready."""
        read_fd, write_fd = os.pipe()
        cmd = [*ENGINE_COMMAND, json.dumps(config_to_dict(config)), str(write_fd)]
        try:
            process = start_child(cmd, pass_fds=(write_fd,), env=child_env())
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls.when_ready(process, read_fd, config.multimodal.mm_transfer_mib << 20)

    @classmethod
    def when_ready(
        cls,
        process: subprocess.Popen,
        read_fd: int,
        mm_transfer_bytes: int = DEFAULT_MM_TRANSFER_BYTES,
    ) -> RingCoreClient:
        """Connects to a started core once its ready line comes on `read_fd` (closed here);
        a core that fails to start is stopped and its error raised."""
        try:
            line = _read_ready_line(read_fd, process)
        except BaseException:
            stop_process(process)
            raise
        finally:
            os.close(read_fd)
        status, _, value = line.partition(" ")
        if status != "ready":
            process.wait(10)
            kind, _, message = value.partition(": ")
            if kind == "ValueError":  # a value the user gave (a flag, a model folder's config)
                raise ValueError(f"the engine core failed to start: {message}")
            raise RuntimeError(f"the engine core failed to start: {value}")
        return cls(InstanceSegment.attach(value), process, mm_transfer_bytes)

    @classmethod
    def connect(cls, instance_name: str) -> RingCoreClient:
        return cls(InstanceSegment.attach(instance_name))

    @property
    def can_restart(self) -> bool:
        """Whether this client started its core process (so it may start it again), rather
        than attaching to another's (`connect`)."""
        return self.process is not None

    def restart(self, config: EngineConfig, standby=None) -> RingCoreClient:
        """This (dead) core cleaned up and a new one started for `config`: the warm
        `standby` (standby.py) if it is still usable, else a fresh process."""
        shut_down_dead(self, "the dead engine core")
        if standby is not None and standby.usable:
            try:
                return standby.activate(config)
            except Exception as exc:  # noqa: BLE001 - the spare failed: start from scratch
                logger.warning("the standby engine core failed (%s); starting a new one", exc)
        elif standby is not None:
            standby.close()
        return RingCoreClient.start(config)

    def restart_rank(self, rank: int):
        raise RuntimeError("a single engine core has no data-parallel ranks to restart")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None:
                self.producer.write(records.encode_simple(records.KIND_BYE), timeout_s=1.0)
        except IpcError:
            pass
        for closable in (self.output_ring, self.request_ring, self.instance, self.slab):
            if closable is None:
                continue
            try:
                closable.close()
            except (IpcError, OSError):
                pass
        if self.process is not None:
            stop_process(self.process)
        if self._dead is not None or self.process is not None:
            # a killed engine unlinked nothing: its segments go now (one killed just before
            # this shutdown, its death not noticed yet, too; a core that exited cleanly
            # left none)
            cleanup_stale()

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_alive()
        check_admissible(request, self.info)
        self.flush_aborts()  # sent before it, if the ring has room now
        seq = next(self._seqs)
        refs = self._put_images(seq, request) if request.mm_inputs else ()
        record, blob = records.encode_add(seq, request, refs)
        # Known before it is sent: the reader thread maps the engine's first output back
        # through _id_of, and that output can arrive before this thread runs again (a lost
        # first output, or a whole short request, otherwise: seen under load).
        self._seq_of[request.request_id] = seq
        self._id_of[seq] = request.request_id
        # A full request ring is the caller's to wait on (AsyncLLM waits without blocking its
        # event loop): no wait here. A blob always fits the ring whole (4,096 slots).
        try:
            self._guard(lambda: self.producer.write_with_blob(record, blob, timeout_s=0.0))
        except BaseException as exc:
            self._seq_of.pop(request.request_id, None)
            self._id_of.pop(seq, None)
            self._free_images(seq)
            if isinstance(exc, RingFullError):
                raise EngineBusyError(
                    "the engine's request ring is full; the request was not sent"
                ) from None
            raise

    def _put_images(self, seq: int, request: EngineCoreRequest) -> list:
        """Each image's pixel values into this client's slab, tagged with the request's seq."""
        if self.slab is None:
            raise ValueError(f"images: the model {self.info.model_path.name} does not take images")
        try:
            return [self.slab.put(image.pixel_values, seq) for image in request.mm_inputs]
        except TensorTooLargeError as exc:
            self.slab.free_tag(seq)
            raise ValueError(f"images: {exc}") from None
        except TensorSlabFullError:
            self.slab.free_tag(seq)
            raise EngineBusyError(
                "the shared memory for images on their way to the engine is full "
                "(--mm-transfer-mib); the request was not sent, retry shortly"
            ) from None

    def _free_images(self, seq: int) -> None:
        if self.slab is not None:
            self.slab.free_tag(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Never waits: on a full request ring the aborts wait here, sent by the next call
        that writes (`flush_aborts`, which the front end also calls on every output batch)."""
        seqs = [self._seq_of.pop(rid) for rid in request_ids if rid in self._seq_of]
        for seq in seqs:
            self._id_of.pop(seq, None)
            self._free_images(seq)
        self._pending_aborts += seqs
        self.flush_aborts()

    def pause_requests(self, request_ids: list[str]) -> None:
        """Never waits, as aborts: what finds the ring full goes with a later call."""
        self._mark_paused(request_ids, True)

    def resume_requests(self, request_ids: list[str]) -> None:
        self._mark_paused(request_ids, False)

    def _mark_paused(self, request_ids: list[str], paused: bool) -> None:
        self._pending_pauses += [
            (self._seq_of[rid], paused) for rid in request_ids if rid in self._seq_of
        ]
        self.flush_aborts()

    def flush_aborts(self) -> None:
        """Sends the aborts, then the pauses and resumes, that found the ring full (in
        order: a resume never overtakes its pause)."""
        if self._dead is not None:
            return
        abort = functools.partial(records.encode_simple, records.KIND_ABORT)
        if self._send_pending(self._pending_aborts, abort):
            self._send_pending(self._pending_pauses, records.encode_pauses)

    def _send_pending(self, pending: list, encode) -> bool:
        """Writes `encode(pending)` without waiting, taking what went out off `pending`;
        False if the ring filled first (the engine is not reading: the rest go later)."""
        if not pending:
            return True
        try:
            self._guard(lambda: self.producer.write(encode(pending), timeout_s=0.0))
        except RingFullError as exc:
            del pending[: exc.num_written]
            return False
        pending.clear()
        return True

    def reset_prefix_cache(self) -> None:
        control = records.encode_simple(
            records.KIND_CONTROL, control=records.CONTROL_RESET_PREFIX_CACHE
        )
        try:
            self._guard(lambda: self.producer.write(control, timeout_s=0.0))
        except RingFullError:
            raise EngineBusyError("the engine's request ring is full; retry shortly") from None

    def control(self, command: str, arg: int = 0, ticket: int | None = None, text: str = "") -> int:
        """Sends a control command (`sleep` with its level, `wake_up`); its answer comes
        back with the outputs (CoreOutputs.replies), under the ticket returned here (the
        caller's own, if it gives one: replies have their own numbering, apart from seqs)."""
        code = _CONTROL_CODES.get(command)
        if code is None:
            raise ValueError(f"control: {command!r} is not one of {tuple(_CONTROL_CODES)}")
        ticket = next(self._seqs) if ticket is None else ticket
        record = records.encode_control(code, ticket, arg)
        blob = np.frombuffer(text.encode(), np.uint8) if text else None

        def send():
            if blob is None:
                return self.producer.write(record, timeout_s=0.0)
            return self.producer.write_with_blob(record, blob, timeout_s=0.0)

        try:
            self._guard(send)
        except RingFullError:
            raise EngineBusyError("the engine's request ring is full; retry shortly") from None
        return ticket

    # ---- outputs -----------------------------------------------------------------------

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None:
        recs, blobs = self._guard(lambda: self.reader.read_with_blobs(4096, timeout_s=timeout_s))
        if len(recs) == 0:
            self.check_alive()
            return None
        outputs, stats, replies = [], None, []
        for row, blob in zip(records.unpack_outputs(recs), blobs, strict=True):
            kind = row[0]
            if kind == records.KIND_STATS:  # counts are per record: several are summed
                stats = merge_stats(stats, records.decode_stats(row))
            elif kind == records.KIND_REPLY:
                error = bytes(np.asarray(blob)).decode(errors="replace") if row[1] else None
                replies.append(ControlReply(row[7], row[5], error))
            elif kind == records.KIND_ERROR:
                out = self._error_output(row[7], blob, refused=row[1] == records.ERROR_REFUSED)
                if out is not None:
                    outputs.append(out)
            else:
                out = self._token_output(row, blob)
                if out is not None:
                    outputs.append(out)
        return CoreOutputs(outputs, stats, replies)

    def _token_output(self, row: tuple, blob) -> EngineCoreOutput | None:
        """A TOKENS record (unpacked: records.unpack_outputs) into its request's output."""
        _, finish_code, has_stop, num_tokens, more, num_cached, queued_s, seq = row[:8]
        rid = self._id_of.get(seq)
        if rid is None:
            return None  # aborted here already
        out = self._pending.pop(seq, None) or EngineCoreOutput(rid, [])
        out.new_token_ids.extend(row[10 : 10 + num_tokens])  # tokens follow stop_token
        if more:
            self._pending[seq] = out  # the rest of this output is in the next record
            return None
        finish = records.finish_name(finish_code)
        out.finish_reason = finish
        out.num_cached_tokens = num_cached
        out.queued_s = None if queued_s != queued_s else queued_s  # NaN: absent
        if has_stop:
            out.stop_reason = row[9]
        if blob is not None:
            decoded = records.decode_blob(blob)
            out.new_logprobs = decoded.sample_logprobs or None
            out.new_prompt_logprobs = decoded.prompt_logprobs or None
            out.pooled = decoded.pooled
        if finish is not None:
            self._seq_of.pop(rid, None)
            self._id_of.pop(seq, None)
            self._free_images(seq)
        return out

    def _error_output(self, seq: int, blob, refused: bool) -> EngineCoreOutput | None:
        rid = self._id_of.pop(seq, None)
        if rid is None:
            return None
        self._seq_of.pop(rid, None)
        self._pending.pop(seq, None)
        self._free_images(seq)
        message = bytes(np.asarray(blob)).decode(errors="replace")
        logger.warning(
            "engine core %s request %s: %s", "refused" if refused else "failed", rid, message
        )
        return EngineCoreOutput(rid, [], finish_reason="error", error=message, refused=refused)

    # ---- liveness ----------------------------------------------------------------------

    def check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead_error()
        if self.process is not None and self.process.poll() is not None:
            self._die(f"the engine core process exited (exit code {self.process.returncode})")
        from ringllm.ipc.liveness import is_process_alive

        if not is_process_alive(self.engine_pid):
            self._die(f"the engine core process (pid {self.engine_pid}) is gone")

    def _die(self, message: str):
        try:
            note = self.instance.note()  # what the core said as it ended on purpose
        except (TypeError, ValueError, OSError):  # closed here already
            note = None
        if note is not None and note.get("error") == "HostLostError":
            self._dead, self._host_lost = str(note.get("message")), True
        else:
            self._dead = message
        raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        return (HostLostError if self._host_lost else EngineDeadError)(self._dead)

    def _guard(self, action):
        """Runs a ring operation; a dead or closed engine becomes EngineDeadError."""
        if self._dead is not None:
            raise self._dead_error()
        try:
            return action()
        except (PeerDeadError, PeerClosedError) as exc:
            self._die(f"the engine core is gone: {exc}")


def merge_stats(earlier: SchedulerStats | None, later: SchedulerStats) -> SchedulerStats:
    """Two STATS records read at once: the later one's gauges, both records' counts."""
    if earlier is None:
        return later
    later.prefix_cache.queries += earlier.prefix_cache.queries
    later.prefix_cache.hits += earlier.prefix_cache.hits
    if earlier.spec_decoding is not None and later.spec_decoding is not None:
        spec = earlier.spec_decoding
        spec.add(later.spec_decoding)
        later.spec_decoding = spec
    if earlier.kv_tiers is not None and later.kv_tiers is not None:
        for name in ("host", "disk"):
            before, after = getattr(earlier.kv_tiers, name), getattr(later.kv_tiers, name)
            if before is not None and after is not None:
                before.add(after)  # counts summed, the later sizes
                setattr(later.kv_tiers, name, before)
    return later


def _read_ready_line(fd: int, process: subprocess.Popen) -> str:
    """The child's one status line ("ready NAME" or "error MESSAGE"), or EngineDeadError."""
    data = b""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
        elif process.poll() is not None or time.monotonic() > deadline:
            break
    if not data.endswith(b"\n"):
        code = process.poll()
        raise EngineDeadError(f"the engine core exited during start-up (exit code {code})")
    return data.decode().strip()


def shut_down_dead(client, what: str) -> None:
    """Reaps a dead core's process and sweeps its segments; a failure there is logged, so
    that it never stops the restart that follows."""
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001 - a dead core's clean-up must not stop a restart
        logger.exception("cleaning up after %s", what)
