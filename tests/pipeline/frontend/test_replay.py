"""What a replayed sequence asks of a new engine core: the rest of its budget."""

from __future__ import annotations

from ringllm.pipeline.frontend.front_end import remaining_params
from ringllm.pipeline.sampling_params import SamplingParams


def test_nothing_delivered_replays_the_request_as_it_was():
    params = SamplingParams(max_tokens=10, min_tokens=3, seed=5, prompt_logprobs=1)
    assert remaining_params(params, 0) is params


def test_the_rest_of_the_budget_and_no_second_prompt_logprobs():
    params = SamplingParams(max_tokens=10, min_tokens=3, seed=5, prompt_logprobs=1, logprobs=2)
    rest = remaining_params(params, 4)
    assert rest.max_tokens == 6 and rest.min_tokens == 0
    assert rest.prompt_logprobs is None  # they went out with the first output
    assert rest.logprobs == 2 and rest.seed == 9  # a seed derived from seed and length
    assert remaining_params(SamplingParams(max_tokens=10, min_tokens=8), 3).min_tokens == 5


def test_unseeded_and_uncapped_stay_so():
    rest = remaining_params(SamplingParams(max_tokens=None, temperature=0.7), 4)
    assert rest.max_tokens is None and rest.seed is None and rest.temperature == 0.7
