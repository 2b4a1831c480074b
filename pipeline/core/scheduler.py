"""`Scheduler`: decides, each step, which requests compute how many tokens.

One unified pass, no prefill/decode phases (vLLM V1's shape): every request has
`num_computed_tokens` and wants to reach `num_tokens`; a step gives each request up to
what it needs, within a token budget (`max_num_batched_tokens`) and `max_num_seqs`.

1. Running requests first, kept in the policy's order (FCFS: by arrival; priority: by
   (priority, arrival)). A long prompt takes what is left of the budget (chunked
   prefill) and continues next step. If the KV pool is short, the lowest-priority
   running request not yet scheduled this step (FCFS: the latest), i.e. the last in that
   order, is preempted: its blocks are freed, it goes back to the waiting queue with
   nothing computed, and is recomputed later (its tokens so far are kept, so nothing is
   lost; the prefix cache usually makes the recompute cheap). Because the order puts
   every higher-priority request first, the victim is never more urgent than a request
   that keeps running.
2. Then waiting requests in policy order (FCFS or priority), starting from their
   prefix-cache hits, while budget, sequence slots and blocks last. No new request is
   admitted in a step that had to preempt.

Fair share (FCFS policy). A user request can hold many sequences: its n children, or the
prompts of one HTTP request, all under one `group_id`. Left to arrival order, a request
with n = 256 and a long max_tokens would fill every sequence slot (or the KV pool) and keep
a later 4-token request waiting until its sequences end. So sequences are shared out
max-min fairly between groups:

- admission takes, among the first waiting requests (FAIR_SCAN of them), the first whose
  group holds the fewest running sequences (arrival order among equals);
- when a waiting request's group holds no running sequence while the slots or the KV pool
  are full, one sequence of the group holding the most is preempted for it at the start of
  the step (at most one a step: a group holding one sequence is never preempted for this);
- the KV-short victim of step 1 is also taken from the group holding the most running
  sequences, not blindly the latest request.

So a new small request runs within a step or two whatever one other request holds, and
a group of many sequences keeps all slots no other group asks for. The priority policy
keeps strict priority order (no fair share).


A step that raises (the model or the sampler failed) costs only the request that caused
it (`step_failed`). The workers' state for the step's requests is no longer trusted: each
is taken back (blocks freed, the workers told to drop it, recomputed from its tokens) and
becomes a suspect. While there are suspects, each step runs one of them alone; one that
fails alone is ended with FINISHED_ERROR ("error"), one that samples a token is cleared.
A request in MAX_FAILED_STEPS failed steps ends with an error too, so a failure that
needs company cannot loop forever. A step of one request that fails ends it at once.

Prompt logprobs go out once per prompt position: a preempted request recomputes its
prompt, and the rows its client already has are dropped (`num_prompt_logprobs_sent`).

Requests that can never run (prompt at or over max_model_len, or prompt plus max_tokens
needing more blocks than the whole cache) are refused in `add_request` with a
ValueError, never left waiting (or preempting themselves) forever.

Finished ids reach the workers on the next step that runs: EngineCore skips an empty
step, so a step that schedules nothing keeps them for the following one.

Speculative decoding (pipeline/worker/spec_decode.py): a running request's drafts (proposed
by the worker after its last step, `Request.spec_token_ids`) are scheduled with its next
token, within the token budget (drafts past it are dropped) and its max_tokens / context
(`_fit_drafts`); `scheduled_spec_tokens` tells the workers. After the step the rejected
drafts' slots are given back (`num_computed_tokens` rolled back, emptied blocks freed,
kv_cache_manager.spec_blocks_kept) and the accepted run is checked token by token: a stop
inside it ends the request there, nothing past it is emitted. A draft model's lookahead
slots (`num_lookahead_slots`) are allocated past every step that samples.

Images (a multimodal model): each image's placeholder positions need its features, which
the workers' vision encoder makes once, when a step first computes one of its positions,
and keep until all of them are computed (pipeline/worker/encoder_cache.py). Besides the
token budget a step has an encoder budget (`encoder_budget` positions, at least one whole
image): a chunk that reaches an image not encoded yet that the budget cannot take stops
before it (`_fit_images`); `Request.images_encoded` mirrors what the workers hold, and is
cleared whenever the workers drop the request's features (preemption, a failed step).

Batches in flight (pipeline parallelism, `pipeline_depth` P > 1 stages): the engine core
keeps up to P scheduled batches in the stages at once (pipeline/engine/engine_core.py), so
`schedule()` runs again before the last batch's results are back. A request with a step in
flight (`in_flight`) is not scheduled again, not preempted and not swapped until its
result has been taken in (`update_from_output`): its next token is not known yet, and its
blocks are still being written. Each batch takes at most 1/P of the requests (rounded up),
so P batches of about equal size follow each other through the stages instead of one
batch that holds every request and leaves the others empty. A request that needs blocks
that only requests in flight could give up waits for them instead of preempting itself.
The earlier stages do not sample: each step carries, for every request it schedules, the
tokens sampled since its last step (`CachedRequestData.new_token_ids`).
Freeing blocks of a request in flight (an abort) is safe: every stage runs batches in the
order they were sent, so a later batch that reuses a block writes it after the earlier
batch's stage has finished with it.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time

from ringllm.pipeline.config import CacheConfig, SchedulerConfig
from ringllm.pipeline.core.admission import check_request_fits
from ringllm.pipeline.core.kv_cache_manager import KVCacheManager, spec_blocks_kept
from ringllm.pipeline.core.kv_tiers import HostTier
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler_output import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ringllm.pipeline.core.structured_output import StructuredOutputManager
from ringllm.pipeline.messages import EngineCoreOutput
from ringllm.pipeline.stats import KVTierStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

FAIR_SCAN = 256  # waiting requests looked at for the fairest next admission
MAX_FAILED_STEPS = 3  # failed steps a request may be part of before it ends with an error


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
    ) -> None:
        """`structured`: compiles grammars and fills masks for requests with
        structured_outputs (None: such requests are refused). `speculative`: the workers
        propose drafts (counted in the stats); `num_lookahead_slots`: KV slots a draft
        model writes past a step's tokens. `encoder_budget`: image feature positions the
        workers' vision encoder makes per step (0: the model takes no images). `host`: the
        KV tier in host memory (swap preemption, prefix-cache offload), None: none.
        `pipeline_depth`: batches kept in flight (pipeline stages; see the module doc)."""
        self.config = config
        self.encoder_budget = encoder_budget
        self._encoder_left = encoder_budget
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_stats = SpecDecodingStats() if speculative else None
        self.structured = structured
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            max_model_len,
            config.max_num_seqs,
            cache_config.enable_prefix_caching,
            host,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by the policy's key
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # KV in the host tier; sorted by the policy's key
        self._swapped_in_now: set[str] = set()  # back from the host tier this step
        self.num_swaps = 0  # swap-outs since the start
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self._finished_ids: set[str] = set()  # to tell the workers next step
        self._scheduled_once: set[str] = set()  # ids whose full data the workers have
        self.num_preemptions = 0
        self._fair = config.scheduling_policy == "fcfs"
        self.running_per_group: collections.Counter[str] = collections.Counter()
        self.suspects: set[str] = set()  # taken back after a failed step: run alone next
        self.pipeline_depth = pipeline_depth
        self.in_flight: dict[str, Request] = {}  # requests with a step not yet taken in
        self._batch_cap = 0  # requests one batch may hold (batches in flight; 0: any)
        self._blocks_short = False  # a running request waits this step for blocks in flight

    # ---- admission -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        kv = self.kv
        check_request_fits(
            request.num_prompt_tokens,
            request.max_tokens,
            self.max_model_len,
            kv.num_blocks,
            kv.block_size,
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
        self._enqueue(request)

    def _sort_key(self, request: Request) -> tuple:
        return request.sort_key(self.config.scheduling_policy)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._sort_key)

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.status.is_finished:
                if request.status == RequestStatus.RUNNING:
                    self._leave_running(request)
                elif request.status == RequestStatus.SWAPPED:
                    self._leave_swapped(request)
                elif not (self.structured and self.structured.forget(request_id)):
                    self.waiting.remove(request)
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """The one exit path: every finish, abort and error comes through here."""
        request.transition(status)
        request.times.finished = time.monotonic()
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._scheduled_once:
            self._scheduled_once.discard(request.request_id)
            self._finished_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        self._swapped_in_now = set()
        if self.pipeline_depth > 1:
            queued = len(self.running) + len(self.waiting) + len(self.swapped)
            self._batch_cap = max(1, -(-queued // self.pipeline_depth))
        if self.suspects and self._schedule_a_suspect(out):
            out.kv_transfers = self._take_transfers()
            return self._close_step(out)
        budget = self.config.max_num_batched_tokens
        self._encoder_left = self.encoder_budget
        fair_preempted = self._make_room_for_a_starved_group()
        self._swap_in()
        self._blocks_short = False
        budget, preempted = self._schedule_running(out, budget)
        preempted += fair_preempted
        # Swapped requests come back before new ones, except the starved group's request
        # that a fair-share preemption (maybe a swap-out) made room for this step.
        short = preempted or self._blocks_short
        if (not short or fair_preempted) and (not self.swapped or fair_preempted):
            self._schedule_waiting(out, budget)
        out.num_preempted = preempted
        if self.structured is not None and not out.is_empty:
            out.grammar = self._grammar_bitmask(out)
        out.kv_transfers = self._take_transfers()
        return self._close_step(out)

    def _close_step(self, out: SchedulerOutput) -> SchedulerOutput:
        if out.is_empty:
            # Nothing runs this step (EngineCore does not execute it): keep the ids.
            self._finished_ids, out.finished_request_ids = out.finished_request_ids, set()
        elif self.pipeline_depth > 1:
            for rid in out.num_scheduled_tokens:
                self.in_flight[rid] = self.requests[rid]
        return out

    def _batch_full(self, out: SchedulerOutput) -> bool:
        return bool(self._batch_cap) and len(out.num_scheduled_tokens) >= self._batch_cap

    def _take_transfers(self):
        transfers = self.kv.take_transfers()
        if transfers is not None:
            transfers.swapped_in = sorted(self._swapped_in_now)
        return transfers

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
            self._enqueue(request)
        outputs = []
        for request, message in failed:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason="error", error=message, refused=True
                )
            )
        return outputs

    def _grammar_bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """The mask rows of the constrained requests that sample in this step (those whose
        scheduled tokens reach the end of what they have)."""
        requests = self.requests
        sampling = [
            requests[rid]
            for rid in out.num_scheduled_tokens
            if requests[rid].matcher is not None
            and requests[rid].num_computed_tokens >= requests[rid].num_tokens
        ]
        if not sampling:
            return None
        bitmask = self.structured.fill_bitmask_soon(sampling)
        return GrammarBitmask([r.request_id for r in sampling], bitmask)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0 and not self._batch_full(out):
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1  # its next token is not known yet
                continue
            num_base = request.num_tokens - request.num_computed_tokens
            num_new = min(num_base + len(request.spec_token_ids), budget)
            images = ()
            if request.mm_inputs:
                num_new, images = self._fit_images(request, request.num_computed_tokens, num_new)
                if not num_new:
                    i += 1  # its next image waits for the next step's encoder budget
                    continue
            drafts = request.spec_token_ids[: max(num_new - num_base, 0)]
            lookahead = self._lookahead(request, num_new)
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_slots=lookahead)
            while new_blocks is None:
                victim = self._pick_victim(self.running[i:])
                if victim is request and self.in_flight:
                    break  # requests in flight hold the blocks: it waits for them
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_slots=lookahead)
            if new_blocks is None:
                if request.status == RequestStatus.RUNNING:
                    self._blocks_short = True  # it waits: no new request goes before it
                    i += 1
                continue  # else `request` itself was preempted; running[i] is the next one
            self._take_images(request, images)
            request.spec_token_ids = []
            if drafts:
                out.scheduled_spec_tokens[request.request_id] = drafts
            self._record(out, request, num_new, new_blocks)
            budget -= num_new
            i += 1
        return budget, preempted

    def _fit_images(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """Cuts a chunk [start, start + num_new) before the first image it reaches that the
        workers have not encoded yet and that this step's encoder budget cannot take; the
        tokens it keeps, and the images they make the workers encode (their cost is taken
        by `_take_images` once the chunk is scheduled). An image is encoded whole once and
        its features kept until its positions are all computed, however the chunks split
        it."""
        images = []
        left = self._encoder_left
        for index in request.images_in(start, start + num_new):
            if index in request.images_encoded:
                continue
            image = request.mm_inputs[index]
            if image.length > left:
                return max(image.offset - start, 0), images
            images.append(index)
            left -= image.length
        return num_new, images

    def _take_images(self, request: Request, images) -> None:
        for index in images:
            request.images_encoded.add(index)
            self._encoder_left -= request.mm_inputs[index].length

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """KV slots to reserve past this step's tokens: a draft model's, when the step
        samples (it drafts right after), within the context."""
        if not self.num_lookahead_slots:
            return 0
        computed = request.num_computed_tokens if num_computed is None else num_computed
        end = computed + num_new
        if end < request.num_tokens:
            return 0  # a prompt chunk: nothing is drafted after it
        return max(0, min(self.num_lookahead_slots, self.max_model_len - end))

    def _make_room_for_a_starved_group(self) -> int:
        """Preempts one sequence of the biggest group when the fairest waiting request's
        group holds none and there is no room for it (slots, or blocks for its prompt)."""
        if not (self._fair and self.waiting and self.running):
            return 0
        request = self.waiting[self._next_waiting()]
        if self.running_per_group[request.group_id] > 0:
            return 0
        slots_full = len(self.running) >= self.config.max_num_seqs
        first_chunk = min(request.num_tokens, self.config.max_num_batched_tokens)
        blocks_short = not self.kv.can_allocate(first_chunk)
        if not (slots_full or blocks_short):
            return 0
        group, held = self.running_per_group.most_common(1)[0]
        if held < 2:
            return 0
        victim = next(
            (
                r
                for r in reversed(self.running)
                if r.group_id == group and r.request_id not in self.in_flight
            ),
            None,
        )
        if victim is None:
            return 0  # the group's sequences are all in flight: next step
        self._preempt(victim)
        return 1

    def _next_waiting(self) -> int:
        """The waiting request to admit next: policy order, or (fair share) the first of the
        first FAIR_SCAN whose group holds the fewest running sequences."""
        if not self._fair:
            return 0
        best, fewest = 0, None
        counts = self.running_per_group
        for index, request in enumerate(self.waiting[:FAIR_SCAN]):
            held = counts[request.group_id]
            if fewest is None or held < fewest:
                best, fewest = index, held
                if held == 0:
                    break
        return best

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not self._batch_full(out)
        ):
            index = self._next_waiting()
            request = self.waiting[index]
            if request.request_id in self.in_flight:
                break  # its id's aborted predecessor is still in flight
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            images = ()
            if request.mm_inputs:
                num_new, images = self._fit_images(request, num_hit_tokens, num_new)
                if not num_new:
                    break  # the encoder budget is spent for this step
            lookahead = self._lookahead(request, num_new, num_hit_tokens)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
            if new_blocks is None:
                break
            self._take_images(request, images)
            self._admit(out, index, num_new, num_hit_tokens, computed_blocks + new_blocks)
            budget -= num_new

    def _admit(
        self, out: SchedulerOutput, index: int, num_new: int, num_hit_tokens: int, blocks
    ) -> None:
        """waiting[index] starts running this step with `num_new` tokens (blocks allocated)."""
        request = self.waiting.pop(index)
        resumed = request.status == RequestStatus.PREEMPTED
        request.transition(RequestStatus.RUNNING)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.monotonic()
        request.num_computed_tokens = num_hit_tokens
        bisect.insort(self.running, request, key=self._sort_key)
        self.running_per_group[request.group_id] += 1
        self._record(out, request, num_new, blocks, resumed=resumed)

    def _schedule_a_suspect(self, out: SchedulerOutput) -> bool:
        """The step runs one suspect alone (the others running wait a step); False when
        no suspect is left waiting."""
        index = next((i for i, r in enumerate(self.waiting) if r.request_id in self.suspects), None)
        if index is None:
            self.suspects.clear()  # they ran, finished or were aborted
            return False
        request = self.waiting[index]
        if len(self.running) >= self.config.max_num_seqs:
            victim = self._pick_victim(self.running)
            if victim is None:
                return True  # every slot is in flight: it runs once one is back
            self._preempt(victim)
            index = self.waiting.index(request)
        computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit_tokens, self.config.max_num_batched_tokens)
        images = ()
        if request.mm_inputs:  # alone in the step: its first image always fits the budget
            num_new, images = self._fit_images(request, num_hit_tokens, num_new)
        lookahead = self._lookahead(request, num_new, num_hit_tokens)
        new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
        while new_blocks is None and self.running:
            victim = self._pick_victim(self.running)
            if victim is None:
                return True  # the blocks are held by requests in flight: next step
            self._preempt(victim)
            index = self.waiting.index(request)
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, lookahead)
        if new_blocks is None:
            return False  # cannot happen: admission checked it fits the cache alone
        self._take_images(request, images)
        self._admit(out, index, num_new, num_hit_tokens, computed_blocks + new_blocks)
        return True

    def _record(
        self, out, request: Request, num_new: int, new_blocks: list[int], resumed: bool = False
    ) -> None:
        rid = request.request_id
        # batches in flight: what the stages that do not sample have not been sent yet
        sampled = (
            request.all_token_ids[request.num_tokens_synced :] if self.pipeline_depth > 1 else []
        )
        request.num_tokens_synced = request.num_tokens
        if rid not in self._scheduled_once:
            self._scheduled_once.add(rid)
            out.new_requests.append(
                NewRequestData(
                    request_id=rid,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    eos_token_ids=tuple(request.eos_token_ids),
                    block_ids=self.kv.block_ids(rid).tolist(),
                    num_computed_tokens=request.num_computed_tokens,
                    mm_inputs=request.mm_inputs,
                )
            )
        elif request.swapped_in:  # back from the host tier: its whole new block list
            request.swapped_in = False
            blocks = self.kv.block_ids(rid).tolist()
            out.cached_requests.append(
                CachedRequestData(rid, blocks, request.num_computed_tokens, True, sampled)
            )
        else:
            out.cached_requests.append(
                CachedRequestData(
                    rid, list(new_blocks), request.num_computed_tokens, resumed, sampled
                )
            )
        out.num_scheduled_tokens[rid] = num_new
        request.num_computed_tokens += num_new

    def _pick_victim(self, candidates: list[Request]) -> Request | None:
        """The request to preempt among those not yet scheduled in this step: the lowest in
        policy order (`running` is kept in it, so the last candidate); with fair share, the
        last of the group that holds the most running sequences. Never one in flight
        (None: every candidate is)."""
        if self.in_flight:
            candidates = [r for r in candidates if r.request_id not in self.in_flight]
            if not candidates:
                return None
        if not self._fair:
            return candidates[-1]
        counts = self.running_per_group
        most = max(counts[r.group_id] for r in candidates)
        return next(r for r in reversed(candidates) if counts[r.group_id] == most)

    def _should_swap(self, request: Request) -> bool:
        """Swap or recompute (`preemption_mode`; `auto`: by cost).

        Recomputing T tokens costs a forward pass over them: about 2 x (parameters) FLOPs
        each (0.3 GFLOP a token for a 135M model; milliseconds per token on a CPU, tens of
        microseconds on a GPU). Swapping costs two copies of their KV (out now, back later):
        2 x layers x KV heads x head size x 2 bytes, tens of KB a token, microseconds per
        token at memory or PCIe bandwidth. So swapping wins by one to three orders of
        magnitude once there is anything to keep, and `auto` swaps every request with at
        least one full block computed (less than that is recomputed in about the time of
        one decode step). A request that came back from the host tier this very step is
        recomputed instead (its blocks are only being copied in; the engine never copies a
        block out and in within one step), and a full host tier falls back to recompute."""
        mode = self.config.preemption_mode
        if self.kv.host is None or mode == "recompute":
            return False
        if request.request_id in self._swapped_in_now or request.num_computed_tokens == 0:
            return False
        return mode == "swap" or request.num_computed_tokens >= self.kv.block_size

    def _swap_in(self) -> None:
        """Swapped requests come back, in policy order, while sequence slots and device
        blocks last (their KV is copied back this step; they run from where they were)."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if request.request_id in self.kv.transfers.swapped_out:
                return  # out this very step (to make room): not straight back in
            if not self.kv.swap_in(request, request.host_blocks):
                return
            self.swapped.pop(0)
            request.transition(RequestStatus.RUNNING)
            self.num_blocks_swapped_in += len(request.host_blocks)
            request.host_blocks = []
            request.swapped_in = True
            self._swapped_in_now.add(request.request_id)
            bisect.insort(self.running, request, key=self._sort_key)
            self.running_per_group[request.group_id] += 1

    def _leave_swapped(self, request: Request) -> None:
        self.swapped.remove(request)
        self.kv.release_swapped(request.host_blocks)
        request.host_blocks = []

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        group = request.group_id
        self.running_per_group[group] -= 1
        if self.running_per_group[group] <= 0:
            del self.running_per_group[group]

    def _preempt(self, request: Request, allow_swap: bool = True) -> None:
        """Takes a running request off the device: swapped out to the host tier (its KV
        copied there this step, nothing recomputed when it comes back) when
        `_should_swap` says so and the tier has room, else by recompute."""
        self._leave_running(request)
        if allow_swap and self._should_swap(request):
            host_blocks = self.kv.swap_out(request)
            if host_blocks is not None:
                request.transition(RequestStatus.SWAPPED)
                request.host_blocks = host_blocks
                request.spec_token_ids = []
                request.images_encoded.clear()  # the workers drop its features on its return
                request.num_preemptions += 1
                request.num_swaps += 1
                self.num_preemptions += 1
                self.num_swaps += 1
                self.num_blocks_swapped_out += len(host_blocks)
                bisect.insort(self.swapped, request, key=self._sort_key)
                return
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.images_encoded.clear()  # the workers drop its features on its resume
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    # ---- failures ------------------------------------------------------------------

    def step_failed(self, sched: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """The step `sched` raised: its requests are taken back (or, if it was one request
        or they failed too often, ended with `message`); the outputs of those ended."""
        for rid in sched.num_scheduled_tokens:
            self.in_flight.pop(rid, None)
        self._finished_ids |= sched.finished_request_ids  # the workers may not have dropped them
        if sched.kv_transfers is not None:
            self._transfers_failed(sched.kv_transfers)
        ids = [rid for rid in sched.num_scheduled_tokens if rid in self.requests]
        for rid in ids:  # what the step was to write is not there: no prefix hit on it
            request = self.requests[rid]
            start = request.num_computed_tokens - sched.num_scheduled_tokens[rid]
            self.kv.uncache_from(request, start)
        if len(ids) == 1:
            return self.fail_requests(ids, message)
        failed = []
        for rid in ids:
            request = self.requests[rid]
            request.num_failed_steps += 1
            if request.num_failed_steps >= MAX_FAILED_STEPS:
                failed.append(rid)
            else:
                self._take_back(request)
                self.suspects.add(rid)
        return self.fail_requests(failed, message)

    def _transfers_failed(self, transfers) -> None:
        """The failed step's copies may not have happened: a request swapped out in it is
        recomputed instead, one swapped in goes back to waiting, and what it offloaded is
        not in the tiers."""
        self.kv.transfers_failed(transfers)
        for rid in transfers.swapped_out:
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.SWAPPED:
                self._leave_swapped(request)
                request.transition(RequestStatus.PREEMPTED)
                request.num_computed_tokens = 0
                self._enqueue(request)
        for rid in transfers.swapped_in:
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._take_back(request)

    def fail_requests(self, request_ids, message: str) -> list[EngineCoreOutput]:
        """Ends each request with FINISHED_ERROR; their outputs (finish_reason "error")."""
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self._leave_running(request)
            elif request.status == RequestStatus.SWAPPED:
                self._leave_swapped(request)
            else:
                self.waiting.remove(request)
            self.suspects.discard(rid)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="error", error=message))
        return outputs

    def _take_back(self, request: Request) -> None:
        """Back to waiting with nothing computed, and out of the workers (they get it anew,
        from its tokens, when it next runs)."""
        if request.status == RequestStatus.RUNNING:
            self._leave_running(request)
            request.transition(RequestStatus.PREEMPTED)
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            request.images_encoded.clear()
            self._enqueue(request)
        rid = request.request_id
        if rid in self._scheduled_once:
            self._scheduled_once.discard(rid)
            self._finished_ids.add(rid)

    # ---- results -------------------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        in_flight = self.in_flight
        for i, rid in enumerate(result.req_ids):
            request = self.requests.get(rid)
            if in_flight and in_flight.pop(rid, None) is not request:
                continue  # aborted while its step was in flight (its id maybe reused since)
            if request is None:
                continue  # aborted while the step ran
            token = result.sampled_token_ids[i]
            prompt_logprobs = self._new_prompt_logprobs(request, sched, result)
            if self.suspects and token is not None:
                self.suspects.discard(rid)
            if token is None and prompt_logprobs is None:
                continue
            new_tokens, new_logprobs, status = [], [], None
            if token is not None:
                tokens, logprobs = [token], [result.logprobs[i]]
                drafts = sched.scheduled_spec_tokens.get(rid)
                if drafts:
                    accepted = result.accepted_token_ids.get(rid, [])
                    self._roll_back(request, len(drafts), len(accepted))
                    tokens = [*accepted, token]
                    logprobs = [*result.accepted_logprobs.get(rid, [None] * len(accepted))]
                    logprobs.append(result.logprobs[i])
                for t, lp in zip(tokens, logprobs, strict=True):
                    request.append_output_token(t)
                    new_tokens.append(t)
                    if request.matcher is not None and not request.matcher.accept([t]):
                        logger.warning("request %s: token %d is outside its grammar", rid, t)
                    if lp is not None:
                        new_logprobs.append(lp)
                    status = self._check_stop(request)
                    if status is not None:
                        break  # nothing past a stop goes out
                if status is None:
                    self._take_drafts(request, result.spec_token_ids.get(rid))
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs or None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=status.finish_reason if status else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    queued_s=_queued_s(request)
                    if len(new_tokens) == request.num_output_tokens
                    else None,
                )
            )
            if status is not None:
                self._leave_running(request)
                self._finish(request, status)
        return outputs

    def _roll_back(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The rejected drafts' slots are given back: their keys and values are not the
        request's; blocks left holding nothing it needs are freed."""
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts, num_accepted)
        self.kv.trim(
            request,
            spec_blocks_kept(
                request.num_computed_tokens, self.num_lookahead_slots, self.kv.block_size
            ),
        )

    def _take_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """Keeps the worker's proposals for the request's next step, as many as can be
        emitted: an accepted run plus one token within max_tokens and the context."""
        if not drafts:
            return
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        request.spec_token_ids = list(drafts[: max(room - 1, 0)])

    def _new_prompt_logprobs(self, request: Request, sched, result) -> list | None:
        """This step's prompt-logprob rows the client does not have yet (row k is prompt
        position start + k; a recompute after preemption repeats rows already sent)."""
        rows = result.prompt_logprobs.get(request.request_id)
        if rows is None:
            return None
        start = request.num_computed_tokens - sched.num_scheduled_tokens[request.request_id]
        sent = request.num_prompt_logprobs_sent
        request.num_prompt_logprobs_sent = max(sent, start + len(rows))
        if sent > start:
            rows = rows[sent - start :]
        return rows or None

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.all_token_ids[-1]
        if request.matcher is not None and request.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar's end (EOS, if it came, too)
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def preempt_all(self) -> int:
        """Every running request back to waiting, its blocks freed (the engine goes to sleep:
        the KV cache is about to be lost); they are recomputed when it runs again. Returns
        how many there were."""
        running = list(self.running)
        for request in reversed(running):
            self._preempt(request, allow_swap=False)  # no step runs to copy anything
        return len(running)

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
            kv_tiers=self._tier_stats(),
        )

    def _tier_stats(self) -> KVTierStats | None:
        host = self.kv.host
        if host is None:
            return None
        return KVTierStats(
            num_swapped=len(self.swapped),
            num_swaps_total=self.num_swaps,
            blocks_swapped_out_total=self.num_blocks_swapped_out,
            blocks_swapped_in_total=self.num_blocks_swapped_in,
            host=host.take_stats(),
            disk=host.disk.take_stats() if host.disk is not None else None,
        )


def _queued_s(request: Request) -> float | None:
    times = request.times
    return None if times.first_scheduled is None else times.first_scheduled - times.arrival
