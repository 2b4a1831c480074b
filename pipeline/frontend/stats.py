"""The front end's view of each step (`IterationStats`: tokens, TTFTs, latencies it saw)
and a throttled logger of both that and the core's `SchedulerStats`.

The server's /metrics reads the same objects; the logger prints one line at most every
`interval_s` seconds, so logging costs nothing on the hot path between lines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ringllm.pipeline.stats import PrefixCacheStats, SchedulerStats

logger = logging.getLogger("ringllm.stats")


@dataclass
class IterationStats:
    """One step's counts, as the front end sees them."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    e2e_latencies_s: list[float] = field(default_factory=list)
    queue_times_s: list[float] = field(default_factory=list)


class StatLogger:
    """Accumulates steps and logs throughput and cache state at a throttled interval."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix = PrefixCacheStats()

    def record(self, sched: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        self._prefix.queries += sched.prefix_cache.queries
        self._prefix.hits += sched.prefix_cache.hits
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._log(sched, now - self._last_log)
            self._last_log = now

    def _log(self, sched: SchedulerStats, elapsed_s: float) -> None:
        hit_rate = self._prefix.hits / self._prefix.queries if self._prefix.queries else 0.0
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%, preemptions %d",
            self._prompt_tokens / elapsed_s,
            self._generation_tokens / elapsed_s,
            sched.num_running,
            sched.num_waiting,
            100 * sched.kv_cache_usage,
            100 * hit_rate,
            sched.num_preemptions_total,
        )
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix = PrefixCacheStats()
