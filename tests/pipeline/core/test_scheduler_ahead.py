"""Async scheduling: the scheduler plans step N+1 while step N is in flight, scheduling the
requests of step N again before their tokens are back (`async_scheduling`).

One fake worker (test_scheduler_in_flight.py's FakeStage, sampling) keeps each request's
state from the diffs alone, appends the tokens it samples itself (the core sends none), and
checks on every step that the tokens it computes are the request's true tokens and that its
cache reads back the true prefix. It runs a batch only when the engine takes it in, after
the next batch was planned: the widest interleaving async scheduling allows, so a token
scheduled before its position is known, a block reused or hit too early, or a request
scheduled past its end shows up as a failed check or a wrong output.
"""

from __future__ import annotations

import collections
import random

import pytest

from ringllm.pipeline.core.request import RequestStatus
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.pipeline.core.test_scheduler import (
    check_all_freed,
    check_invariants,
    expected_output,
    make_request,
    make_scheduler,
    random_prompt,
)
from tests.pipeline.core.test_scheduler_in_flight import FakeStage, _cache_config


def ahead_scheduler(**kwargs) -> Scheduler:
    template = make_scheduler(**kwargs)
    return Scheduler(
        template.config,
        _cache_config(template),
        template.max_model_len,
        template.kv.num_blocks,
        pipeline_depth=2,
        async_scheduling=True,
    )


class AheadHarness:
    """Steps the scheduler as EngineCore._step_ahead does."""

    def __init__(self, scheduler: Scheduler, failing: frozenset[str] = frozenset()) -> None:
        self.s = scheduler
        self.failing = failing  # a batch holding one of these raises (after its diffs)
        self.errors: dict[str, str | None] = {}
        self.worker = FakeStage(scheduler.kv.num_blocks, samples=True)
        self.queue: collections.deque[SchedulerOutput] = collections.deque()
        self.outputs: dict[str, list[int]] = collections.defaultdict(list)
        self.finished: set[str] = set()
        self.num_ahead = 0  # steps of requests scheduled while their step before was in flight
        self.num_overlapped = 0  # batches planned while another was in flight

    def _submit(self) -> bool:
        s = self.s
        before = {rid for sched in self.queue for rid in sched.num_scheduled_tokens}
        sched = s.schedule()
        check_invariants(s)
        assert sched.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        if sched.is_empty:
            return False
        ahead = before & set(sched.num_scheduled_tokens)
        self.num_ahead += len(ahead)
        self.num_overlapped += bool(self.queue)
        for rid in ahead:
            request = s.requests[rid]
            assert not s.suspects, "scheduled ahead while suspects wait"
            assert request.num_in_flight == 2 and request.status == RequestStatus.RUNNING
            assert request.num_output_tokens + request.num_placeholders <= request.max_tokens
        self.queue.append(sched)
        return True

    def _take_in(self) -> None:
        sched = self.queue.popleft()
        sampled = self.worker.run(sched)
        ids = list(sched.num_scheduled_tokens)
        if self.failing & set(ids):
            outs = self.s.step_failed(sched, "boom")
        else:
            outs = self.s.update_from_output(
                sched, ModelRunnerOutput(ids, sampled, [None] * len(ids))
            )
        for out in outs:
            if out.error is not None:
                self.errors[out.request_id] = out.error
            assert out.request_id not in self.finished
            if out.error is None:
                self.outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                self.finished.add(out.request_id)
        check_invariants(self.s)

    def step(self) -> None:
        if not self.queue and not self._submit():
            return
        if len(self.queue) == 1 and self.s.can_schedule_ahead():
            self._submit()
        self._take_in()

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests() and not self.queue:
                assert not self.s.in_flight
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def add(s: Scheduler, truth: dict, rid: str, prompt: list[int], max_tokens: int) -> None:
    """Adds a request and what it makes alone (its outputs) to `truth`."""
    s.add_request(make_request(rid, prompt, max_tokens))
    truth[rid] = expected_output(prompt, max_tokens, s.max_model_len)


def truth_of(prompt: list[int], max_tokens: int, max_model_len: int, stop: int | None):
    out = expected_output(prompt, max_tokens, max_model_len)
    if stop is not None and stop in out:
        out = out[: out.index(stop) + 1]
    return out


def test_decodes_run_every_step_with_the_next_planned_while_one_runs():
    """Steady decoding: every request is in every batch, each planned while the one before
    runs, and the outputs are exact."""
    s = ahead_scheduler(max_num_batched_tokens=64)
    h = AheadHarness(s)
    rng = random.Random(1)
    truth = {}
    for i in range(6):
        add(s, truth, f"r{i}", random_prompt(rng, 6), 12)
    h.run()
    assert h.outputs == truth
    # one prefill step, then 11 decode steps each of all six, all but the first ahead
    assert h.num_ahead == 6 * 11
    check_all_freed(s)


def test_a_stop_in_flight_costs_one_token_and_emits_nothing_past_it():
    """A request that its step in flight stops (a stop token) was already scheduled once
    more: that step's token is computed and dropped, nothing past the stop goes out, and
    its blocks are freed once; a request at its max_tokens is not scheduled ahead."""
    s = ahead_scheduler(max_num_batched_tokens=64)
    h = AheadHarness(s)
    rng = random.Random(2)
    prompt = random_prompt(rng, 7)
    full = expected_output(prompt, 10, s.max_model_len)
    stop = full[4]
    s.add_request(make_request("stops", prompt, 10, stop_token_ids=[stop]))
    s.add_request(make_request("capped", list(prompt), 3))
    h.run()
    assert h.outputs["stops"] == full[: full.index(stop) + 1]
    assert h.outputs["capped"] == full[:3]
    # what the worker still holds, it is told to drop with the next step that runs
    assert set(h.worker.states) <= s.view.finished_ids
    check_all_freed(s)


def test_the_batch_is_taken_in_first_while_a_request_needs_its_token():
    """A request whose next step needs what its step in flight brings back (a grammar's
    mask, drafts to verify) or a pause to take makes the engine take the batch in before
    planning the next one (can_schedule_ahead False), so no stream is left a step behind."""
    s = ahead_scheduler(max_num_batched_tokens=64)
    request = make_request("r", [5, 6, 7], 4)
    s.add_request(request)
    h = AheadHarness(s)
    h._submit()
    assert s.can_schedule_ahead()  # a plain decode may go ahead
    request.matcher = object()  # as a request with structured outputs has
    assert not s.can_schedule_ahead() and not s._goes_ahead(request)
    request.matcher = None
    request.spec_token_ids = [3]
    assert not s.can_schedule_ahead()
    request.spec_token_ids = []
    s.pause_requests(["r"])
    assert not s.can_schedule_ahead()
    s.resume_requests(["r"])
    assert s.can_schedule_ahead()
    h.run()
    assert h.outputs["r"] == expected_output([5, 6, 7], 4, s.max_model_len)


def test_a_request_short_of_blocks_waits_then_preempts_once_nothing_is_in_flight():
    """A pool too small: the scheduler cannot preempt requests in flight, so a request
    short of blocks waits and the engine takes the batch in before planning again, then
    preemption works as without async scheduling; every output is exact."""
    s = ahead_scheduler(num_blocks=9, max_num_batched_tokens=16, max_model_len=48)
    h = AheadHarness(s)
    rng = random.Random(3)
    truth = {}
    for i in range(6):
        add(s, truth, f"r{i}", random_prompt(rng, rng.randint(5, 12)), 10)
    h.run()
    assert s.num_preemptions > 0 and h.num_ahead > 0
    assert h.outputs == truth
    check_all_freed(s)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_ahead(seed):
    """Random arrivals, lengths, stop tokens, shared prefixes, aborts (an id sometimes
    reused), a small pool: every output is what the request makes alone (cut at its
    stop), steps really went ahead, and at the end everything is freed."""
    rng = random.Random(500 + seed)
    max_model_len = 48
    num_blocks = rng.randint(10, 16)
    s = ahead_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=rng.randint(3, 6),
        max_num_batched_tokens=rng.randint(8, 24),
        max_model_len=max_model_len,
    )
    h = AheadHarness(s)
    prefixes = [random_prompt(rng, 12) for _ in range(3)]
    truth: dict[str, list[int]] = {}
    sent_before: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(150):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + random_prompt(
                rng, rng.randint(1, 20)
            )
            max_tokens = rng.randint(1, 14)
            if len(prompt) + max_tokens <= num_blocks * 4 and len(prompt) < max_model_len:
                full = expected_output(prompt, max_tokens, max_model_len)
                stop = rng.choice(full) if full and rng.random() < 0.4 else None
                rid = f"r{i}"
                if aborted and rng.random() < 0.1:
                    rid = rng.choice(sorted(aborted))  # an aborted request's id again
                    if rid in s.requests:
                        continue
                    aborted.discard(rid)
                    sent_before[rid] = len(h.outputs[rid])
                params = {"stop_token_ids": [stop]} if stop is not None else {}
                s.add_request(make_request(rid, prompt, max_tokens, **params))
                truth[rid] = truth_of(prompt, max_tokens, max_model_len, stop)
        live = sorted(s.requests)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            s.abort_requests([victim])
            aborted.add(victim)
        h.step()
    h.run()
    for rid, want in truth.items():
        got = h.outputs[rid][sent_before.get(rid, 0) :]
        if rid in aborted:
            assert got == want[: len(got)], rid
        else:
            assert got == want and rid in h.finished, rid
    assert h.num_ahead > 50 and h.num_overlapped > 20
    check_all_freed(s)


def test_a_failed_step_costs_only_its_culprit_even_with_the_next_in_flight():
    """ "bad" makes every batch holding it raise. Its first failure comes while the next
    batch (planned ahead, with it and a request admitted only there) is in flight: that
    batch fails too, yet the request admitted there is no lone culprit (it becomes a
    suspect), the requests taken back are not sorted twice, "bad" alone ends with an
    error, and everyone else ends exactly."""
    s = ahead_scheduler(max_num_batched_tokens=64)
    h = AheadHarness(s)
    rng = random.Random(9)
    truth = {}
    for i in range(3):
        add(s, truth, f"r{i}", random_prompt(rng, 6), 10)
    s.add_request(make_request("bad", random_prompt(rng, 5), 10))
    for _ in range(3):
        h.step()
    assert len(h.queue) == 1 and "bad" in h.queue[0].num_scheduled_tokens
    add(s, truth, "late", random_prompt(rng, 7), 6)
    h.failing = frozenset({"bad"})
    h.step()  # plans a batch with "bad" and "late", then takes in the one that fails
    assert "late" in h.queue[0].num_scheduled_tokens and s.suspects
    h.run()
    assert set(h.errors) == {"bad"}
    for rid, want in truth.items():
        assert h.outputs[rid] == want, rid
    check_all_freed(s)
