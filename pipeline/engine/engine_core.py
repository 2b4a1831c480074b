"""`EngineCore`: the scheduler, the KV cache and the worker(s), stepped one batch at a time.

It knows token ids only (text lives on the front-end side). One `step()`:

    schedule -> worker.execute (model + sampler) -> scheduler.update_from_output
             -> EngineCoreOutputs (new tokens, logprobs, finish reasons)

The KV pool is sized once at start from what the worker can hold. With
tensor_parallel_size > 1 the worker is a `TPExecutor` (same surface) that drives one
process per rank; `shutdown()` stops them. Run in-process by `LLMEngine`, or inside its
own process behind the shared-memory rings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.admission import resolve_max_tokens
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.outputs import EngineCoreOutput
from ringllm.pipeline.stats import SchedulerStats
from ringllm.pipeline.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know about the engine core it talks to."""

    model_path: Path
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]


class EngineCore:
    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.config = config
        self.worker = worker or _make_worker(config)
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        runner = self.worker.runner
        self.max_model_len = runner.max_model_len
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {sched.max_num_batched_tokens} tokens is less than max_model_len "
                f"{self.max_model_len}; without chunked prefill a whole prompt must fit in one step"
            )
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(sched, config.cache, self.max_model_len, num_blocks)
        self.vocab_size = runner.arch.vocab_size

    @property
    def info(self) -> EngineInfo:
        runner = self.worker.runner
        return EngineInfo(
            model_path=runner.model_path,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            num_blocks=self.scheduler.kv.num_blocks,
            block_size=self.config.cache.block_size,
            eos_token_ids=runner.arch.eos_token_ids,
        )

    def add_request(self, request: Request) -> None:
        """Admits a request, or raises ValueError (it is then not admitted at all)."""
        request.max_tokens = resolve_max_tokens(
            request.sampling_params.max_tokens, request.num_prompt_tokens, self.max_model_len
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.worker.execute(sched)
        return self.scheduler.update_from_output(sched, result)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        """Stop the worker processes of tensor parallelism (an in-process Worker has none)."""
        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()


def _make_worker(config: EngineConfig):
    """The in-process Worker, or with tensor_parallel_size > 1 the executor of its ranks."""
    if config.parallel.tensor_parallel_size > 1:
        from ringllm.pipeline.worker.tp_executor import TPExecutor

        return TPExecutor(config)
    return Worker(config)
