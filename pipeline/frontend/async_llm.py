"""`AsyncLLM`: the asyncio engine API the HTTP server uses; never blocks the event loop.

    llm = AsyncLLM.from_config(config)                # core in its own process (rings)
    async for out in llm.generate(prompt, params, "req-1"):
        ...                                           # RequestOutput per step (DELTA/CUMULATIVE)

A shell around `FrontEnd` (front_end.py), which does the front-end work (tokenize,
detokenize, stop strings, n > 1) in this process. A reader thread takes the core's output
batches and hands them to the event loop, which runs the front end's output processing
and feeds each request's queue. Leaving the `async for` early
(a client that disconnects, a task cancelled) aborts the request in the core, which
frees its KV blocks.

If the core dies: with `max_restarts` > 0 and core processes this front end started (one,
or one per data-parallel rank), it is **restarted** (a supervisor thread starts a new one,
or the whole data-parallel group, with the same config; children are forked by the
process's spawner thread, pipeline/child_process.py, so they live as long as this process)
and every unfinished sequence is replayed into it as its
prompt plus the tokens already delivered (`FrontEnd.replay`): streams go on where they
stopped, except a poison request (in flight at consecutive deaths: supervisor.py), which
ends with RequestFailedError (to tell it from the others in flight with it at its
deaths, half of those may wait in the front end, unsent, while the rest run again). New
requests wait for it (up to `restart_wait_s`); `check_health` says EngineRestartingError
meanwhile. More than `max_restarts` deaths within
`restart_window_s` is a crash loop: then, as without supervision, every waiting request
and every new one gets `EngineDeadError` at once. A core that ended because another host
of its ranks was lost (HostLostError) is not replayed into: every request, and every new
one until the host is back, gets that error at once (503 host_lost), while the restart
(not counted against the budget) waits for the host (`_wait_for_host`).

Sleep mode (`sleep(level)`, `wake_up()`, config enable_sleep_mode): commands go to the core
as control records and their answers come back with the outputs (`CoreOutputs.replies`);
while asleep, new requests get EngineSleepingError and those under way wait for the wake.
"""

from __future__ import annotations

import asyncio
import logging
import queue as queue_module
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import CoreClient, make_core_client
from ringllm.pipeline.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineRestartingError,
    EngineSleepingError,
    HostLostError,
    RequestFailedError,
    SlowReaderError,
)
from ringllm.pipeline.frontend.front_end import (
    FrontEnd,
    check_structured_outputs,
    random_request_id,
)
from ringllm.pipeline.frontend.input_processor import ProcessedPrompt
from ringllm.pipeline.frontend.output_queue import OutputQueue, QueuedBytes, longest_stalled
from ringllm.pipeline.frontend.stats import IterationStats
from ringllm.pipeline.frontend.supervisor import DEFAULT_RESTART_WINDOW_S, Supervisor
from ringllm.pipeline.lora_request import LoRARequest, adapter_digest
from ringllm.pipeline.messages import CoreOutputs, wake_bits
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SchedulerStats

logger = logging.getLogger(__name__)
DEFAULT_MAX_QUEUED_OUTPUTS = 4096
DEFAULT_MAX_QUEUED_OUTPUT_BYTES = 4 << 20  # one request's unread outputs
DEFAULT_MAX_QUEUED_OUTPUT_BYTES_TOTAL = 256 << 20  # every request's together
DEFAULT_BUSY_WAIT_S = 5.0
DEFAULT_RESTART_WAIT_S = 300.0  # how long a new request waits for a restarting core
HOST_RETRY_S = 1.0  # a start that gave up on a lost host: the pause before the next one
CONTROL_TIMEOUT_S = 600.0  # a sleep or wake-up (a level-2 wake loads the weights again)
_BUSY_RETRY_S = (0.001, 0.05)  # first and longest pause between tries on a full ring
StatListener = Callable[[SchedulerStats | None, IterationStats], None]


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        client: CoreClient,
        max_queued_outputs: int = DEFAULT_MAX_QUEUED_OUTPUTS,
        busy_wait_s: float = DEFAULT_BUSY_WAIT_S,
        max_queued_output_bytes: int = DEFAULT_MAX_QUEUED_OUTPUT_BYTES,
        max_queued_output_bytes_total: int = DEFAULT_MAX_QUEUED_OUTPUT_BYTES_TOTAL,
        max_restarts: int = 0,
        restart_window_s: float = DEFAULT_RESTART_WINDOW_S,
        restart_wait_s: float = DEFAULT_RESTART_WAIT_S,
        standby: bool = False,
    ) -> None:
        """`max_queued_outputs`, `max_queued_output_bytes`: outputs, and their bytes, one
        request may have waiting for its reader before it is dropped as a reader that
        stopped reading; `max_queued_output_bytes_total`: the bytes of every request's
        together (past it, the request whose reader has taken nothing the longest is
        dropped: output_queue.py; long before that, a request whose reader has fallen
        behind is paused in the engine until its reader catches up); `busy_wait_s`: how
        long a request waits (asynchronously) for room on a full request ring before
        EngineBusyError; `standby`: with supervision of a single core, keep a warm spare
        core process (standby.py) so that a restart costs the model load, not a fresh
        interpreter's imports."""
        self.config = config
        self.client = client
        self.front_end = FrontEnd(config, client, offload_tokenizing=True)
        self._lora_lock = asyncio.Lock()  # one adapter load or unload at a time
        self.max_queued_outputs = max_queued_outputs
        self.max_queued_output_bytes = max_queued_output_bytes
        self.queued_bytes = QueuedBytes(max_queued_output_bytes_total)
        self.busy_wait_s = busy_wait_s
        self._queues: dict[str, OutputQueue] = {}
        self._stat_listeners: list[StatListener] = []
        self.last_scheduler_stats: SchedulerStats | None = None
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._retired_reader: threading.Thread | None = None
        self._stopping = threading.Event()
        # supervision (supervisor.py): only of core processes this front end started itself
        self.supervisor = Supervisor(config, client, max_restarts, restart_window_s, standby)
        self.restart_wait_s = restart_wait_s
        self._restarted: asyncio.Event | None = None  # set once a restart is over
        # a host of the engine's ranks is gone: its restart waits for it, requests do not
        self._host_lost: HostLostError | None = None
        self._supervisor_thread: threading.Thread | None = None
        self._jobs: queue_module.Queue = queue_module.Queue()
        # sleep mode: the core's level as its last answer said; commands awaiting answers
        self.sleep_level = 0
        self._falling_asleep = 0
        self._replies: dict[int, asyncio.Future] = {}

    @property
    def instance_name(self) -> str | None:
        """The engine's IPC instance name (for `ringllm.pipeline.Client.connect`), if it has one."""
        return getattr(self.client, "instance_name", None)

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True, **options) -> AsyncLLM:
        """Starts the engine core (its own process over rings, or a thread here)."""
        client = make_core_client(config, "process" if multiprocess else "thread")
        try:
            return cls(config, client, **options)
        except BaseException:
            client.shutdown()
            raise

    # What callers read of the front end.
    tokenizer = property(lambda self: self.front_end.tokenizer)
    chat_template = property(lambda self: self.front_end.chat_template)
    max_model_len = property(lambda self: self.front_end.max_model_len)
    vocab_size = property(lambda self: self.front_end.vocab_size)
    model_path = property(lambda self: self.front_end.model_path)
    pooler_config = property(lambda self: self.front_end.pooler_config)

    def add_stat_listener(self, listener: StatListener) -> None:
        self._stat_listeners.append(listener)

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        group_id: str = "",
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; raises ValueError before the first one if it cannot run.
        `lora_request`: the LoRA adapter it runs with (loaded first if it is new).

        The prompt is tokenized on a worker thread (tokenizers then releases the GIL), so a
        large one never stalls the event loop; a full request ring is waited on here,
        asynchronously, up to `busy_wait_s` (then EngineBusyError, nothing sent)."""
        self._start_reader()
        request_id = request_id or random_request_id()
        loop = asyncio.get_running_loop()
        if not isinstance(prompt, ProcessedPrompt):
            prompt = await loop.run_in_executor(None, self.front_end.process_prompt, prompt)
        if params.structured_outputs is not None:  # a big schema's check is off the loop too
            await loop.run_in_executor(None, check_structured_outputs, params)
        if lora_request is not None:
            await self.add_lora(lora_request)
            params = params.clone()
            params.lora_id = lora_request.lora_int_id
        queue = await self._add(request_id, prompt, params, priority, group_id)
        finished = False
        try:
            while True:
                item = await queue.get()
                if queue.should_resume():
                    self._resume(request_id, queue)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise item.error  # refused (ValueError) or failed in the engine
                yield item
                if finished:
                    return
        finally:
            queue.clear()  # what it left unread no longer counts, even if the queue was ended
            self._forget_queue(request_id)
            if not finished:
                self.abort(request_id)

    async def _add(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int,
        group_id: str,
    ) -> OutputQueue:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.busy_wait_s
        pause, longest = _BUSY_RETRY_S
        while True:
            self._check_host()
            if self._restarted is not None:
                await self._wait_for_restart()
                deadline = loop.time() + self.busy_wait_s
                continue
            try:
                self.check_health()
            except EngineRestartingError:
                continue
            if request_id in self._queues:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._check_awake()
            try:
                self.front_end.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority,
                    strict_max_tokens=True,
                    group_id=group_id,
                )
                break
            except EngineDeadError as exc:  # died just now: a restart, or the end
                self._mark_dead(exc)
                if self._restarted is None:
                    raise
                continue
            except EngineBusyError:
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, longest)
        queue = OutputQueue(
            self.max_queued_outputs, self.max_queued_output_bytes, self.queued_bytes
        )
        self._queues[request_id] = queue
        return queue

    def _forget_queue(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.clear()  # what its reader left unread no longer counts

    def abort(self, request_id: str) -> None:
        self._forget_queue(request_id)
        try:
            self.front_end.abort([request_id], in_core=self._dead is None)
        except EngineDeadError:  # the core died meanwhile: nothing there to abort
            pass
        if self.supervisor.holding:  # it may have been a suspect, replayed or held
            self._release_held(())

    def fail_all(self, error: BaseException) -> int:
        """Ends every unfinished request with `error` (its reader raises it) and aborts it
        in the core: for a server that stops. Returns how many there were."""
        request_ids = list(self._queues)
        for queue in self._queues.values():
            queue.end(error, drop_unread=True)
        self._queues.clear()
        if request_ids:
            self.front_end.abort(request_ids, in_core=self._dead is None)
        return len(request_ids)

    def reset_prefix_cache(self) -> None:
        """Every cached prefix forgotten in the core; EngineBusyError on a full request ring
        (never waits)."""
        self.check_health()
        self.front_end.reset_prefix_cache()

    # ---- LoRA adapters (pipeline/lora_request.py) --------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter in every worker; False if this very adapter is loaded already.
        ValueError (the reason) when it does not fit the model, its name or id is another
        adapter's, or LoRA is not enabled; nothing is loaded then."""
        async with self._lora_lock:
            loras = self.front_end.loras
            loaded = loras.by_id.get(lora_request.lora_int_id)
            if loaded is not None and loaded.request == lora_request:
                return False
            if not self.config.lora.enable_lora:
                raise ValueError("LoRA is not enabled; start the engine with --enable-lora")
            loras.check_new(lora_request)
            loop = asyncio.get_running_loop()
            digest = await loop.run_in_executor(None, adapter_digest, lora_request.lora_path)
            text = loras.control_text(lora_request)
            await self._control("add_lora", lora_request.lora_int_id, text)
            loras.add(lora_request, digest)
            return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Unloads adapter `lora_id`; False if it is not loaded. ValueError while requests
        that run with it are under way."""
        async with self._lora_lock:
            if lora_id not in self.front_end.loras.by_id:
                return False
            await self._control("remove_lora", lora_id)
            self.front_end.loras.remove(lora_id)
            return True

    def list_loras(self) -> list[LoRARequest]:
        return [entry.request for entry in self.front_end.loras.by_id.values()]

    # ---- sleep mode ------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Puts the engine to sleep (config enable_sleep_mode): level 1 offloads the weights,
        2 drops them (reloaded on wake); both free the KV cache. New requests are refused
        (EngineSleepingError) from now until `wake_up`; requests under way pause and go on
        after it. ValueError if sleep mode is off or the level is not 1 or 2."""
        self._falling_asleep += 1
        try:
            await self._control("sleep", level)
        finally:
            self._falling_asleep -= 1

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Weights and KV cache back (`tags`: only "weights" or "kv_cache", vLLM's; the
        engine takes new requests again once every part is back)."""
        await self._control("wake_up", wake_bits(tags))

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def _check_awake(self) -> None:
        if self.sleep_level or self._falling_asleep:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level or 'pending'}); "
                "wake it up first (POST /wake_up)"
            )

    async def _control(self, command: str, arg: int = 0, text: str = "") -> None:
        self._start_reader()
        self._check_host()
        if self._restarted is not None:
            await self._wait_for_restart()
        self.check_health()
        ticket = self.client.control(command, arg, text=text)
        future = asyncio.get_running_loop().create_future()
        self._replies[ticket] = future  # the answer is dispatched on this loop: after this
        try:
            reply = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self._replies.pop(ticket, None)
        if reply.error is not None:
            raise ValueError(reply.error)
        self.sleep_level = reply.sleep_level

    def _fail_replies(self, error: BaseException) -> None:
        replies, self._replies = self._replies, {}
        for future in replies.values():
            if not future.done():
                future.set_exception(error)

    async def _wait_for_restart(self) -> None:
        restarted = self._restarted
        try:
            await asyncio.wait_for(restarted.wait(), self.restart_wait_s)
        except TimeoutError:
            raise EngineRestartingError(
                "the engine core is restarting and was not back in time; retry shortly"
            ) from None

    def _check_host(self) -> None:
        if self._host_lost is not None:  # a fresh error: one raised again keeps every traceback
            raise HostLostError(str(self._host_lost))

    def check_health(self) -> None:
        self._check_host()
        if self._restarted is not None:
            raise EngineRestartingError("the engine core is restarting")
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is dead: {self._dead}")
        try:
            self.client.check_alive()
        except EngineDeadError as exc:
            self._mark_dead(exc)
            self._check_host()
            if self._restarted is not None:
                raise EngineRestartingError("the engine core is restarting") from exc
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
        """One reader thread per core client; none while a restart is under way (the
        restart starts the new client's: `_spawn_reader`)."""
        if self._reader is None and self._restarted is None:
            self._spawn_reader()

    def _spawn_reader(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(
            target=self._read_outputs, args=(self.client,), name="ringllm-output-reader",
            daemon=True,
        )  # fmt: skip
        self._reader.start()

    def _read_outputs(self, client: CoreClient) -> None:
        loop = self._loop
        while not self._stopping.is_set():
            try:
                batch = client.get_outputs(timeout_s=0.1)
            except BaseException as exc:  # the core is gone: tell everyone waiting
                if not self._stopping.is_set():
                    loop.call_soon_threadsafe(self._mark_dead, exc)
                return
            if batch is not None:
                loop.call_soon_threadsafe(self._dispatch, batch, time.monotonic())

    def _dispatch(self, batch: CoreOutputs, read_at: float | None = None) -> None:
        """Hands a batch's outputs to their queues (on the loop; `read_at`: when the reader
        thread took it from the core, so the loop's lag is known)."""
        loop_lag_s = 0.0 if read_at is None else max(0.0, time.monotonic() - read_at)
        for reply in batch.replies:
            future = self._replies.pop(reply.ticket, None)
            if future is not None and not future.done():
                future.set_result(reply)
        outputs, stats = self.front_end.process_outputs(batch)
        restarts = self.supervisor.num_restarts
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            if not queue.offer(out):
                self._drop_slow_reader(out.request_id, _unread(queue))
            elif queue.should_pause(restarts):
                self._pause(out.request_id, queue)
        while self.queued_bytes.over and (
            stalled := longest_stalled(self._queues.items(), loop_lag_s)
        ):
            request_id, queue = stalled
            self._drop_slow_reader(
                request_id,
                f"its {queue.num_bytes} bytes of outputs waited the longest with none read "
                f"while all requests' unread outputs passed {self.queued_bytes.max_total_bytes} "
                "bytes",
            )
        if self.supervisor.holding:  # (after the drops: a dropped suspect has ended)
            self._release_held(batch.outputs)
        if batch.stats is not None:
            self.last_scheduler_stats = batch.stats
        for listener in self._stat_listeners:
            listener(batch.stats, stats)

    def _pause(self, request_id: str, queue: OutputQueue) -> None:
        """Its reader has fallen behind: the core stops scheduling its sequences, which
        leave their slots and blocks to requests whose readers read (output_queue.py)."""
        queue.paused_after_restarts = self.supervisor.num_restarts
        self._send_pause(request_id, self.client.pause_requests)

    def _resume(self, request_id: str, queue: OutputQueue) -> None:
        queue.paused_after_restarts = None
        self._send_pause(request_id, self.client.resume_requests)

    def _send_pause(self, request_id: str, send) -> None:
        if self._dead is not None or self._restarted is not None:
            return  # a new core runs it unpaused
        try:
            send(self.front_end.output_processor.child_ids(request_id))
        except EngineDeadError:  # the reader thread reports the death
            pass

    def _drop_slow_reader(self, request_id: str, unread: str) -> None:
        """A request's reader left more unread than its queue may hold: it stopped reading.
        Abort it in the core (its KV blocks are freed) and hand the reader an error in
        place of what it did not read, so the server's memory stays bounded."""
        logger.warning(
            "request %s: its reader stopped reading (%s); aborting it", request_id, unread
        )
        queue = self._queues.pop(request_id)
        self.front_end.abort([request_id], in_core=self._dead is None)
        queue.end(
            SlowReaderError(f"request {request_id}: {unread}; the request was aborted"),
            drop_unread=True,
        )

    # ---- supervision -------------------------------------------------------------------

    max_restarts = property(lambda self: self.supervisor.max_restarts)
    num_restarts = property(lambda self: self.supervisor.num_restarts)
    last_restart_s = property(lambda self: self.supervisor.last_restart_s)

    def _may_restart(self) -> bool:
        in_flight = [
            rid for rid, s in self.front_end.output_processor.states.items() if s.core_request
        ]
        return not self._stopping.is_set() and self.supervisor.allow(in_flight)

    def _begin_restart(self, exc: BaseException) -> None:
        logger.error("engine core died (%s); restarting it", exc)
        self._fail_replies(EngineDeadError(f"the engine core died ({exc}); a new one starts awake"))
        self._loop = asyncio.get_running_loop()  # (noticed by a health check: no reader yet)
        self._restarted = asyncio.Event()
        # the old reader thread has returned, or will at the error it reads next (a death
        # noticed by a health check first): kept to see it gone before a new one starts
        self._retired_reader, self._reader = self._reader, None
        if self._supervisor_thread is None:
            self._supervisor_thread = threading.Thread(
                target=self._supervise, name="ringllm-supervisor", daemon=True
            )
            self._supervisor_thread.start()
        self._jobs.put((self.client, exc))

    def _supervise(self) -> None:
        """The supervisor thread: each job is a dead core client to replace; the new core
        is handed to the event loop (`_put_in_service`)."""
        while (job := self._jobs.get()) is not None:
            dead, exc = job
            try:
                replacement = self.supervisor.replace(dead, exc)
            except BaseException as error:  # noqa: BLE001 - reported to the loop
                self._to_loop(self._restart_failed, error)
                continue
            if self._stopping.is_set() or not self._to_loop(self._put_in_service, replacement):
                replacement.abandon()  # nobody left to hand it to

    def _put_in_service(self, replacement) -> None:
        retired = self._retired_reader
        if replacement.of_rank and retired is not None and retired.is_alive():
            # it reads the rank's error from the group's queue next: gone before the swap
            self._loop.call_later(0.01, self._put_in_service, replacement)
            return
        self._quarantine(self.supervisor.take_quarantined())
        fresh, requests = replacement.put_in_service(self.front_end.replay_requests())
        requests = self.supervisor.hold_back(requests)
        if fresh is not self.client:
            self.client = fresh
            self.front_end.client = fresh
            self.sleep_level = 0  # a new core starts awake
        self.front_end.restore_loras(fresh)  # (a data-parallel client: the new core's)
        self._spawn_reader()
        asyncio.ensure_future(self._replay_all(fresh, requests))

    def _quarantine(self, core_ids: set[str]) -> None:
        """Ends the user requests of poison sequences (never replayed) with their error."""
        states = self.front_end.output_processor.states
        for core_id in core_ids:
            state = states.get(core_id)
            if state is None:
                continue  # its request ended meanwhile (another child quarantined it)
            request_id = core_id if state.parent is None else state.parent.request_id
            self.front_end.abort([request_id], in_core=False)
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.end(
                    RequestFailedError(
                        f"request {request_id}: the engine core died each time it ran it"
                    ),
                    drop_unread=False,
                )

    def _to_loop(self, callback, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except (RuntimeError, AttributeError):  # the loop is closed: nobody to hand it to
            return False
        return True

    async def _replay_all(self, fresh, requests) -> None:
        if (died := await self._replay(fresh, requests)) is None:
            self.supervisor.replayed(len(requests))
        self._restart_over()
        if died is not None:  # died again before the replay was done
            self._mark_dead(died)

    async def _replay(self, client, requests) -> EngineDeadError | None:
        """Sends `requests` to `client` (but those aborted meanwhile); the error if it died."""
        for request in requests:
            while request.request_id in self.front_end.output_processor.states:
                try:
                    client.add_request(request)
                    break
                except EngineBusyError:  # a fresh core reads fast: wait for room
                    await asyncio.sleep(0.005)
                except EngineDeadError as exc:
                    return exc
        return None

    def _release_held(self, outputs) -> None:
        """Held suspects of a death (`Supervisor.hold_back`) the triage lets go: replayed
        into the core serving now. (If it dies first, its reader reports the death, and
        the restart replays them.)"""
        if self._restarted is not None:
            return  # the core these outputs came from died: the restart decides
        states = self.front_end.output_processor.states
        released = self.supervisor.release_held(outputs, states)
        if released:
            requests = [r for r in self.front_end.replay_requests() if r.request_id in released]
            asyncio.ensure_future(self._replay(self.client, requests))

    def _restart_over(self) -> None:
        restarted, self._restarted = self._restarted, None
        self._host_lost = None
        if restarted is not None:
            restarted.set()

    def _restart_failed(self, exc: BaseException) -> None:
        lost = self._host_lost
        logger.error("the engine core could not be restarted: %s", exc)
        self._restart_over()
        if lost is not None and not self._stopping.is_set():  # it gave up waiting: again
            self._host_lost = lost
            self._loop.call_later(HOST_RETRY_S, self._restart_without_host, lost)
            return
        self._mark_dead(exc)

    def _wait_for_host(self, exc: HostLostError) -> None:
        """A host of the engine's ranks is gone: no restart can finish before it is back, so
        nothing waits on one. Every request ends now with `exc` (503 host_lost), new ones
        are refused until the restart is over, and the restart (a new core, whose start
        waits for the host) is not counted against the budget: a host that comes and goes
        is not a crash loop."""
        exc = HostLostError(
            f"{exc}; the engine waits for it to come back: start `ringllm serve --headless` "
            "there again"
        )
        self._host_lost = exc
        request_ids = list(self._queues)
        for queue in self._queues.values():
            queue.end(HostLostError(str(exc)), drop_unread=False)
        self._queues.clear()
        self.front_end.abort(request_ids, in_core=False)  # none is replayed
        self._begin_restart(exc)

    def _restart_without_host(self, lost: HostLostError) -> None:
        if self._host_lost is lost and self._restarted is None and not self._stopping.is_set():
            self._begin_restart(lost)

    def _mark_dead(self, exc: BaseException) -> None:
        if self._restarted is not None:
            return  # the restart under way handles it
        if (
            isinstance(exc, HostLostError)
            and self._dead is None
            and self.supervisor.max_restarts > 0
            and not self._stopping.is_set()
            and _on_a_loop()
        ):
            self._wait_for_host(exc)
            return
        if self._dead is None and _on_a_loop() and self._may_restart():
            self._begin_restart(exc)
            return
        if self._dead is None:
            self._dead = exc
            logger.error("engine core died: %s", exc)
            self.supervisor.close()  # no restart will come
        error = (
            exc
            if isinstance(exc, EngineDeadError)
            else EngineDeadError(f"the engine core is dead: {exc}")
        )
        self._fail_replies(error)
        for queue in self._queues.values():
            queue.end(error, drop_unread=False)

    def shutdown(self) -> None:
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(timeout=2)
        self.front_end.shutdown()
        self.supervisor.close()  # no spare spawned from now on
        if self._supervisor_thread is not None:
            self._jobs.put(None)
            # a restart under way ends (shut down); one waiting for a lost host ends with
            # this process (its core's start is abandoned on the SIGTERM it then gets)
            self._supervisor_thread.join(timeout=0 if self._host_lost is not None else 60)
        self.supervisor.close()  # one spawned meanwhile


def _unread(queue: OutputQueue) -> str:
    """What a queue that refused an output held, for the reader's error."""
    return (
        f"{len(queue)} outputs ({queue.num_bytes} bytes) were left unread, at most "
        f"{queue.max_outputs} ({queue.max_bytes} bytes) may wait"
    )


def _on_a_loop() -> bool:
    """A restart is run from the event loop; a death noticed off one ends the engine, as
    without supervision."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
