"""Async scheduling on a real model (`async_scheduling=True`): step N+1 is planned and sent
while step N runs on the worker's step thread, and whatever a request asks for comes out
exactly as it does without it. The oracle is the same engine without async scheduling (the
engine is batch-invariant: test_llm.py), so every token, logprob and finish reason must be
equal."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline import errors as errors_module
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.messages import EngineCoreRequest
from ringllm.pipeline.sampling_params import StructuredOutputsParams

ARGS = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=64)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def plain(model_path):
    return LLM(str(model_path), num_gpu_blocks_override=512, **ARGS)


@pytest.fixture(scope="module")
def ahead(model_path):
    return LLM(str(model_path), num_gpu_blocks_override=512, async_scheduling=True, **ARGS)


def prompts_of(count: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(count)]


def mixed_params(plain_llm, prompts) -> list[SamplingParams]:
    """Every kind of request a step ahead must keep exact: greedy and seeded sampling,
    penalties, logprobs and prompt logprobs, stop tokens and strings met early, min_tokens,
    max_tokens of 1."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = plain_llm.generate(prompts[:2], greedy, use_tqdm=False)
    tokens, text = base[0].outputs[0].token_ids, base[1].outputs[0].text
    kinds = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=24, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.7,
            seed=8,
            max_tokens=18,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3]]),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3]], min_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[text[6:8]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9),
    ]
    return [kinds[i % len(kinds)] for i in range(len(prompts))]


def same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert len(g.outputs) == len(w.outputs)
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids
            assert gc.text == wc.text
            assert (gc.finish_reason, gc.stop_reason) == (wc.finish_reason, wc.stop_reason)
            if wc.logprobs is not None:
                assert len(gc.logprobs) == len(wc.logprobs)
                for a, b in zip(gc.logprobs, wc.logprobs, strict=True):
                    assert a.keys() == b.keys()
                    for k in b:
                        assert a[k].logprob == pytest.approx(b[k].logprob, abs=1e-5)
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)


def test_mixed_requests_come_out_as_without_it(plain, ahead):
    prompts = prompts_of(40, seed=1)
    params = mixed_params(plain, prompts)
    want = plain.generate(prompts, params, use_tqdm=False)
    scheduler = ahead.llm_engine.engine_core.scheduler
    before = scheduler.num_scheduled_ahead
    got = ahead.generate(prompts, params, use_tqdm=False)
    same_outputs(got, want)
    assert scheduler.num_scheduled_ahead - before > 100  # it did schedule ahead
    assert not scheduler.in_flight and not ahead.llm_engine.engine_core.has_unfinished_requests()


def test_n_children_and_streaming_deltas(plain, ahead):
    prompt = prompts_of(1, seed=2)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    want = plain.generate([prompt], params, use_tqdm=False)
    same_outputs(ahead.generate([prompt], params, use_tqdm=False), want)


def test_preemption_and_chunked_prefill_keep_outputs_identical(model_path, plain):
    """A KV cache of a few blocks preempts constantly; prompts longer than the step budget
    are chunked: the steps ahead change nothing."""
    prompts = prompts_of(12, seed=3, low=40, high=90)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
    ]
    params = [params[i % 2] for i in range(len(prompts))]
    want = plain.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(model_path), num_gpu_blocks_override=24, async_scheduling=True, **ARGS)
    same_outputs(tight.generate(prompts, params, use_tqdm=False), want)
    core = tight.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_scheduled_ahead > 0
    assert core.scheduler.kv.pool.num_free_blocks == 24
    tight.shutdown()


def test_structured_outputs_beside_plain_requests(plain, ahead):
    """A request under a grammar needs each token for its next mask: while one is in
    flight the engine takes the batch in before planning the next, so it is never skipped
    a step, and its output is the one it gets without async scheduling."""
    structured = SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = ["A user as JSON:", "Hello there", "Another user:", "Count: 1 2 3"]
    params = [structured, free, structured, free]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = ahead.generate(prompts, params, use_tqdm=False)
    same_outputs(got, want)
    for out in (got[0], got[2]):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def _run_core(core: EngineCore, requests) -> dict[str, tuple[list[int], str | None]]:
    for request in requests:
        core.add_request(request)
    got: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in requests}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            return got
        for out in core.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason)
    raise AssertionError("requests still unfinished")


def _request(rid: str, prompt: list[int], seed: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, seed=seed, max_tokens=12, ignore_eos=True)
    return EngineCoreRequest(rid, prompt, params, (), 0.0)


def test_a_failing_request_costs_only_itself(model_path, monkeypatch):
    """A step that raises while the next one is already in flight: the failing request
    ends with an error, the others (taken back, run alone as suspects) end exactly as
    without the failure, and the engine goes on."""
    config = EngineConfig.from_kwargs(
        model=str(model_path), num_gpu_blocks_override=256, async_scheduling=True, **ARGS
    )
    prompts = prompts_of(4, seed=4)
    clean = EngineCore(config)
    want = _run_core(clean, [_request(f"r{i}", p, i) for i, p in enumerate(prompts)])
    clean.shutdown()
    core = EngineCore(config)
    # the first steps run clean (the requests go ahead), then the fault is armed
    requests = [_request(f"r{i}", p, i) for i, p in enumerate(prompts)]
    requests.append(_request("bad", prompts[0][:5], 6661))
    for request in requests:
        core.add_request(request)
    got = {r.request_id: ([], None) for r in requests}
    for _ in range(4):
        for out in core.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason)
    assert core.num_batches_in_flight == 1
    monkeypatch.setattr(errors_module, "_FAULT_SEEDS", {"forward": 6661})
    monkeypatch.setattr(errors_module, "FAULTS_ARMED", True)
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason)
    assert got["bad"][1] == "error"
    for rid, value in want.items():
        assert got[rid] == value, rid
    assert not core.scheduler.in_flight
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks
    core.shutdown()


def test_it_is_refused_where_it_cannot_apply(model_path):
    with pytest.raises(ValueError, match="async_scheduling: not with speculative_config"):
        EngineConfig.from_kwargs(
            model=str(model_path),
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="async_scheduling: not with pipeline_parallel_size"):
        EngineConfig.from_kwargs(
            model=str(model_path), async_scheduling=True, pipeline_parallel_size=2
        )


def test_tensor_parallel_ranks_take_two_batches_in_flight(model_path, plain):
    """With tensor_parallel_size 2 the ranks read both batches from their ring and each
    fills the tokens in from its own rows: the same outputs."""
    prompts = prompts_of(6, seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
    ]
    params = [params[i % 3] for i in range(len(prompts))]
    want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(
        str(model_path),
        num_gpu_blocks_override=512,
        async_scheduling=True,
        tensor_parallel_size=2,
        **ARGS,
    ) as tp:
        same_outputs(tp.generate(prompts, params, use_tqdm=False), want)
        core = tp.llm_engine.engine_core
        assert core.async_scheduling and core.scheduler.num_scheduled_ahead > 0
