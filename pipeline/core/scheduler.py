"""`Scheduler`: decides, each step, which requests compute how many tokens.

One unified pass, no prefill/decode phases (vLLM V1's shape): every request has
`num_computed_tokens` and wants to reach `num_tokens`; a step gives each request up to
what it needs, within a token budget (`max_num_batched_tokens`) and `max_num_seqs`.

1. Running requests first, kept in the policy's order (FCFS: by arrival; priority: by
   (priority, arrival)). A long prompt takes what is left of the budget (chunked
   prefill) and continues next step. If the KV pool is short, a running request not yet
   scheduled this step is preempted (core/scheduling_policy.py picks it: the last in that
   order, or with fair share the last of the biggest group; core/preemption.py swaps it
   to the host tier or frees it for recompute). Because the order puts every
   higher-priority request first, the victim is never more urgent than a request that
   keeps running.
2. Then waiting requests (core/scheduling_policy.py's order: FCFS with fair share between
   groups, or priority), starting from their prefix-cache hits, while budget, sequence
   slots and blocks last. No new request is admitted in a step that had to preempt.

Decodes first (`_prefill_budget`): the requests decoding (one token to compute, plus their
drafts) keep their share of the budget whatever their place in the running order, and
prompt chunks, running or new, get what is left. Every decoding stream's next token waits
for the whole step, so with `target_itl` set (milliseconds, or auto: a multiple of a
step of the decodes alone) the prompt tokens of a step that has
decodes in it also stop where the step's cost, fitted from the steps that ran
(core/step_cost.py, reported by EngineCore), would pass that target (at least
MIN_PREFILL_CHUNK: a prompt always moves on). A step with no request decoding takes prompts
up to the budget: nobody's stream waits on it, and the prompts' first tokens come sooner.

The parts, each in its own module: the policy (scheduling_policy.py), swap and recompute
(preemption.py), speculative decoding's drafts and lookahead slots (speculation.py), the
image encoder budget (encoder_budget.py), a failed step's suspects (failed_steps.py), what
a step's result makes of a request (step_results.py) and the grammar masks
(structured_output.py). This module is the loop that holds the queues and calls them.

Requests that can never run (prompt at or over max_model_len, or prompt plus max_tokens
needing more blocks than the whole cache) are refused in `add_request` with a
ValueError, never left waiting (or preempting themselves) forever.

Requests whose client reads none of their outputs are paused (`pause_requests`, from the
front end's output queues: pipeline/frontend/output_queue.py) and resumed once it reads
again (`resume_requests`): paused, a request leaves its queue and frees its blocks
(core/queues.py), so silent streams cannot hold every sequence slot while a client that
reads waits behind them. A pause takes effect at the next `schedule()` the request has no
step in flight and no grammar compiling; an abort of a paused request frees it as any
other.

Finished ids reach the workers on the next step that runs: EngineCore skips an empty
step, so a step that schedules nothing keeps them for the following one.

Batches in flight (pipeline parallelism, `pipeline_depth` P > 1): `schedule()` runs again
before the last batch's results are back. A request with a step in flight (`in_flight`) is
not scheduled, preempted or swapped until its result is taken in; each batch takes at most
1/P of the requests; a request short of blocks that only requests in flight hold waits for
them; the earlier stages get each request's sampled tokens with its next step
(`CachedRequestData.new_token_ids`). Freeing the blocks of a request aborted in flight is
safe because every stage runs batches in the order they were sent (docs/architecture.md,
"Pipeline parallelism", says why).

Async scheduling (`async_scheduling`, two batches in flight on one worker or one group of
tensor-parallel ranks): `schedule()` runs while the previous batch computes, and a request
in flight in it may be scheduled again ("ahead"). The rule that keeps it exact:

- A request goes ahead only from the newest batch (at most two steps of it in flight), and
  its next step starts where its step in flight ends: `num_tokens + num_placeholders`
  counts the tokens it will have, a placeholder being a token sampled in flight. The
  worker runs batches in the order they were sent and appends every token it samples, so
  the placeholder's position already holds the true token when the step ahead reads it;
  the core never sends it (`WorkerView`: no sampled tokens synced).
- It does not go ahead when that token may end it for certain (max_tokens, max_model_len)
  or when its next step needs the token itself: a grammar (the mask comes from the token),
  drafts (speculative decoding is refused with async scheduling), a prompt chunk with
  images (the encoder budget counts from the computed tokens). While any request in flight
  cannot go ahead, a request is pausing, a step failed (suspects), or a request waited for
  blocks that only requests in flight hold, EngineCore takes the batch in first
  (`can_schedule_ahead`): a stream is never left a step behind.
- A request that a step in flight ends (EOS, a stop token) has had one token computed past
  its end: its result is dropped (it is no longer in `requests`), its blocks were freed
  when it finished, and the batch that wrote them ran before any batch that reuses them.
  A prefix block is cached only once its tokens are known (`min(total, num_tokens)`), and
  the step that writes its last token runs before any batch that could hit it.
- A request taken back after a failed step (failed_steps.py) may still be in the later
  batch: its result there is dropped (it is no longer RUNNING), and it is not scheduled
  until that batch is taken in.
"""

from __future__ import annotations

import time

from ringllm.pipeline.config import CacheConfig, SchedulerConfig
from ringllm.pipeline.core import failed_steps, step_results
from ringllm.pipeline.core.admission import check_request_fits
from ringllm.pipeline.core.encoder_budget import EncoderBudget
from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.kv_groups import KVGroups
from ringllm.pipeline.core.kv_tiers import HostTier
from ringllm.pipeline.core.queues import RequestQueues
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.core.speculation import Speculation, drafts_in_chunk
from ringllm.pipeline.core.step_cost import StepCost
from ringllm.pipeline.core.structured_output import StructuredOutputManager
from ringllm.pipeline.core.worker_view import WorkerView
from ringllm.pipeline.messages import EngineCoreOutput
from ringllm.pipeline.stats import SchedulerStats, SpecDecodingStats

# While requests decode, a step still carries at least this many prompt tokens (one KV
# block at the default size), however tight `target_itl`: a prompt always moves on.
MIN_PREFILL_CHUNK = 16


class _InPart:
    """A `Scheduler` attribute that one of its parts holds (`scheduler.waiting` is
    `scheduler.queues.waiting`): the engine and the tests keep one name for it."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, scheduler, owner=None):
        return self if scheduler is None else getattr(getattr(scheduler, self.part), self.name)

    def __set__(self, scheduler, value) -> None:
        setattr(getattr(scheduler, self.part), self.name, value)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        structured: StructuredOutputManager | None = None,
        speculative: bool = False,
        num_lookahead_slots: int = 0,
        encoder_budget: int = 0,
        host: HostTier | None = None,
        pipeline_depth: int = 1,
        kv_groups: KVGroups | None = None,
        max_loras: int = 0,
        async_scheduling: bool = False,
    ) -> None:
        """`structured`: compiles grammars and fills masks for requests with
        structured_outputs (None: such requests are refused). `speculative`: the workers
        propose drafts (counted in the stats); `num_lookahead_slots`: KV slots a draft
        model writes past a step's tokens. `encoder_budget`: image feature positions the
        workers' vision encoder makes per step (0: the model takes no images). `host`: the
        KV tier in host memory (swap preemption, prefix-cache offload), None: none.
        `pipeline_depth`: batches kept in flight (pipeline stages; see the module doc).
        `kv_groups`: the layers' block tables (core/kv_groups.py; None: one for all).
        `max_loras`: LoRA adapters one step may mix (the workers' slots; 0: no LoRA); a
        waiting request whose adapter would be one too many waits while others go first.
        `async_scheduling`: with `pipeline_depth` 2, requests in flight are scheduled ahead
        (the module doc's rule)."""
        self.config = config
        self.max_loras = max_loras
        self.structured = structured
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            max_model_len,
            config.max_num_seqs,
            cache_config.enable_prefix_caching,
            host,
            kv_groups,
        )
        # tokens one request can hold, where that is not num_blocks * block_size (0)
        self.max_request_tokens = 0
        if kv_groups is not None and kv_groups.slides:
            chunk = (
                config.max_num_batched_tokens if config.enable_chunked_prefill else max_model_len
            )
            self.max_request_tokens = self.kv.max_request_tokens(chunk)
        self.encoder = EncoderBudget(encoder_budget)
        stats = SpecDecodingStats() if speculative else None
        self.spec = Speculation(num_lookahead_slots, max_model_len, stats)
        self.requests: dict[str, Request] = {}
        self.queues = RequestQueues(self.kv, config.scheduling_policy, config.preemption_mode)
        self.swaps = self.queues.swaps
        self.ahead = async_scheduling and pipeline_depth > 1
        self.view = WorkerView(sync_sampled_tokens=pipeline_depth > 1 and not self.ahead)
        self.suspects: set[str] = set()  # taken back after a failed step: run alone next
        self.pipeline_depth = pipeline_depth
        self.in_flight: dict[str, Request] = {}  # requests with a step not yet taken in
        self.num_scheduled_ahead = 0  # async scheduling: steps of requests already in flight
        self._batch_cap = 0  # requests one batch may hold (batches in flight; 0: any)
        self._blocks_short = False  # a running request waits this step for blocks in flight
        self._pausing: set[str] = set()  # pauses asked for, not yet taken (`_take_pauses`)
        self.step_cost = StepCost()  # the engine reports each step's tokens and time
        self._itl_target = config.itl_target

    # ---- the parts' state, under the names the engine and the tests read -----------

    waiting = _InPart("queues", "waiting")
    running = _InPart("queues", "running")
    running_per_group = _InPart("queues", "running_per_group")
    paused = _InPart("queues", "paused")
    num_preemptions = _InPart("queues", "num_preemptions")
    swapped = _InPart("swaps", "requests")
    num_swaps = _InPart("swaps", "num_swaps")
    num_blocks_swapped_out = _InPart("swaps", "num_blocks_swapped_out")
    num_blocks_swapped_in = _InPart("swaps", "num_blocks_swapped_in")
    num_lookahead_slots = _InPart("spec", "num_lookahead_slots")
    spec_stats = _InPart("spec", "stats")

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        kv = self.kv
        check_request_fits(
            request.num_prompt_tokens,
            request.max_tokens,
            self.max_model_len,
            kv.num_blocks,
            kv.block_size,
            self.max_request_tokens,
        )
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError(
                    "structured_outputs: this engine cannot enforce them (the model folder "
                    "has no tokenizer.json for the grammar backend)"
                )
            self.requests[request.request_id] = request
            self.structured.submit(request)  # queued once its grammar is ready
            return
        self.requests[request.request_id] = request
        self.queues.enqueue(request)

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            queued = request.status in (
                RequestStatus.RUNNING,
                RequestStatus.SWAPPED,
                RequestStatus.PAUSED,
            )
            if queued or not (self.structured and self.structured.forget(request_id)):
                self.queues.remove(request)  # else it was still compiling its grammar
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def pause_requests(self, request_ids) -> None:
        """Their clients read none of their outputs: they stop being scheduled, from the
        next `schedule()` on, until `resume_requests` (unknown or finished ids: ignored)."""
        self._pausing.update(rid for rid in request_ids if rid in self.requests)

    def resume_requests(self, request_ids) -> None:
        for rid in request_ids:
            self._pausing.discard(rid)
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.PAUSED:
                self.queues.resume(request)

    def _take_pauses(self) -> None:
        """The pauses asked for whose request is in a queue and has no step in flight."""
        for rid in list(self._pausing):
            request = self.requests.get(rid)
            if request is None or request.status == RequestStatus.PAUSED:
                self._pausing.discard(rid)
            elif rid not in self.in_flight and not (
                self.structured is not None and self.structured.is_pending(rid)
            ):
                self._pausing.discard(rid)
                self.queues.pause(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """The one exit path: every finish, abort and error comes through here."""
        self._pausing.discard(request.request_id)
        request.transition(status)
        request.times.finished = time.monotonic()
        self.kv.free(request)
        del self.requests[request.request_id]
        self.view.forget(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a request may be scheduled (paused ones wait for their clients)."""
        return len(self.requests) > len(self.queues.paused)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (not in any queue yet)."""
        return self.structured.num_pending if self.structured is not None else 0

    def take_grammar_results(self, message_prefix: str = "") -> list[EngineCoreOutput]:
        """Requests whose grammar compiled join the waiting queue; those whose grammar
        failed end here with the error (a refusal: the spec was the client's)."""
        if self.structured is None or not self.structured.num_pending:
            return []
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.queues.enqueue(request)
        outputs = []
        for request, message in failed:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason="error", error=message, refused=True
                )
            )
        return outputs

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._pausing:
            self._take_pauses()
        out = SchedulerOutput(finished_request_ids=self.view.take_finished())
        self.swaps.begin_step()
        if self.pipeline_depth > 1 and not self.ahead:
            queued = len(self.running) + len(self.waiting) + len(self.swapped)
            self._batch_cap = max(1, -(-queued // self.pipeline_depth))
        if self.suspects and self._schedule_a_suspect(out):
            out.kv_transfers = self.swaps.take_transfers()
            return self._close_step(out)
        budget = self.config.max_num_batched_tokens
        self.encoder.begin_step()
        fair_preempted = self.queues.make_room_for_a_starved_group(
            self.config.max_num_seqs, self.config.max_num_batched_tokens, self.in_flight
        )
        for request in self.swaps.swap_in(self.config.max_num_seqs - len(self.running)):
            self.queues.join_running(request)
        self._blocks_short = False
        decode_tokens, prefill_budget = self._prefill_budget(budget)
        budget, preempted, prefill_budget = self._schedule_running(
            out, budget, decode_tokens, prefill_budget
        )
        preempted += fair_preempted
        # Swapped requests come back before new ones, except the starved group's request
        # that a fair-share preemption (maybe a swap-out) made room for this step.
        short = preempted or self._blocks_short
        if (not short or fair_preempted) and (not self.swapped or fair_preempted):
            self._schedule_waiting(out, min(budget, prefill_budget))
        out.num_preempted = preempted
        if self.structured is not None and not out.is_empty:
            out.grammar = self.structured.step_bitmask(
                [self.requests[rid] for rid in out.num_scheduled_tokens]
            )
        out.kv_transfers = self.swaps.take_transfers()
        return self._close_step(out)

    def _close_step(self, out: SchedulerOutput) -> SchedulerOutput:
        if out.is_empty:
            # Nothing runs this step (EngineCore does not execute it): keep the ids.
            self.view.finished_ids |= out.finished_request_ids
            out.finished_request_ids = set()
        elif self.pipeline_depth > 1:
            for rid in out.num_scheduled_tokens:
                request = self.requests[rid]
                self.in_flight[rid] = request
                request.num_in_flight += 1
                if (
                    self.ahead
                    and request.num_computed_tokens >= request.num_tokens + request.num_placeholders
                ):
                    request.num_placeholders += 1  # it samples: a step ahead counts on it
                    out.placeholders.add(rid)
        return out

    def _taken_in(self, sched: SchedulerOutput, rid: str) -> Request | None:
        """A batch's step of `rid` is back (or failed): the request it was for (None: not in
        flight, as without batches in flight)."""
        request = self.in_flight.get(rid)
        if request is not None:
            request.num_in_flight -= 1
            if rid in sched.placeholders:
                request.num_placeholders -= 1
            if not request.num_in_flight:
                del self.in_flight[rid]
        return request

    def _goes_ahead(self, request: Request) -> bool:
        """Async scheduling: whether `request`, in the newest batch in flight, may be
        scheduled again now (the module doc's rule)."""
        if not self.ahead or request.num_in_flight != 1 or self._needs_its_tokens(request):
            return False
        pending = request.num_placeholders
        return not pending or (
            request.num_output_tokens + pending < request.max_tokens
            and request.num_tokens + pending < self.max_model_len
        )

    @staticmethod
    def _needs_its_tokens(request: Request) -> bool:
        """Whether its next step needs what its step in flight brings back."""
        params = request.sampling_params
        if request.matcher is not None or params.structured_outputs is not None:
            return True
        if params.pooling_type is not None or request.spec_token_ids:
            return True
        return bool(request.mm_inputs) and request.num_computed_tokens < request.num_prompt_tokens

    def can_schedule_ahead(self) -> bool:
        """Async scheduling: whether EngineCore may call `schedule()` with a batch still in
        flight, every request in flight able to go ahead (else it takes the batch in first,
        so that no stream skips a step)."""
        if not self.ahead or self.suspects or self._pausing or self._blocks_short:
            return False
        return not any(self._needs_its_tokens(r) for r in self.in_flight.values())

    def _batch_full(self, out: SchedulerOutput) -> bool:
        return bool(self._batch_cap) and len(out.num_scheduled_tokens) >= self._batch_cap

    def _prefill_budget(self, budget: int) -> tuple[int, int]:
        """(decode tokens, prompt tokens) this step may carry. Decoding requests (one
        token to compute, plus drafts) come first: prompt chunks get what the budget leaves
        them. With `target_itl` (milliseconds, or auto: AUTO_ITL_FACTOR times a step of the
        decodes alone), while any request decodes, prompt tokens also stop
        where the step's measured cost (core/step_cost.py) would pass the target, at least
        MIN_PREFILL_CHUNK so a prompt always moves on; with no stream waiting on the step,
        the whole budget goes to prompts (their first tokens come sooner)."""
        in_flight = self.in_flight
        decode_tokens = sum(
            1 + len(r.spec_token_ids)
            for r in self.running
            if (r.request_id not in in_flight or self._goes_ahead(r))
            and r.num_tokens + r.num_placeholders - r.num_computed_tokens == 1
        )
        prefill = max(0, budget - decode_tokens)
        mode, value = self._itl_target
        if decode_tokens and mode != "off":
            target_s = value / 1000.0
            if mode == "auto":
                alone_s = self.step_cost.decodes_alone_s
                target_s = None if alone_s is None else value * alone_s
            cost = self.step_cost
            fits = None if target_s is None else cost.prompt_tokens_within(target_s, decode_tokens)
            if fits is not None:
                prefill = min(prefill, max(MIN_PREFILL_CHUNK, fits))
        return decode_tokens, prefill

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, decode_tokens: int, prefill_budget: int
    ) -> tuple[int, int, int]:
        """Returns (budget left, requests preempted, prompt tokens left)."""
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0 and not self._batch_full(out):
            request = self.running[i]
            ahead = request.request_id in self.in_flight
            if ahead and not self._goes_ahead(request):
                i += 1  # its next token is not known yet
                continue
            num_base = request.num_tokens + request.num_placeholders - request.num_computed_tokens
            decoding = num_base == 1
            num_new = min(num_base + len(request.spec_token_ids), budget)
            if not decoding:
                # a prompt chunk (or a recompute): never the decodes' reserved share
                num_new = min(num_new, prefill_budget, budget - decode_tokens)
                if num_new <= 0:
                    i += 1
                    continue
            images = []
            if request.mm_inputs:
                num_new, images = self.encoder.fit(request, request.num_computed_tokens, num_new)
                if not num_new:
                    i += 1  # its next image waits for the next step's encoder budget
                    continue
            drafts = drafts_in_chunk(request, num_new)
            lookahead = self.spec.lookahead(request, num_new, request.num_computed_tokens)
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_slots=lookahead)
            while new_blocks is None:
                victim = self.queues.pick_victim(self.running[i:], self.in_flight)
                if victim is None or (victim is request and self.in_flight):
                    break  # requests in flight hold the blocks: it waits for them
                self.queues.preempt(victim)
                preempted += 1
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_slots=lookahead)
            if new_blocks is None:
                if request.status == RequestStatus.RUNNING:
                    self._blocks_short = True  # it waits: no new request goes before it
                    i += 1
                continue  # else `request` itself was preempted; running[i] is the next one
            self.encoder.take(request, images)
            request.spec_token_ids = []
            if drafts:
                out.scheduled_spec_tokens[request.request_id] = drafts
            self.view.record(out, request, num_new, new_blocks, self.kv)
            self.num_scheduled_ahead += ahead
            budget -= num_new
            if decoding:
                decode_tokens -= num_new
            else:
                prefill_budget -= num_new
            i += 1
        return budget, preempted, prefill_budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not self._batch_full(out)
        ):
            index = self.queues.next_waiting()
            request = self.waiting[index]
            if self.max_loras and not self._lora_fits(request):
                index = next((i for i, r in enumerate(self.waiting) if self._lora_fits(r)), None)
                if index is None:
                    break  # every waiting request needs an adapter slot in use
                request = self.waiting[index]
            if request.request_id in self.in_flight:
                break  # its id's aborted predecessor is still in flight
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new, images = min(num_new, budget), []
            if request.mm_inputs:
                num_new, images = self.encoder.fit(request, num_hit_tokens, num_new)
                if not num_new:
                    break  # the encoder budget is spent for this step
            lookahead = self.spec.lookahead(request, num_new, num_hit_tokens)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
            if new_blocks is None:
                break
            self.encoder.take(request, images)
            self._admit(out, index, num_new, num_hit_tokens)
            budget -= num_new

    def uses_lora(self, lora_id: int) -> bool:
        """Whether a request waiting, running or swapped out runs with adapter `lora_id`."""
        queues = (self.waiting, self.running, getattr(self, "swapped", ()))
        return any(r.sampling_params.lora_id == lora_id for q in queues for r in q)

    def _lora_fits(self, request: Request) -> bool:
        """Its adapter (if any) is one the running requests use, or a slot is left."""
        lora_id = request.sampling_params.lora_id
        if not lora_id:
            return True
        used = {r.sampling_params.lora_id for r in self.running} - {0}
        return lora_id in used or len(used) < self.max_loras

    def _admit(self, out: SchedulerOutput, index: int, num_new: int, num_hit_tokens: int) -> None:
        """waiting[index] starts running this step with `num_new` tokens (blocks allocated:
        its whole row, prefix hits and tier loads in their columns)."""
        request = self.waiting.pop(index)
        blocks = self.kv.block_ids(request.request_id).tolist()
        resumed = request.status == RequestStatus.PREEMPTED
        request.transition(RequestStatus.RUNNING)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.monotonic()
        request.num_computed_tokens = num_hit_tokens
        self.queues.join_running(request)
        self.view.record(out, request, num_new, blocks, self.kv, resumed=resumed)

    def _schedule_a_suspect(self, out: SchedulerOutput) -> bool:
        """The step runs one suspect alone (the others running wait a step); False when
        no suspect is left waiting."""
        index = failed_steps.next_suspect(self.waiting, self.suspects)
        if index is None:
            self.suspects.clear()  # they ran, finished or were aborted
            return False
        request = self.waiting[index]
        if len(self.running) >= self.config.max_num_seqs:
            victim = self.queues.pick_victim(self.running, self.in_flight)
            if victim is None:
                return True  # every slot is in flight: it runs once one is back
            self.queues.preempt(victim)
        computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit_tokens, self.config.max_num_batched_tokens)
        images = []
        if request.mm_inputs:  # alone in the step: its first image always fits the budget
            num_new, images = self.encoder.fit(request, num_hit_tokens, num_new)
        lookahead = self.spec.lookahead(request, num_new, num_hit_tokens)
        new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
        while new_blocks is None and self.running:
            victim = self.queues.pick_victim(self.running, self.in_flight)
            if victim is None:
                return True  # the blocks are held by requests in flight: next step
            self.queues.preempt(victim)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
        if new_blocks is None:
            return False  # cannot happen: admission checked it fits the cache alone
        self.encoder.take(request, images)
        index = self.waiting.index(request)  # preemptions above may have moved it
        self._admit(out, index, num_new, num_hit_tokens)
        return True

    # ---- failures ------------------------------------------------------------------

    def preempt_all(self) -> int:
        """Every running request back to waiting, its blocks freed (the engine goes to sleep:
        the KV cache is about to be lost); they are recomputed when it runs again. Returns
        how many there were."""
        return self.queues.preempt_all()

    def step_failed(self, sched: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """The step `sched` raised: its requests are taken back (or, if it was one request
        or they failed too often, ended with `message`); the outputs of those ended
        (core/failed_steps.py)."""
        for rid in sched.num_scheduled_tokens:
            self._taken_in(sched, rid)
        # the workers may not have dropped them
        self.view.finished_ids |= sched.finished_request_ids
        if sched.kv_transfers is not None:
            recompute, take_back = self.swaps.undo_failed(sched.kv_transfers, self.requests)
            for request in recompute:
                self.queues.enqueue(request)
            for request in take_back:
                self._take_back(request)
        scheduled = sched.num_scheduled_tokens
        if self.ahead:  # not those taken back after an earlier batch failed
            scheduled = {
                rid: n
                for rid, n in scheduled.items()
                if rid in self.requests and self.requests[rid].status == RequestStatus.RUNNING
            }
        ids = failed_steps.uncache_failed_writes(scheduled, self.requests, self.kv, sched)
        if sched.kv_transfers is not None and sched.kv_transfers.from_disk:
            # A disk block that does not verify when read fails its step (worker/
            # kv_tiers.py: KVLoadError). The blocks the step read are forgotten (undo_failed),
            # so its requests go back and compute them: none is blamed for it. Were the
            # failure theirs, a later step that reads no disk block sorts them out (each
            # such failure forgets what it read, so the disk runs out of blocks to blame).
            for rid in ids:
                self._take_back(self.requests[rid])
            return []
        step_size = len(sched.num_scheduled_tokens) if self.ahead else None
        failed, suspects = failed_steps.sort_out_failed(
            [self.requests[rid] for rid in ids], step_size
        )
        for request in suspects:
            self._take_back(request)
            self.suspects.add(request.request_id)
        return self.fail_requests([r.request_id for r in failed], message)

    def fail_requests(self, request_ids, message: str) -> list[EngineCoreOutput]:
        """Ends each request with FINISHED_ERROR; their outputs (finish_reason "error")."""
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            self.queues.remove(request)
            self.suspects.discard(rid)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="error", error=message))
        return outputs

    def _take_back(self, request: Request) -> None:
        """Back to waiting with nothing computed, and out of the workers (they get it anew,
        from its tokens, when it next runs)."""
        if request.status == RequestStatus.RUNNING:
            self.queues.take_back(request)
        self.view.forget(request.request_id)

    # ---- results -------------------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        in_flight = self.in_flight
        for i, rid in enumerate(result.req_ids):
            request = self.requests.get(rid)
            if in_flight and self._taken_in(sched, rid) is not request:
                continue  # aborted while its step was in flight (its id maybe reused since)
            if request is None:
                continue  # aborted while the step ran
            if self.ahead and request.status != RequestStatus.RUNNING:
                continue  # taken back after an earlier batch failed: this step is void
            if self.suspects and result.sampled_token_ids[i] is not None:
                self.suspects.discard(rid)  # it ran and sampled: not the culprit
            taken = step_results.take_result(
                request, sched, result, i, self.spec, self.kv, self.max_model_len
            )
            if taken is None:
                continue
            output, status = taken
            outputs.append(output)
            if status is not None:
                self.queues.leave_running(request)
                self._finish(request, status)
        return outputs

    # ---- the rest the engine asks ----------------------------------------------------

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def load(self) -> tuple[int, int]:
        """(running, waiting): what a data-parallel front end routes by."""
        return len(self.running), len(self.waiting) + len(self.swapped)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache=self.kv.prefix_stats.take(),
            num_preemptions_total=self.num_preemptions,
            spec_decoding=self.spec_stats.take() if self.spec_stats is not None else None,
            kv_tiers=self.swaps.take_tier_stats(),
        )
