"""The engine core's accounting of the KV tiers (core/kv_tiers.py), and the scheduler's
swap preemption on it: which block goes where, in which order, and what a failed step
undoes. No model: the copies themselves are tests/pipeline/engine/test_kv_tiers.py's."""

from __future__ import annotations

from ringllm.pipeline.config import CacheConfig, SchedulerConfig
from ringllm.pipeline.core.kv_tiers import DiskTier, HostTier
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.core.scheduler_output import KVTransfers
from ringllm.pipeline.sampling_params import SamplingParams


def test_swaps_take_free_blocks_then_evict_cached_ones_to_disk():
    disk = DiskTier(4)
    host = HostTier(3, disk)
    t = KVTransfers()
    assert host.offload(10, 0xA, t) and host.offload(11, 0xB, t)
    assert t.to_host == [(10, 0), (11, 1)] and host.lookup(0xA) == 0
    host.end_step()
    blocks = host.allocate(2, KVTransfers())  # one free, then the LRU cached one (0xA)
    assert blocks == [2, 0]
    assert host.lookup(0xA) is None and 0xA in disk  # it went to disk
    assert host.allocate(2, KVTransfers()) is None  # one block left (0xB's): nothing taken
    host.end_step()
    t = KVTransfers()
    assert host.allocate(1, t) == [1] and t.to_disk == [(1, disk.lookup(0xB), 0xB)]
    assert host.allocate(1, KVTransfers()) is None  # every block held by swaps


def test_blocks_read_or_written_this_step_are_never_reused_in_it():
    host = HostTier(2)
    t = KVTransfers()
    host.offload(1, 0xA, t)
    host.end_step()
    assert host.load(0xA) == 0  # a prefix hit read this step: protected
    assert host.offload(2, 0xB, t) and host.lookup(0xB) == 1  # the free block, not 0xA's
    assert host.num_available == 0  # one read, one written this step
    assert host.allocate(1, KVTransfers()) is None
    assert not host.offload(3, 0xC, t)  # no room: the offload is dropped
    host.end_step()
    assert host.num_available == 2
    swapped = host.allocate(2, KVTransfers())
    assert sorted(swapped) == [0, 1] and host.lookup(0xA) is None
    host.release_swapped(swapped)
    assert host.num_available == 0  # given back, free only from the next step
    host.end_step()
    assert host.num_available == 2


def test_disk_tier_starts_from_what_the_files_hold_and_evicts_lru():
    disk = DiskTier(3, {0xA: 0, 0xB: 2, 0xC: 9, 0xD: 2})  # 0xC: out of range; 0xD: a used slot
    assert disk.num_used == 2 and disk.lookup(0xB) == 2 and 0xC not in disk
    assert disk.put(0xA) is None  # there already: no write
    assert disk.put(0xE) == 1
    disk.load(0xB)  # read this step: kept
    slot = disk.put(0xF)  # evicts the least recently used not being read: 0xA
    assert slot == 0 and 0xA not in disk and 0xB in disk


def make_scheduler(num_blocks=8, host_blocks=16, mode="swap", max_seqs=4):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, preemption_mode=mode),
        CacheConfig(block_size=4),
        64,
        num_blocks,
        host=HostTier(host_blocks),
    )


def request(rid, n, max_tokens=8):
    first = 100 * (ord(rid[0]) - ord("a") + 1)  # its own tokens: no prefix shared
    return Request(rid, list(range(first, first + n)), SamplingParams(), max_tokens=max_tokens)


def step(s: Scheduler):
    """Schedule, then pretend every scheduled request sampled token 7."""
    from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput

    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [
        7 if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else None for r in ids
    ]
    s.update_from_output(out, ModelRunnerOutput(ids, sampled, [None] * len(ids)))
    return out


def test_a_preempted_request_is_swapped_out_then_back_before_new_requests():
    s = make_scheduler(num_blocks=6)
    s.add_request(request("a", 10))
    s.add_request(request("b", 10))
    step(s)  # both prefill: 3 + 3 blocks
    for _ in range(4):
        out = step(s)
        if s.swapped:
            break
    (victim,) = s.swapped
    assert victim.status == RequestStatus.SWAPPED and victim.host_blocks
    transfers = out.kv_transfers
    assert transfers.swapped_out == [victim.request_id]
    swap_pairs = transfers.to_host[: len(victim.host_blocks)]
    assert [host for _, host in swap_pairs] == victim.host_blocks
    # the device blocks it gave back are reused at once: the cached ones are also offloaded
    # (read before the step overwrites them, like the swap's own copies)
    assert all(dev in {d for d, _ in swap_pairs} for dev, _ in transfers.to_host[len(swap_pairs) :])
    s.add_request(request("c", 4))
    for _ in range(20):
        out = step(s)
        if victim.status != RequestStatus.SWAPPED:
            break
        assert "c" not in out.num_scheduled_tokens  # swapped requests come back first
    assert out.kv_transfers.swapped_in == [victim.request_id]
    assert victim.status == RequestStatus.RUNNING
    resumed = [c for c in out.cached_requests if c.request_id == victim.request_id]
    assert resumed and resumed[0].resumed  # the workers get its whole new block list


def test_a_failed_step_turns_its_swap_outs_into_recomputes():
    s = make_scheduler(num_blocks=6)
    s.add_request(request("a", 10))
    s.add_request(request("b", 10))
    step(s)
    out = None
    for _ in range(4):
        out = s.schedule()
        if s.swapped:
            break
        ids = list(out.num_scheduled_tokens)
        from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput

        s.update_from_output(out, ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids)))
    (victim,) = s.swapped
    s.step_failed(out, "test")
    assert not s.swapped and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim in s.waiting


def test_recompute_mode_and_no_host_tier_never_swap():
    for s in (make_scheduler(num_blocks=6, mode="recompute"),):
        s.add_request(request("a", 10))
        s.add_request(request("b", 10))
        for _ in range(6):
            step(s)
        assert s.num_preemptions > 0 and s.num_swaps == 0 and not s.swapped


def test_a_fair_share_swap_out_still_admits_the_starved_request():
    """A group holding every slot: the fair share swaps one of its sequences out for a new
    group's request, which runs in that very step (a swapped request would otherwise keep
    every new request waiting until it is back: a starved group forever)."""
    s = make_scheduler(num_blocks=64, max_seqs=2)
    for rid in ("a1", "a2"):
        req = request(rid, 10)
        req.group_id = "a"
        s.add_request(req)
    step(s)
    step(s)
    s.add_request(request("b", 4))
    out = step(s)
    assert s.num_swaps == 1 and "b" in out.num_scheduled_tokens
