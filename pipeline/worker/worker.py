"""`Worker`: one model replica (one tensor-parallel rank) that turns a `SchedulerOutput`
into sampled tokens.

It keeps each request's tokens, block ids and sampling state across steps (the
scheduler sends only what changed, see pipeline/core/scheduler_output.py), runs the model
runner, samples the requests whose step reaches the end of their known tokens, and
computes prompt logprobs for prompt chunks that asked for them. State is dropped when
the request's id comes back in `finished_request_ids`; preemption keeps it (only the
blocks change), so a resumed seeded request continues its random stream exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ringllm.pipeline.messages import Logprobs
from ringllm.pipeline.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingRequestState,
    compute_prompt_logprobs,
)
from ringllm.pipeline.worker.model_runner import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    ModelRunner,
    RunnerRequest,
)


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs of the model (pipeline/engine/executor.py)."""

    model_path: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingRequestState


class Worker:
    def __init__(self, config: EngineConfig, comm=None) -> None:
        self.runner = ModelRunner(config, comm=comm)
        self.sampler = Sampler(self.runner.arch.vocab_size, seed=config.model.seed)
        self.requests: dict[str, WorkerRequestState] = {}

    def info(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(
            runner.model_path,
            runner.max_model_len,
            runner.arch.vocab_size,
            runner.arch.eos_token_ids,
        )

    def shutdown(self) -> None:
        """Nothing to stop: the model lives and dies with this process."""

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def _add(self, new: NewRequestData) -> None:
        sampling = SamplingRequestState.create(
            new.sampling_params,
            new.token_ids[: new.num_prompt_tokens],
            new.eos_token_ids,
            self.runner.device,
        )
        sampling.output_token_ids.extend(new.token_ids[new.num_prompt_tokens :])
        self.requests[new.request_id] = WorkerRequestState(
            list(new.token_ids),
            new.num_prompt_tokens,
            list(new.block_ids),
            new.num_computed_tokens,
            sampling,
        )

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        for new in sched.new_requests:
            self._add(new)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [], [])
        runner_reqs, samples = [], []
        for rid in req_ids:
            state = self.requests[rid]
            start = state.num_computed_tokens
            end = start + sched.num_scheduled_tokens[rid]
            reaches_end = end >= len(state.token_ids)
            wants_prompt = (
                state.sampling.params.prompt_logprobs is not None
                and start < state.num_prompt_tokens
            )
            mode = LOGITS_ALL if wants_prompt else LOGITS_LAST if reaches_end else LOGITS_NONE
            runner_reqs.append(
                RunnerRequest(state.token_ids[start:end], start, state.block_ids, mode)
            )
            samples.append(reaches_end)
        step = self.runner.execute(runner_reqs)
        prompt_logprobs = self._prompt_logprobs(req_ids, runner_reqs, step)
        sampled = self._sample(req_ids, samples, step)
        tokens: list[int | None] = [None] * len(req_ids)
        logprobs: list[Logprobs | None] = [None] * len(req_ids)
        for i, token, lp in sampled:
            tokens[i] = token
            logprobs[i] = lp
        return ModelRunnerOutput(req_ids, tokens, logprobs, prompt_logprobs)

    def _sample(self, req_ids, samples, step):
        rows = [i for i, s in enumerate(samples) if s]
        if not rows:
            return []
        # The last logits row of each sampling request: one gather, not a Python stack.
        last_rows = torch.tensor(
            [step.row_starts[i + 1] - 1 for i in rows], device=step.logits.device
        )
        logits = (
            step.logits
            if len(last_rows) == step.logits.shape[0]
            else step.logits.index_select(0, last_rows)
        )
        states = [self.requests[req_ids[i]].sampling for i in rows]
        out = self.sampler.sample(logits, states)
        token_list = out.sampled_token_ids.tolist()
        results = []
        for k, i in enumerate(rows):
            token = token_list[k]
            state = self.requests[req_ids[i]]
            state.token_ids.append(token)
            state.sampling.output_token_ids.append(token)
            n = state.sampling.params.logprobs
            lp = (
                _row_logprobs(out.logprobs, k, n)
                if (n is not None and out.logprobs is not None)
                else None
            )
            results.append((i, token, lp))
        return results

    def _prompt_logprobs(self, req_ids, runner_reqs, step) -> dict[str, list[Logprobs]]:
        result = {}
        for i, rid in enumerate(req_ids):
            if runner_reqs[i].logits != LOGITS_ALL:
                continue
            state = self.requests[rid]
            start = runner_reqs[i].num_computed_tokens
            end = start + len(runner_reqs[i].token_ids)
            next_ids = state.token_ids[start + 1 : min(end + 1, state.num_prompt_tokens)]
            n = state.sampling.params.prompt_logprobs
            tensors = compute_prompt_logprobs(step.rows(i), next_ids, n)
            result[rid] = [_row_logprobs(tensors, k, n) for k in range(len(next_ids))]
        return result


def _row_logprobs(tensors: LogprobsTensors, row: int, num_top: int) -> Logprobs:
    return Logprobs(
        token_ids=tensors.token_ids[row, : 1 + num_top].tolist(),
        logprobs=tensors.logprobs[row, : 1 + num_top].tolist(),
        rank=int(tensors.ranks[row]),
    )
