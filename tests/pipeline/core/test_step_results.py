"""core/step_results.py: a step's tokens checked one by one for a stop, prompt-logprob rows
sent once per position, and the output one result row makes."""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.core.speculation import Speculation
from ringllm.pipeline.core.step_results import (
    append_tokens,
    check_stop,
    new_prompt_logprobs,
    queued_s,
    take_result,
)
from ringllm.pipeline.sampling_params import SamplingParams

EOS = 1


def req(max_tokens: int = 8, **params) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**params), {EOS}, max_tokens=max_tokens)


def test_check_stop_by_eos_stop_token_min_tokens_and_length():
    request = req()
    request.append_output_token(EOS)
    assert check_stop(request, 64) == RequestStatus.FINISHED_STOPPED
    request = req(min_tokens=2)
    request.append_output_token(EOS)
    assert check_stop(request, 64) is None  # before min_tokens
    request = req(stop_token_ids=[9])
    request.append_output_token(9)
    assert check_stop(request, 64) == RequestStatus.FINISHED_STOPPED and request.stop_reason == 9
    request = req(max_tokens=1)
    request.append_output_token(4)
    assert check_stop(request, 64) == RequestStatus.FINISHED_LENGTH_CAPPED
    request = req()
    request.append_output_token(4)
    assert check_stop(request, 4) == RequestStatus.FINISHED_LENGTH_CAPPED  # the context
    assert check_stop(req(ignore_eos=True), 64) is None


def test_nothing_past_a_stop_is_appended():
    request = req()
    tokens, logprobs, status = append_tokens(request, [4, EOS, 6], [None, None, None], 64)
    assert tokens == [4, EOS] and logprobs == [] and status == RequestStatus.FINISHED_STOPPED
    assert request.all_token_ids == [5, 6, 7, 4, EOS]


def test_prompt_logprob_rows_go_out_once_per_position():
    request = req()
    request.num_computed_tokens = 2
    assert new_prompt_logprobs(request, 0, ["p0", "p1"]) == ["p0", "p1"]
    request.num_computed_tokens = 3  # a recompute from 0 repeats rows 0 and 1
    assert new_prompt_logprobs(request, 0, ["p0", "p1", "p2"]) == ["p2"]
    assert new_prompt_logprobs(request, 0, ["p0", "p1", "p2"]) is None
    assert new_prompt_logprobs(request, 0, None) is None


def test_take_result_emits_the_accepted_drafts_then_the_sampled_token():
    kv = KVCacheManager(16, 4, 64, 2)
    request = req()
    request.times.first_scheduled = request.times.arrival + 0.5
    kv.allocate_slots(request, 3 + 2)
    request.num_computed_tokens = 5  # the prompt and two drafts
    sched = SchedulerOutput(num_scheduled_tokens={"r": 5}, scheduled_spec_tokens={"r": [8, 9]})
    result = ModelRunnerOutput(
        ["r"], [4], [None], accepted_token_ids={"r": [8]}, spec_token_ids={"r": [2, 3]}
    )
    output, status = take_result(request, sched, result, 0, Speculation(0, 64, None), kv, 64)
    assert output.new_token_ids == [8, 4] and status is None
    assert request.num_computed_tokens == 4 and request.spec_token_ids == [2, 3]
    assert output.queued_s == queued_s(request) == 0.5
    sched = SchedulerOutput(num_scheduled_tokens={"r": 1})
    assert (
        take_result(request, sched, ModelRunnerOutput(["r"], [None], [None]), 0, None, kv, 64)
        is None
    )
