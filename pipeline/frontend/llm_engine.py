"""`LLMEngine`: the synchronous engine API (vLLM's shape): add_request / step / abort.

Front-end work (tokenizing, detokenizing, stop strings, n > 1 fan-out) happens here; the
engine core behind it sees token ids only. The core runs in this process (`EngineCore`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.frontend.chat_template import ChatTemplate
from ringllm.pipeline.frontend.input_processor import process_prompt, submit
from ringllm.pipeline.frontend.output_processor import OutputProcessor
from ringllm.pipeline.frontend.stats import IterationStats, StatLogger
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SchedulerStats


class LLMEngine:
    def __init__(
        self, config: EngineConfig, log_stats: bool = True, multiprocess: bool = False
    ) -> None:
        """`multiprocess`: run the engine core in its own process behind the rings."""
        self.config = config
        self.engine_core: EngineCore | None = None
        self.core_client = None
        if multiprocess:
            from ringllm.pipeline.engine.dp_client import start_core_client

            self.core_client = start_core_client(config)
            info = self.core_client.info
            self.core = self.core_client
        else:
            if config.parallel.data_parallel_size > 1:
                raise ValueError(
                    "data_parallel_size: several engine cores run as processes; "
                    "use multiprocess=True (LLM(..., multiprocess=True))"
                )
            self.engine_core = self.core = EngineCore(config)
            info = self.engine_core.info
        self.model_path = info.model_path
        self.tokenizer = Tokenizer.from_folder(config.model.tokenizer or self.model_path)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or info.eos_token_ids)
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self._last_stats: SchedulerStats | None = None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLogger() if log_stats else None
        self.last_iteration_stats = IterationStats()

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**engine_args))

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_folder(self.config.model.tokenizer or self.model_path)

    # ---- requests ------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Tokenizes and admits a request; raises ValueError (nothing admitted) if it cannot run."""
        params = params or SamplingParams()
        if (
            request_id in self.output_processor.states
            or request_id in self.output_processor.parents
        ):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        processed = process_prompt(prompt, self.tokenizer, self.vocab_size)
        params.check_token_ids(self.vocab_size)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        submit(
            self.core,
            self.output_processor,
            request_id,
            processed,
            params,
            self.eos_token_ids,
            arrival,
            priority,
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)] or list(
            request_ids
        )
        self.output_processor.abort(list(request_ids))
        self.core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self._core_step()
        stats = IterationStats()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs, stats)
        if to_abort:
            self.core.abort_requests(to_abort)
        self.last_iteration_stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(self._last_stats or SchedulerStats(), stats)
        return outputs

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def _core_step(self) -> list:
        if self.engine_core is not None:
            outputs = self.engine_core.step()
            self._last_stats = self.engine_core.make_stats()
            return outputs
        batch = self.core_client.get_outputs(timeout_s=1.0)
        if batch is None:
            return []
        self._last_stats = batch.stats or self._last_stats
        return batch.outputs

    def shutdown(self) -> None:
        if self.core_client is not None:
            self.core_client.shutdown()
        if self.engine_core is not None:
            self.engine_core.shutdown()  # the tensor-parallel worker processes, if any

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer
