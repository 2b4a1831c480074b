"""`AsyncLLM`: the asyncio engine API the HTTP server uses; never blocks the event loop.

    llm = AsyncLLM.from_config(config)                # core in its own process (rings)
    async for out in llm.generate(prompt, params, "req-1"):
        ...                                           # RequestOutput per step (DELTA/CUMULATIVE)

Front-end work (tokenize, detokenize, stop strings, n > 1) happens in this process. A
reader thread takes the core's output batches and hands them to the event loop, which
runs the output processor and feeds each request's queue. Leaving the `async for` early
(a client that disconnects, a task cancelled) aborts the request in the core, which
frees its KV blocks. If the core dies, every waiting request and every new one gets
`EngineDeadError` at once.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.admission import check_max_tokens
from ringllm.pipeline.engine.core_client import CoreClient, CoreOutputs, InprocCoreClient
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.frontend.chat_template import ChatTemplate
from ringllm.pipeline.frontend.input_processor import process_prompt, submit
from ringllm.pipeline.frontend.output_processor import OutputProcessor
from ringllm.pipeline.frontend.stats import IterationStats
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SchedulerStats

logger = logging.getLogger(__name__)
StatListener = Callable[[SchedulerStats | None, IterationStats], None]


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: CoreClient) -> None:
        self.config = config
        self.client = client
        info = client.info
        self.model_path = info.model_path
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.tokenizer = Tokenizer.from_folder(config.model.tokenizer or info.model_path)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or info.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stat_listeners: list[StatListener] = []
        self.last_scheduler_stats: SchedulerStats | None = None
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()

    @property
    def instance_name(self) -> str | None:
        """The engine's IPC instance name (for `ringllm.pipeline.Client.connect`), if it has one."""
        return getattr(self.client, "instance_name", None)

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True) -> AsyncLLM:
        """Starts the engine core (its own process over rings, or a thread here)."""
        if multiprocess:
            from ringllm.pipeline.engine.dp_client import start_core_client

            return cls(config, start_core_client(config))
        return cls(config, InprocCoreClient(config))

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_folder(self.config.model.tokenizer or self.model_path)

    def add_stat_listener(self, listener: StatListener) -> None:
        self._stat_listeners.append(listener)

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; raises ValueError before the first one if it cannot run."""
        self._start_reader()
        request_id = request_id or f"req-{next(self._ids)}"
        queue = self._add(request_id, prompt, params, priority)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _add(
        self, request_id: str, prompt: Any, params: SamplingParams, priority: int
    ) -> asyncio.Queue:
        self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        processed = process_prompt(prompt, self.tokenizer, self.vocab_size)
        params.check_token_ids(self.vocab_size)
        check_max_tokens(len(processed.token_ids), params.max_tokens, self.max_model_len)
        arrival = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        submit(
            self.client,
            self.output_processor,
            request_id,
            processed,
            params,
            self.eos_token_ids,
            arrival,
            priority,
        )
        self._queues[request_id] = queue
        return queue

    def abort(self, request_id: str) -> None:
        core_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort([request_id])
        self._queues.pop(request_id, None)
        if core_ids and self._dead is None:
            self.client.abort_requests(core_ids)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is dead: {self._dead}")
        try:
            self.client.check_alive()
        except EngineDeadError as exc:
            self._mark_dead(exc)
            raise

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    # ---- outputs ---------------------------------------------------------------------

    def _start_reader(self) -> None:
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(
            target=self._read_outputs, name="ringllm-output-reader", daemon=True
        )
        self._reader.start()

    def _read_outputs(self) -> None:
        loop = self._loop
        while not self._stopping.is_set():
            try:
                batch = self.client.get_outputs(timeout_s=0.1)
            except BaseException as exc:  # the core is gone: tell everyone waiting
                if not self._stopping.is_set():
                    loop.call_soon_threadsafe(self._mark_dead, exc)
                return
            if batch is not None:
                loop.call_soon_threadsafe(self._dispatch, batch)

    def _dispatch(self, batch: CoreOutputs) -> None:
        stats = IterationStats()
        outputs, to_abort = self.output_processor.process_outputs(batch.outputs, stats)
        if to_abort:
            self.client.abort_requests(to_abort)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if batch.stats is not None:
            self.last_scheduler_stats = batch.stats
        for listener in self._stat_listeners:
            listener(batch.stats, stats)

    def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
            logger.error("engine core died: %s", exc)
        error = (
            exc
            if isinstance(exc, EngineDeadError)
            else EngineDeadError(f"the engine core is dead: {exc}")
        )
        for queue in self._queues.values():
            queue.put_nowait(error)

    def shutdown(self) -> None:
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout=2)
        self.client.shutdown()
