"""core/scheduling_policy.py: which waiting request is admitted next, which running request
is preempted, and which sequence a starved group takes the place of."""

from __future__ import annotations

from collections import Counter

from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduling_policy import (
    FAIR_SCAN,
    fair_share_victim,
    next_waiting,
    pick_victim,
)
from ringllm.pipeline.sampling_params import SamplingParams


def req(rid: str, group: str | None = None) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(), group_id=group)


def test_next_waiting_is_the_first_unless_fair_share_finds_a_group_holding_fewer():
    waiting = [req("a1", "a"), req("a2", "a"), req("b1", "b"), req("c1", "c")]
    counts = Counter({"a": 3, "b": 1})
    assert next_waiting(waiting, counts, fair=False) == 0
    assert next_waiting(waiting, counts, fair=True) == 3  # "c" holds none
    assert next_waiting(waiting[:3], counts, fair=True) == 2  # "b" holds fewest
    assert next_waiting(waiting[:2], counts, fair=True) == 0  # arrival order among equals


def test_next_waiting_looks_at_only_the_first_fair_scan_requests():
    waiting = [req(f"a{i}", "a") for i in range(FAIR_SCAN)] + [req("b1", "b")]
    assert next_waiting(waiting, Counter({"a": 1}), fair=True) == 0


def test_the_victim_is_the_last_or_the_last_of_the_biggest_group_never_one_in_flight():
    running = [req("a1", "a"), req("a2", "a"), req("b1", "b")]
    counts = Counter({"a": 2, "b": 1})
    assert pick_victim(running, counts, fair=False, in_flight=()).request_id == "b1"
    assert pick_victim(running, counts, fair=True, in_flight=()).request_id == "a2"
    assert pick_victim(running, counts, fair=True, in_flight={"a2"}).request_id == "a1"
    assert pick_victim(running, counts, fair=False, in_flight={"a1", "a2", "b1"}) is None


def test_a_starved_group_takes_a_sequence_of_a_group_holding_two_or_more():
    running = [req("a1", "a"), req("a2", "a"), req("b1", "b")]
    counts = Counter({"a": 2, "b": 1})
    assert fair_share_victim(running, counts, in_flight=()).request_id == "a2"
    assert fair_share_victim(running, counts, in_flight={"a2"}).request_id == "a1"
    assert fair_share_victim(running, counts, in_flight={"a1", "a2"}) is None
    assert fair_share_victim(running[2:], Counter({"b": 1}), in_flight=()) is None
    assert fair_share_victim([], Counter(), in_flight=()) is None
