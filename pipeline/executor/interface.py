"""`Executor`: how the engine core reaches its model, whichever process runs it.

    Worker             (pipeline/worker/worker.py)            the model in this process
    MultiprocExecutor  (pipeline/executor/multiproc.py)       one process per rank (tensor
                                                              and pipeline), other hosts too
    RayExecutor        (pipeline/executor/ray_executor.py)    the same ranks as Ray actors

The engine core sizes the KV pool once (`determine_num_blocks`, then
`initialize_kv_cache`), then calls `execute` once per step with the scheduler's diff (or,
with batches in flight, `submit` and later `collect`: pipeline stages, async scheduling),
`sleep(level)` / `wake_up()` to give back and take again the memory of the weights and the
KV cache (pipeline/worker/sleep.py), and `shutdown` at the end; `info` is what it needs of
the model. Nothing else of a worker is reached from here: its runner, model and caches are the worker's own.
"""

from __future__ import annotations

from typing import Protocol

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.worker.worker import WorkerInfo


class Executor(Protocol):
    def info(self) -> WorkerInfo: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def initialize_kv_tiers(self) -> tuple[int, int, dict[int, int]]: ...

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def sleep(self, level: int) -> None: ...

    def add_lora(self, lora_id: int, path: str, name: str = "") -> None: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    """The in-process Worker, or with tensor (or pipeline) parallelism the executor of its
    ranks."""
    parallel = config.parallel
    if parallel.distributed_executor_backend == "ray":
        from ringllm.pipeline.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        from ringllm.pipeline.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from ringllm.pipeline.worker.worker import Worker

    return Worker(config)
