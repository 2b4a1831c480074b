"""`Worker`: one model replica (one tensor-parallel rank) that turns a `SchedulerOutput`
into sampled tokens.

It keeps each request's tokens, block ids and sampling state across steps (the
scheduler sends only what changed, see pipeline/core/scheduler_output.py), runs the model
runner, samples the requests whose step reaches the end of their known tokens, and
computes prompt logprobs for prompt chunks that asked for them. State is dropped when
the request's id comes back in `finished_request_ids`; preemption keeps it (only the
blocks change), so a resumed seeded request continues its random stream exactly.

Speculative decoding (pipeline/worker/spec_decode.py): the step's drafts are scored with
the rest, the rows that verified drafts go through pipeline/sample/speculative.py (the
others through the plain sampler), and after sampling the proposer drafts the next tokens
of every request that sampled, unless the step holds more than `disable_by_batch_size`
requests or the request has structured outputs (speculation is off for those: its grammar
would need a mask per draft position).

Images (a model that takes them): the step's input rows at image positions are the images'
features, made by `EncoderCache` (pipeline/worker/encoder_cache.py) when a step first
reaches an image and dropped once its positions are all computed.

Async scheduling (the in-process worker): `submit` hands a step to the worker's one step
thread and returns, `collect` waits for the oldest; steps run one at a time in the order
they came, so a step scheduled ahead finds the tokens the step before it sampled in its
rows (the engine core does not send them). The kernels give up the GIL while they run, so
the engine core's scheduling and output handling go on beside the model.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ringllm.pipeline import errors
from ringllm.pipeline.child_process import give_back_free_heap
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    spec_blocks_kept,
)
from ringllm.pipeline.messages import LogprobRow
from ringllm.pipeline.sample.grammar_mask import apply_bitmask
from ringllm.pipeline.sample.sampler import (
    LogprobRows,
    Sampler,
    compute_prompt_logprobs,
)
from ringllm.pipeline.sample.speculative import verify
from ringllm.pipeline.worker.encoder_cache import EncoderCache
from ringllm.pipeline.worker.input_batch import InputBatch, StepInputs
from ringllm.pipeline.worker.model_runner import ModelRunner
from ringllm.pipeline.worker.pooler import Pooler
from ringllm.pipeline.worker.spec_decode import make_proposer


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs of the model (pipeline/executor/interface.py)."""

    model_path: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # a model that takes images (models/llava.py): its image token, positions per image and
    # pixels per side (-1, 0, 0: text only)
    image_token_id: int = -1
    num_image_tokens: int = 0
    image_size: int = 0
    # every layer's sliding window, the whole model's (0: a global layer; core/kv_groups.py)
    layer_windows: tuple[int, ...] = ()
    # an encoder (models/bert.py): whole prompts, no prefix cache, pooling requests only
    encoder_only: bool = False


def layer_windows(arch) -> tuple[int, ...]:
    """Every layer's sliding window (0: global), read from the model's config alone."""
    from ringllm.pipeline.models.registry import model_class

    return tuple(model_class(arch.architecture).layer_windows(arch))


def encoder_only(arch) -> bool:
    """Whether the model is an encoder (models/bert.py), read from its config alone."""
    from ringllm.pipeline.models.registry import model_class

    return bool(getattr(model_class(arch.architecture), "encoder_only", False))


def image_fields(arch) -> tuple[int, int, int]:
    """WorkerInfo's image fields of a model, read from its config alone."""
    from ringllm.pipeline.models.registry import model_class

    fields = getattr(model_class(arch.architecture), "image_fields", None)
    return fields(arch) if fields is not None else (-1, 0, 0)


class Worker:
    def __init__(self, config: EngineConfig, comm=None, stage=None, pipe=None) -> None:
        """`comm`: its tensor-parallel group; `stage` and `pipe` (pipeline parallelism):
        its stage of the model (models/stages.py) and its links to the other stages
        (executor/process_groups.py PipelineLink)."""
        self.runner = ModelRunner(config, comm=comm, stage=stage, hybrid_kv=True)
        self.stage = stage
        self.pipe = pipe
        self.sampler = Sampler(self.runner.arch.vocab_size, seed=config.model.seed)
        self.batch = InputBatch(
            config.cache.block_size,
            self.runner.max_model_len,
            self.runner.device,
            self.runner.kv_groups.num_groups,
        )
        self.spec = config.speculative
        # a model that takes images: their features, from encoding until computed
        first = stage is None or stage.is_first  # images are the first stage's
        takes_images = first and hasattr(self.runner.model, "embed_images")
        self.encoder_cache = (
            EncoderCache(timed=self.runner.device == "cuda") if takes_images else None
        )
        if self.encoder_cache is not None and self.spec.method == "draft_model":
            raise ValueError(
                "speculative_config: a draft model cannot follow a model that takes images "
                "(it would not see them); use the ngram method"
            )
        self.proposer = make_proposer(config, self.runner)
        self.pooler = Pooler()  # pooling requests' partial vectors (worker/pooler.py)
        self.config = config
        self.rank = getattr(comm, "rank", 0) if comm is not None else 0
        self.tiers = None  # the KV tiers behind the device cache (worker/kv_tiers.py)
        self._draft_probs: dict[str, torch.Tensor | None] = {}  # q of the drafts sent out
        self._steps: ThreadPoolExecutor | None = None  # async scheduling: the step thread
        self._pending: collections.deque[Future] = collections.deque()

    def info(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(
            runner.model_path,
            runner.max_model_len,
            runner.arch.vocab_size,
            runner.arch.eos_token_ids,
            *image_fields(runner.arch),
            layer_windows=layer_windows(runner.arch),
            encoder_only=encoder_only(runner.arch),
        )

    def describe(self) -> dict[str, str]:
        """What runs the model here, for reports: dtype, ops, the matrices' layout."""
        from ringllm.pipeline.models.linear import layout

        layers = getattr(self.runner.model, "layers", None)
        return {
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "ops": repr(self.runner.ops),
            "weight_layout": layout(layers[0].qkv) if layers else "-",
        }

    def shutdown(self) -> None:
        """The step thread (if any) finishes its steps, the disk KV tier is flushed and
        closed; the model lives and dies with this process."""
        if self._steps is not None:
            self._steps.shutdown(wait=True, cancel_futures=True)
            self._steps = None
            self._pending.clear()
        if self.tiers is not None:
            self.tiers.close()

    def submit(self, sched: SchedulerOutput) -> None:
        """Async scheduling: the step runs on the step thread, after those submitted before
        it; `collect` gives its result."""
        if self._steps is None:
            # torch's thread count is the calling thread's setting (OpenMP's nthreads-var):
            # the step thread gets the engine's, not the machine's default
            self._steps = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="ringllm-step",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
        self._pending.append(self._steps.submit(self.execute, sched))

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest step submitted and not yet collected (its exception, if
        it raised)."""
        if not self._pending:
            raise RuntimeError("collect: no step is in flight")
        return self._pending.popleft().result()

    def determine_num_blocks(self) -> int:
        extra = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        return self.runner.determine_num_blocks(extra_bytes_per_block=extra)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        # the worker is set up: what its load freed (a GGUF's blocks are copied out of the
        # file before their repacking) given back; with the front end's, the demo GGUF's
        # resident size after load fell from 641 to 610 MiB (256 MiB of it the KV cache)
        if self.runner.device == "cpu":  # (no collection: what the load dropped is freed)
            give_back_free_heap()

    def initialize_kv_tiers(self) -> tuple[int, int, dict[int, int]]:
        """The host (and disk) KV tiers: (host blocks, disk slots, what the disk holds)."""
        from ringllm.pipeline.worker.kv_tiers import WorkerKVTiers

        self.tiers = WorkerKVTiers(self.runner, self.config, self.rank)
        return self.tiers.num_host_blocks, self.tiers.num_disk_slots, self.tiers.disk_entries()

    def add_lora(self, lora_id: int, path: str, name: str = "") -> None:
        """The PEFT adapter at `path` under `lora_id` (models/lora.py; ValueError: unfit)."""
        self.runner.add_lora(lora_id, path, name)

    def remove_lora(self, lora_id: int) -> bool:
        return self.runner.remove_lora(lora_id)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)
        if self.proposer is not None:
            self.proposer.release_kv_cache()

    def wake_up(self, tags=None) -> None:
        self.runner.wake_up(tags)
        if self.proposer is not None and self.runner.kv_caches:
            self.proposer.initialize_kv_cache(self.runner.num_blocks)

    def _update_states(self, sched: SchedulerOutput) -> None:
        batch = self.batch
        proposer = self.proposer
        cache = self.encoder_cache
        for rid in sched.finished_request_ids:
            if cache is not None and rid in batch.row_of:
                cache.drop(batch.row_of[rid])
            batch.remove(rid)
            self.pooler.drop(rid)
            if proposer is not None:
                proposer.finish(rid)
                self._draft_probs.pop(rid, None)
        for new in sched.new_requests:
            batch.add(new)
            if proposer is not None:
                proposer.start(new.request_id)
        samples_here = self.stage is None or self.stage.is_last
        for cached in sched.cached_requests:
            batch.update(cached)
            if cached.new_token_ids and not samples_here:  # sampled by the last stage
                batch.append_runs([batch.row_of[cached.request_id]], [cached.new_token_ids])
            if cache is not None and cached.resumed:
                cache.drop(batch.row_of[cached.request_id])
            if proposer is not None and cached.resumed:
                proposer.start(cached.request_id)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.kv_transfers is not None:  # before the forward reads or overwrites them
            self.tiers.apply(sched.kv_transfers, self.runner.kv_tensors)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [], [])
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(req_ids))
        drafts = sched.scheduled_spec_tokens
        num_drafts = None
        if drafts:
            self.batch.set_drafts(drafts)
            num_drafts = np.fromiter((len(drafts.get(r, ())) for r in req_ids), np.int64)
        step = self.batch.prepare(req_ids, counts, num_drafts)
        if errors.FAULTS_ARMED:
            seeds = [self._params(rid).seed for rid in req_ids]
            errors.check_fault("forward", seeds)
            errors.check_fault("crash", seeds)
        if self.pipe is not None:
            return self._execute_stage(req_ids, step, sched)
        logits = self.runner.run(step, self.encoder_cache, self.batch)
        if self.encoder_cache is not None:
            self.encoder_cache.release_computed(self.batch, step)
        prompt_logprobs = self._prompt_logprobs(req_ids, step, logits)
        out = ModelRunnerOutput(
            req_ids, *self._sample(req_ids, step, logits, sched), prompt_logprobs
        )
        self._pool(req_ids, step, out)
        if drafts:
            self._verify(req_ids, step, logits, sched, out)
        if self.proposer is not None:
            self._propose(req_ids, out)
        return out

    def _execute_stage(self, req_ids, step: StepInputs, sched) -> ModelRunnerOutput:
        """One pipeline stage's part of the step: the previous stage's hidden states in,
        this stage's layers, then either on to the next stage (sent without waiting: the
        stage goes on to its next batch) or (the last) logits and sampling. The earlier
        stages learn the sampled tokens from the engine core, with the request's next step
        (`CachedRequestData.new_token_ids`), never by waiting for the last stage."""
        from ringllm.pipeline.models.stages import IntermediateTensors

        pipe, stage = self.pipe, self.stage
        intermediate = None
        if not stage.is_first:
            shape = (len(step.input_ids), self.runner.arch.hidden_size)
            dtype, device = self.runner.dtype, self.runner.device
            hidden = pipe.recv_prev(torch.empty(shape, dtype=dtype, device=device))
            residual = pipe.recv_prev(torch.empty(shape, dtype=dtype, device=device))
            intermediate = IntermediateTensors(hidden, residual)
        out = self.runner.run(step, self.encoder_cache, self.batch, intermediate)
        if self.encoder_cache is not None:
            self.encoder_cache.release_computed(self.batch, step)
        if not stage.is_last:
            pipe.send_next([out.hidden, out.residual])
            return ModelRunnerOutput(req_ids, [None] * len(req_ids), [None] * len(req_ids))
        prompt_logprobs = self._prompt_logprobs(req_ids, step, out)
        result = ModelRunnerOutput(
            req_ids, *self._sample(req_ids, step, out, sched), prompt_logprobs
        )
        self._pool(req_ids, step, result)
        return result

    def _pool(self, req_ids, step: StepInputs, out: ModelRunnerOutput) -> None:
        """The vectors of the pooling requests whose prompt this step ends, into `out`."""
        hidden = self.runner.last_hidden
        if hidden is None:
            return
        self.runner.last_hidden = None
        out.pooled = self.pooler.pool(req_ids, step, hidden, self._row_params)

    def _row_params(self, row: int):
        return self.batch.sampling[row].params

    def _verify(self, req_ids, step: StepInputs, logits, sched, out: ModelRunnerOutput) -> None:
        """The rows that verified drafts: accepted drafts + one token each, into `out`."""
        drafts = sched.scheduled_spec_tokens
        batch_pos = [b for b in np.flatnonzero(step.samples).tolist() if step.num_drafts[b]]
        if not batch_pos:
            return
        rows = step.rows[batch_pos].tolist()
        ids = [req_ids[int(step.order[b])] for b in batch_pos]
        index = np.concatenate(
            [np.arange(step.logit_starts[b], step.logit_starts[b + 1]) for b in batch_pos]
        )
        states = [self.batch.sampling[r] for r in rows]
        if errors.FAULTS_ARMED:
            errors.check_fault("sample", [state.params.seed for state in states])
        verified = verify(
            self.sampler,
            logits[torch.from_numpy(index).to(logits.device)],
            states,
            [drafts[rid] for rid in ids],
            [self._draft_probs.pop(rid, None) for rid in ids],
        )
        self.batch.append_runs(rows, verified.token_ids)
        lookahead = self.spec.num_lookahead_slots
        where = {rid: i for i, rid in enumerate(req_ids)}
        for k, rid in enumerate(ids):
            run, row = verified.token_ids[k], rows[k]
            i = where[rid]
            out.sampled_token_ids[i] = run[-1]
            out.accepted_token_ids[rid] = run[:-1]
            n = states[k].params.logprobs
            if n is not None and verified.logprobs[k] is not None:
                rows_lp = [_row_logprobs(verified.logprobs[k], j, n) for j in range(len(run))]
                out.logprobs[i] = rows_lp[-1]
                out.accepted_logprobs[rid] = rows_lp[:-1]
            rejected = len(drafts[rid]) - verified.num_accepted[k]
            computed = int(self.batch.num_computed_tokens[row]) + sched.num_scheduled_tokens[rid]
            kept = spec_blocks_kept(computed - rejected, lookahead, self.batch.block_size)
            self.batch.trim_blocks(row, kept)

    def _propose(self, req_ids, out: ModelRunnerOutput) -> None:
        """Drafts for the next step of each request that sampled and may speculate."""
        cutoff = self.spec.disable_by_batch_size
        if cutoff is not None and len(req_ids) > cutoff:
            return
        batch = self.batch
        ids = [
            rid
            for rid, token in zip(req_ids, out.sampled_token_ids, strict=True)
            if token is not None and self._params(rid).structured_outputs is None
        ]
        if not ids:
            return
        rows = np.fromiter((batch.row_of[rid] for rid in ids), np.int64, len(ids))
        proposals = self.proposer.propose(batch, rows, ids)
        for k, rid in enumerate(ids):
            tokens = proposals.token_ids[k]
            if len(tokens):
                out.spec_token_ids[rid] = tokens.tolist()
                if proposals.probs is not None:
                    self._draft_probs[rid] = proposals.probs[k]

    def _sample(self, req_ids, step: StepInputs, logits: torch.Tensor, sched):
        """Samples the requests whose step reaches their end (those without drafts);
        results in `req_ids` order. Structured outputs: a constrained row's logits are
        masked by its grammar first, so the sampler (penalties, temperature, top-k / top-p,
        logprobs) sees only the tokens the grammar allows: logprobs are those of the
        constrained distribution."""
        grammar = sched.grammar
        num = len(req_ids)
        tokens: list[int | None] = [None] * num
        logprobs: list[LogprobRow | None] = [None] * num
        samples = step.samples if step.pools is None else step.samples & ~step.pools
        sampling = np.flatnonzero(samples)  # batch positions (a pooling request samples none)
        if step.num_drafts is not None:
            sampling = sampling[step.num_drafts[sampling] == 0]
        if sampling.size == 0:
            return tokens, logprobs
        # The last logits row of each sampling request: one gather, not a Python stack.
        last_rows = step.logit_starts[sampling + 1] - 1
        if last_rows.size != logits.shape[0]:
            logits = logits.index_select(0, torch.from_numpy(last_rows).to(logits.device))
        rows = step.rows[sampling]
        where = step.order[sampling]  # each sampled row's index in req_ids
        if grammar is not None:
            logits = _apply_grammar(logits, [req_ids[i] for i in where.tolist()], grammar)
        states = [self.batch.sampling[r] for r in rows.tolist()]
        if errors.FAULTS_ARMED:
            errors.check_fault("sample", [state.params.seed for state in states])
        out = self.sampler.sample(logits, states)
        sampled = out.sampled_token_ids.cpu().numpy()
        self.batch.append_tokens(rows, sampled.astype(np.int32))
        for k, (i, token) in enumerate(zip(where.tolist(), sampled.tolist(), strict=True)):
            tokens[i] = token
            n = states[k].params.logprobs
            if n is not None and out.logprobs is not None:
                logprobs[i] = _row_logprobs(out.logprobs, k, n)
        return tokens, logprobs

    def _params(self, request_id: str):
        return self.batch.sampling[self.batch.row_of[request_id]].params

    def _prompt_logprobs(self, req_ids, step: StepInputs, logits) -> dict[str, list[LogprobRow]]:
        """Prompt logprobs of the requests whose prompt chunk asked for them."""
        batch = self.batch
        rows = step.rows
        asked = np.flatnonzero(
            (batch.prompt_logprobs[rows] >= 0)
            & (step.seq_lens - np.diff(step.query_start_loc) < batch.num_prompt_tokens[rows])
        )
        result = {}
        for b in asked.tolist():
            row = int(rows[b])
            start = int(step.seq_lens[b]) - int(
                step.query_start_loc[b + 1] - step.query_start_loc[b]
            )
            end = int(step.seq_lens[b])
            num_prompt = int(batch.num_prompt_tokens[row])
            next_ids = batch.token_ids[row, start + 1 : min(end + 1, num_prompt)].tolist()
            n = int(batch.prompt_logprobs[row])
            chunk = logits[int(step.logit_starts[b]) : int(step.logit_starts[b + 1])]
            tensors = compute_prompt_logprobs(chunk, next_ids, n)
            result[req_ids[int(step.order[b])]] = [
                _row_logprobs(tensors, k, n) for k in range(len(next_ids))
            ]
        return result


def _apply_grammar(logits: torch.Tensor, sampled_ids: list[str], grammar) -> torch.Tensor:
    """The grammar's mask applied to the rows of constrained requests (others untouched)."""
    index = {rid: j for j, rid in enumerate(grammar.request_ids)}
    picks = [(k, index[rid]) for k, rid in enumerate(sampled_ids) if rid in index]
    if not picks:
        return logits
    rows, mask_rows = (list(t) for t in zip(*picks, strict=True))
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        apply_bitmask(logits, grammar.bitmask[mask_rows])
        return logits
    constrained = logits[rows]  # a copy (advanced indexing): masked, then written back
    apply_bitmask(constrained, grammar.bitmask[mask_rows])
    logits[rows] = constrained  # prompt logprobs were taken from these logits already
    return logits


def _row_logprobs(tensors: LogprobRows, row: int, num_top: int) -> LogprobRow:
    return LogprobRow(
        token_ids=tensors.token_ids[row, : 1 + num_top].tolist(),
        logprobs=tensors.logprobs[row, : 1 + num_top].tolist(),
        rank=int(tensors.ranks[row]),
    )
