"""What the KV-tier benchmarks read of an in-process engine, beyond its outputs.

    CopyTimer    the worker's KV-tier copies (`WorkerKVTiers.apply`: device <-> host,
                 host -> disk, disk -> device), timed call by call, with the blocks each
                 moved
    TierTotals   the engine core's per-step statistics (`SchedulerStats`) summed: prefix
                 queries and hits (tokens), each tier's queries, hits, blocks in and out
                 (blocks), the swap counters

Both need the engine core and its worker in this process (`LLM(...)` as the benchmarks
build it: no engine process, tensor parallel 1); elsewhere `CopyTimer` times nothing and
says so (`available`). On a GPU it times what `apply` takes on the host: the copies run
on a stream of their own, so the step's time holds the rest.

NOTE: they wrap the worker's `apply` and take the engine's `stat_logger` slot, on that
one instance: the benchmark observes the engine without a hook of its own in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ringllm.pipeline.stats import SchedulerStats, TierStats


@dataclass
class CopyCall:
    seconds: float
    blocks_to_host: int
    blocks_to_device: int
    blocks_to_disk: int
    blocks_from_disk: int


class CopyTimer:
    def __init__(self, llm) -> None:
        self.calls: list[CopyCall] = []
        core = llm.llm_engine.engine_core
        executor = getattr(core, "executor", None)
        self.tiers = getattr(executor, "tiers", None)
        runner = getattr(executor, "runner", None)
        self.kv_bytes_per_block = int(runner.kv_bytes_per_block) if runner is not None else 0
        self.available = self.tiers is not None
        if self.available:
            self._apply = self.tiers.apply
            self.tiers.apply = self._timed_apply

    def _timed_apply(self, transfers, device_caches) -> None:
        start_s = time.perf_counter()
        self._apply(transfers, device_caches)
        self.calls.append(
            CopyCall(
                time.perf_counter() - start_s,
                len(transfers.to_host),
                len(transfers.to_device),
                len(transfers.to_disk),
                len(transfers.from_disk),
            )
        )

    def seconds_since(self, index: int) -> float:
        return sum(c.seconds for c in self.calls[index:])

    def totals_since(self, index: int) -> dict[str, float]:
        calls = self.calls[index:]
        return {
            "copy_s": sum(c.seconds for c in calls),
            "copy_calls": len(calls),
            "blocks_to_host": sum(c.blocks_to_host for c in calls),
            "blocks_to_device": sum(c.blocks_to_device for c in calls),
            "blocks_to_disk": sum(c.blocks_to_disk for c in calls),
            "blocks_from_disk": sum(c.blocks_from_disk for c in calls),
        }


@dataclass
class TierTotals:
    """Sums of every `SchedulerStats` the engine hands its stat logger (see the module doc)."""

    prefix_queries: int = 0  # tokens
    prefix_hits: int = 0  # tokens, every tier
    host: TierStats = field(default_factory=TierStats)  # blocks
    disk: TierStats = field(default_factory=TierStats)
    num_swaps_total: int = 0
    num_preemptions_total: int = 0

    @classmethod
    def attach(cls, llm) -> TierTotals:
        totals = cls()
        llm.llm_engine.stat_logger = totals
        return totals

    def record(self, sched: SchedulerStats | None, iteration) -> None:
        if sched is None:
            return
        self.prefix_queries += sched.prefix_cache.queries
        self.prefix_hits += sched.prefix_cache.hits
        self.num_preemptions_total = sched.num_preemptions_total
        tiers = sched.kv_tiers
        if tiers is None:
            return
        self.num_swaps_total = tiers.num_swaps_total
        self.host.add(tiers.host)
        if tiers.disk is not None:
            self.disk.add(tiers.disk)

    def snapshot(self) -> dict[str, int]:
        """The counts now, to subtract from a later snapshot (`counts_since`)."""
        return {
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "host_hits": self.host.hits,
            "disk_hits": self.disk.hits,
            "host_blocks_in": self.host.blocks_in,
            "disk_blocks_in": self.disk.blocks_in,
            "num_swaps": self.num_swaps_total,
            "num_preemptions": self.num_preemptions_total,
        }

    def counts_since(self, before: dict[str, int]) -> dict[str, int]:
        now = self.snapshot()
        return {k: now[k] - before[k] for k in now}
