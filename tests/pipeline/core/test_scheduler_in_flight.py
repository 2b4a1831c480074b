"""The scheduler with batches in flight (pipeline parallelism, `pipeline_depth` P > 1),
driven by a fake pipeline of P fake stages (no model).

Each stage keeps its own requests' state from the diffs alone and its own "KV" (as
test_scheduler.py's fake worker: the value at a position hashes the whole prefix), and checks
on every step that the tokens it computes are the request's true tokens (its prompt and
what the fake model makes of it) and that its cache
reads back the true prefix. Only the last stage samples; the others learn the sampled tokens
from `CachedRequestData.new_token_ids`. The first stage runs a batch as soon as it is
submitted, the later stages only when the engine takes its result in: the widest
interleaving a real pipeline allows (stage 0 is always ahead), so a block reused too early,
a token not handed over, or a request scheduled twice in flight shows up as a failed check.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from ringllm.pipeline.core.request import RequestStatus
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.pipeline.core.test_scheduler import (
    BS,
    FakeRequestState,
    can_ever_run,
    check_all_freed,
    check_invariants,
    expected_output,
    make_request,
    make_scheduler,
    prefix_hashes,
    random_prompt,
    token_from_kv,
)


class FakeStage:
    def __init__(self, num_blocks: int, samples: bool) -> None:
        self.kv = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.samples = samples
        self.states: dict[str, FakeRequestState] = {}

    def run(self, sched: SchedulerOutput) -> list[int | None]:
        for rid in sched.finished_request_ids:
            del self.states[rid]
        for new in sched.new_requests:
            assert new.request_id not in self.states
            self.states[new.request_id] = FakeRequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), 0
            )
            self.states[new.request_id].num_computed_tokens = new.num_computed_tokens
        for cached in sched.cached_requests:
            state = self.states[cached.request_id]
            if self.samples:  # it sampled them itself: they must be its last tokens
                n = len(cached.new_token_ids)
                assert state.token_ids[len(state.token_ids) - n :] == cached.new_token_ids
            else:
                state.token_ids += cached.new_token_ids
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                assert cached.num_computed_tokens == state.num_computed_tokens
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
        sampled: list[int | None] = []
        for rid, num in sched.num_scheduled_tokens.items():
            state = self.states[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            assert end <= len(state.token_ids), f"{rid}: scheduled past its known tokens"
            prompt = state.token_ids[: state.num_prompt_tokens]
            true = prompt + expected_output(prompt, end - len(prompt), end + 1)
            assert state.token_ids[:end] == true[:end], f"{rid}: a token missing"
            values = prefix_hashes(state.token_ids[:end])
            for pos in range(start, end):
                self.kv[state.block_ids[pos // BS], pos % BS] = values[pos]
            read = [int(self.kv[state.block_ids[p // BS], p % BS]) for p in range(end)]
            assert read == values, f"{rid}: this stage's cache lost its prefix"
            state.num_computed_tokens = end
            if end < len(state.token_ids) or not self.samples:
                sampled.append(None)
                continue
            token = token_from_kv(read[-1])
            state.token_ids.append(token)
            sampled.append(token)
        return sampled


class FakePipeline:
    """P stages; `submit` runs a batch through stage 0, `collect` through the rest."""

    def __init__(self, num_blocks: int, num_stages: int) -> None:
        self.stages = [FakeStage(num_blocks, k == num_stages - 1) for k in range(num_stages)]
        self.queue: collections.deque[SchedulerOutput] = collections.deque()

    def submit(self, sched: SchedulerOutput) -> None:
        self.stages[0].run(sched)
        self.queue.append(sched)

    def collect(self) -> ModelRunnerOutput:
        sched = self.queue.popleft()
        for stage in self.stages[1:]:
            sampled = stage.run(sched)
        ids = list(sched.num_scheduled_tokens)
        return ModelRunnerOutput(ids, sampled, [None] * len(ids))


class InFlightHarness:
    """Steps the scheduler as EngineCore._step_in_flight does, checking on every step that
    no request is in two batches in flight and none in flight was preempted."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.depth = scheduler.pipeline_depth
        self.pipe = FakePipeline(scheduler.kv.num_blocks, self.depth)
        self.outputs: dict[str, list[int]] = collections.defaultdict(list)
        self.finished: set[str] = set()
        self.max_in_flight = 0
        self.batch_sizes: list[int] = []

    def in_flight_ids(self) -> list[str]:
        return [rid for sched in self.pipe.queue for rid in sched.num_scheduled_tokens]

    def step(self) -> None:
        s, queue = self.s, self.pipe.queue
        if len(queue) < self.depth:
            before = set(self.in_flight_ids())
            sched = s.schedule()
            check_invariants(s)
            assert not before & set(sched.num_scheduled_tokens), "scheduled while in flight"
            for rid, request in s.in_flight.items():  # never preempted or swapped in flight
                if s.requests.get(rid) is request:  # not aborted since
                    assert request.status == RequestStatus.RUNNING
            assert sched.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
            if not sched.is_empty:
                self.pipe.submit(sched)
                self.batch_sizes.append(len(sched.num_scheduled_tokens))
                self.max_in_flight = max(self.max_in_flight, len(queue))
                assert set(s.in_flight) == set(self.in_flight_ids())
                if len(queue) < self.depth:
                    return
            elif not queue:
                return
        sched = queue[0]
        result = self.pipe.collect()
        for out in s.update_from_output(sched, result):
            assert out.request_id not in self.finished
            self.outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                self.finished.add(out.request_id)
        check_invariants(s)

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests() and not self.pipe.queue:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def pipelined_scheduler(depth: int, **kwargs) -> Scheduler:
    template = make_scheduler(**kwargs)
    return Scheduler(
        template.config,
        _cache_config(template),
        template.max_model_len,
        template.kv.num_blocks,
        pipeline_depth=depth,
    )


def _cache_config(scheduler: Scheduler):
    from ringllm.pipeline.config import CacheConfig

    return CacheConfig(block_size=BS, enable_prefix_caching=scheduler.kv.pool.enable_caching)


def add(h: InFlightHarness, truth, rid: str, prompt: list[int], max_tokens: int, **kw) -> None:
    h.s.add_request(make_request(rid, prompt, max_tokens, **kw))
    truth[rid] = prompt + expected_output(prompt, max_tokens, h.s.max_model_len)


def test_steady_decoding_splits_into_one_batch_per_stage():
    """8 requests, 2 stages: two batches of 4 alternate, both in flight."""
    truth: dict[str, list[int]] = {}
    h = InFlightHarness(pipelined_scheduler(2, max_num_batched_tokens=64))
    rng = random.Random(1)
    for i in range(8):
        add(h, truth, f"r{i}", random_prompt(rng, 6), 12)
    h.run()
    assert h.max_in_flight == 2
    assert all(size <= 4 for size in h.batch_sizes)
    assert h.batch_sizes.count(4) >= 2 * 10  # most steps carry half the requests
    for rid, tokens in truth.items():
        assert h.outputs[rid] == tokens[len(tokens) - 12 :]
    check_all_freed(h.s)


def test_a_request_short_of_blocks_waits_for_those_in_flight():
    """A pool too small for all: a request whose blocks are held in flight waits rather
    than preempt itself, and everything still ends exactly."""
    truth: dict[str, list[int]] = {}
    h = InFlightHarness(
        pipelined_scheduler(2, num_blocks=9, max_num_batched_tokens=16, max_model_len=48)
    )
    rng = random.Random(2)
    for i in range(6):
        add(h, truth, f"r{i}", random_prompt(rng, rng.randint(5, 12)), 10)
    h.run()
    assert h.s.num_preemptions > 0
    for rid, tokens in truth.items():
        assert h.outputs[rid] == tokens[len(tokens) - 10 :], rid
    check_all_freed(h.s)


def test_an_abort_in_flight_frees_blocks_a_later_batch_may_reuse():
    """The blocks of a request aborted in flight go to a later batch (stage 1 still has to
    run the earlier one), and a new request under its id gets nothing of the old one's."""
    truth: dict[str, list[int]] = {}
    h = InFlightHarness(pipelined_scheduler(2, num_blocks=12, max_model_len=48))
    rng = random.Random(3)
    for i in range(4):
        add(h, truth, f"r{i}", random_prompt(rng, 10), 20)
    for _ in range(6):
        h.step()
    victim = h.in_flight_ids()[0]
    h.s.abort_requests([victim])
    sent_before = len(h.outputs[victim])
    add(h, truth, "late", random_prompt(rng, 20), 8)  # takes the freed blocks
    add(h, truth, victim, random_prompt(rng, 5), 3)  # its id again
    h.run()
    assert h.outputs["late"] == truth["late"][20:]
    assert h.outputs[victim][sent_before:] == truth[victim][5:]
    for rid in ("r0", "r1", "r2", "r3"):
        if rid != victim:
            assert h.outputs[rid] == truth[rid][10:]
    check_all_freed(h.s)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_in_flight(depth, seed):
    """Random arrivals, lengths, shared prefixes, aborts, a small pool: every output is what
    the request makes alone, and at the end everything is freed."""
    rng = random.Random(100 + seed)
    max_model_len = 48
    num_blocks = rng.randint(10, 14)
    s = pipelined_scheduler(
        depth,
        num_blocks=num_blocks,
        max_num_seqs=rng.randint(3, 6),
        max_num_batched_tokens=rng.randint(8, 24),
        max_model_len=max_model_len,
    )
    truth: dict[str, list[int]] = {}
    h = InFlightHarness(s)
    prefixes = [random_prompt(rng, 12) for _ in range(3)]
    aborted: set[str] = set()
    prompt_len: dict[str, int] = {}
    for i in range(120):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + random_prompt(
                rng, rng.randint(1, 24)
            )
            max_tokens = rng.randint(1, 14)
            if can_ever_run(len(prompt), max_tokens, num_blocks, max_model_len):
                add(h, truth, f"r{i}", prompt, max_tokens)
                prompt_len[f"r{i}"] = len(prompt)
        live = sorted(s.requests)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            s.abort_requests([victim])
            aborted.add(victim)
        h.step()
    h.run()
    for rid, tokens in truth.items():
        want, got = tokens[prompt_len[rid] :], h.outputs[rid]
        if rid in aborted:
            assert got == want[: len(got)], rid
        else:
            assert got == want and rid in h.finished, rid
    assert h.max_in_flight == depth and s.num_preemptions > 0
    check_all_freed(s)
