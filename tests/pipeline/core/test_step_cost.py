"""The step-cost model (core/step_cost.py) and the scheduler's inter-token target: prompt
tokens beside decoding requests stop where the fitted cost would pass the target, decodes
are never crowded out by a prompt chunk, and the outputs stay exact."""

from __future__ import annotations

import random

import pytest

from ringllm.pipeline.config import AUTO_ITL_FACTOR, CacheConfig, SchedulerConfig
from ringllm.pipeline.core.scheduler import MIN_PREFILL_CHUNK, Scheduler
from ringllm.pipeline.core.step_cost import StepCost
from tests.pipeline.core.test_scheduler import (
    BS,
    Harness,
    check_all_freed,
    expected_output,
    make_request,
    random_prompt,
)


def test_fit_recovers_the_line_and_answers_the_budget():
    cost = StepCost()
    for tokens in (1, 16, 40, 7, 64, 3):
        cost.observe(tokens, 0.020 + 0.001 * tokens)
    a, b = cost.fit()
    assert a == pytest.approx(0.020) and b == pytest.approx(0.001)
    assert cost.tokens_within(0.050) == 30
    assert cost.tokens_within(0.010) == 0  # not even an empty step fits


def test_no_answer_without_spread_or_with_a_senseless_slope():
    cost = StepCost()
    assert cost.tokens_within(1.0) is None
    for _ in range(10):
        cost.observe(16, 0.03)  # decode-only steps: one size, no slope
    assert cost.tokens_within(1.0) is None
    falling = StepCost()
    for tokens in (1, 50, 100):
        falling.observe(tokens, 0.1 - 0.0005 * tokens)  # noise on a busy machine
    assert falling.fit() is None
    bad = StepCost()
    for sample in ((0, 1.0), (5, 0.0), (5, -1.0), (5, float("nan")), (5, float("inf"))):
        bad.observe(*sample)
    assert not bad.samples


def test_the_window_follows_a_changed_cost():
    cost = StepCost(window=16)
    for tokens in range(1, 17):
        cost.observe(tokens, 0.01 + 0.001 * tokens)
    for tokens in range(1, 17):
        cost.observe(tokens, 0.01 + 0.004 * tokens)  # the context grew, or the CPU slowed
    assert cost.fit()[1] == pytest.approx(0.004)


def make(target: str, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, target_itl=target),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        128,
        128,
    )


def teach(s: Scheduler, a: float, b: float, decode_step_s: float | None = None) -> None:
    for tokens in (1, 8, 32, 64):
        s.step_cost.observe(tokens, a + b * tokens)
    if decode_step_s is not None:
        s.step_cost.observe(2, decode_step_s, decodes=2)


def test_prompt_tokens_beside_decodes_stop_at_the_target():
    s = make("40")
    teach(s, a=0.010, b=0.001)  # 40 ms fits 30 tokens
    h = Harness(s)
    h.add(make_request("d1", [11, 12, 13], max_tokens=20), make_request("d2", [14], 20))
    first = h.step()
    assert first.total_num_scheduled_tokens == 4  # nobody decodes yet: no cap
    long_prompt = list(range(200, 300))
    h.add(make_request("long", long_prompt, max_tokens=2))
    chunks = []
    while "long" not in h.outputs:
        sched = h.step()
        assert sched.num_scheduled_tokens["d1"] == sched.num_scheduled_tokens["d2"] == 1
        assert sched.total_num_scheduled_tokens <= 30
        chunks.append(sched.num_scheduled_tokens["long"])
    assert chunks == [28, 28, 28, 16]
    h.run()
    assert h.outputs["long"] == expected_output(long_prompt, 2, 128)
    check_all_freed(s)


def test_a_tight_target_still_moves_prompts_and_none_means_the_budget():
    s = make("5ms")
    teach(s, a=0.010, b=0.001)  # not even a decode step fits in 5 ms
    h = Harness(s)
    h.add(make_request("d", [11], max_tokens=30))
    h.step()
    h.add(make_request("p", list(range(300, 340)), max_tokens=2))
    sched = h.step()
    assert sched.num_scheduled_tokens["p"] == MIN_PREFILL_CHUNK
    off = make("off")
    teach(off, a=0.010, b=0.001)
    h = Harness(off)
    h.add(make_request("d", [11], max_tokens=30))
    h.step()
    h.add(make_request("p", list(range(300, 340)), max_tokens=2))
    assert h.step().num_scheduled_tokens["p"] == 40  # the token budget alone


def test_a_running_prompt_chunk_leaves_the_decodes_their_tokens():
    """Without a target too: a prompt chunk earlier in the running order than a decoding
    request takes what the decodes leave, not the whole budget."""
    s = make("off", budget=16)
    h = Harness(s)
    h.add(make_request("late", [21, 22], max_tokens=10, arrival=2.0))
    h.step()  # late's prompt
    h.add(make_request("long", list(range(400, 460)), max_tokens=3, arrival=1.0))
    h.step()  # long admitted, now first in the running order (it arrived first)
    assert [r.request_id for r in s.running] == ["long", "late"]
    chunks = []
    while "long" not in h.outputs:
        sched = h.step()
        assert sched.num_scheduled_tokens["late"] == 1  # late decodes every step
        chunks.append(sched.num_scheduled_tokens["long"])
    assert chunks[:-1] == [15] * (len(chunks) - 1)
    h.run()
    assert h.outputs["late"] == expected_output([21, 22], 10, 128)
    check_all_freed(s)


def first_chunk_beside_two_decodes(s: Scheduler) -> int:
    h = Harness(s)
    h.add(make_request("d1", [11, 12, 13], max_tokens=20), make_request("d2", [14], 20))
    h.step()
    h.add(make_request("p", list(range(500, 560)), max_tokens=2))
    return h.step().num_scheduled_tokens["p"]


def test_auto_takes_a_multiple_of_the_decodes_alone():
    s = make("auto")
    teach(s, a=0.010, b=0.001)
    assert first_chunk_beside_two_decodes(s) == 60  # no decode step measured yet: no cap
    s = make("auto")
    teach(s, a=0.020, b=0.0005, decode_step_s=0.021)  # on the line: the fit stays exact
    assert AUTO_ITL_FACTOR == 1.5
    assert first_chunk_beside_two_decodes(s) == 23 - 2  # 1.5 x 21 ms: 23 tokens in all
    s = make("3x")
    teach(s, a=0.010, b=0.001, decode_step_s=0.012)
    assert first_chunk_beside_two_decodes(s) == 26 - 2  # 3 x 12 ms: 26 tokens in all
    s = make("3x")
    teach(s, a=0.010, b=0.001, decode_step_s=0.012)
    s.step_cost.observe(2, 0.014, decodes=2)
    s.step_cost.observe(1, 0.008, decodes=1)  # of 8, 12 and 14 ms, sorted[int(0.9 * 2)]: 12
    assert first_chunk_beside_two_decodes(s) == 26 - 2
    # one slow step among many does not set the target: the 90th percentile of the
    # window's steps of decodes alone, not the longest
    s = make("3x")
    teach(s, a=0.010, b=0.001)
    for _ in range(19):
        s.step_cost.observe(2, 0.012, decodes=2)  # on the line
    s.step_cost.observe(2, 0.040, decodes=2)  # one outlier
    assert s.step_cost.decodes_alone_s == 0.012  # sorted[int(0.9 * 19)]
    a, b = s.step_cost.fit()
    assert first_chunk_beside_two_decodes(s) == int((3 * 0.012 - a) / b + 1e-6) - 2 < 60


@pytest.mark.parametrize("bad", ["", "fast", "0", "-5", "nan", "inf", "ms", "0.5x", "x", "twox"])
def test_a_bad_target_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="target_itl: "):
        SchedulerConfig(target_itl=bad)
    assert SchedulerConfig(target_itl="1.5X").itl_target == ("auto", 1.5)
    assert SchedulerConfig(target_itl=" 80ms ").itl_target == ("ms", 80.0)


def test_random_workload_stays_exact_under_a_target():
    rng = random.Random(3)
    s = make("30", budget=48)
    teach(s, a=0.008, b=0.0007)
    h = Harness(s)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(1, 60)) for i in range(24)}
    limits = {rid: rng.randint(1, 16) for rid in prompts}
    for rid, prompt in prompts.items():
        h.add(make_request(rid, prompt, limits[rid]))
        if rng.random() < 0.5:
            h.step()
    h.run()
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == expected_output(prompt, limits[rid], 128)
    check_all_freed(s)


def test_decodes_and_prompt_tokens_are_fitted_apart():
    """A decode costs 2 ms, a prompt token 0.2 ms: one slope for both would let a step of
    16 decodes take too many prompt tokens; the split fit answers exactly."""
    cost = StepCost()
    assert cost.prompt_tokens_within(0.05, 16) is None
    for decodes, prompts in ((16, 0), (16, 48), (8, 64), (15, 10), (4, 0), (12, 30), (2, 60)):
        tokens = decodes + prompts
        cost.observe(tokens, 0.010 + 0.002 * decodes + 0.0002 * prompts, decodes)
    a, b_d, b_p = cost.split_fit()
    assert (a, b_d, b_p) == pytest.approx((0.010, 0.002, 0.0002))
    assert cost.prompt_tokens_within(0.050, 16) == 40  # (50 - 10 - 32) ms / 0.2 ms
    assert cost.prompt_tokens_within(0.040, 16) == 0
    one_slope = cost.tokens_within(0.050) - 16
    assert one_slope > 40  # what the single line would have let in


def test_without_split_samples_the_one_slope_answers():
    cost = StepCost()
    for tokens in (1, 16, 40, 7, 64, 3):
        cost.observe(tokens, 0.020 + 0.001 * tokens)
    assert cost.split_fit() is None
    assert cost.prompt_tokens_within(0.050, 10) == 20


def test_a_served_load_with_alike_decode_counts_still_gets_a_split_fit():
    """Steps of 14-16 decodes beside prompt chunks (a server at its concurrency): the
    decodes' own slope comes out below zero from the noise, so their cost is fitted into
    the fixed part instead of refusing the split fit."""
    cost = StepCost()
    rng = random.Random(5)
    for _ in range(48):
        decodes, prompts = rng.choice((14, 15, 16)), rng.choice((0, 0, 24, 40, 64))
        noise = 0.002 if decodes == 14 else 0.0  # the smallest batches ran slowest
        cost.observe(decodes + prompts, 0.015 + 0.0003 * prompts + noise, decodes)
    a, b_d, b_p = cost.split_fit()
    assert b_d == 0.0 and b_p == pytest.approx(0.0003, rel=0.1)
    assert 0.015 <= a <= 0.017
    assert cost.prompt_tokens_within(0.030, 15) is not None


def test_the_margin_keeps_most_steps_with_prompts_within_the_target():
    """Half of the steps run past a least-squares line: the answer leaves room for the
    90th percentile of how far the window's steps with prompt tokens ran past it."""
    cost = StepCost()
    overruns = [0.0, 0.001, 0.002, 0.003, 0.004, -0.001, -0.002, -0.003, -0.004, 0.0] * 3
    prompts = [8, 16, 24, 32, 40, 48] * 5
    for over, p in zip(overruns, prompts, strict=True):
        cost.observe(16 + p, 0.010 + 0.001 * 16 + 0.0002 * p + over, 16)
    for decodes in (4, 8, 12):
        cost.observe(decodes, 0.010 + 0.001 * decodes, decodes)
    a, b_d, b_p = cost.split_fit()
    predicted = [a + b_d * 16 + b_p * p for p in prompts]
    runs = sorted(
        0.010 + 0.016 + 0.0002 * p + over - pred
        for over, p, pred in zip(overruns, prompts, predicted, strict=True)
    )
    assert cost.margin_s == pytest.approx(runs[int(0.9 * (len(runs) - 1))])
    assert 0.002 < cost.margin_s < 0.005
    room = 0.040 - cost.margin_s - a - b_d * 16
    assert cost.prompt_tokens_within(0.040, 16) == int(room / b_p + 1e-6)
    assert cost.prompt_tokens_within(0.040, 16) < int((0.040 - a - b_d * 16) / b_p)


def test_only_recent_steps_of_decodes_alone_set_the_multiple():
    """A server's first, cold steps must not hold the target up once a steady load makes
    most steps carry a prompt: only the steps of decodes alone among the last `window`
    count, and with none of them recent the split fit gives the decodes' cost."""
    cost = StepCost(window=16)
    for _ in range(8):
        cost.observe(16, 0.030, decodes=16)  # cold
    assert cost.decodes_alone_s == 0.030
    for i in range(16):  # a steady load: every step takes a prompt chunk
        cost.observe(16 + 8 * (i % 4 + 1), 0.010 + 0.0005 * 16 + 0.0002 * 8 * (i % 4 + 1), 16)
    a, b_d, _ = cost.split_fit()
    assert cost.decodes_alone_s == pytest.approx(a + b_d * 16)
    assert cost.decodes_alone_s < 0.020
    cost.observe(16, 0.017, decodes=16)
    cost.observe(12, 0.015, decodes=12)
    assert cost.decodes_alone_s == 0.015  # sorted[int(0.9 * 1)] of the recent two
