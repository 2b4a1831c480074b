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
class TierStats:
    """One KV tier behind the device's cache (core/kv_tiers.py): its size and use now, and
    counts since the last report: blocks looked up there (misses above it), found, written
    in, loaded back out."""

    num_blocks: int = 0
    blocks_used: int = 0
    queries: int = 0
    hits: int = 0
    blocks_in: int = 0
    blocks_out: int = 0

    FIELDS = ("num_blocks", "blocks_used", "queries", "hits", "blocks_in", "blocks_out")

    def values(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def take(self) -> TierStats:
        out = TierStats(*self.values())
        self.queries = self.hits = self.blocks_in = self.blocks_out = 0
        return out

    def add(self, other: TierStats) -> None:
        """Counts summed, sizes taken (another interval of the same tier) or summed by the
        caller (several engines)."""
        self.num_blocks, self.blocks_used = other.num_blocks, other.blocks_used
        self.queries += other.queries
        self.hits += other.hits
        self.blocks_in += other.blocks_in
        self.blocks_out += other.blocks_out


@dataclass
class KVTierStats:
    """Swap preemption and the KV tiers: requests swapped out now, totals since the start,
    and each tier's `TierStats` (disk None: no disk tier)."""

    num_swapped: int = 0
    num_swaps_total: int = 0
    blocks_swapped_out_total: int = 0
    blocks_swapped_in_total: int = 0
    host: TierStats = field(default_factory=TierStats)
    disk: TierStats | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding, counted since the last report (vLLM's spec_decode_* names):
    steps that verified drafts, drafts verified, of those accepted, and accepted at each
    draft position (position 0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, count in enumerate(other.accepted_per_pos):
            if i == len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[i] += count

    def take(self) -> SpecDecodingStats:
        """Returns the counts so far and starts new ones."""
        out = SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = []
        return out


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions_total: int = 0
    spec_decoding: SpecDecodingStats | None = None  # None: speculation is off
    kv_tiers: KVTierStats | None = None  # None: no host tier (--swap-space 0)
