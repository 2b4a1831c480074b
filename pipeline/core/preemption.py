"""Preemption: a running request leaves the device by swap (its KV copied to the host
tier, core/kv_tiers.py) or by recompute (its blocks freed, recomputed from its tokens
later; they are kept, so nothing is lost, and the prefix cache usually makes it cheap).

`SwappedQueue` owns the swapped-out requests (in policy order), their way back in, the
swap counters, and the undo of a failed step's transfers. The scheduler's queues (waiting,
running) stay the scheduler's: these functions say what moves, the scheduler moves it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler_output import KVTransfers
from ringllm.pipeline.stats import KVTierStats


def should_swap(
    request: Request,
    preemption_mode: str,
    has_host_tier: bool,
    swapped_in_now: bool,
    block_size: int,
) -> bool:
    """Swap or recompute (`preemption_mode`; `auto`: by cost).

    Recomputing T tokens costs a forward pass over them: about 2 x (parameters) FLOPs
    each (0.3 GFLOP a token for a 135M model; milliseconds per token on a CPU, tens of
    microseconds on a GPU). Swapping costs two copies of their KV (out now, back later):
    2 x layers x KV heads x head size x 2 bytes, tens of KB a token, microseconds per
    token at memory or PCIe bandwidth. So swapping wins by one to three orders of
    magnitude once there is anything to keep, and `auto` swaps every request with at
    least one full block computed (less than that is recomputed in about the time of
    one decode step). A request that came back from the host tier this very step
    (`swapped_in_now`) is recomputed instead (its blocks are only being copied in; the
    engine never copies a block out and in within one step), and a full host tier falls
    back to recompute (`SwappedQueue.swap_out` says so)."""
    if not has_host_tier or preemption_mode == "recompute":
        return False
    if swapped_in_now or request.num_computed_tokens == 0:
        return False
    return preemption_mode == "swap" or request.num_computed_tokens >= block_size


def forget_computed(request: Request) -> None:
    """What the workers held for a request taken off the device to be recomputed: its
    computed tokens, its drafts and its images' features."""
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.images_encoded.clear()  # the workers drop its features on its resume


class SwappedQueue:
    """The requests whose KV is in the host tier, sorted by `sort_key`, and the counts of
    what went out and came back."""

    def __init__(self, kv: KVCacheManager, sort_key: Callable[[Request], tuple]) -> None:
        self.kv = kv
        self.sort_key = sort_key
        self.requests: list[Request] = []
        self.swapped_in_now: set[str] = set()  # back from the host tier this step
        self.num_swaps = 0  # swap-outs since the start
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    def begin_step(self) -> None:
        self.swapped_in_now = set()

    def swap_out(self, request: Request) -> bool:
        """Copies a request that has left `running` to the host tier (False: the tier is
        full; the caller recomputes it instead)."""
        host_blocks = self.kv.swap_out(request)
        if host_blocks is None:
            return False
        request.transition(RequestStatus.SWAPPED)
        request.host_blocks = host_blocks
        request.spec_token_ids = []
        request.images_encoded.clear()  # the workers drop its features on its return
        request.num_preemptions += 1
        request.num_swaps += 1
        self.num_swaps += 1
        self.num_blocks_swapped_out += sum(1 for b in host_blocks if b >= 0)  # -1: a null
        bisect.insort(self.requests, request, key=self.sort_key)
        return True

    def swap_in(self, num_slots: int) -> list[Request]:
        """Swapped requests come back, in policy order, while `num_slots` sequence slots and
        device blocks last (their KV is copied back this step; they run from where they
        were). The requests back, RUNNING, for the caller to put in `running`."""
        back = []
        while self.requests and len(back) < num_slots:
            request = self.requests[0]
            if request.request_id in self.kv.transfers.swapped_out:
                break  # out this very step (to make room): not straight back in
            if not self.kv.swap_in(request, request.host_blocks):
                break
            self.requests.pop(0)
            request.transition(RequestStatus.RUNNING)
            self.num_blocks_swapped_in += sum(1 for b in request.host_blocks if b >= 0)
            request.host_blocks = []
            request.swapped_in = True
            self.swapped_in_now.add(request.request_id)
            back.append(request)
        return back

    def remove(self, request: Request) -> None:
        """A swapped request leaves (finished, aborted, failed): its host blocks are freed."""
        self.requests.remove(request)
        self.kv.release_swapped(request.host_blocks)
        request.host_blocks = []

    def take_transfers(self) -> KVTransfers | None:
        """The step's copies between tiers, with the ids swapped in this step."""
        transfers = self.kv.take_transfers()
        if transfers is not None:
            transfers.swapped_in = sorted(self.swapped_in_now)
        return transfers

    def undo_failed(
        self, transfers: KVTransfers, requests: Mapping[str, Request]
    ) -> tuple[list[Request], list[Request]]:
        """The failed step's copies may not have happened: what it offloaded is not in the
        tiers, a request swapped out in it is to be recomputed, one swapped in to be taken
        back. Returns (PREEMPTED requests for the waiting queue, RUNNING requests to take
        back)."""
        self.kv.transfers_failed(transfers)
        recompute = []
        for rid in transfers.swapped_out:
            request = requests.get(rid)
            if request is not None and request.status == RequestStatus.SWAPPED:
                self.remove(request)
                request.transition(RequestStatus.PREEMPTED)
                request.num_computed_tokens = 0
                recompute.append(request)
        take_back = [
            requests[rid]
            for rid in transfers.swapped_in
            if rid in requests and requests[rid].status == RequestStatus.RUNNING
        ]
        return recompute, take_back

    def take_tier_stats(self) -> KVTierStats | None:
        """The tiers' counters since the last call (None: no host tier)."""
        host = self.kv.host
        if host is None:
            return None
        return KVTierStats(
            num_swapped=len(self.requests),
            num_swaps_total=self.num_swaps,
            blocks_swapped_out_total=self.num_blocks_swapped_out,
            blocks_swapped_in_total=self.num_blocks_swapped_in,
            host=host.take_stats(),
            disk=host.disk.take_stats() if host.disk is not None else None,
        )
