"""core/failed_steps.py: a failed step's requests sorted into the culprit(s) to end and
the suspects to take back, and the first suspect to run alone."""

from __future__ import annotations

from ringllm.pipeline.core.failed_steps import (
    MAX_FAILED_STEPS,
    next_suspect,
    sort_out_failed,
    uncache_failed_writes,
)
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.sampling_params import SamplingParams


def req(rid: str) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams())


def test_a_lone_request_is_the_culprit_at_once():
    only = req("a")
    assert sort_out_failed([only]) == ([only], [])
    assert only.num_failed_steps == 0


def test_a_batch_becomes_suspects_until_max_failed_steps():
    a, b = req("a"), req("b")
    a.num_failed_steps = MAX_FAILED_STEPS - 1
    failed, suspects = sort_out_failed([a, b])
    assert failed == [a] and suspects == [b]
    assert (a.num_failed_steps, b.num_failed_steps) == (MAX_FAILED_STEPS, 1)


def test_next_suspect_is_the_first_waiting_one():
    waiting = [req("a"), req("b"), req("c")]
    assert next_suspect(waiting, {"c", "b"}) == 1
    assert next_suspect(waiting, {"x"}) is None


def test_what_the_failed_step_was_to_write_is_uncached_for_the_requests_left():
    class FakeKV:
        def __init__(self) -> None:
            self.uncached = []

        def uncache_from(self, request, num_tokens) -> None:
            self.uncached.append((request.request_id, num_tokens))

    a = req("a")
    a.num_computed_tokens = 3
    kv = FakeKV()
    ids = uncache_failed_writes({"a": 2, "gone": 1}, {"a": a}, kv)
    assert ids == ["a"] and kv.uncached == [("a", 1)]
