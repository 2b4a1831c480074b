"""Engine-core clients: how a front end reaches an engine core.

Every kind has the same small interface (`CoreClient`): add, abort, pause and resume
requests, take batches of outputs (`CoreOutputs`) as the core produces them, check the
core is alive.

    InlineCoreClient   the core in this process, one step per `get_outputs` call
                       (`LLMEngine`: the caller's loop is the engine's loop)
    InprocCoreClient   the core on a thread of this process (torch releases the GIL in its
                       ops, so the caller's event loop keeps running while a step computes)
    RingCoreClient     the core in its own process behind the shared-memory rings
    DPCoreClient       several such cores, one per data-parallel rank (dp_client.py)

`make_core_client(config, where)` picks one. Every client checks admission
(pipeline/core/admission.py) before a request leaves it, so a request that can never run is
refused with a ValueError at once, in the caller's frame.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from typing import Protocol

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.admission import check_admissible
from ringllm.pipeline.errors import STEP_FAILED_MESSAGE, EngineDeadError
from ringllm.pipeline.messages import (
    ControlReply,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
)

logger = logging.getLogger(__name__)

WHERE = ("inline", "thread", "process")
# The core thread runs no step while this many of its steps wait for the reader: what a
# slow caller has not taken stays a few steps' outputs, not everything the core can make.
MAX_UNREAD_STEPS = 4


class CoreClient(Protocol):
    info: EngineInfo

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def pause_requests(self, request_ids: list[str]) -> None:
        """Their readers take none of their outputs: the core stops scheduling them (their
        slots and blocks go to others) until `resume_requests`; never waits."""

    def resume_requests(self, request_ids: list[str]) -> None: ...

    def flush_aborts(self) -> None:
        """Sends aborts (and pauses, resumes) that could not go at once (a full request
        ring); never waits."""

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None: ...

    def check_alive(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def control(self, command: str, arg: int = 0, text: str = "") -> int:
        """Sends a control command (`sleep` with its level, `wake_up`); the core's answer
        comes in a later `get_outputs` batch (`CoreOutputs.replies`) under the returned
        ticket."""

    def shutdown(self) -> None: ...

    # ---- supervision (frontend/supervisor.py) ----------------------------------------

    @property
    def can_restart(self) -> bool:
        """Whether this client started its core process(es), so it may start them again."""

    def restart(self, config: EngineConfig, standby=None) -> CoreClient:
        """This dead client cleaned up and a new one for `config` returned, made from the
        warm `standby` (engine/standby.py, used or closed here) where one fits."""

    def restart_rank(self, rank: int):
        """Dead data-parallel core `rank` cleaned up and started again: a `RankRestart`
        (dp_client.py) whose `put_in_service()` returns the request ids the dead one held."""


class _NoRestart:
    """The core in this process: nothing to start again (a failure there is the caller's)."""

    can_restart = False

    def restart(self, config: EngineConfig, standby=None) -> CoreClient:
        raise RuntimeError("an engine core in this process cannot be restarted")

    def restart_rank(self, rank: int):
        raise RuntimeError("an engine core in this process cannot be restarted")


def make_core_client(config: EngineConfig, where: str) -> CoreClient:
    """The engine core for `config`: inline, on a thread, or in its own process(es)."""
    if where not in WHERE:
        raise ValueError(f"where: {where!r} is not one of {WHERE}")
    if where == "process":
        from ringllm.pipeline.engine.dp_client import start_core_client

        return start_core_client(config)
    if config.parallel.data_parallel_size > 1:
        raise ValueError(
            "data_parallel_size: several engine cores run as processes; "
            "use multiprocess=True (LLM(..., multiprocess=True))"
        )
    return InlineCoreClient(config) if where == "inline" else InprocCoreClient(config)


def _engine_core(config: EngineConfig):
    """An EngineCore in this process. NOTE: imported here, not at the top: a front end whose
    core is another process (`ringllm serve`) imports this module, and the engine's modules
    bring torch (about 200 MiB resident) into a process that never runs a model."""
    from ringllm.pipeline.engine.engine_core import EngineCore

    return EngineCore(config)


class InlineCoreClient(_NoRestart):
    """The core in this process; `get_outputs` runs one step of it (or waits for nothing)."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = _engine_core(config)
        self.info = self.core.info
        self._tickets = itertools.count(1)
        self._replies: list[ControlReply] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        check_admissible(request, self.info)
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def pause_requests(self, request_ids: list[str]) -> None:
        self.core.pause_requests(request_ids)

    def resume_requests(self, request_ids: list[str]) -> None:
        self.core.resume_requests(request_ids)

    def flush_aborts(self) -> None:
        pass  # aborts never wait here

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None:
        replies, self._replies = self._replies, []
        if not self.core.has_work():
            return CoreOutputs([], self.core.make_stats(), replies) if replies else None
        return CoreOutputs(self.core.step(), self.core.make_stats(), replies)

    def control(self, command: str, arg: int = 0, text: str = "") -> int:
        """Run at once; the answer comes with the next `get_outputs`."""
        ticket = next(self._tickets)
        error = self.core.control(command, arg, text)
        self._replies.append(ControlReply(ticket, self.core.sleep_level, error))
        return ticket

    def check_alive(self) -> None:
        """Always alive: a failure raised in the caller's own step."""

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()  # the tensor-parallel worker processes, if any


class InprocCoreClient(_NoRestart):
    def __init__(self, config: EngineConfig) -> None:
        self.core = _engine_core(config)
        self.info = self.core.info
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._outbox: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stopping = False
        self._tickets = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="ringllm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_alive()
        check_admissible(request, self.info)
        self._post(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(("abort", list(request_ids)))

    def pause_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(("pause", list(request_ids)))

    def resume_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(("resume", list(request_ids)))

    def flush_aborts(self) -> None:
        pass  # aborts never wait here

    def reset_prefix_cache(self) -> None:
        self._post(("reset_prefix_cache", None))

    def control(self, command: str, arg: int = 0, text: str = "") -> int:
        ticket = next(self._tickets)
        self._post(("control", (ticket, command, arg, text)))
        return ticket

    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None:
        try:
            item = self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            self.check_alive()
            return None
        if self._outbox.qsize() < MAX_UNREAD_STEPS:
            with self._wake:
                self._wake.notify()  # a core that waited for this reader steps again
        if isinstance(item, BaseException):
            raise EngineDeadError(f"the engine core failed: {item!r}") from item
        return item

    def check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine core failed: {self._error!r}")
        if not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("the engine core thread is not running")

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self.core.shutdown()  # the tensor-parallel worker processes, if any

    # ---- the core's thread -----------------------------------------------------------

    def _run(self) -> None:
        stats_load = (0, 0)  # the scheduler's load in the stats last sent
        try:
            while True:
                items = self._take_inbox()
                if items is None:
                    return
                for kind, payload in items:
                    if kind == "add":
                        self._add(payload)
                    elif kind == "abort":
                        self.core.abort_requests(payload)
                    elif kind == "pause":
                        self.core.pause_requests(payload)
                    elif kind == "resume":
                        self.core.resume_requests(payload)
                    elif kind == "control":
                        self._control(*payload)
                    else:
                        self.core.reset_prefix_cache()
                if self.core.has_work() and not self._unread():
                    outputs = self.core.step()
                    load = self.core.scheduler.load()
                    if outputs or load != stats_load:
                        # with async scheduling a pause is taken a step after it came in
                        stats_load = load
                        self._outbox.put(CoreOutputs(outputs, self.core.make_stats()))
                elif items and not self.core.has_work():
                    # aborts (or pauses) can leave the core idle: say so, as the engine
                    # process does, or the gauges keep the last step's counts
                    stats_load = self.core.scheduler.load()
                    self._outbox.put(CoreOutputs([], self.core.make_stats()))
        except BaseException as exc:  # the front end must hear of any failure
            self._error = exc
            self._outbox.put(exc)

    def _add(self, request: EngineCoreRequest) -> None:
        """As the engine process does: a request the core refuses, or fails to take in,
        ends with an error for it alone, never the core's thread."""
        try:
            self.core.add_request(request)
        except ValueError as exc:
            logger.warning("engine core refused request %s: %s", request.request_id, exc)
            self._end_with(request.request_id, str(exc), refused=True)
        except Exception:
            logger.exception("engine core failed to add request %s", request.request_id)
            self._end_with(request.request_id, STEP_FAILED_MESSAGE, refused=False)

    def _control(self, ticket: int, command: str, arg: int, text: str = "") -> None:
        error = self.core.control(command, arg, text)
        reply = ControlReply(ticket, self.core.sleep_level, error)
        self._outbox.put(CoreOutputs([], self.core.make_stats(), [reply]))

    def _end_with(self, request_id: str, message: str, refused: bool) -> None:
        out = EngineCoreOutput(
            request_id, [], finish_reason="error", error=message, refused=refused
        )
        self._outbox.put(CoreOutputs([out]))

    def _unread(self) -> bool:
        """Whether MAX_UNREAD_STEPS steps wait for the reader: the next waits for it."""
        return self._outbox.qsize() >= MAX_UNREAD_STEPS

    def _take_inbox(self) -> list | None:
        """What was posted, once there is something to do: a post, or a step to run that
        the reader is not MAX_UNREAD_STEPS behind (None: stop)."""
        with self._wake:
            while not (
                self._inbox or self._stopping or (self.core.has_work() and not self._unread())
            ):
                self._wake.wait(timeout=0.5)
            if self._stopping:
                return None
            items = list(self._inbox)
            self._inbox.clear()
            return items
