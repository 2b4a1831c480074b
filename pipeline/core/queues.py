"""The scheduler's request queues and the moves between them.

    waiting (policy order) --admit--> running (policy order) --finish--> gone
       ^                                 |  preempt: recompute
       +---------------------------------+
       ^                                 |  preempt: swap (core/preemption.py)
       +-- (failed swap) -- swapped <----+
                               +--swap in--> running
       ^
       +--resume-- paused <--pause-- waiting, running, swapped

A paused request's client reads none of its outputs (pipeline/frontend/output_queue.py):
it leaves whichever queue it is in, its blocks (or host blocks) freed and its computed
tokens forgotten as by a recompute preemption, so it holds no sequence slot and no KV
while it waits; resumed, it rejoins `waiting` by its arrival, ahead of every request that
came after it, and its full blocks are usually still in the prefix cache.

Every queue is kept sorted by the policy's key (`Request.sort_key`: FCFS by arrival,
priority by (priority, arrival)); `running_per_group` counts each group's running
sequences for fair share (core/scheduling_policy.py). Invariants: a request is in exactly
one queue, matching its status (WAITING / PREEMPTED: waiting, RUNNING: running, SWAPPED:
swapped, PAUSED: paused); a request leaves `running` only through `leave_running`, so the
group counts stay true.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Container

from ringllm.pipeline.core import scheduling_policy
from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.preemption import SwappedQueue, forget_computed, should_swap
from ringllm.pipeline.core.request import Request, RequestStatus


class RequestQueues:
    def __init__(self, kv: KVCacheManager, scheduling_policy: str, preemption_mode: str) -> None:
        """`scheduling_policy`: "fcfs" (with fair share) or "priority"; `preemption_mode`:
        "swap", "recompute" or "auto" (preemption.should_swap)."""
        self.kv = kv
        self.policy = scheduling_policy
        self.fair = scheduling_policy == "fcfs"
        self.preemption_mode = preemption_mode
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.running_per_group: collections.Counter[str] = collections.Counter()
        self.swaps = SwappedQueue(kv, self.sort_key)  # KV in the host tier
        self.paused: dict[str, Request] = {}  # by request id: not scheduled until resumed
        self.num_preemptions = 0  # since the start, swaps and recomputes

    def sort_key(self, request: Request) -> tuple:
        return request.sort_key(self.policy)

    def enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.sort_key)

    def join_running(self, request: Request) -> None:
        bisect.insort(self.running, request, key=self.sort_key)
        self.running_per_group[request.group_id] += 1

    def leave_running(self, request: Request) -> None:
        self.running.remove(request)
        group = request.group_id
        self.running_per_group[group] -= 1
        if self.running_per_group[group] <= 0:
            del self.running_per_group[group]

    def remove(self, request: Request) -> None:
        """Out of whichever queue its status puts it in (it is ending)."""
        if request.status == RequestStatus.RUNNING:
            self.leave_running(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swaps.remove(request)
        elif request.status == RequestStatus.PAUSED:
            del self.paused[request.request_id]
        else:
            self.waiting.remove(request)

    def next_waiting(self) -> int:
        """The index in `waiting` of the request to admit next."""
        return scheduling_policy.next_waiting(self.waiting, self.running_per_group, self.fair)

    def pick_victim(self, candidates: list[Request], in_flight: Container[str]) -> Request | None:
        """The running request among `candidates` to preempt (None: all are in flight)."""
        return scheduling_policy.pick_victim(
            candidates, self.running_per_group, self.fair, in_flight
        )

    def fair_share_victim(self, in_flight: Container[str]) -> Request | None:
        """The sequence a starved group's request takes the place of (None: none)."""
        return scheduling_policy.fair_share_victim(self.running, self.running_per_group, in_flight)

    def make_room_for_a_starved_group(
        self, max_num_seqs: int, max_num_batched_tokens: int, in_flight: Container[str]
    ) -> int:
        """Fair share: preempts one sequence of the biggest group when the fairest waiting
        request's group holds none and there is no room for it (slots, or blocks for its
        first chunk). How many it preempted (0 or 1)."""
        if not (self.fair and self.waiting and self.running):
            return 0
        request = self.waiting[self.next_waiting()]
        if self.running_per_group[request.group_id] > 0:
            return 0
        slots_full = len(self.running) >= max_num_seqs
        first_chunk = min(request.num_tokens, max_num_batched_tokens)
        if not (slots_full or not self.kv.can_allocate(first_chunk)):
            return 0
        victim = self.fair_share_victim(in_flight)
        if victim is None:
            return 0  # none to spare, or the group's sequences are all in flight: next step
        self.preempt(victim)
        return 1

    def preempt(self, request: Request, allow_swap: bool = True) -> None:
        """Takes a running request off the device: swapped out to the host tier (its KV
        copied there this step, nothing recomputed when it comes back) when
        preemption.should_swap says so and the tier has room, else by recompute."""
        self.leave_running(request)
        self.num_preemptions += 1
        swap = allow_swap and should_swap(
            request,
            self.preemption_mode,
            self.kv.host is not None,
            request.request_id in self.swaps.swapped_in_now,
            self.kv.block_size,
        )
        if swap and self.swaps.swap_out(request):
            return
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        forget_computed(request)
        request.num_preemptions += 1
        self.enqueue(request)

    def preempt_all(self) -> int:
        """Every running request back to waiting by recompute (no step runs to copy
        anything: the engine goes to sleep); how many there were."""
        running = list(self.running)
        for request in reversed(running):
            self.preempt(request, allow_swap=False)
        return len(running)

    def take_back(self, request: Request) -> None:
        """A running request back to waiting with nothing computed (a failed step: what the
        workers hold of it is not trusted); not counted as a preemption."""
        self.leave_running(request)
        request.transition(RequestStatus.PREEMPTED)
        self.kv.free(request)
        forget_computed(request)
        self.enqueue(request)

    def pause(self, request: Request) -> None:
        """Out of its queue until `resume`, holding nothing: its device blocks (or host
        blocks) freed, its computed tokens forgotten (not counted as a preemption)."""
        self.remove(request)
        self.kv.free(request)
        forget_computed(request)
        request.transition(RequestStatus.PAUSED)
        self.paused[request.request_id] = request

    def resume(self, request: Request) -> None:
        """A paused request back to `waiting`, by its arrival: a request that ran before
        comes back PREEMPTED (the workers kept its row and its sampling state)."""
        del self.paused[request.request_id]
        ran = request.times.first_scheduled is not None
        request.transition(RequestStatus.PREEMPTED if ran else RequestStatus.WAITING)
        self.enqueue(request)
