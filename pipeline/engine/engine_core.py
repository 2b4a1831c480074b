"""`EngineCore`: the scheduler, the KV cache and the executor, stepped one batch at a time.

It knows token ids only (text lives on the front-end side). One `step()`:

    schedule -> executor.execute (model + sampler) -> scheduler.update_from_output
             -> EngineCoreOutputs (new tokens, logprobs, finish reasons)

Requests arrive as `EngineCoreRequest`s (pipeline/messages.py) and become the scheduler's
own `Request` state here. The KV pool is sized once at start from what the executor can
hold. The executor is the in-process `Worker`, or with tensor_parallel_size > 1 a
`MultiprocExecutor` driving one process per rank (pipeline/executor/interface.py); `shutdown()`
stops them. Run in-process by `LLMEngine` / `AsyncLLM`, or in its own process behind the
shared-memory rings (engine_core_proc.py).

Batches in flight (pipeline parallelism: an executor with `max_concurrent_batches` P > 1,
vLLM's batch queue): `step()` submits a newly scheduled batch and returns at once while
fewer than P are in flight and the scheduler found something to run; otherwise it waits for
the oldest batch's result and takes it in. So the stages each work on a different batch,
results are taken in the order the batches were sent, and the scheduler (which skips the
requests in flight, pipeline/core/scheduler.py) never waits on a batch it does not need.
Commands that change the cache or the workers (sleep, reset_prefix_cache) first take in
every batch in flight; their outputs go out with the next step.

Async scheduling (`--async-scheduling`, one stage): two batches in flight on the one worker
(the in-process Worker runs them on its step thread; tensor-parallel ranks read them from
their ring). `step()` plans and sends step N+1 while step N runs, then takes step N's
result in and returns its outputs, which the caller hands out while step N+1 runs
(`_step_ahead`); the scheduler's module doc states the rule that keeps it exact.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from pathlib import Path

from ringllm.pipeline import errors
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.admission import check_images, resolve_max_tokens
from ringllm.pipeline.core.kv_groups import engine_kv_groups, hybrid_off_reason
from ringllm.pipeline.core.kv_tiers import DiskTier, HostTier
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.core.structured_output import StructuredOutputManager
from ringllm.pipeline.errors import STEP_FAILED_MESSAGE, EngineDeadError
from ringllm.pipeline.executor.host_memory import check_swap_space
from ringllm.pipeline.executor.interface import Executor, make_executor
from ringllm.pipeline.messages import (
    SLEEP_LEVELS,
    WAKE_TAGS,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    wake_tags,
)
from ringllm.pipeline.stats import SchedulerStats
from ringllm.pipeline.structured.grammar import GuidanceBackend

logger = logging.getLogger(__name__)


CONTROL_COMMANDS = ("sleep", "wake_up", "add_lora", "remove_lora")


def _for_an_encoder(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """An encoder's scheduling (models/bert.py): a prompt is one step (no chunked prefill;
    the step budget holds the longest), and no prefix cache (a cached block holds nothing
    an encoder can start from)."""
    sched = dataclasses.replace(
        config.scheduler,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens, max_model_len),
    )
    cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
    return dataclasses.replace(config, scheduler=sched, cache=cache)


GRAMMAR_POLL_S = 0.0005  # a step with nothing to run but compiling grammars waits this long


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.sleep_level = 0  # 0: awake; 1, 2: asleep (pipeline/worker/sleep.py)
        self._woken: set[str] = set()  # parts a partial wake_up(tags) brought back
        self._batches: collections.deque = collections.deque()  # submitted, not taken in
        self._drained: list[EngineCoreOutput] = []  # taken in by a command: out next step
        started = time.perf_counter()
        self.executor = executor or make_executor(config)
        loaded = time.perf_counter()
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        # what start-up cost (the restart-time breakdown: README, `ringllm bench lifecycle`)
        self.startup_s = {
            "model_s": round(loaded - started, 4),
            "kv_cache_s": round(time.perf_counter() - loaded, 4),
        }

    def _start(self, config: EngineConfig) -> None:
        model = self.executor.info()
        self.max_model_len = model.max_model_len
        if model.encoder_only:
            config = _for_an_encoder(config, self.max_model_len)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {sched.max_num_batched_tokens} tokens is less than max_model_len "
                f"{self.max_model_len}; without chunked prefill a whole prompt must fit in one step"
            )
        encoder_budget = _encoder_budget(config, model)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        groups = engine_kv_groups(model.layer_windows or (0,), config)
        if groups.slides:
            logger.info("KV cache: %s", groups.describe())
        elif any(model.layer_windows):
            logger.info(
                "KV cache: the sliding-window layers keep every block (%s)",
                hybrid_off_reason(config),
            )
        host = _host_tier(config, self.executor)
        self.max_concurrent_batches = getattr(self.executor, "max_concurrent_batches", 1)
        self.async_scheduling = sched.async_scheduling and self.max_concurrent_batches == 1
        if self.async_scheduling:
            self.max_concurrent_batches = 2  # step N+1 planned and sent while step N runs
        self._submitted_at: collections.deque[float] = collections.deque()
        self._last_taken_in = 0.0
        self.scheduler = Scheduler(
            sched,
            config.cache,
            self.max_model_len,
            num_blocks,
            _structured_outputs(config, model),
            speculative=config.speculative.enabled,
            num_lookahead_slots=config.speculative.num_lookahead_slots,
            encoder_budget=encoder_budget,
            host=host,
            pipeline_depth=self.max_concurrent_batches,
            kv_groups=groups,
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
            async_scheduling=self.async_scheduling,
        )
        self.loras: dict[int, str] = {}  # the adapters the workers hold: id -> name
        self.info = EngineInfo(
            model_path=model.model_path,
            max_model_len=self.max_model_len,
            vocab_size=model.vocab_size,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            eos_token_ids=model.eos_token_ids,
            image_token_id=model.image_token_id,
            num_image_tokens=model.num_image_tokens,
            image_size=model.image_size,
            max_request_tokens=self.scheduler.max_request_tokens,
            encoder_only=model.encoder_only,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admits a request, or raises ValueError (it is then not admitted at all); asleep,
        none is (a front end that does not know it is asleep, e.g. another one attached
        to this core, is told so)."""
        if self.sleep_level:
            raise ValueError(
                f"the engine is asleep (sleep level {self.sleep_level}); retry once it is woken up"
            )
        if errors.FAULTS_ARMED:
            errors.check_fault("add", [request.sampling_params.seed])
        max_tokens = resolve_max_tokens(
            request.sampling_params.max_tokens, request.num_prompt_tokens, self.max_model_len
        )
        lora_id = request.sampling_params.lora_id
        if lora_id and lora_id not in self.loras:
            raise ValueError(
                f"lora id {lora_id}: no such LoRA adapter is loaded in this engine (add_lora)"
            )
        if request.mm_inputs or self.info.takes_images:
            check_images(request, self.info)
            if any(image.pixel_values is None for image in request.mm_inputs):
                raise ValueError("images: an image came without its pixel values")
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                request.eos_token_ids,
                max_tokens=max_tokens,
                priority=request.priority,
                arrival_time=request.arrival_time,
                group_id=request.group,
                mm_inputs=request.mm_inputs,
                cache_salt=request.cache_salt,
            )
        )

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def pause_requests(self, request_ids) -> None:
        """Their clients read none of their outputs: not scheduled until resumed."""
        self.scheduler.pause_requests(request_ids)

    def resume_requests(self, request_ids) -> None:
        self.scheduler.resume_requests(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. A step that raises costs its requests, not the engine: the
        scheduler takes them back and runs them alone until the one that fails is found
        (`Scheduler.step_failed`); only a dead executor (EngineDeadError) ends the engine."""
        drained, self._drained = self._drained, []
        if self.sleep_level:
            return drained  # asleep: requests wait for wake_up
        refused = drained + self.scheduler.take_grammar_results()  # compiled since: queued
        if self.async_scheduling:
            return refused + self._step_ahead()
        if self.max_concurrent_batches > 1:
            return refused + self._step_in_flight()
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty and sched.kv_transfers is not None:
            self.executor.execute(sched)  # copies only (a swap-out of the one running request)
        if sched.is_empty:
            if not refused and self.scheduler.num_compiling:
                time.sleep(GRAMMAR_POLL_S)  # only grammars compiling: do not spin a core
            return refused
        try:
            result = self.executor.execute(sched)
        except EngineDeadError:
            raise
        except Exception:
            ids = list(sched.num_scheduled_tokens)
            logger.exception("a step of %d request(s) failed: %s", len(ids), ", ".join(ids[:8]))
            _wait_for_masks(sched)
            return refused + self.scheduler.step_failed(sched, STEP_FAILED_MESSAGE)
        _wait_for_masks(sched)  # the matchers move on only once their masks are done
        outputs = self.scheduler.update_from_output(sched, result)
        # the step as a decoding stream waits for it: scheduling, the model, its results
        tokens = sched.total_num_scheduled_tokens
        self.scheduler.step_cost.observe(tokens, time.perf_counter() - started, _num_decodes(sched))
        return refused + outputs

    def _step_in_flight(self) -> list[EngineCoreOutput]:
        """A step with batches in flight: submit a new batch while there is room and
        something to run, else take in the oldest batch's result; and right after taking
        one in, submit the next, so the stages work on it while the caller handles the
        outputs (detokenizing, streaming) instead of waiting for that too."""
        if len(self._batches) < self.max_concurrent_batches:
            submitted, failed = self._submit_next()
            if failed or (submitted and len(self._batches) < self.max_concurrent_batches):
                return failed
            if not submitted and not self._batches:
                if self.scheduler.num_compiling:
                    time.sleep(GRAMMAR_POLL_S)  # only grammars compiling: do not spin a core
                return []
        outputs = self._take_in_oldest()
        if len(self._batches) < self.max_concurrent_batches:
            outputs += self._submit_next()[1]
        return outputs

    def _step_ahead(self) -> list[EngineCoreOutput]:
        """Async scheduling: with a batch in flight, plan and send the next one while it
        runs (when the scheduler allows it: `Scheduler.can_schedule_ahead`), then take the
        older one in; its outputs go to the caller while the newer one runs."""
        if not self._batches:
            _, failed = self._submit_next()
            if failed:
                return failed
            if not self._batches:
                if self.scheduler.num_compiling:
                    time.sleep(GRAMMAR_POLL_S)  # only grammars compiling: do not spin a core
                return []
        outputs: list[EngineCoreOutput] = []
        if len(self._batches) == 1 and self.scheduler.can_schedule_ahead():
            outputs = self._submit_next()[1]
        return outputs + self._take_in_oldest()

    def _submit_next(self) -> tuple[bool, list[EngineCoreOutput]]:
        """Schedules a batch and submits it: (whether one went, the outputs of a failed
        submission)."""
        sched = self.scheduler.schedule()
        if sched.is_empty and sched.kv_transfers is None:
            return False, []
        try:
            self.executor.submit(sched)
        except EngineDeadError:
            raise
        except Exception:
            ids = list(sched.num_scheduled_tokens)
            logger.exception("sending a step of %d request(s) failed", len(ids))
            _wait_for_masks(sched)
            return False, self.scheduler.step_failed(sched, STEP_FAILED_MESSAGE)
        self._batches.append(sched)
        self._submitted_at.append(time.perf_counter())
        return not sched.is_empty, []

    def _take_in_oldest(self) -> list[EngineCoreOutput]:
        sched = self._batches.popleft()
        submitted = self._submitted_at.popleft()
        try:
            result = self.executor.collect()
        except EngineDeadError:
            raise
        except Exception:
            logger.exception("a step of %d request(s) failed", len(sched.num_scheduled_tokens))
            _wait_for_masks(sched)
            return self.scheduler.step_failed(sched, STEP_FAILED_MESSAGE)
        collected = time.perf_counter()
        if self.async_scheduling and not sched.is_empty:
            # the step's own time, from when the worker could start it (sent, and the batch
            # before it back) to its result: the step cost that target_itl fits
            tokens = sched.total_num_scheduled_tokens
            started = max(submitted, self._last_taken_in)
            self.scheduler.step_cost.observe(tokens, collected - started, _num_decodes(sched))
        self._last_taken_in = collected
        _wait_for_masks(sched)
        return self.scheduler.update_from_output(sched, result)

    def _drain(self) -> None:
        """Every batch in flight taken in (before a command that changes the cache); the
        outputs go out with the next step."""
        while self._batches:
            self._drained += self._take_in_oldest()

    @property
    def num_batches_in_flight(self) -> int:
        return len(self._batches)

    def has_unfinished_requests(self) -> bool:
        # a batch in flight whose requests all ended (aborted: a stop string) holds nobody's
        # request; the next step takes it in (`has_work`)
        return self.scheduler.has_unfinished_requests() or bool(self._drained)

    def has_work(self) -> bool:
        """Whether a step would compute or hand out something (asleep, requests wait)."""
        if self._batches or self._drained:
            return True
        return not self.sleep_level and self.scheduler.has_work()

    def reset_prefix_cache(self) -> None:
        self._drain()
        self.scheduler.reset_prefix_cache()

    # ---- sleep mode ------------------------------------------------------------------

    def control(self, command: str, arg: int = 0, text: str = "") -> str | None:
        """Runs a control command (`sleep` with its level, `wake_up`, `add_lora` with the
        adapter's id and {"path", "name"} as JSON `text`, `remove_lora` with its id);
        returns the error to tell the caller, None when done. A dead executor still ends
        the engine."""
        try:
            if command == "sleep":
                self.sleep(arg)
            elif command == "wake_up":
                self.wake_up(wake_tags(arg))
            elif command == "add_lora":
                spec = json.loads(text)
                self.add_lora(arg, spec["path"], spec.get("name", ""))
            elif command == "remove_lora":
                self.remove_lora(arg)
            else:
                raise ValueError(f"control: {command!r} is not one of {CONTROL_COMMANDS}")
        except EngineDeadError:
            raise
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - told to the caller, the engine goes on
            logger.exception("%s (%d) failed", command, arg)
            return f"{command} failed: {type(exc).__name__}: {exc}"
        return None

    def add_lora(self, lora_id: int, path: str, name: str = "") -> None:
        """Every worker reads the PEFT adapter at `path` under `lora_id` (ValueError: it
        does not fit the model, with the reason; nothing is loaded then)."""
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA is not enabled; start the engine with --enable-lora")
        if self.sleep_level:
            raise ValueError("the engine is asleep; wake it up before loading an adapter")
        if lora_id in self.loras:
            raise ValueError(f"lora id {lora_id} is loaded already (as {self.loras[lora_id]!r})")
        self._drain()  # the workers take it between steps
        self.executor.add_lora(lora_id, path, name)
        self.loras[lora_id] = name

    def remove_lora(self, lora_id: int) -> None:
        """The workers drop adapter `lora_id` (its requests must be over)."""
        if lora_id not in self.loras:
            raise ValueError(f"lora id {lora_id} is not loaded")
        if self.scheduler.uses_lora(lora_id):
            raise ValueError(f"adapter {self.loras[lora_id]!r} has requests under way")
        self._drain()
        self.executor.remove_lora(lora_id)
        del self.loras[lora_id]

    def sleep(self, level: int) -> None:
        """Gives back the memory of the weights (level 1: offloaded, 2: dropped) and of the
        KV cache. Running requests are preempted (their KV is lost with the cache) and
        every request waits until `wake_up`, then runs on as if nothing had happened; the
        prefix cache is emptied. Asleep already: a deeper level goes deeper, else nothing."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError(
                "sleep: sleep mode is off; start the engine with enable_sleep_mode=True "
                "(ringllm serve --enable-sleep-mode)"
            )
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep: level {level} is not one of {SLEEP_LEVELS}")
        if level < self.sleep_level or (level == self.sleep_level and not self._woken):
            return  # as deep already (and nothing woken since)
        self._drain()
        preempted = self.scheduler.preempt_all()
        self.scheduler.reset_prefix_cache()
        self.executor.sleep(level)
        self.sleep_level = level
        self._woken: set[str] = set()
        logger.info("engine asleep (level %d); %d running request(s) wait", level, preempted)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Brings back `tags` (WAKE_TAGS, default all); the engine serves again, and reports
        sleep level 0, once every part is back."""
        if not self.sleep_level:
            return
        parts = set(tags or WAKE_TAGS) - self._woken
        if parts:
            self.executor.wake_up(sorted(parts))
            self._woken |= parts
        if self._woken >= set(WAKE_TAGS):
            self.sleep_level = 0
            self._woken = set()
            logger.info("engine awake")
        else:
            logger.info(
                "engine woken in part (%s); asleep until the rest", ", ".join(sorted(self._woken))
            )

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        """Stops the executor's processes (an in-process Worker has none)."""
        structured = getattr(getattr(self, "scheduler", None), "structured", None)
        if structured is not None:
            structured.shutdown()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()


def _num_decodes(sched) -> int:
    """The step's requests that compute one token (decodes; drafts make more)."""
    return sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)


def _host_tier(config: EngineConfig, executor) -> HostTier | None:
    """The core's accounting of the KV tiers the executor's workers made (None: none)."""
    if not config.cache.swap_space:
        return None
    check_swap_space(config.cache.swap_space, config.parallel.tensor_parallel_size)
    num_host_blocks, num_disk_slots, entries = executor.initialize_kv_tiers()
    if not num_host_blocks:
        return None
    disk = DiskTier(num_disk_slots, entries) if num_disk_slots else None
    if disk is not None and entries:
        logger.info("KV disk tier: %d block(s) kept from an earlier run", disk.num_used)
    return HostTier(num_host_blocks, disk)


def _encoder_budget(config: EngineConfig, model) -> int:
    """Image positions the vision encoder makes per step (0: a text-only model); at least
    one whole image, or no image could ever be scheduled."""
    if not model.num_image_tokens:
        return 0
    budget = config.multimodal.max_num_encoder_input_tokens
    if budget is None:
        return max(config.scheduler.max_num_batched_tokens, model.num_image_tokens)
    if budget < model.num_image_tokens:
        raise ValueError(
            f"max_num_encoder_input_tokens: {budget} positions cannot hold one image of this "
            f"model ({model.num_image_tokens} positions)"
        )
    return budget


def _wait_for_masks(sched) -> None:
    if sched.grammar is not None:
        try:
            _ = sched.grammar.bitmask
        except Exception:  # noqa: BLE001 - a mask that failed: its step failed with it
            logger.exception("filling the grammar masks failed")


def _structured_outputs(config: EngineConfig, model) -> StructuredOutputManager | None:
    """The grammar manager, if the model's tokenizer.json is there for the backend (read
    and built on the compile thread, when the first constrained request comes)."""
    folder = Path(config.model.tokenizer or model.model_path)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None

    def make_backend() -> GuidanceBackend:
        return GuidanceBackend(
            tokenizer_file.read_text(encoding="utf-8"), model.vocab_size, model.eos_token_ids
        )

    return StructuredOutputManager(
        make_backend, config.scheduler.structured_outputs_compile_timeout_s
    )
