"""core/queues.py: the waiting, running and swapped queues in policy order, the group
counts fair share reads, and the moves between queues (preempt, take back, remove)."""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.kv_tiers import HostTier
from ringllm.pipeline.core.queues import RequestQueues
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.sampling_params import SamplingParams

BS = 4


def req(rid: str, arrival: float, group: str | None = None, priority: int = 0) -> Request:
    return Request(
        rid, [7] * 8, SamplingParams(), arrival_time=arrival, group_id=group, priority=priority
    )


def run(queues: RequestQueues, request: Request, num_tokens: int = 8) -> None:
    assert queues.kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    request.transition(RequestStatus.RUNNING)
    queues.join_running(request)


def test_queues_keep_the_policy_order_and_the_group_counts():
    queues = RequestQueues(KVCacheManager(16, BS, 64, 4), "priority", "recompute")
    low, high = req("low", 1.0, priority=5), req("high", 2.0, priority=0)
    queues.enqueue(low)
    queues.enqueue(high)
    assert queues.waiting == [high, low] and not queues.fair
    a1, a2 = req("a1", 1.0, "a"), req("a2", 2.0, "a")
    run(queues, a2)
    run(queues, a1)
    assert queues.running == [a1, a2] and queues.running_per_group == {"a": 2}
    queues.leave_running(a1)
    queues.leave_running(a2)
    assert not queues.running_per_group  # no group left at zero


def test_preempt_recomputes_without_a_host_tier_and_swaps_with_one():
    queues = RequestQueues(KVCacheManager(16, BS, 64, 4), "fcfs", "auto")
    victim = req("v", 1.0)
    run(queues, victim)
    queues.preempt(victim)
    assert victim.status == RequestStatus.PREEMPTED and queues.waiting == [victim]
    assert victim.num_computed_tokens == 0 and queues.num_preemptions == 1
    queues = RequestQueues(KVCacheManager(16, BS, 64, 4, True, HostTier(8)), "fcfs", "auto")
    victim = req("v", 1.0)
    run(queues, victim)
    queues.preempt(victim)
    assert victim.status == RequestStatus.SWAPPED and queues.swaps.requests == [victim]
    queues.remove(victim)
    assert queues.swaps.requests == []


def test_take_back_and_preempt_all_recompute_and_remove_finds_the_queue():
    queues = RequestQueues(KVCacheManager(16, BS, 64, 4, True, HostTier(8)), "fcfs", "swap")
    a, b, c = req("a", 1.0), req("b", 2.0), req("c", 3.0)
    for request in (a, b, c):
        run(queues, request)
    queues.take_back(c)
    assert c.status == RequestStatus.PREEMPTED and queues.num_preemptions == 0
    assert queues.preempt_all() == 2  # never swapped: no step runs to copy anything
    assert queues.waiting == [a, b, c] and queues.swaps.requests == []
    queues.remove(b)
    assert queues.waiting == [a, c]


def test_a_starved_group_gets_a_sequence_of_the_biggest_group_when_the_slots_are_full():
    queues = RequestQueues(KVCacheManager(16, BS, 64, 4), "fcfs", "recompute")
    a1, a2 = req("a1", 1.0, "a"), req("a2", 2.0, "a")
    run(queues, a1)
    run(queues, a2)
    queues.enqueue(req("b1", 3.0, "b"))
    assert queues.make_room_for_a_starved_group(3, 64, in_flight=()) == 0  # a slot is free
    assert queues.make_room_for_a_starved_group(2, 64, in_flight={"a1", "a2"}) == 0
    assert queues.make_room_for_a_starved_group(2, 64, in_flight=()) == 1
    assert a2.status == RequestStatus.PREEMPTED and queues.running == [a1]
    assert [r.request_id for r in queues.waiting] == ["a2", "b1"]  # arrival order
    assert queues.next_waiting() == 1  # b1: its group holds none
    assert queues.pick_victim(queues.running, in_flight=()) is a1


def test_pause_frees_what_a_running_or_swapped_request_holds_and_resume_requeues_it():
    host = HostTier(8)
    kv = KVCacheManager(16, BS, 64, 4, True, host)
    queues = RequestQueues(kv, "fcfs", "swap")
    running, swapped, later = req("r", 1.0), req("s", 2.0), req("l", 3.0)
    run(queues, running)
    run(queues, swapped)
    queues.preempt(swapped)
    assert swapped.status == RequestStatus.SWAPPED and host.num_swapped_blocks == 2
    queues.enqueue(later)
    queues.pause(running)
    queues.pause(swapped)
    assert queues.paused == {"r": running, "s": swapped}
    assert not queues.running and not queues.swaps.requests and queues.waiting == [later]
    assert kv.pool.num_free_blocks == 16 and host.num_swapped_blocks == 0 and not kv.rows
    assert running.num_computed_tokens == 0 and not queues.running_per_group
    running.times.first_scheduled = 0.0  # it ran: back as preempted, ahead of later ones
    queues.resume(running)
    assert running.status == RequestStatus.PREEMPTED and queues.waiting == [running, later]
    queues.remove(swapped)  # aborted while paused
    assert not queues.paused and queues.num_preemptions == 1
