"""/metrics: the engine's statistics in Prometheus text format, named as vLLM names them.

Each served model has one `ServerMetrics` with its own `CollectorRegistry` (two servers in
one process never share or collide on metrics; a server of several models renders theirs as
one exposition: `render_merged`). The engine feeds it through
`AsyncLLM.add_stat_listener` once per engine step:

    SchedulerStats  -> gauges num_requests_running / num_requests_waiting /
                       kv_cache_usage_perc (a fraction in [0, 1], as vLLM's);
                       counters prefix_cache_queries / prefix_cache_hits (per-step counts)
                       and num_preemptions (the core reports a running total: we add
                       the increase); speculative decoding: counters
                       spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens
                       and _num_accepted_tokens_per_pos{position}; the KV tiers:
                       gauge num_requests_swapped, counters num_swaps /
                       swapped_out_blocks / swapped_in_blocks (running totals: the
                       increase), and per tier{tier="host"|"disk"} gauges kv_tier_blocks /
                       kv_tier_usage_perc, counters kv_tier_queries / kv_tier_hits (blocks
                       looked up there / found) and kv_tier_blocks_in / _out
    IterationStats  -> counters prompt_tokens / generation_tokens; histograms
                       time_to_first_token_seconds, inter_token_latency_seconds,
                       e2e_request_latency_seconds, request_queue_time_seconds

request_success{finished_reason} is counted by the HTTP handlers, which see how every
choice ends (including "abort" when its client went away).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from ringllm.pipeline.frontend.stats import IterationStats
from ringllm.pipeline.stats import SchedulerStats

PREFIX = "ringllm:"
# Bucket bounds in seconds (vLLM's, trimmed): token latencies are ms..s, requests s..min.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                     50.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._last_preemptions_total = 0
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests running in a step.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by requests (0..1)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.engine_restarts = counter(
            "engine_restarts", "Engine core processes restarted after dying (requests replayed)."
        )
        self._last_restarts_total = 0
        self.engine_sleep_level = gauge(
            "engine_sleep_level", "Sleep mode: 0 awake, 1 weights offloaded, 2 weights dropped."
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: request steps that verified drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position (0 first).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Requests swapped out to the host KV tier."
        )
        self._swap_totals = [
            counter("num_swaps", "Preemptions by swap to the host KV tier."),
            counter("swapped_out_blocks", "KV blocks copied to the host tier by swap-outs."),
            counter("swapped_in_blocks", "KV blocks copied back by swap-ins."),
        ]
        self._last_swap_totals = [0, 0, 0]

        def tier_metric(kind, name: str, doc: str):
            return kind(PREFIX + name, doc, ["model_name", "tier"], registry=self.registry)

        self._tier_blocks = tier_metric(Gauge, "kv_tier_blocks", "KV blocks a tier holds.")
        self._tier_usage = tier_metric(
            Gauge, "kv_tier_usage_perc", "Fraction of a KV tier's blocks in use (0..1)."
        )
        self._tier_counts = {
            "queries": tier_metric(
                Counter, "kv_tier_queries", "KV blocks looked up in a tier (misses above it)."
            ),
            "hits": tier_metric(Counter, "kv_tier_hits", "KV blocks found in a tier."),
            "blocks_in": tier_metric(Counter, "kv_tier_blocks_in", "KV blocks written to a tier."),
            "blocks_out": tier_metric(
                Counter, "kv_tier_blocks_out", "KV blocks loaded back from a tier."
            ),
        }
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests (choices), by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft_s = histogram(
            "time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS_S
        )
        self.itl_s = histogram(
            "inter_token_latency_seconds", "Time between two tokens.", ITL_BUCKETS_S
        )
        self.e2e_s = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS_S
        )
        self.queue_s = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS_S
        )

    def record(self, sched: SchedulerStats | None, iteration: IterationStats) -> None:
        """The stat listener: called once per engine step with its statistics."""
        if sched is not None:
            self.num_requests_running.set(sched.num_running)
            self.num_requests_waiting.set(sched.num_waiting)
            self.kv_cache_usage.set(sched.kv_cache_usage)
            self.prefix_cache_queries.inc(sched.prefix_cache.queries)
            self.prefix_cache_hits.inc(sched.prefix_cache.hits)
            new_preemptions = sched.num_preemptions_total - self._last_preemptions_total
            if new_preemptions > 0:
                self.num_preemptions.inc(new_preemptions)
            self._last_preemptions_total = sched.num_preemptions_total
            spec = sched.spec_decoding
            if spec is not None:
                self.spec_decode_num_drafts.inc(spec.num_drafts)
                self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
                self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
                for position, count in enumerate(spec.accepted_per_pos):
                    self._spec_per_pos.labels(self.model_name, str(position)).inc(count)
            if sched.kv_tiers is not None:
                self._record_tiers(sched.kv_tiers)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for histogram, values in (
            (self.ttft_s, iteration.ttfts_s),
            (self.itl_s, iteration.inter_token_latencies_s),
            (self.e2e_s, iteration.e2e_latencies_s),
            (self.queue_s, iteration.queue_times_s),
        ):
            for value in values:
                histogram.observe(value)

    def _record_tiers(self, tiers) -> None:
        self.num_requests_swapped.set(tiers.num_swapped)
        totals = [
            tiers.num_swaps_total,
            tiers.blocks_swapped_out_total,
            tiers.blocks_swapped_in_total,
        ]
        for counter, last, total in zip(
            self._swap_totals, self._last_swap_totals, totals, strict=True
        ):
            if total > last:
                counter.inc(total - last)
        self._last_swap_totals = totals
        for name, tier in (("host", tiers.host), ("disk", tiers.disk)):
            if tier is None:
                continue
            self._tier_blocks.labels(self.model_name, name).set(tier.num_blocks)
            usage = tier.blocks_used / tier.num_blocks if tier.num_blocks else 0.0
            self._tier_usage.labels(self.model_name, name).set(usage)
            for field, counter in self._tier_counts.items():
                counter.labels(self.model_name, name).inc(getattr(tier, field))

    def count_finished(self, finished_reason: str, count: int = 1) -> None:
        if count > 0:
            self._request_success.labels(self.model_name, finished_reason).inc(count)

    def count_restarts(self, total: int) -> None:
        """The engine's restart total (AsyncLLM.num_restarts), as a counter."""
        if total > self._last_restarts_total:
            self.engine_restarts.inc(total - self._last_restarts_total)
            self._last_restarts_total = total

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


def render_merged(metrics: list[ServerMetrics]) -> bytes:
    """Several models' metrics as one exposition: each family once, its samples from every
    model (their `model_name` labels tell them apart)."""
    if len(metrics) == 1:
        return metrics[0].render()
    families: dict[str, Metric] = {}
    for one in metrics:
        for family in one.registry.collect():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(family.samples)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
