"""Engine-core clients: how a front end reaches an engine core.

Both kinds have the same small interface (`CoreClient`): add and abort requests, and
take batches of `EngineCoreOutput`s as the core produces them.

- `InprocCoreClient`: the core runs in a thread of this process (torch releases the GIL
  in its ops, so the front end's event loop keeps running while a step computes).
- `ringllm.pipeline.engine.ring_client.RingCoreClient`: the core runs in its own process behind
  shared-memory rings.

Every front end checks admission (`pipeline/core/admission.py`) before a request leaves it,
so a request that can never run is refused with a ValueError at once.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.admission import check_admissible
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.engine.engine_core import EngineCore, EngineInfo
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.outputs import EngineCoreOutput
from ringllm.pipeline.stats import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass
class CoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


class CoreClient(Protocol):
    info: EngineInfo

    def add_request(self, request: Request) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None: ...

    def check_alive(self) -> None: ...

    def shutdown(self) -> None: ...


class InprocCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.info = self.core.info
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._outbox: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ringllm-engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request: Request) -> None:
        self.check_alive()
        check_admissible(request, self.info)
        self._post(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(("abort", list(request_ids)))

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
        try:
            while True:
                items = self._take_inbox()
                if items is None:
                    return
                for kind, payload in items:
                    if kind == "add":
                        self._add(payload)
                    else:
                        self.core.abort_requests(payload)
                if self.core.has_unfinished_requests():
                    outputs = self.core.step()
                    if outputs:
                        self._outbox.put(CoreOutputs(outputs, self.core.make_stats()))
        except BaseException as exc:  # the front end must hear of any failure
            self._error = exc
            self._outbox.put(exc)

    def _add(self, request: Request) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:
            # Checked before it was posted; if the core still refuses it, the request
            # ends (aborted) rather than the engine.
            logger.warning("engine core refused request %s: %s", request.request_id, exc)
            self._outbox.put(
                CoreOutputs([EngineCoreOutput(request.request_id, [], finish_reason="abort")])
            )

    def _take_inbox(self) -> list | None:
        with self._wake:
            while (
                not self._inbox and not self.core.has_unfinished_requests() and not self._stopping
            ):
                self._wake.wait()
            if self._stopping:
                return None
            items = list(self._inbox)
            self._inbox.clear()
            return items
