"""Scheduler driven by a fake worker (no model): budgets, chunked prefill, FCFS and
priority order, preemption by recompute, prefix hits, aborts, admission errors, stop
conditions, the request state machine, and a seeded randomized invariant check.

The fake worker plays the part of `Worker` + model honestly enough to catch lost or
corrupted KV: it keeps each request's state only from the diffs the scheduler sends,
and, like a real model, the "KV" it writes for position p depends on every token up to
p: a rolling hash of the prefix, stored in a fake cache [num_blocks, block_size] at the
slot the request's block table gives. Before sampling it reads the whole prefix back
from those slots and checks it, and the sampled token is a function of the value read at
the last position. So the expected output of a request is computable without any
scheduler (`expected_output`), and a block that was shared with the wrong prefix,
evicted while in use, or reused wrongly shows up as a failed read-back or a wrong token.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from ringllm.pipeline.config import CacheConfig, SchedulerConfig
from ringllm.pipeline.core.request import ALLOWED_TRANSITIONS, Request, RequestStatus
from ringllm.pipeline.core.scheduler import Scheduler
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.messages import LogprobRow
from ringllm.pipeline.sampling_params import SamplingParams

EOS = 1
BS = 4  # tokens per block


def prefix_hashes(tokens: list[int]) -> list[int]:
    """The fake KV of each position: a polynomial hash of the tokens up to it."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t) % 2_147_483_647
        out.append(h)
    return out


def token_from_kv(kv_value: int) -> int:
    """A deterministic 'model head': never EOS (1) or 2."""
    return 10 + kv_value % 990


def next_token(tokens: list[int]) -> int:
    return token_from_kv(prefix_hashes(tokens)[-1])


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class FakeRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int = BS, script=None) -> None:
        self.block_size = block_size
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.states: dict[str, FakeRequestState] = {}
        self.script = script or {}  # request id -> its output tokens, overriding next_token
        self.num_computed_total = 0

    def _apply_diffs(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            del self.states[rid]  # strict: each id is handed over exactly once
        for new in sched.new_requests:
            assert new.request_id not in self.states
            self.states[new.request_id] = FakeRequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for cached in sched.cached_requests:
            state = self.states[cached.request_id]
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                # Continuing without preemption: the scheduler's count must match ours.
                assert cached.num_computed_tokens == state.num_computed_tokens
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens

    def _slot(self, state: FakeRequestState, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(sched)
        req_ids = list(sched.num_scheduled_tokens)
        # Write every new token's "KV" first (a real step writes the cache of all requests
        # of a layer before any attention reads it), then read back and sample.
        for rid in req_ids:
            state = self.states[rid]
            start = state.num_computed_tokens
            end = start + sched.num_scheduled_tokens[rid]
            assert end <= len(state.token_ids), f"{rid}: scheduled past its known tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{rid}: too few blocks"
            kv_values = prefix_hashes(state.token_ids[:end])
            for pos in range(start, end):
                self.kv[self._slot(state, pos)] = kv_values[pos]
            self.num_computed_total += end - start
        sampled: list[int | None] = []
        for rid in req_ids:
            state = self.states[rid]
            end = state.num_computed_tokens + sched.num_scheduled_tokens[rid]
            read = [int(self.kv[self._slot(state, pos)]) for pos in range(end)]
            expected = prefix_hashes(state.token_ids[:end])
            assert read == expected, f"{rid}: KV cache does not hold its prefix"
            state.num_computed_tokens = end
            if end < len(state.token_ids):
                sampled.append(None)  # a prompt chunk that does not reach the end yet
                continue
            script = self.script.get(rid)
            if script is not None:
                token = script[len(state.token_ids) - state.num_prompt_tokens]
            else:
                token = token_from_kv(read[-1])
            state.token_ids.append(token)
            sampled.append(token)
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def make_scheduler(
    num_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=64,
    policy="fcfs",
    chunked=True,
    caching=True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        max_model_len,
        num_blocks,
    )


def make_request(rid, prompt, max_tokens=8, priority=0, arrival=None, **params) -> Request:
    params.setdefault("ignore_eos", False)
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=(EOS,),
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=arrival,
    )


def free_queue(scheduler: Scheduler) -> list[int]:
    """The pool's intrusive free list, head to tail (index num_blocks is its sentinel)."""
    pool = scheduler.kv.pool
    order, block = [], int(pool._next[pool.num_blocks])
    while block != pool.num_blocks:
        order.append(block)
        assert len(order) <= pool.num_blocks, "free list has a cycle"
        block = int(pool._next[block])
    return order


def check_invariants(scheduler: Scheduler) -> None:
    kv, pool = scheduler.kv, scheduler.kv.pool
    queue = free_queue(scheduler)
    assert len(queue) == len(set(queue)) == pool.num_free_blocks
    assert set(queue) == set(np.flatnonzero(pool.ref_counts == 0).tolist())
    owners: Counter[int] = Counter()
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        blocks = kv.block_ids(request.request_id).tolist()
        assert len(blocks) == len(set(blocks)), f"{request.request_id} holds a block twice"
        owners.update(blocks)
    assert pool.ref_counts.tolist() == [owners[b] for b in range(pool.num_blocks)]
    for block, count in owners.items():
        if count > 1:  # only full, identified prefix blocks are ever shared
            assert pool.block_hashes[block] is not None
    assert set(kv.rows) == {r.request_id for r in scheduler.running}
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
    for rid, request in scheduler.paused.items():  # out of every queue, holding nothing
        assert request.status == RequestStatus.PAUSED and request.request_id == rid
        assert request.num_computed_tokens == 0 and rid not in kv.rows
    ids = [r.request_id for r in scheduler.running + scheduler.waiting]
    assert sorted(ids + list(scheduler.paused)) == sorted(scheduler.requests)


def check_all_freed(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not pool.ref_counts.any() and pool.num_free_blocks == pool.num_blocks
    assert len(free_queue(scheduler)) == pool.num_blocks
    assert not scheduler.kv.rows and not scheduler.kv.num_blocks_of_row.any()


class Harness:
    """Steps a scheduler the way EngineCore.step does, against the fake worker."""

    def __init__(self, scheduler: Scheduler, script=None) -> None:
        self.scheduler = scheduler
        self.worker = FakeWorker(scheduler.kv.num_blocks, script=script)
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish_reasons: dict[str, str] = {}
        self.stop_reasons: dict[str, int | str | None] = {}
        self.steps: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        s = self.scheduler
        running_before = list(s.running)
        sched = s.schedule()
        self.steps.append(sched)
        self.check_victims(running_before, sched)
        assert sched.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(sched.num_scheduled_tokens) <= s.config.max_num_seqs
        assert len(s.running) <= s.config.max_num_seqs
        assert all(n >= 1 for n in sched.num_scheduled_tokens.values())
        assert set(sched.num_scheduled_tokens) <= {r.request_id for r in s.running}
        check_invariants(s)
        if sched.is_empty:
            return sched  # EngineCore.step runs nothing for an empty step
        result = self.worker.execute(sched)
        for rid in sched.num_scheduled_tokens:  # the diffs rebuilt the scheduler's tables
            assert self.worker.states[rid].block_ids == s.kv.block_ids(rid).tolist()
        for out in s.update_from_output(sched, result):
            assert out.request_id not in self.finish_reasons
            self.outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                self.finish_reasons[out.request_id] = out.finish_reason
                self.stop_reasons[out.request_id] = out.stop_reason
        check_invariants(s)
        return sched

    def check_victims(self, running_before: list[Request], sched: SchedulerOutput) -> None:
        """Preemption evicts the lowest-priority (FCFS: latest) requests, and admits nothing."""
        s = self.scheduler
        victims = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        assert len(victims) == sched.num_preempted
        if not victims:
            return
        policy = s.config.scheduling_policy
        for victim in victims:
            assert victim in s.waiting and victim.request_id not in sched.num_scheduled_tokens
            assert all(r.sort_key(policy) <= victim.sort_key(policy) for r in s.running)
        assert not sched.new_requests and not any(c.resumed for c in sched.cached_requests)
        assert set(sched.num_scheduled_tokens) <= {r.request_id for r in running_before}

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def scheduled_ids(self, step: int) -> list[str]:
        return list(self.steps[step].num_scheduled_tokens)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(length)]


# ---- budgets and chunked prefill ---------------------------------------------------


def test_budgets_hold_every_step_and_outputs_are_exact():
    rng = random.Random(0)
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)
    h = Harness(s)
    prompts = {f"r{i}": random_prompt(rng, rng.randint(1, 30)) for i in range(20)}
    max_tokens = {rid: rng.randint(1, 12) for rid in prompts}
    for rid, prompt in prompts.items():
        h.add(make_request(rid, prompt, max_tokens[rid]))
    h.run()
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == expected_output(prompt, max_tokens[rid], 48)
        assert h.finish_reasons[rid] == "length"
    totals = [step.total_num_scheduled_tokens for step in h.steps]
    assert max(totals) == 16  # the budget was the binding limit at some point
    assert max(len(step.num_scheduled_tokens) for step in h.steps) == 4
    check_all_freed(s)


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    s = make_scheduler(max_num_batched_tokens=12, max_model_len=64)
    h = Harness(s)
    h.add(make_request("short", [11, 12, 13], max_tokens=10))
    h.step()  # short's prompt
    long_prompt = list(range(100, 140))  # 40 tokens
    h.add(make_request("long", long_prompt, max_tokens=2))
    chunks = []
    while "long" not in h.outputs:
        sched = h.step()
        assert sched.num_scheduled_tokens["short"] == 1  # short decodes every step
        chunks.append(sched.num_scheduled_tokens["long"])
    assert chunks == [11, 11, 11, 7]
    assert len(h.outputs["long"]) == 1  # sampled only when the last chunk ran
    h.run()
    assert h.outputs["long"] == expected_output(long_prompt, 2, 64)
    assert h.outputs["short"] == expected_output([11, 12, 13], 10, 64)
    check_all_freed(s)


def test_without_chunked_prefill_a_prompt_waits_for_room():
    s = make_scheduler(max_num_batched_tokens=12, chunked=False)
    h = Harness(s)
    h.add(make_request("a", [5, 6], max_tokens=3))
    h.step()
    h.add(make_request("b", list(range(20, 32)), max_tokens=1))  # 12 tokens: the whole budget
    assert h.step().num_scheduled_tokens == {"a": 1}  # only 11 left this step
    h.step()
    assert h.finish_reasons == {"a": "length"}
    assert h.step().num_scheduled_tokens == {"b": 12}  # all at once, never a chunk
    h.run()
    check_all_freed(s)


# ---- queue order -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["c", "a", "d", "b"])]
)
def test_waiting_order_fcfs_and_priority(policy, order):
    s = make_scheduler(max_num_seqs=1, policy=policy)
    h = Harness(s)
    # Added out of arrival order: the queue order comes from arrival and priority only.
    h.add(
        make_request("d", [4, 4], max_tokens=1, priority=1, arrival=4.0),
        make_request("b", [2, 2], max_tokens=1, priority=5, arrival=2.0),
        make_request("a", [1, 1], max_tokens=1, priority=1, arrival=1.0),
        make_request("c", [3, 3], max_tokens=1, priority=0, arrival=3.0),
    )
    h.run()
    assert [ids[0] for ids in map(h.scheduled_ids, range(len(h.steps)))] == order


# ---- preemption --------------------------------------------------------------------


def run_alone_with_plenty(requests_args) -> dict[str, list[int]]:
    h = Harness(make_scheduler(num_blocks=200))
    for args in requests_args:
        h.add(make_request(**args))
    h.run()
    return dict(h.outputs)


def test_preemption_evicts_latest_and_resumes_with_nothing_lost():
    s = make_scheduler(num_blocks=6)  # 24 token slots for three requests growing to 15 each
    h = Harness(s)
    args = [
        dict(rid=rid, prompt=[k] * 3 + [k + 1] * 3, max_tokens=10, arrival=float(k))
        for k, rid in ((10, "a"), (20, "b"), (30, "c"))
    ]
    requests = {a["rid"]: make_request(**a) for a in args}
    h.add(*requests.values())
    while not s.num_preemptions:
        sched = h.step()
    c = requests["c"]
    assert sched.num_preempted == 1 and c.status == RequestStatus.PREEMPTED
    assert c.num_preemptions == 1 and c.num_computed_tokens == 0 and "c" not in s.kv.rows
    assert s.waiting == [c] and set(sched.num_scheduled_tokens) == {"a", "b"}
    tokens_at_preemption = list(c.all_token_ids)
    assert len(tokens_at_preemption) > 6  # it had produced output: it is kept
    h.run()
    resumed = {cr.request_id for step in h.steps for cr in step.cached_requests if cr.resumed}
    assert "c" in resumed
    assert all(requests[rid].num_preemptions >= 1 for rid in resumed)
    assert c.all_token_ids[: len(tokens_at_preemption)] == tokens_at_preemption
    assert dict(h.outputs) == run_alone_with_plenty(args)
    for a in args:
        assert h.outputs[a["rid"]] == expected_output(a["prompt"], 10, 64)
    check_all_freed(s)


def test_priority_preemption_evicts_lowest_priority_even_if_scheduled_first():
    """A low-priority request that started early must be the victim, not a newer urgent one."""
    s = make_scheduler(num_blocks=7, policy="priority")
    h = Harness(s)
    low = make_request("low", [7] * 6, max_tokens=10, priority=2, arrival=0.0)
    h.add(low)
    h.step()  # low runs alone first, then the urgent ones arrive
    h.add(
        make_request("urgent", [8] * 6, max_tokens=10, priority=0, arrival=1.0),
        make_request("mid", [9] * 6, max_tokens=10, priority=1, arrival=2.0),
    )
    while not s.num_preemptions:
        h.step()
    assert low.status == RequestStatus.PREEMPTED
    assert {r.request_id for r in s.running} == {"urgent", "mid"}
    h.run()
    for rid, k in (("low", 7), ("urgent", 8), ("mid", 9)):
        assert h.outputs[rid] == expected_output([k] * 6, 10, 64)
    check_all_freed(s)


def test_request_that_outgrows_the_whole_cache_is_refused_not_stuck():
    """Its prompt fits, but prompt + max_tokens would need more blocks than exist."""
    s = make_scheduler(num_blocks=3, max_model_len=64)  # 12 token slots
    with pytest.raises(ValueError, match=r"more KV blocks than the whole cache has \(3 blocks"):
        s.add_request(make_request("big", [5] * 8, max_tokens=10))
    assert not s.requests
    # One that can just finish inside the cache runs to the end alone.
    h = Harness(s)
    h.add(make_request("fits", [5] * 8, max_tokens=5))  # at most 12 tokens in the cache
    h.run()
    assert h.outputs["fits"] == expected_output([5] * 8, 5, 64)
    check_all_freed(s)


# ---- prefix caching ----------------------------------------------------------------


def test_prefix_hits_skip_computation():
    s = make_scheduler()
    h = Harness(s)
    shared = list(range(200, 213))  # 13 tokens: 3 full blocks
    h.add(make_request("a", shared + [1000], max_tokens=2))
    h.run()
    computed_a = h.worker.num_computed_total
    s.kv.prefix_stats.take()
    b = make_request("b", shared + [2000, 2001], max_tokens=2)
    h.add(b)
    h.run()
    assert b.num_cached_tokens == 12
    assert h.worker.num_computed_total - computed_a == 15 - 12 + 1  # suffix + one decode
    stats = s.kv.prefix_stats.take()
    assert (stats.queries, stats.hits) == (15, 12)
    assert h.outputs["b"] == expected_output(shared + [2000, 2001], 2, 64)
    check_all_freed(s)


def test_running_requests_share_prefix_blocks():
    s = make_scheduler()
    h = Harness(s)
    prompt = list(range(300, 310))
    h.add(make_request("a", prompt, max_tokens=6))
    h.step()
    h.add(make_request("b", prompt, max_tokens=6))
    h.step()
    a_blocks = s.kv.block_ids("a").tolist()
    b_blocks = s.kv.block_ids("b").tolist()
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] != b_blocks[2]
    assert s.kv.pool.ref_counts[a_blocks[:2]].tolist() == [2, 2]
    h.run()
    assert h.outputs["a"] == h.outputs["b"] == expected_output(prompt, 6, 64)
    check_all_freed(s)


def test_freed_cached_prompts_are_evicted_in_lru_order():
    s = make_scheduler(num_blocks=6)
    h = Harness(s)
    old, new = [41] * 8 + [1], [42] * 8 + [1]  # 2 full blocks each
    h.add(make_request("old", old, max_tokens=1))
    h.run()
    h.add(make_request("new", new, max_tokens=1))
    h.run()
    # 6 free blocks: old's 2 cached, new's 2 cached, 2 partial ones; need 3 fresh blocks.
    h.add(make_request("filler", [77] * 11, max_tokens=1))
    h.run()
    probe_old, probe_new = make_request("p1", old), make_request("p2", new)
    assert s.kv.get_computed_blocks(probe_old)[1] == 0  # least recently freed: evicted
    assert s.kv.get_computed_blocks(probe_new)[1] == 8
    check_all_freed(s)


def test_stats_report_usage_queue_lengths_and_prefix_counts():
    s = make_scheduler(num_blocks=8, max_num_seqs=1)
    h = Harness(s)
    prompt = list(range(70, 79))  # 9 tokens: 3 blocks
    h.add(make_request("a", prompt, max_tokens=1), make_request("b", prompt, max_tokens=1))
    h.step()
    stats = s.make_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 1)  # a finished in its first step
    assert stats.kv_cache_usage == 0.0  # a's blocks are free (cached, still reusable)
    assert (stats.prefix_cache.queries, stats.prefix_cache.hits) == (9, 0)
    assert stats.num_preemptions_total == 0
    h.add(make_request("c", [5] * 20, max_tokens=2, arrival=1e9))
    h.step()  # b: 8 of its 9 tokens come from a's blocks
    stats = s.make_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 1)
    assert (stats.prefix_cache.queries, stats.prefix_cache.hits) == (9, 8)
    h.step()  # c prefills 20 tokens: 5 of the 8 blocks
    stats = s.make_stats()
    assert stats.num_running == 1 and stats.kv_cache_usage == pytest.approx(5 / 8)
    h.run()
    assert s.make_stats().kv_cache_usage == 0.0


def test_reset_prefix_cache_then_no_hits():
    s = make_scheduler()
    h = Harness(s)
    prompt = list(range(50, 61))
    h.add(make_request("a", prompt, max_tokens=1))
    h.run()
    s.kv.reset_prefix_cache()
    b = make_request("b", prompt, max_tokens=1)
    h.add(b)
    h.run()
    assert b.num_cached_tokens == 0


def test_prefix_query_counted_once_for_a_request_left_waiting():
    s = make_scheduler(num_blocks=4)  # 16 slots
    h = Harness(s)
    prompt = list(range(60, 69))  # 9 tokens: 2 full blocks, cached once p finishes
    h.add(make_request("p", prompt, max_tokens=1))
    h.run()
    h.add(make_request("a", [7] * 5, max_tokens=6))  # grows to 3 of the 4 blocks
    h.step()
    b = make_request("b", prompt + [5, 5, 5], max_tokens=1)  # needs 3 blocks
    h.add(b)
    waited = 0
    while b.status == RequestStatus.WAITING:
        h.step()
        waited += 1
    assert waited > 3 and s.num_preemptions == 0  # b was looked up on every one of them
    h.run()
    # a's growth evicted p's second block (LRU); its first still served b.
    assert b.num_cached_tokens == 4
    stats = s.kv.prefix_stats.take()
    assert (stats.queries, stats.hits) == (9 + 5 + 12, 4)
    check_all_freed(s)


# ---- aborts and finished ids -------------------------------------------------------


def test_abort_waiting_running_and_preempted_requests():
    s = make_scheduler(num_blocks=6, max_num_seqs=2)
    h = Harness(s)
    reqs = [
        make_request(r, [i + 10] * 6, max_tokens=10, arrival=float(i)) for i, r in enumerate("abcd")
    ]
    h.add(*reqs)
    h.step()  # a, b running; c, d waiting
    assert [r.request_id for r in s.running] == ["a", "b"]
    s.abort_requests(["d", "nope"])  # waiting, and an unknown id: ignored
    assert reqs[3].status == RequestStatus.FINISHED_ABORTED and "d" not in s.requests
    while not s.num_preemptions:
        h.step()
    assert reqs[1].status == RequestStatus.PREEMPTED
    s.abort_requests(["b"])  # preempted: back in the waiting queue
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED and reqs[1] not in s.waiting
    s.abort_requests(["a"])  # running: its blocks come back at once
    assert reqs[0].status == RequestStatus.FINISHED_ABORTED
    check_invariants(s)
    assert s.kv.pool.num_free_blocks == 6
    s.abort_requests(["a"])  # twice: a no-op
    sched = h.step()
    # Workers drop the ones they knew; d was never scheduled, so they never had it.
    assert sched.finished_request_ids == {"a", "b"}
    h.run()
    assert h.finish_reasons == {"c": "length"} and not h.worker.states.keys() - {"c"}
    check_all_freed(s)


def test_abort_while_a_step_runs_drops_its_result():
    s = make_scheduler()
    h = Harness(s)
    h.add(make_request("a", [5, 6, 7], max_tokens=4), make_request("b", [8, 9], max_tokens=4))
    sched = s.schedule()
    result = h.worker.execute(sched)
    s.abort_requests(["a"])
    outputs = s.update_from_output(sched, result)
    assert [o.request_id for o in outputs] == ["b"]
    assert s.schedule().finished_request_ids == {"a"}


def test_finished_ids_are_handed_over_once_even_after_an_empty_step():
    s = make_scheduler()
    h = Harness(s)
    h.add(make_request("a", [5, 6, 7], max_tokens=2))
    h.step()
    s.abort_requests(["a"])
    empty = h.step()  # nothing to run: EngineCore does not call the workers
    assert empty.is_empty and not empty.finished_request_ids
    assert "a" in h.worker.states  # the worker has not heard yet
    h.add(make_request("b", [1, 2], max_tokens=1))
    assert h.step().finished_request_ids == {"a"}
    assert set(h.worker.states) == {"b"}
    h.add(make_request("c", [3, 4], max_tokens=3))
    sched = h.step()
    assert sched.finished_request_ids == {"b"}
    assert [n.request_id for n in sched.new_requests] == ["c"]
    h.run()
    assert sum(len(step.finished_request_ids) for step in h.steps) == 2  # c still pending
    check_all_freed(s)


def test_a_request_id_can_be_reused_after_it_finished():
    s = make_scheduler()
    h = Harness(s)
    h.add(make_request("x", [5, 6], max_tokens=1))
    h.run()
    assert h.outputs.pop("x") == expected_output([5, 6], 1, 64)
    assert h.finish_reasons.pop("x") == "length"
    h.add(make_request("x", [7, 8, 9], max_tokens=2))
    sched = h.step()
    # The worker drops the old state before it takes the new one.
    assert sched.finished_request_ids == {"x"} and sched.new_requests[0].token_ids == [7, 8, 9]
    h.run()
    assert h.outputs["x"] == expected_output([7, 8, 9], 2, 64)


# ---- admission errors --------------------------------------------------------------


def test_admission_errors_name_the_counts_and_admit_nothing():
    s = make_scheduler(num_blocks=4, max_model_len=32)  # 16 token slots
    s.add_request(make_request("dup", [1, 2], max_tokens=1))
    cases = [
        (make_request("long", [3] * 32), r"prompt: 32 tokens leave no room .* max_model_len 32"),
        (make_request("longer", [3] * 40), r"prompt: 40 tokens leave no room .* max_model_len 32"),
        (
            make_request("big", [3] * 17, max_tokens=1),
            r"prompt: 17 tokens plus up to 1 output tokens need more KV blocks than the "
            r"whole cache has \(4 blocks of 4 tokens\)",
        ),
        (make_request("empty", []), r"prompt: must contain at least one token"),
        (make_request("dup", [4, 5]), r"request_id: 'dup' is already in use"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            s.add_request(request)
    assert list(s.requests) == ["dup"] and [r.request_id for r in s.waiting] == ["dup"]
    # The largest request the cache can hold is admitted and completes.
    h = Harness(s)
    h.add(make_request("edge", [3] * 16, max_tokens=1))
    h.run()
    assert h.outputs["edge"] == expected_output([3] * 16, 1, 32)
    check_all_freed(s)


# ---- the request state machine -----------------------------------------------------


def test_state_machine_allows_only_the_documented_transitions():
    S = RequestStatus
    finished = {S.FINISHED_STOPPED, S.FINISHED_LENGTH_CAPPED, S.FINISHED_ABORTED, S.FINISHED_ERROR}
    documented = {
        S.WAITING: {S.RUNNING, S.PAUSED, S.FINISHED_ABORTED, S.FINISHED_ERROR},
        S.RUNNING: {S.PREEMPTED, S.SWAPPED, S.PAUSED} | finished,
        S.PREEMPTED: {S.RUNNING, S.PAUSED, S.FINISHED_ABORTED, S.FINISHED_ERROR},
        # swapped out to the host tier; PREEMPTED: the step copying it out failed
        S.SWAPPED: {S.RUNNING, S.PREEMPTED, S.PAUSED, S.FINISHED_ABORTED, S.FINISHED_ERROR},
        # its client reads nothing; back as WAITING if it never ran, else PREEMPTED
        S.PAUSED: {S.WAITING, S.PREEMPTED, S.FINISHED_ABORTED, S.FINISHED_ERROR},
    }
    assert ALLOWED_TRANSITIONS == documented
    for source in S:
        for target in S:
            request = make_request("r", [1])
            request.status = source
            if target in documented.get(source, ()):
                request.transition(target)
                assert request.status == target
            else:
                with pytest.raises(
                    RuntimeError,
                    match=f"request r: illegal transition {source.name} -> {target.name}",
                ):
                    request.transition(target)
                assert request.status == source
    assert [s.finish_reason for s in S] == [
        None, None, None, "stop", "length", "abort", "error", None, None
    ]  # fmt: skip
    assert [s.is_finished for s in S] == [
        False, False, False, True, True, True, True, False, False
    ]  # fmt: skip


# ---- stop conditions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "script", "max_tokens", "expected", "reason", "stop_reason"),
    [
        ({}, [20, EOS, 21], 8, [20, EOS], "stop", None),
        ({"ignore_eos": True}, [20, EOS, 21, 22], 4, [20, EOS, 21, 22], "length", None),
        ({"stop_token_ids": [2, 30]}, [20, 30, 21], 8, [20, 30], "stop", 30),
        ({"stop_token_ids": [30]}, [20, 21, 22], 3, [20, 21, 22], "length", None),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 20], 8, [EOS, EOS, EOS], "stop", None),
        ({"min_tokens": 2, "stop_token_ids": [30]}, [30, 30, 21], 8, [30, 30], "stop", 30),
        (
            {"min_tokens": 3, "stop_token_ids": [30]},
            [30, EOS, 20, 30],
            8,
            [30, EOS, 20, 30],
            "stop",
            30,
        ),
        ({"ignore_eos": True, "stop_token_ids": [EOS]}, [20, EOS], 8, [20, EOS], "stop", EOS),
    ],
)
def test_stop_conditions(params, script, max_tokens, expected, reason, stop_reason):
    s = make_scheduler()
    h = Harness(s, script={"r": script})
    h.add(make_request("r", [5, 6, 7], max_tokens=max_tokens, **params))
    h.run()
    assert h.outputs["r"] == expected
    assert (h.finish_reasons["r"], h.stop_reasons["r"]) == (reason, stop_reason)
    check_all_freed(s)


def test_max_model_len_caps_the_output():
    s = make_scheduler(max_model_len=10)
    h = Harness(s)
    h.add(make_request("r", [5] * 7, max_tokens=100))
    h.run()
    assert len(h.outputs["r"]) == 3 and h.finish_reasons["r"] == "length"
    assert h.outputs["r"] == expected_output([5] * 7, 100, 10)


# ---- randomized --------------------------------------------------------------------


def can_ever_run(prompt_len: int, max_tokens: int, num_blocks: int, max_model_len: int) -> bool:
    if prompt_len == 0 or prompt_len >= max_model_len:
        return False
    max_len = min(prompt_len + max_tokens, max_model_len)
    return -(-(max_len - 1) // BS) <= num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_invariants_and_outputs(seed, policy):
    """Many requests with random lengths, shared prefixes and aborts, on a small pool.

    Every step: budgets, free queue == ref count 0, ref counts == owners, victims (see
    Harness); at the end everything is freed and every request that was not aborted
    produced exactly what it would have alone.
    """
    rng = random.Random(seed)
    max_model_len = 48
    num_blocks = rng.randint(8, 12)
    s = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.randint(6, 24),
        max_model_len=max_model_len,
        policy=policy,
        caching=seed != 0,
    )
    h = Harness(s)
    prefixes = [random_prompt(rng, 12) for _ in range(3)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i in range(150):
        if rng.random() < 0.7:
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + random_prompt(
                rng, rng.randint(0, 30)
            )
            max_tokens = rng.randint(1, 16)
            request = make_request(
                f"r{i}", prompt, max_tokens, priority=rng.randint(0, 3), arrival=float(i)
            )
            if can_ever_run(len(prompt), max_tokens, num_blocks, max_model_len):
                h.add(request)
                expected[f"r{i}"] = expected_output(prompt, max_tokens, max_model_len)
            else:
                with pytest.raises(ValueError):
                    h.add(request)
        live = sorted(s.requests)
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            s.abort_requests([victim])
            aborted.add(victim)
            check_invariants(s)
        h.step()
    h.run()
    for rid, tokens in expected.items():
        if rid in aborted:
            assert tokens[: len(h.outputs[rid])] == h.outputs[rid]
            assert rid not in h.finish_reasons
        else:
            assert h.outputs[rid] == tokens, rid
    assert s.num_preemptions > 0 and aborted  # the test exercised them
    if seed != 0:
        assert s.kv.prefix_stats.hits > 0
    check_all_freed(s)


def test_a_block_is_reused_only_after_the_same_prefix():
    """Block 1 of `b` has the same tokens as block 1 of `other`, after a different block 0."""
    s = make_scheduler()
    h = Harness(s)
    a_blk, other_blk, x_blk = [11] * BS, [12] * BS, [13] * BS
    h.add(make_request("a", a_blk + [50] * BS + [1], max_tokens=1))
    h.add(make_request("other", other_blk + x_blk + [1], max_tokens=1))
    h.run()
    b = make_request("b", a_blk + x_blk + [60], max_tokens=3)
    h.add(b)
    h.run()
    assert b.num_cached_tokens == BS  # block 0 from a; block 1 is not other's block 1
    assert h.outputs["b"] == expected_output(a_blk + x_blk + [60], 3, 64)


def test_a_fully_cached_block_aligned_prompt_still_computes_its_last_block():
    s = make_scheduler()
    h = Harness(s)
    prompt = list(range(400, 412))  # exactly 3 blocks
    h.add(make_request("a", prompt, max_tokens=2))
    h.run()
    before = h.worker.num_computed_total
    b = make_request("b", prompt, max_tokens=2)
    h.add(b)
    h.run()
    # The last block is recomputed so the step has a query to sample from.
    assert b.num_cached_tokens == 8 and h.worker.num_computed_total - before == 4 + 1
    assert h.outputs["b"] == h.outputs["a"] == expected_output(prompt, 2, 64)


# ---- fair share between user requests ------------------------------------------------


class FairHarness(Harness):
    """Harness without the FCFS-victim check: fair share picks victims by group."""

    def check_victims(self, running_before, sched) -> None:
        victims = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        assert len(victims) == sched.num_preempted


def grouped(rid, group, prompt, max_tokens, arrival):
    request = make_request(rid, prompt, max_tokens, arrival=arrival)
    request.group_id = group
    return request


@pytest.mark.parametrize("limit", ["slots", "blocks"])
def test_a_small_request_is_not_starved_by_one_holding_every_sequence(limit):
    """One user request of 8 sequences fills every slot (or the KV pool) for 40 tokens each;
    a 4-token request arriving after it runs within two steps and finishes in a handful,
    while the big one keeps every slot the small one does not need and is never wrong."""
    rng = random.Random(5)
    if limit == "slots":
        s = make_scheduler(
            max_num_seqs=8, num_blocks=256, max_num_batched_tokens=64, max_model_len=64
        )
    else:
        s = make_scheduler(
            max_num_seqs=16, num_blocks=24, max_num_batched_tokens=64, max_model_len=64
        )
    h = FairHarness(s)
    big = {f"{i}_big": random_prompt(rng, 8) for i in range(8)}
    for i, (rid, prompt) in enumerate(big.items()):
        h.add(grouped(rid, "big", prompt, 40, arrival=float(i)))
    for _ in range(3):
        h.step()
    assert s.running_per_group["big"] == len(s.running) == 8
    small = random_prompt(rng, 5)
    h.add(grouped("small", "small", small, 4, arrival=100.0))
    started = None
    for step in range(12):
        h.step()
        if started is None and "small" in h.steps[-1].num_scheduled_tokens:
            started = step
        if "small" in h.finish_reasons:
            break
    assert started is not None and started <= 1, "the small request waited for the big one"
    assert h.finish_reasons["small"] == "length" and step <= 7
    assert h.outputs["small"] == expected_output(small, 4, 64)
    h.run()
    for rid, prompt in big.items():  # preempted and recomputed, never wrong
        assert h.outputs[rid] == expected_output(prompt, 40, 64)
    check_all_freed(s)


def test_fair_admission_takes_the_group_holding_fewest_sequences():
    s = make_scheduler(max_num_seqs=4, num_blocks=256, max_num_batched_tokens=64)
    h = FairHarness(s)
    for i in range(6):  # group a arrives first with 6 sequences
        h.add(grouped(f"a{i}", "a", [10 + i, 11], 8, arrival=float(i)))
    for i in range(2):
        h.add(grouped(f"b{i}", "b", [20 + i, 21], 8, arrival=10.0 + i))
    h.step()
    running = Counter(r.group_id for r in s.running)
    assert running == {"a": 2, "b": 2}  # not a0..a3, which arrival order alone would give


def test_priority_policy_keeps_strict_priority_without_fair_share():
    s = make_scheduler(max_num_seqs=2, num_blocks=256, policy="priority")
    h = Harness(s)
    for i in range(3):
        request = grouped(f"a{i}", "a", [10 + i], 8, arrival=float(i))
        request.priority = 0
        h.add(request)
    late = grouped("b", "b", [30], 8, arrival=9.0)
    late.priority = 5
    h.add(late)
    h.step()
    assert {r.request_id for r in s.running} == {"a0", "a1"}


# ---- a step that fails -------------------------------------------------------------


class StepFailed(RuntimeError):
    pass


class FaultyWorker(FakeWorker):
    """Fails a step (after taking its diffs in, as Worker.execute does) when `fails(ids)`
    says so for the step's request ids. The real worker drops an id it does not hold; so
    does this one (a failed step's finished ids are handed over again)."""

    def __init__(self, num_blocks: int, fails) -> None:
        super().__init__(num_blocks)
        self.fails = fails
        self.num_failed = 0

    def _apply_diffs(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
        sched = SchedulerOutput(
            new_requests=sched.new_requests,
            cached_requests=sched.cached_requests,
            num_scheduled_tokens=sched.num_scheduled_tokens,
        )
        super()._apply_diffs(sched)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.fails(set(sched.num_scheduled_tokens)):
            self._apply_diffs(sched)
            self.num_failed += 1
            raise StepFailed("injected")
        return super().execute(sched)


class FailingHarness(Harness):
    """Harness + EngineCore.step's handling of a step that raises."""

    def __init__(self, scheduler: Scheduler, fails) -> None:
        super().__init__(scheduler)
        self.worker = FaultyWorker(scheduler.kv.num_blocks, fails)
        self.errors: dict[str, str] = {}

    def step(self) -> SchedulerOutput:
        try:
            return super().step()
        except StepFailed:
            sched = self.steps[-1]
            for out in self.scheduler.step_failed(sched, "boom"):
                assert out.finish_reason == "error" and out.error == "boom"
                assert out.request_id not in self.finish_reasons
                self.finish_reasons[out.request_id] = "error"
            check_invariants(self.scheduler)
            return sched


def failing_workload():
    args = [
        dict(rid=rid, prompt=[k] * 5 + [k + 1] * 3, max_tokens=6, arrival=float(k))
        for k, rid in ((10, "a"), (20, "b"), (30, "c"), (40, "d"))
    ]
    return args, [make_request(**a) for a in args]


def test_a_request_that_fails_every_step_is_found_and_ended_the_others_complete():
    s = make_scheduler()
    h = FailingHarness(s, fails=lambda ids: "c" in ids)
    args, requests = failing_workload()
    h.add(*requests)
    h.run()
    assert h.finish_reasons == {"a": "length", "b": "length", "c": "error", "d": "length"}
    for a in args:
        if a["rid"] != "c":
            assert h.outputs[a["rid"]] == expected_output(a["prompt"], 6, 64)
    assert "c" not in h.outputs  # no token of it went out
    # the batch of four failed once; then suspects ran alone until c failed alone
    alone = [ids for ids in map(set, (st.num_scheduled_tokens for st in h.steps)) if len(ids) == 1]
    assert {"c"} in alone and h.worker.num_failed == 2
    assert requests[2].status == RequestStatus.FINISHED_ERROR and not s.suspects
    check_all_freed(s)


def test_a_step_of_one_request_that_fails_ends_it_at_once():
    s = make_scheduler()
    h = FailingHarness(s, fails=lambda ids: True)
    h.add(make_request("x", [5, 6, 7]))
    h.step()
    assert h.finish_reasons == {"x": "error"} and h.worker.num_failed == 1
    check_all_freed(s)


def test_a_failure_that_needs_company_ends_after_max_failed_steps_without_looping():
    """Any batch of two or more fails: alone, each suspect runs fine, then they batch and
    fail again; after MAX_FAILED_STEPS failed steps a request is ended, never a loop."""
    from ringllm.pipeline.core.failed_steps import MAX_FAILED_STEPS

    s = make_scheduler()
    h = FailingHarness(s, fails=lambda ids: len(ids) > 1)
    args, requests = failing_workload()
    h.add(*requests)
    h.run(max_steps=200)
    assert set(h.finish_reasons) == {"a", "b", "c", "d"}
    assert all(r.num_failed_steps <= MAX_FAILED_STEPS for r in requests)
    for a, request in zip(args, requests, strict=True):
        if h.finish_reasons[a["rid"]] != "error":  # a survivor's tokens are still exact
            assert h.outputs[a["rid"]] == expected_output(a["prompt"], 6, 64)
        else:
            assert request.num_failed_steps == MAX_FAILED_STEPS
    check_all_freed(s)


def test_a_request_taken_back_is_sent_to_the_worker_anew():
    s = make_scheduler()
    h = FailingHarness(s, fails=lambda ids: h.worker.num_failed == 0 and len(ids) > 1)
    args, requests = failing_workload()
    h.add(*requests)
    h.step()  # all four fail together, once
    assert not h.finish_reasons and s.suspects == {"a", "b", "c", "d"}
    h.step()
    first_alone = h.steps[-1]
    (rid,) = first_alone.num_scheduled_tokens
    assert [n.request_id for n in first_alone.new_requests] == [rid]
    # the workers drop all four (their state from the failed step is not trusted)
    assert first_alone.finished_request_ids == {"a", "b", "c", "d"}
    h.run()
    assert set(h.finish_reasons.values()) == {"length"}
    for a in args:
        assert h.outputs[a["rid"]] == expected_output(a["prompt"], 6, 64)
    check_all_freed(s)


class PromptLogprobWorker(FakeWorker):
    """Also gives one prompt-logprob row per prompt position computed (position p's row
    carries p as its token id), as Worker._prompt_logprobs does for a request asking."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        starts = {}
        for new in sched.new_requests:
            starts[new.request_id] = new.num_computed_tokens
        for cached in sched.cached_requests:
            starts[cached.request_id] = cached.num_computed_tokens
        prompt_lens = {rid: st.num_prompt_tokens for rid, st in self.states.items()}
        prompt_lens.update({n.request_id: n.num_prompt_tokens for n in sched.new_requests})
        out = super().execute(sched)
        for rid, n in sched.num_scheduled_tokens.items():
            start, end = starts[rid], min(starts[rid] + n, prompt_lens[rid] - 1)
            if start < end:
                out.prompt_logprobs[rid] = [LogprobRow([p], [0.0], 1) for p in range(start, end)]
        return out


def test_prompt_logprobs_go_out_once_even_when_a_preempted_request_recomputes():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=4)
    h = Harness(s)
    h.worker = PromptLogprobWorker(s.kv.num_blocks)
    rows: dict[str, list[int]] = defaultdict(list)
    real_update = s.update_from_output

    def update(sched, result):
        outputs = real_update(sched, result)
        for out in outputs:
            for row in out.new_prompt_logprobs or ():
                rows[out.request_id].append(row.token_ids[0])
        return outputs

    s.update_from_output = update
    args = [
        dict(
            rid=rid,
            prompt=[k] * 3 + [k + 1] * 3,
            max_tokens=10,
            arrival=float(k),
            prompt_logprobs=0,
        )
        for k, rid in ((10, "a"), (20, "b"), (30, "c"))
    ]
    h.add(*(make_request(**a) for a in args))
    h.run()
    assert s.num_preemptions >= 1  # some prompt was computed twice
    assert dict(rows) == {a["rid"]: list(range(5)) for a in args}  # positions 0..4, once each
    for a in args:
        assert h.outputs[a["rid"]] == expected_output(a["prompt"], 10, 64)
    check_all_freed(s)
