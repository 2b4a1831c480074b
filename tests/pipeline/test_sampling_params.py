"""SamplingParams: vLLM's defaults, normalization, validation messages, helpers."""

import math

import pytest

from ringllm.pipeline.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert params.n == 1
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.seed is None
    assert params.stop == [] and params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert params.include_stop_str_in_output is False
    assert params.logit_bias is None
    assert params.use_beam_search is False
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert MAX_LOGPROBS == 20
    assert not params.is_greedy


def test_stop_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]


def test_logit_bias_clamped_and_keys_checked():
    params = SamplingParams(logit_bias={3: 250, 4: -1000.0, 5: 1.5})
    assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 1.5}
    with pytest.raises(ValueError, match=r"logit_bias.*'3'"):
        SamplingParams(logit_bias={"3": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: math.nan})


def test_max_tokens_none_means_up_to_context():
    assert SamplingParams(max_tokens=None, min_tokens=50).max_tokens is None


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("temperature", -0.1, "[0, inf)"),
        ("temperature", math.nan, "[0, inf)"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_k", -2, "[-1, 2147483647]"),
        ("top_k", 2.0, "[-1, 2147483647]"),
        ("top_k", 2**31, "[-1, 2147483647]"),  # the wire's int32
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.1, "[-2, 2]"),
        ("repetition_penalty", 0.0, "(0, inf)"),
        ("repetition_penalty", 1e-320, "does not fit float32"),  # 0 in the sampler
        ("temperature", 1e300, "does not fit float32"),  # inf there: -inf / inf = NaN
        ("min_p", 1e-45, "does not fit float32"),
        ("max_tokens", 0, "[1, 2147483647]"),
        ("max_tokens", 2**31, "[1, 2147483647]"),
        ("min_tokens", -1, "[0, 2147483647]"),
        ("min_tokens", 2**40, "[0, 2147483647]"),
        ("logprobs", MAX_LOGPROBS + 1, "[0, 20]"),
        ("logprobs", -1, "[0, 20]"),
        ("prompt_logprobs", 21, "[0, 20]"),
        ("n", 0, "[1, 2147483647]"),
        ("seed", 1.5, "None"),
        ("stop_token_ids", [-1], "ints >= 0"),
        ("stop_token_ids", [2**31], "at most 2147483647"),  # the wire's int32
        ("logit_bias", {2**31: 1.0}, "at most 2147483647"),
        ("stop", [""], "non-empty"),
        ("logit_bias", {-3: 1.0}, "ints >= 0"),
        ("output_kind", "delta", "CUMULATIVE"),
        ("use_beam_search", True, "False"),
    ],
)
def test_validation_names_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert message.startswith(field + ":")
    assert allowed in message
    if field not in ("logit_bias", "stop", "stop_token_ids"):
        assert repr(value) in message or str(value) in message


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens: must be <= max_tokens \(4 tokens\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_numbers_are_floats_after_validation():
    params = SamplingParams(temperature=0, top_p=1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.is_greedy
    assert SamplingParams(temperature=0.9e-5).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_top_k_minus_one_and_zero_accepted():
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0).top_k == 0


def test_clone_is_deep():
    params = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0}, seed=7)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.stop_token_ids.append(5)
    copy.logit_bias[9] = -1.0
    assert params.stop == ["x"] and params.stop_token_ids == [1] and params.logit_bias == {2: 1.0}


def test_all_stop_token_ids():
    params = SamplingParams(stop_token_ids=[5, 6])
    assert params.all_stop_token_ids(2) == {2, 5, 6}
    assert params.all_stop_token_ids([2, 3]) == {2, 3, 5, 6}
    assert params.all_stop_token_ids(None) == {5, 6}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids([2]) == {5}


def test_check_token_ids_against_vocab():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).check_token_ids(10)
    with pytest.raises(
        ValueError, match=r"logit_bias: token ids must be < vocab size 10, got \[10\]"
    ):
        SamplingParams(logit_bias={10: 1.0}).check_token_ids(10)
    with pytest.raises(ValueError, match=r"stop_token_ids: .* < vocab size 10, got \[12\]"):
        SamplingParams(stop_token_ids=[3, 12]).check_token_ids(10)
