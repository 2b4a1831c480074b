"""Paused requests (their clients read none of their outputs) make way for the others: a
paused request leaves the running set, its slot and blocks go to a waiting request, it is
not scheduled until resumed, resumed it comes back ahead of later requests and ends with
exactly the tokens of an undisturbed run; aborted while paused, it is freed.

Driven by test_scheduler.py's fake worker, which checks every step's KV against the true
prefix: a block freed while still in use, or a resumed request computed from the wrong
tokens, fails there.
"""

from __future__ import annotations

from ringllm.pipeline.core.request import RequestStatus
from tests.pipeline.core.test_scheduler import (
    Harness,
    check_all_freed,
    check_invariants,
    expected_output,
    make_request,
    make_scheduler,
)

MAX_MODEL_LEN = 64


def add_requests(h: Harness, ids: str = "abc", max_tokens: int = 12):
    requests = [
        make_request(rid, [10 + i, 20 + i, 30 + i, 40 + i, 50 + i], max_tokens, arrival=float(i))
        for i, rid in enumerate(ids)
    ]
    h.add(*requests)
    return requests


def test_a_paused_request_leaves_its_slot_to_a_waiting_one_and_resumes_exactly():
    s = make_scheduler(max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    h = Harness(s)
    a, b, c, d = add_requests(h, "abcd")
    h.step()
    h.step()
    assert s.running == [a, b] and s.waiting == [c, d]
    s.pause_requests(["a", "unknown"])
    assert a.status == RequestStatus.RUNNING  # taken at the next schedule()
    sched = h.step()  # (its invariant check: a holds no block, c took a's place)
    assert a.status == RequestStatus.PAUSED and s.paused == {"a": a}
    assert "a" not in s.kv.rows and a.num_computed_tokens == 0
    assert [n.request_id for n in sched.new_requests] == ["c"]
    assert set(sched.num_scheduled_tokens) == {"b", "c"} and s.waiting == [d]
    for _ in range(3):
        assert "a" not in h.step().num_scheduled_tokens
    s.resume_requests(["a", "b"])  # b is not paused: ignored
    assert a.status == RequestStatus.PREEMPTED  # it ran: the workers kept its row
    assert s.waiting == [a, d]  # ahead of every request that came after it
    h.run()
    for request in (a, b, c, d):
        prompt = request.prompt_token_ids
        assert h.outputs[request.request_id] == expected_output(prompt, 12, MAX_MODEL_LEN)
    assert set(h.finish_reasons.values()) == {"length"} and len(h.finish_reasons) == 4
    check_all_freed(s)


def test_a_request_paused_before_it_ran_comes_back_as_new():
    s = make_scheduler(max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    h = Harness(s)
    a, b, c = add_requests(h, max_tokens=3)
    s.pause_requests(["b"])
    h.step()
    assert b.status == RequestStatus.PAUSED and s.waiting == [c]
    s.resume_requests(["b"])
    assert b.status == RequestStatus.WAITING and s.waiting == [b, c]
    h.run()
    assert h.outputs["b"] == expected_output(b.prompt_token_ids, 3, MAX_MODEL_LEN)
    check_all_freed(s)


def test_paused_requests_leave_the_engine_idle_until_one_resumes():
    s = make_scheduler(max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    h = Harness(s)
    add_requests(h)
    h.step()
    s.pause_requests(["a", "b", "c"])
    assert s.has_work()  # the pauses are not taken yet
    assert h.step().is_empty
    assert not s.has_work() and s.has_unfinished_requests()
    assert not s.running and not s.waiting and len(s.paused) == 3
    assert s.make_stats().num_running == 0
    s.resume_requests(["c"])
    assert s.has_work()
    assert set(h.step().num_scheduled_tokens) == {"c"}


def test_an_aborted_paused_request_is_freed_and_the_workers_drop_it():
    s = make_scheduler(max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    h = Harness(s)
    a, b, c = add_requests(h)
    h.step()
    s.pause_requests(["a"])
    h.step()
    assert a.status == RequestStatus.PAUSED and "a" in h.worker.states  # its row is kept
    s.abort_requests(["a"])
    assert a.status == RequestStatus.FINISHED_ABORTED and "a" not in s.requests
    assert not s.paused
    check_invariants(s)
    assert "a" in h.step().finished_request_ids  # the workers free its row
    s.pause_requests(["b"])
    s.abort_requests(["b"])  # asked, not yet taken: the pause is forgotten with it
    h.step()
    assert not s.paused and b.status == RequestStatus.FINISHED_ABORTED
    h.run()
    assert h.finish_reasons == {"c": "length"}
    check_all_freed(s)
