"""The front end's view of each step (`IterationStats`: tokens, TTFTs, latencies it saw)
and a throttled logger of both that and the core's `SchedulerStats`.

The server's /metrics reads the same objects; the logger prints one line at most every
`interval_s` seconds, so logging costs nothing on the hot path between lines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ringllm.pipeline.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats, TierStats

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
        self._spec: SpecDecodingStats | None = None
        self._tiers: dict[str, TierStats] = {}  # KV tiers, summed since the last line
        self._last_sched: SchedulerStats | None = None

    def record(self, sched: SchedulerStats | None, iteration: IterationStats) -> None:
        """One step; `sched` None: the core sent no new statistics (the last are shown)."""
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        if sched is None:
            sched = self._last_sched
            if sched is None:
                return
        else:
            self._last_sched = sched
            self._count(sched)
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._log(sched, now - self._last_log)
            self._last_log = now

    def _count(self, sched: SchedulerStats) -> None:
        self._prefix.queries += sched.prefix_cache.queries
        self._prefix.hits += sched.prefix_cache.hits
        if sched.spec_decoding is not None:
            self._spec = self._spec or SpecDecodingStats()
            self._spec.add(sched.spec_decoding)
        if sched.kv_tiers is not None:
            self._count_tiers(sched.kv_tiers)

    def _count_tiers(self, tiers) -> None:
        for name, tier in (("host", tiers.host), ("disk", tiers.disk)):
            if tier is not None:
                self._tiers.setdefault(name, TierStats()).add(tier)

    def _log_tiers(self, tiers) -> None:
        parts = []
        for name, tier in self._tiers.items():
            rate = tier.hits / tier.queries if tier.queries else 0.0
            usage = tier.blocks_used / tier.num_blocks if tier.num_blocks else 0.0
            parts.append(
                f"{name} tier {100 * usage:.1f}% used, hit rate {100 * rate:.1f}%, "
                f"{tier.blocks_in} blocks in, {tier.blocks_out} out"
            )
        logger.info(
            "KV tiers: %d swapped, %d swaps (%d blocks out, %d in)%s",
            tiers.num_swapped,
            tiers.num_swaps_total,
            tiers.blocks_swapped_out_total,
            tiers.blocks_swapped_in_total,
            "".join(f"; {p}" for p in parts),
        )
        self._tiers = {}

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
        tiers = sched.kv_tiers
        if tiers is not None:
            self._log_tiers(tiers)
        if self._spec is not None:
            spec = self._spec
            rate = spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0
            mean_len = 1 + spec.num_accepted_tokens / spec.num_drafts if spec.num_drafts else 0
            per_pos = (
                ", ".join(f"{count / spec.num_drafts:.2f}" for count in spec.accepted_per_pos)
                if spec.num_drafts
                else "-"
            )
            logger.info(
                "speculative decoding: %d drafts, %d draft tokens, %d accepted (%.1f%%), mean "
                "acceptance length %.2f, acceptance per position [%s]",
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                100 * rate,
                mean_len,
                per_pos,
            )
            self._spec = SpecDecodingStats()
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix = PrefixCacheStats()
