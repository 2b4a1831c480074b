"""The periodic stats line: throughput, cache state and, with speculation, its acceptance."""

from __future__ import annotations

import logging

from ringllm.pipeline.frontend.stats import IterationStats, StatLogger
from ringllm.pipeline.stats import PrefixCacheStats, SchedulerStats, SpecDecodingStats


def test_the_line_sums_the_interval_and_shows_acceptance_per_position(caplog):
    logger = StatLogger(interval_s=3600.0)
    steps = [
        SpecDecodingStats(2, 8, 5, [2, 2, 1]),
        SpecDecodingStats(2, 8, 3, [2, 1]),
    ]
    for spec in steps:
        sched = SchedulerStats(2, 1, 0.25, PrefixCacheStats(10, 4), 0, spec)
        logger.record(sched, IterationStats(num_generation_tokens=6))
    logger.record(None, IterationStats(num_generation_tokens=2))  # a batch without stats
    logger.interval_s = 0.0
    with caplog.at_level(logging.INFO, logger="ringllm.stats"):
        logger.record(SchedulerStats(2, 1, 0.25), IterationStats())
    lines = [r.getMessage() for r in caplog.records]
    assert any("prefix hit rate 40.0%" in line for line in lines), lines
    spec = next(line for line in lines if line.startswith("speculative decoding"))
    # 4 drafts of 16 tokens, 8 accepted: per position 4/4, 3/4, 1/4
    assert "4 drafts, 16 draft tokens, 8 accepted (50.0%)" in spec
    assert "mean acceptance length 3.00" in spec
    assert "acceptance per position [1.00, 0.75, 0.25]" in spec


def test_no_speculation_no_line(caplog):
    logger = StatLogger(interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="ringllm.stats"):
        logger.record(SchedulerStats(1, 0, 0.1), IterationStats(num_generation_tokens=3))
    assert caplog.records and not any(
        r.getMessage().startswith("speculative") for r in caplog.records
    )
