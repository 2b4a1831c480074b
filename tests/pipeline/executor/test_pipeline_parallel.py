"""Pipeline parallelism on the CPU (gloo): the decoder's layers split into stages, one rank
process per stage (x tensor-parallel ranks), hidden states and residuals sent from stage to
stage, the last stage sampling, the engine core keeping one batch in flight per stage and
handing the sampled tokens to the earlier stages with each request's next step.

Oracle: the same engine with one process (PP=1): greedy tokens identical and logprobs
within 1e-4 on a mixed batch (chunked prefill split at odd points, preemption by swap and
by recompute, n > 1, prompt logprobs), for even and uneven splits and PP=2 x TP=2."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.frontend.llm import LLM
from ringllm.pipeline.sampling_params import SamplingParams

BASE = dict(dtype="float32", block_size=8, max_num_batched_tokens=29, seed=3)


@pytest.fixture(scope="module")
def model(model_factory):
    return str(model_factory("llama", num_layers=4))


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 400, int(rng.integers(8, 70))).tolist() for _ in range(count)]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True, n=2),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=10, seed=4, max_tokens=20, ignore_eos=True),
]


def run(model, **kwargs):
    with LLM(model, **BASE, **kwargs) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts(len(PARAMS), seed=1)], PARAMS, use_tqdm=False
        )
        scheduler = llm.llm_engine.engine_core.scheduler
        return results, scheduler.num_preemptions, scheduler.num_swaps


def check_same(results, expected) -> None:
    for got, want in zip(results, expected, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        for g, w in zip(got.outputs, want.outputs, strict=True):
            for row_g, row_w in zip(g.logprobs or [], w.logprobs or [], strict=True):
                for token, lp in row_w.items():
                    assert abs(row_g[token].logprob - lp.logprob) <= 1e-4
        for row_g, row_w in zip(got.prompt_logprobs or [], want.prompt_logprobs or [], strict=True):
            for token, lp in (row_w or {}).items():
                assert abs(row_g[token].logprob - lp.logprob) <= 1e-4


@pytest.fixture(scope="module")
def expected(model):
    results, preemptions, _ = run(model)
    assert preemptions == 0
    return results


@pytest.mark.parametrize(
    "parallel",
    [
        dict(pipeline_parallel_size=2),
        dict(pipeline_parallel_size=2, pipeline_layer_partition="1,3"),
        dict(pipeline_parallel_size=3),
        dict(pipeline_parallel_size=2, tensor_parallel_size=2),
    ],
    ids=["pp2", "pp2-uneven", "pp3", "pp2xtp2"],
)
def test_stages_give_the_single_process_outputs(model, expected, parallel):
    results, _, _ = run(model, **parallel)
    check_same(results, expected)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_across_stages(model, expected, mode):
    """A KV cache forced small: every stage swaps (or drops) its own layers' blocks."""
    results, preemptions, swaps = run(
        model, pipeline_parallel_size=2, num_gpu_blocks_override=20, preemption_mode=mode
    )
    assert preemptions > 0 and (swaps > 0) == (mode == "swap")
    check_same(results, expected)


def drive(core: EngineCore, requests, on_step=None, max_steps: int = 5000) -> dict:
    """Steps `core` until it is done; each request's tokens. `on_step(core, step)` runs
    after every step."""
    from ringllm.pipeline.messages import EngineCoreRequest

    for rid, prompt, params in requests:
        core.add_request(EngineCoreRequest(rid, prompt, params, (), 0.0))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for step in range(max_steps):
        if not core.has_work():
            return tokens
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        if on_step is not None:
            on_step(core, step)
    raise AssertionError("the engine did not finish")


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def greedy_requests(count: int, seed: int):
    return [(f"g{i}", p, GREEDY) for i, p in enumerate(prompts(count, seed))]


@pytest.fixture(scope="module")
def greedy_expected(model):
    core = EngineCore(EngineConfig.from_kwargs(model=model, **BASE))
    try:
        return drive(core, greedy_requests(8, seed=5))
    finally:
        core.shutdown()


@pytest.mark.parametrize("pp", [2, 3])
def test_every_stage_has_a_batch_in_flight(model, greedy_expected, pp):
    """P batches in flight at once, results taken in in order (the tokens are one
    process's), and each stage's counts: every rank ran every batch, what one stage sent
    the next received."""
    core = EngineCore(EngineConfig.from_kwargs(model=model, **BASE, pipeline_parallel_size=pp))
    executor, seen = core.executor, []
    collect = executor.collect

    def counting_collect():
        seen.append(executor.num_in_flight)
        return collect()

    executor.collect = counting_collect
    try:
        tokens = drive(core, greedy_requests(8, seed=5))
        # NOTE: an earlier stage counts its step once its send is handed over, which can
        # come a moment after the last stage has answered: wait (boundedly) for the counts.
        deadline = time.monotonic() + 5.0
        stats = executor.stage_stats()
        while len({row["steps"] for row in stats}) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
            stats = executor.stage_stats()
    finally:
        core.shutdown()
    assert tokens == greedy_expected
    assert max(seen) == pp
    assert len({row["steps"] for row in stats}) == 1 and stats[0]["steps"] > 0
    for before, after in zip(stats, stats[1:], strict=False):
        assert before["bytes_sent"] == after["bytes_received"] > 0
    assert stats[-1]["bytes_sent"] == 0 and stats[0]["bytes_received"] == 0
    assert all(row["step_s"] >= row["recv_wait_s"] + row["send_wait_s"] for row in stats)


def test_an_abort_in_flight_costs_only_that_request(model, greedy_expected):
    """A request aborted while its batch is in the stages: its result is dropped, its
    blocks go to later batches, and the others' tokens are one process's."""
    core = EngineCore(EngineConfig.from_kwargs(model=model, **BASE, pipeline_parallel_size=2))
    aborted = []

    def abort_once(c, step):
        if not aborted and c.num_batches_in_flight and step > 10:
            victim = next(iter(c.scheduler.in_flight))
            c.abort_requests([victim])
            aborted.append(victim)

    try:
        tokens = drive(core, greedy_requests(8, seed=5), abort_once)
    finally:
        core.shutdown()
    assert aborted
    for rid, want in greedy_expected.items():
        if rid == aborted[0]:
            assert tokens[rid] == want[: len(tokens[rid])] and len(tokens[rid]) < len(want)
        else:
            assert tokens[rid] == want


def test_a_pause_in_flight_takes_effect_after_its_batch_and_resumes_exactly(model, greedy_expected):
    """A request paused (its client reads nothing) while its batch is in the stages: the
    batch is taken in first, then it is paused (out of the running set, a few steps
    later still), and resumed it ends as in one process, like every other request."""
    from ringllm.pipeline.core.request import RequestStatus

    core = EngineCore(EngineConfig.from_kwargs(model=model, **BASE, pipeline_parallel_size=2))
    paused, statuses = [], []

    def pause_then_resume(c, step):
        if not paused and c.num_batches_in_flight and step > 5:
            victim = next(iter(c.scheduler.in_flight))
            c.pause_requests([victim])
            paused.append((victim, step))
        elif paused and step == paused[0][1] + 6:
            statuses.append(c.scheduler.requests[paused[0][0]].status)
            c.resume_requests([paused[0][0]])

    try:
        tokens = drive(core, greedy_requests(8, seed=5), pause_then_resume)
    finally:
        core.shutdown()
    assert paused and statuses == [RequestStatus.PAUSED]
    assert tokens == greedy_expected


def test_sleep_takes_in_the_batches_in_flight_first(model, greedy_expected):
    """sleep with batches in flight: they are taken in (their tokens go out with the next
    step), the engine sleeps and wakes, and every request ends as in one process."""
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=model, **BASE, pipeline_parallel_size=2, enable_sleep_mode=True
        )
    )
    slept = []

    def sleep_once(c, step):
        if not slept and c.num_batches_in_flight and step > 6:
            assert c.control("sleep", 1) is None
            slept.append(c.num_batches_in_flight)
            assert c.control("wake_up") is None

    try:
        tokens = drive(core, greedy_requests(8, seed=5), sleep_once)
    finally:
        core.shutdown()
    assert slept == [0]
    assert tokens == greedy_expected


def test_the_kv_cache_grows_with_the_stages(model):
    """The same KV budget per rank holds twice the blocks when each holds half the layers."""
    budget = dict(kv_cache_memory_bytes=1 << 20, swap_space=0)
    one = EngineCore(EngineConfig.from_kwargs(model=model, **BASE, **budget))
    two = EngineCore(
        EngineConfig.from_kwargs(model=model, **BASE, pipeline_parallel_size=2, **budget)
    )
    try:
        assert two.info.num_blocks == 2 * one.info.num_blocks
    finally:
        one.shutdown()
        two.shutdown()


def test_a_killed_stage_rank_is_noticed_within_a_second(model):
    core = EngineCore(EngineConfig.from_kwargs(model=model, **BASE, pipeline_parallel_size=2))
    try:
        from ringllm.pipeline.messages import EngineCoreRequest

        core.add_request(
            EngineCoreRequest(
                "r", prompts(1, seed=2)[0], SamplingParams(max_tokens=500, ignore_eos=True), (), 0.0
            )
        )
        core.step()
        os.kill(core.executor.pids[1], signal.SIGKILL)  # the last stage
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(1000):
                core.step()
        assert time.monotonic() - started < 1.0
    finally:
        core.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipeline_parallel_size=5), "5 stages is more than the model's 4 layers"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="1,2"), "add"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="2,x"), "integer"),
        (dict(pipeline_parallel_size=3, tensor_parallel_size=3), "make sense"),
        (
            dict(
                pipeline_parallel_size=2,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            ),
            "speculative_config: not with pipeline_parallel_size",
        ),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be >= 1"),
    ],
    ids=["too-many-stages", "partition-sum", "partition-text", "too-many-ranks", "spec", "zero"],
)
def test_bad_pipeline_configurations_are_refused_at_start(model, kwargs, message):
    if kwargs.get("tensor_parallel_size") == 3 and 9 <= 4 * (os.cpu_count() or 1):
        pytest.skip("this machine has the cores for 9 ranks")
    with pytest.raises(ValueError, match=message):
        EngineCore(EngineConfig.from_kwargs(model=model, **BASE, **kwargs))


def test_images_go_through_the_first_stage(tmp_path):
    """LLaVA over two stages: the vision tower and the encoder cache are the first
    stage's; the tokens equal one process's."""
    from PIL import Image

    from ringllm.tools.make_model import ModelShape, make_model

    folder = str(make_model(tmp_path / "llava", ModelShape(arch="llava")))
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 30, 3), np.uint8))
    prompt = {"prompt": "<image> what", "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for parallel in ({}, {"pipeline_parallel_size": 2}):
        with LLM(folder, dtype="float32", max_model_len=512, **parallel) as llm:
            tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_nccl_rendezvous_has_a_segment_per_group_without_a_gpu():
    """On GPUs each stage's tensor-parallel group and the grid of all ranks meet through an
    NCCL id segment of their own; all are removed on close."""
    from ringllm.ipc.shm import list_segments
    from ringllm.pipeline.executor.process_groups import Rendezvous, stage_addresses

    rendezvous = Rendezvous.create("cuda", num_stages=3)
    try:
        stages, world = stage_addresses(rendezvous.address, 3)
        names = [*stages, world]
        assert len(set(names)) == 4 and set(names) <= set(list_segments())
        with pytest.raises(ValueError, match="3 NCCL id segments for 4 stages"):
            stage_addresses(",".join(stages), 4)
    finally:
        rendezvous.close()
    assert not set(names) & set(list_segments())
    single = Rendezvous.create("cuda")
    try:
        assert stage_addresses(single.address, 1) == ([single.address], single.address)
    finally:
        single.close()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs a CUDA device (two of them)")
def test_nccl_pp2_equals_pp1(model):
    """Two stages on two GPUs, hidden states over ncclSend / ncclRecv: one GPU's tokens."""
    args = dict(dtype="float32", num_gpu_blocks_override=64, device="cuda", swap_space=0)
    requests = [{"prompt_token_ids": p} for p in prompts(4, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model, **args) as llm:
        want = [r.outputs[0].token_ids for r in llm.generate(requests, params, use_tqdm=False)]
    with LLM(model, pipeline_parallel_size=2, **args) as llm:
        got = [r.outputs[0].token_ids for r in llm.generate(requests, params, use_tqdm=False)]
    assert got == want
