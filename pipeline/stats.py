"""What the engine core reports of itself each step (`SchedulerStats`, with its prefix-cache
counts `PrefixCacheStats`): made by the scheduler, carried to every front end (in process,
or as a STATS record of the output ring), read by /metrics and the front end's logger."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    def take(self) -> PrefixCacheStats:
        """Returns the counts so far and starts new ones (for per-interval reporting)."""
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions_total: int = 0
