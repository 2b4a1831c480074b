"""`bench tiers`, part two: a multi-turn chat workload whose KV outgrows the device cache.

The requests are `bench serve`'s `--dataset multi-turn` (tools/bench/datasets/multi_turn.py):
conversations interleaved turn by turn, each turn's prompt the conversation so far plus
a new user message, so between two turns of one conversation all the others pass through
the cache. They go to an in-process engine the way `bench serve --max-concurrency K`
sends them: strictly in order, at most K in flight, and (so that a turn can find its
history) a turn only once its conversation's previous turn has finished. The device
cache holds (K + 1) requests of the longest turn (`--multi-turn-gpu-blocks`), several
times less than the conversations' KV (`prefix_blocks`, in the result).

Three configurations, built alike but for their tiers, run the same requests, the prefix
cache and tiers emptied before each run, configurations alternating run by run:

    none        --swap-space 0: only the device cache (what ringllm did before the tiers)
    host        --swap-space GiB: evicted prefix blocks kept in host memory, loaded back
    host+disk   a smaller host tier (--disk-swap-space) in front of a disk tier in a
                temporary folder (--kv-offload-dir's, deleted after), --kv-offload-max-gib

Per request: TTFT (from `add_request` to the `LLMEngine.step()` that returns its first
token: the in-process client's view, like `bench serve`'s first chunk) and the prompt
tokens the engine found cached. Per run: hit rate (cached / prompt tokens), median and
P99 TTFT, hits per tier (the core's own counts, `tier_probes.TierTotals`) and the
worker's copy time. The figures are medians over the runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ringllm.tools.bench.report import summarize
from ringllm.tools.bench.tier_probes import CopyTimer, TierTotals

CHAT_CONFIGS = ("none", "host", "host+disk")


def run_conversations(
    llm, prompts: list[list[int]], num_conversations: int, output_len: int, max_concurrency: int
) -> list[dict[str, Any]]:
    """Every prompt through `llm.llm_engine`, at most `max_concurrency` in flight; request
    i waits for request i - num_conversations (its conversation's previous turn)."""
    from ringllm.pipeline import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    pending = list(range(len(prompts)))
    in_flight: dict[str, int] = {}
    done: set[int] = set()
    records = [{"turn": i // num_conversations} for i in range(len(prompts))]
    tag = f"chat-{time.monotonic_ns()}"
    while pending or in_flight:
        while len(in_flight) < max_concurrency:
            if not pending:
                break
            ready = pending[0]
            if ready >= num_conversations and ready - num_conversations not in done:
                break  # strictly in order: the next turn waits for its conversation
            pending.pop(0)
            request_id = f"{tag}-{ready}"
            records[ready]["submit_s"] = time.perf_counter()
            engine.add_request(request_id, {"prompt_token_ids": prompts[ready]}, params)
            in_flight[request_id] = ready
        outputs = engine.step()
        now_s = time.perf_counter()
        for out in outputs:
            index = in_flight.get(out.request_id)
            if index is None:
                continue
            record = records[index]
            if "ttft_s" not in record and out.outputs[0].token_ids:
                record["ttft_s"] = now_s - record["submit_s"]
            if out.finished:
                record["prompt_len"] = len(out.prompt_token_ids)
                record["cached_tokens"] = out.num_cached_tokens
                record["output_len"] = len(out.outputs[0].token_ids)
                done.add(in_flight.pop(out.request_id))
    return records


def run_chat_once(
    llm,
    timer: CopyTimer,
    totals: TierTotals,
    prompts: list[list[int]],
    num_conversations: int,
    output_len: int,
    max_concurrency: int,
    percentiles: list[float],
    block_size: int,
    kv_groups: int = 1,
) -> dict[str, Any]:
    """One run of the workload on an emptied cache: its figures and per-request lists.
    `kv_groups` > 1 (a sliding-window model): a tier's hits are blocks of one layer group,
    not of every layer, so they are not turned into tokens."""
    llm.reset_prefix_cache()
    counts_before, copies_before = totals.snapshot(), len(timer.calls)
    start_s = time.perf_counter()
    records = run_conversations(llm, prompts, num_conversations, output_len, max_concurrency)
    duration_s = time.perf_counter() - start_s
    counts = totals.counts_since(counts_before)
    ttfts_ms = [1e3 * r["ttft_s"] for r in records]
    prompt_tokens = sum(r["prompt_len"] for r in records)
    cached_tokens = sum(r["cached_tokens"] for r in records)
    result: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens,
        "host_hit_blocks": counts["host_hits"],
        "disk_hit_blocks": counts["disk_hits"],
        "host_blocks_in": counts["host_blocks_in"],
        "disk_blocks_in": counts["disk_blocks_in"],
        "num_preemptions": counts["num_preemptions"],
        **timer.totals_since(copies_before),
    }
    if kv_groups == 1:
        host_tokens = block_size * counts["host_hits"]
        disk_tokens = block_size * counts["disk_hits"]
        result["device_hit_tokens"] = counts["prefix_hits"] - host_tokens - disk_tokens
        result["host_hit_tokens"] = host_tokens
        result["disk_hit_tokens"] = disk_tokens
    result.update(summarize("ttft_ms", ttfts_ms, percentiles))
    turns = max(r["turn"] for r in records) + 1
    result["median_ttft_ms_by_turn"] = [
        float(np.median([t for t, r in zip(ttfts_ms, records, strict=True) if r["turn"] == turn]))
        for turn in range(turns)
    ]
    result["ttfts_ms"] = ttfts_ms
    result["cached_tokens_per_request"] = [r["cached_tokens"] for r in records]
    return result


def chat_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over runs of every figure (lists: element-wise for the per-turn TTFTs)."""
    summary: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float):
            summary[key] = float(np.median([r[key] for r in runs]))
    summary["median_ttft_ms_by_turn"] = np.median(
        [r["median_ttft_ms_by_turn"] for r in runs], axis=0
    ).tolist()
    summary["runs"] = runs
    return summary
