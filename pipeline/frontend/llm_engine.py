"""`LLMEngine`: the synchronous engine API (vLLM's shape): add_request / step / abort.

A shell around `FrontEnd` (front_end.py) that waits for outputs by stepping: with the core
in this process (`InlineCoreClient`) each `step()` runs one engine step; with
`multiprocess=True` the core runs in its own process(es) and `step()` takes what it sent;
a core process that dies is then restarted in `step()` (a data-parallel one alone, with
the sequences it held) and every unfinished sequence replayed into it (`max_restarts`
within a window, as the server does: supervisor.py), but a poison request, whose output
from that `step()` ends with RequestFailedError (the suspects of a death the triage holds
back are replayed from a later `step()`). The new process is forked by the spawner thread
(child_process.start_child), so it does not die with the thread that called `step()`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import make_core_client
from ringllm.pipeline.errors import EngineBusyError, EngineDeadError, EngineSleepingError
from ringllm.pipeline.frontend.front_end import FrontEnd
from ringllm.pipeline.frontend.stats import IterationStats, StatLogger
from ringllm.pipeline.frontend.supervisor import DEFAULT_MAX_RESTARTS, Supervisor
from ringllm.pipeline.lora_request import LoRARequest, adapter_digest
from ringllm.pipeline.messages import CoreOutputs, EngineCoreOutput, wake_bits
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SchedulerStats

STEP_WAIT_S = 1.0  # a step() over the rings waits at most this long for the core's outputs
CONTROL_TIMEOUT_S = 600.0  # a sleep or wake-up (a level-2 wake loads the weights again)
QUARANTINED = "the engine core died each time it ran this request"
logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        multiprocess: bool = False,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
    ) -> None:
        """`multiprocess`: run the engine core in its own process behind the rings;
        `max_restarts`: how many deaths of it (within a minute) are restarted."""
        self.config = config
        client = make_core_client(config, "process" if multiprocess else "inline")
        try:
            self.front_end = FrontEnd(config, client)
        except BaseException:
            client.shutdown()
            raise
        self.supervisor = Supervisor(config, client, max_restarts)
        self._last_stats: SchedulerStats | None = None
        self.sleep_level = 0
        self._held: list[CoreOutputs] = []  # outputs read while waiting for a control answer
        self.stat_logger = StatLogger() if log_stats else None
        self.last_iteration_stats = IterationStats()

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**engine_args))

    @property
    def core_client(self):
        """How this engine reaches its core (pipeline/engine/core_client.py)."""
        return self.front_end.client

    @property
    def engine_core(self):
        """The `EngineCore` itself when it runs in this process (else None)."""
        return getattr(self.front_end.client, "core", None)

    # What callers read of the front end.
    tokenizer = property(lambda self: self.front_end.tokenizer)
    chat_template = property(lambda self: self.front_end.chat_template)
    eos_token_ids = property(lambda self: self.front_end.eos_token_ids)
    vocab_size = property(lambda self: self.front_end.vocab_size)
    max_model_len = property(lambda self: self.front_end.max_model_len)
    model_path = property(lambda self: self.front_end.model_path)

    # ---- requests ------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Tokenizes and admits a request; raises ValueError (nothing admitted) if it cannot
        run, EngineSleepingError while the engine is asleep. `lora_request`: the adapter
        it runs with (loaded first if it is new)."""
        if self.sleep_level:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level}); call wake_up() first"
            )
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
            params = params.clone()
            params.lora_id = lora_request.lora_int_id
        self.front_end.add_request(request_id, prompt, params, arrival_time, priority)

    def abort_request(self, request_ids: str | list[str]) -> None:
        self.front_end.abort([request_ids] if isinstance(request_ids, str) else list(request_ids))
        if self.supervisor.holding:  # it may have been a suspect, replayed or held
            self._release_held(())

    def has_unfinished_requests(self) -> bool:
        return self.front_end.num_unfinished_requests > 0

    def get_num_unfinished_requests(self) -> int:
        return self.front_end.num_unfinished_requests

    # ---- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        try:
            batch = self._next_batch()
        except EngineDeadError as exc:
            failed = self._restart(exc)
            if failed is None:
                raise
            return failed
        if batch is None:
            return []
        self._last_stats = batch.stats or self._last_stats
        outputs, stats = self.front_end.process_outputs(batch)
        if self.supervisor.holding:
            self._release_held(batch.outputs)
        self.last_iteration_stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(batch.stats, stats)  # None: no new counts
        return outputs

    def _next_batch(self) -> CoreOutputs | None:
        if self._held:
            return self._held.pop(0)
        return self.front_end.client.get_outputs(timeout_s=STEP_WAIT_S)

    # ---- sleep mode ----------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights offloaded, KV cache freed; 2: weights dropped too (reloaded on
        wake). Needs enable_sleep_mode=True (else ValueError). Unfinished requests pause;
        new ones are refused (EngineSleepingError) until `wake_up`."""
        self._control("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._control("wake_up", wake_bits(tags))

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    # ---- LoRA adapters (pipeline/lora_request.py) ------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter in every worker; False if this very adapter is loaded already;
        ValueError (nothing loaded) when it does not fit or its name or id is taken."""
        loras = self.front_end.loras
        loaded = loras.by_id.get(lora_request.lora_int_id)
        if loaded is not None and loaded.request == lora_request:
            return False
        if not self.front_end.config.lora.enable_lora:
            raise ValueError("LoRA is not enabled; create the LLM with enable_lora=True")
        loras.check_new(lora_request)
        digest = adapter_digest(lora_request.lora_path)
        self._control("add_lora", lora_request.lora_int_id, loras.control_text(lora_request))
        loras.add(lora_request, digest)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        if lora_id not in self.front_end.loras.by_id:
            return False
        self._control("remove_lora", lora_id)
        self.front_end.loras.remove(lora_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return [entry.request for entry in self.front_end.loras.by_id.values()]

    def _control(self, command: str, arg: int = 0, text: str = "") -> None:
        """Sends the command and reads outputs until its answer; what else comes meanwhile
        is held for the next `step()`."""
        client = self.front_end.client
        ticket = client.control(command, arg, text=text)
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while True:
            batch = client.get_outputs(timeout_s=STEP_WAIT_S)
            if batch is not None:
                reply = next((r for r in batch.replies if r.ticket == ticket), None)
                if batch.outputs or batch.stats is not None:
                    self._held.append(batch)
                if reply is not None:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{command}: no answer from the engine core in {CONTROL_TIMEOUT_S:.0f} s"
                )
        if reply.error is not None:
            raise ValueError(reply.error)
        self.sleep_level = reply.sleep_level

    def _restart(self, exc: EngineDeadError) -> list[RequestOutput] | None:
        """A new core in place of the dead one (supervisor.py), the unfinished sequences
        it held replayed into it (but the suspects the poison triage holds back); returns
        the outputs of the requests it quarantined, None when this engine does not
        restart it."""
        states = self.front_end.output_processor.states
        if not self.supervisor.allow([rid for rid, s in states.items() if s.core_request]):
            return None
        logger.error("engine core died (%s); restarting it", exc)
        failed, siblings = self.front_end.output_processor.process_outputs(
            [
                EngineCoreOutput(rid, [], finish_reason="error", error=QUARANTINED)
                for rid in sorted(self.supervisor.take_quarantined())
            ]
        )
        replacement = self.supervisor.replace(self.front_end.client, exc)
        fresh, replays = replacement.put_in_service(self.front_end.replay_requests())
        if fresh is not self.front_end.client:
            self.front_end.client = fresh
            self.sleep_level = 0  # a new core starts awake
        self.front_end.restore_loras(fresh)
        if siblings:  # a quarantined child's, on another data-parallel core
            fresh.abort_requests(siblings)
        replays = self.supervisor.hold_back(replays)
        self._add_all(replays)
        self.supervisor.replayed(len(replays))
        return failed

    def _release_held(self, outputs) -> None:
        """Held suspects of a death (`Supervisor.hold_back`) the triage lets go: replayed."""
        states = self.front_end.output_processor.states
        released = self.supervisor.release_held(outputs, states)
        if released:
            replays = [r for r in self.front_end.replay_requests() if r.request_id in released]
            try:
                self._add_all(replays)
            except EngineDeadError:  # the next step() restarts the core, replaying them
                pass

    def _add_all(self, requests) -> None:
        client = self.front_end.client
        for request in requests:
            while True:
                try:
                    client.add_request(request)
                    break
                except EngineBusyError:  # a fresh core reads fast
                    time.sleep(0.001)

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    def reset_prefix_cache(self) -> None:
        self.front_end.reset_prefix_cache()

    def shutdown(self) -> None:
        self.front_end.shutdown()

    def get_tokenizer(self):
        return self.front_end.tokenizer
