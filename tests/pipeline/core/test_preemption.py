"""core/preemption.py: swap or recompute, and the swapped queue on a real KV cache manager
with a host tier: out, back in, and the undo of a failed step's transfers."""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.kv_tiers import HostTier
from ringllm.pipeline.core.preemption import SwappedQueue, forget_computed, should_swap
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.sampling_params import SamplingParams

BS = 4


def running(rid: str, num_tokens: int, kv: KVCacheManager, arrival: float = 0.0) -> Request:
    request = Request(rid, list(range(10, 10 + num_tokens)), SamplingParams(), arrival_time=arrival)
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    request.transition(RequestStatus.RUNNING)
    return request


def test_should_swap_by_mode_and_cost():
    request = Request("r", [1] * 8, SamplingParams())
    request.num_computed_tokens = BS - 1
    assert not should_swap(request, "auto", True, False, BS)  # less than a block: recompute
    assert should_swap(request, "swap", True, False, BS)
    assert not should_swap(request, "swap", False, False, BS)  # no host tier
    assert not should_swap(request, "swap", True, True, BS)  # back in this very step
    request.num_computed_tokens = BS
    assert should_swap(request, "auto", True, False, BS)
    assert not should_swap(request, "recompute", True, False, BS)
    request.num_computed_tokens = 0
    assert not should_swap(request, "swap", True, False, BS)  # nothing to keep


def test_forget_computed_drops_what_the_workers_held():
    request = Request("r", [1] * 8, SamplingParams())
    request.num_computed_tokens, request.spec_token_ids = 5, [3, 4]
    request.images_encoded.add(0)
    forget_computed(request)
    assert (request.num_computed_tokens, request.spec_token_ids) == (0, [])
    assert not request.images_encoded


def test_a_swapped_request_comes_back_in_order_with_its_blocks_copied_both_ways():
    kv = KVCacheManager(8, BS, 64, 4, True, HostTier(8))
    swaps = SwappedQueue(kv, lambda r: (r.times.arrival,))
    late, early = running("late", 8, kv, arrival=2.0), running("early", 4, kv, arrival=1.0)
    assert swaps.swap_out(late) and swaps.swap_out(early)
    assert [r.request_id for r in swaps.requests] == ["early", "late"]
    assert (swaps.num_swaps, swaps.num_blocks_swapped_out) == (2, 3)
    assert late.status == RequestStatus.SWAPPED and late.num_preemptions == 1
    assert swaps.swap_in(2) == []  # out this very step: not straight back in
    transfers = swaps.take_transfers()
    assert len(transfers.to_host) == 3 and transfers.swapped_out == ["late", "early"]
    swaps.begin_step()
    back = swaps.swap_in(1)  # one sequence slot
    assert back == [early] and early.status == RequestStatus.RUNNING and early.swapped_in
    assert swaps.swapped_in_now == {"early"} and swaps.num_blocks_swapped_in == 1
    assert swaps.take_transfers().swapped_in == ["early"]
    assert swaps.take_tier_stats().num_swapped == 1


def test_a_failed_step_undoes_its_swaps():
    kv = KVCacheManager(8, BS, 64, 4, True, HostTier(8))
    swaps = SwappedQueue(kv, lambda r: (r.times.arrival,))
    out = running("out", 8, kv)
    assert swaps.swap_out(out)
    transfers = swaps.take_transfers()
    inside = running("in", 4, kv)
    transfers.swapped_in.append("in")
    recompute, take_back = swaps.undo_failed(transfers, {"out": out, "in": inside})
    assert recompute == [out] and take_back == [inside]
    assert out.status == RequestStatus.PREEMPTED and out.num_computed_tokens == 0
    assert swaps.requests == [] and out.host_blocks == []


def test_a_full_host_tier_refuses_the_swap_and_removing_frees_host_blocks():
    kv = KVCacheManager(8, BS, 64, 4, True, HostTier(1))
    swaps = SwappedQueue(kv, lambda r: (r.times.arrival,))
    assert not swaps.swap_out(running("big", 8, kv))  # two blocks, the tier has one
    small = running("small", 4, kv)
    assert swaps.swap_out(small)
    swaps.remove(small)
    assert swaps.requests == [] and small.host_blocks == []
    assert SwappedQueue(KVCacheManager(8, BS, 64, 4), lambda r: ()).take_tier_stats() is None
