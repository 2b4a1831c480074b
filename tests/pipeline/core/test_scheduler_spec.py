"""The scheduler with speculative decoding, driven by test_scheduler.py's fake worker taught
to verify drafts (no model).

The fake worker's "KV" at position p is a hash of every token up to p, drafts included, and
it reads the whole prefix back before each verification; so a rejected draft's slot that the
scheduler did not roll back, a block trimmed on one side only, or a prefix-cache block that
holds a draft instead of the request's own token shows up as a failed read-back or a wrong
token. Its proposer drafts the true continuation with a mistake at a random place (or none),
so runs are accepted in part, in whole, or not at all.
"""

from __future__ import annotations

import random

import pytest

from ringllm.pipeline.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    spec_blocks_kept,
)
from ringllm.pipeline.stats import SpecDecodingStats
from tests.pipeline.core.test_scheduler import (
    BS,
    EOS,
    FakeWorker,
    Harness,
    can_ever_run,
    check_all_freed,
    check_invariants,
    expected_output,
    make_request,
    make_scheduler,
    next_token,
    prefix_hashes,
    random_prompt,
    token_from_kv,
)


class SpecFakeWorker(FakeWorker):
    def __init__(self, num_blocks, k, rng, lookahead=0, script=None) -> None:
        super().__init__(num_blocks, script=script)
        self.k, self.rng, self.lookahead = k, rng, lookahead
        self.num_verified = 0
        self._trims: dict[str, int] = {}  # applied when the next step starts (see execute)

    def _apply_diffs(self, sched: SchedulerOutput) -> None:
        # NOTE: the real worker trims its table right after verifying; here the harness
        # compares both tables before the scheduler has read the result, so the trim waits
        # for the next step: the same table either way once the next step's diff is applied.
        for rid, kept in self._trims.items():
            if rid in self.states:
                self.states[rid].block_ids = self.states[rid].block_ids[:kept]
        self._trims = {}
        super()._apply_diffs(sched)

    def _true_token(self, rid, tokens: list[int], kv_value: int, state) -> int:
        script = self.script.get(rid)
        if script is not None:
            return script[len(tokens) - state.num_prompt_tokens]
        return token_from_kv(kv_value)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(sched)
        req_ids = list(sched.num_scheduled_tokens)
        drafts = sched.scheduled_spec_tokens
        assert set(drafts) <= set(req_ids)
        for rid in req_ids:
            state, d = self.states[rid], drafts.get(rid, [])
            start = state.num_computed_tokens
            end = start + sched.num_scheduled_tokens[rid]
            known_end = end - len(d)
            assert known_end <= len(state.token_ids), f"{rid}: scheduled past its tokens"
            if d:  # drafts follow the last known token, never a prompt chunk
                assert known_end == len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= end, f"{rid}: too few blocks"
            if self.lookahead and known_end == len(state.token_ids):
                need = min(end + self.lookahead, 64)  # the harness's max_model_len
                assert len(state.block_ids) * self.block_size >= need, f"{rid}: no lookahead"
            values = prefix_hashes(state.token_ids + d)
            for pos in range(start, end):
                self.kv[self._slot(state, pos)] = values[pos]
        out = ModelRunnerOutput(req_ids, [], [None] * len(req_ids))
        for rid in req_ids:
            state, d = self.states[rid], drafts.get(rid, [])
            start = state.num_computed_tokens
            end = start + sched.num_scheduled_tokens[rid]
            if end - len(d) < len(state.token_ids):
                out.sampled_token_ids.append(None)
                state.num_computed_tokens = end
                continue
            read = [int(self.kv[self._slot(state, pos)]) for pos in range(end)]
            assert read == prefix_hashes((state.token_ids + d)[:end]), f"{rid}: KV is wrong"
            run, tokens = [], list(state.token_ids)
            for j in range(len(d) + 1):
                true = self._true_token(rid, tokens, read[len(state.token_ids) - 1 + j], state)
                run.append(true)
                tokens.append(true)
                if j == len(d) or d[j] != true:
                    break
            accepted = len(run) - 1
            state.token_ids += run
            state.num_computed_tokens = end - (len(d) - accepted)
            if d:
                out.accepted_token_ids[rid] = run[:-1]
                self._trims[rid] = spec_blocks_kept(state.num_computed_tokens, self.lookahead, BS)
                self.num_verified += 1
            out.sampled_token_ids.append(run[-1])
            out.spec_token_ids[rid] = self._propose(rid, state)
        return out

    def _propose(self, rid, state) -> list[int]:
        """The true continuation, wrong from a random position on (or right throughout)."""
        tokens = list(state.token_ids)
        script = self.script.get(rid)
        proposal = []
        for _ in range(self.k):
            if script is not None:
                index = len(tokens) - state.num_prompt_tokens
                true = script[index] if index < len(script) else 5
            else:
                true = next_token(tokens)
            proposal.append(true)
            tokens.append(true)
        wrong_from = self.rng.randint(0, self.k + 2)
        return [t if i < wrong_from else 2 for i, t in enumerate(proposal)]


def spec_harness(s, k=3, seed=0, lookahead=0, script=None) -> Harness:
    h = Harness(s, script=script)
    h.worker = SpecFakeWorker(s.kv.num_blocks, k, random.Random(seed), lookahead, script)
    return h


@pytest.mark.parametrize("lookahead", [0, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_drafts_keeps_invariants_and_outputs(seed, lookahead):
    """Shared prefixes, aborts and preemption on a small pool, every request speculating:
    each one that was not aborted produces exactly what it would have alone, and the
    budget counts the drafts."""
    rng = random.Random(seed)
    max_model_len = 64
    num_blocks = rng.randint(12, 16)
    s = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=rng.randint(2, 5),
        max_num_batched_tokens=rng.randint(8, 20),
        max_model_len=max_model_len,
        caching=seed != 0,
    )
    s.num_lookahead_slots = lookahead
    h = spec_harness(s, k=3, seed=seed, lookahead=lookahead)
    prefixes = [random_prompt(rng, 12) for _ in range(3)]
    expected, aborted = {}, set()
    for i in range(120):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + random_prompt(
                rng, rng.randint(0, 24)
            )
            max_tokens = rng.randint(1, 20)
            request = make_request(f"r{i}", prompt, max_tokens, arrival=float(i))
            fits = can_ever_run(len(prompt), max_tokens + lookahead, num_blocks, max_model_len)
            if fits:
                h.add(request)
                expected[f"r{i}"] = expected_output(prompt, max_tokens, max_model_len)
        live = sorted(s.requests)
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            s.abort_requests([victim])
            aborted.add(victim)
            check_invariants(s)
        h.step()
    h.run()
    for rid, tokens in expected.items():
        if rid in aborted:
            assert tokens[: len(h.outputs[rid])] == h.outputs[rid]
        else:
            assert h.outputs[rid] == tokens, rid
    assert h.worker.num_verified > 0 and s.num_preemptions > 0
    check_all_freed(s)


def test_drafts_are_counted_in_the_budget_and_dropped_past_it():
    s = make_scheduler(max_num_batched_tokens=6, max_num_seqs=4)
    h = spec_harness(s, k=4, seed=1)
    h.add(make_request("a", random_prompt(random.Random(0), 5), 30))
    h.add(make_request("b", random_prompt(random.Random(1), 5), 30))
    for _ in range(12):
        sched = h.step()
        assert sched.total_num_scheduled_tokens <= 6
        for d in sched.scheduled_spec_tokens.values():
            assert 1 <= len(d) <= 4
    assert any(sched.scheduled_spec_tokens for sched in h.steps)


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    """The scripted output has EOS at position 3; the proposer drafts it inside a run:
    nothing after it is emitted and the request ends "stop"."""
    s = make_scheduler()
    script = {"a": [40, 41, 42, EOS, 43, 44, 45, 46, 47, 48]}
    h = spec_harness(s, k=4, seed=3, script=script)
    h.worker.rng = random.Random(0)
    h.worker.rng.randint = lambda lo, hi: hi  # drafts always right
    h.add(make_request("a", [7, 8, 9], 10))
    h.run()
    assert h.outputs["a"] == [40, 41, 42, EOS]
    assert h.finish_reasons["a"] == "stop"
    check_all_freed(s)


def test_max_tokens_inside_an_accepted_run_and_drafts_trimmed_to_what_can_be_emitted():
    s = make_scheduler()
    h = spec_harness(s, k=4, seed=3)
    h.worker.rng.randint = lambda lo, hi: hi
    prompt = random_prompt(random.Random(5), 6)
    h.add(make_request("a", prompt, 7))
    h.run()
    assert h.outputs["a"] == expected_output(prompt, 7, 64)
    assert h.finish_reasons["a"] == "length"
    for sched in h.steps:  # never more drafts than the output has room for
        for d in sched.scheduled_spec_tokens.values():
            assert len(d) <= 7 - 1
    check_all_freed(s)


def test_rejected_drafts_free_the_blocks_they_emptied_and_only_verified_tokens_are_cached():
    """A request whose drafts are all wrong: each step writes drafts into a fresh block, the
    rejection frees it; a second request with the first one's whole sequence as its prompt
    hits only blocks of verified tokens (the fake worker's read-back proves their KV)."""
    s = make_scheduler(num_blocks=32)
    h = spec_harness(s, k=4, seed=0)
    h.worker._propose = lambda rid, state: [2, 2, 2, 2]  # always wrong
    prompt = random_prompt(random.Random(9), 3)  # 3 + 1 + 4 drafts: past one block
    h.add(make_request("a", prompt, 12))
    held = []
    while s.has_unfinished_requests():
        h.step()
        if s.requests:
            held.append(len(s.kv.block_ids("a")))
            request = s.requests["a"]
            assert held[-1] == spec_blocks_kept(request.num_computed_tokens, 0, BS)
    tokens = prompt + h.outputs["a"]
    assert h.outputs["a"] == expected_output(prompt, 12, 64)
    h.add(make_request("b", tokens + [11], 2))
    h.run()
    assert h.outputs["b"] == expected_output(tokens + [11], 2, 64)
    assert s.kv.prefix_stats.hits == (len(tokens) // BS) * BS
    check_all_freed(s)


def test_speculation_stats_count_drafts_and_acceptance_per_position():
    s = make_scheduler()
    s.spec_stats = SpecDecodingStats()  # what Scheduler(speculative=True) starts with
    h = spec_harness(s, k=3, seed=4)
    h.add(make_request("a", random_prompt(random.Random(2), 4), 25))
    h.run()
    stats = s.make_stats().spec_decoding
    verified = sum(len(d) for st in h.steps for d in st.scheduled_spec_tokens.values())
    assert stats.num_drafts == h.worker.num_verified > 0
    assert stats.num_draft_tokens == verified
    assert 0 < stats.num_accepted_tokens < verified
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] >= stats.accepted_per_pos[2]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert s.make_stats().spec_decoding.num_drafts == 0  # counts since the last report
