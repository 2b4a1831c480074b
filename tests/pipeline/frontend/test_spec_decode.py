"""Speculative decoding end to end through `LLM`, on tiny random models: greedy outputs are
token-identical with and without it (a mixed batch, runs ending inside an accepted run, a
stop string inside a draft, forced preemption, chunked prefill, n > 1, penalties,
min_tokens, logprobs); random sampling keeps the target's distribution (a two-sample
chi-square test of the tokens that were verified as drafts); seeded requests repeat."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ringllm.pipeline import LLM, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
ENGINE = {"dtype": "float32", "max_num_seqs": 64, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def plain(model_path):
    return LLM(model_path, num_gpu_blocks_override=512, **ENGINE)


@pytest.fixture(scope="module")
def ngram(model_path):
    return LLM(model_path, num_gpu_blocks_override=512, speculative_config=NGRAM, **ENGINE)


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram hits) or not, of mixed lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 500) for _ in range(rng.randint(2, 8))]
        if i % 3:
            prompts.append(phrase * rng.randint(2, 12))
        else:
            prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(1, 90))])
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def spec_counts(llm: LLM):
    return llm.llm_engine.front_end.spec_decoding


def test_greedy_mixed_batch_is_token_identical_and_drafts_were_accepted(plain, ngram):
    rng = random.Random(0)
    prompts = repetitive_prompts(40, seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in prompts
    ]
    before = spec_counts(ngram).num_accepted_tokens
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    got = token_ids(ngram.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert [len(t) for t in got] == [p.max_tokens for p in params]  # max_tokens inside runs
    assert spec_counts(ngram).num_accepted_tokens - before > 50


def test_logprobs_penalties_min_tokens_and_n_are_those_of_plain_decoding(plain, ngram):
    prompts = repetitive_prompts(12, seed=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20),
        SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=2, logprobs=1),
    ] * 2
    want = plain.generate(prompts, params, use_tqdm=False)
    got = ngram.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert wc.finish_reason == gc.finish_reason
            if wc.logprobs is not None:
                for wl, gl in zip(wc.logprobs, gc.logprobs, strict=True):
                    assert wl.keys() == gl.keys()
                    for token in wl:
                        assert gl[token].logprob == pytest.approx(wl[token].logprob, abs=1e-4)
                        assert gl[token].rank == wl[token].rank
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)


def test_a_stop_string_inside_a_draft_ends_the_output_there(plain, ngram, model_path):
    prompt = repetitive_prompts(3, seed=4)[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    text = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = ngram.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.text == want.text and stop not in got.text
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.stop_reason == stop


def test_preemption_and_chunked_prefill_keep_greedy_outputs(plain, model_path):
    """A KV pool far too small for the batch (requests preempted and recomputed) and a
    small token budget (prompts in chunks, drafts cut to what is left)."""
    small = LLM(
        model_path,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=24,
        num_gpu_blocks_override=16,
        speculative_config=NGRAM,
    )
    prompts = repetitive_prompts(16, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    got = token_ids(small.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert spec_counts(small).num_accepted_tokens > 0


def test_batch_size_cutoff_turns_proposals_off(model_path, plain):
    off = LLM(
        model_path,
        num_gpu_blocks_override=512,
        speculative_config={**NGRAM, "disable_by_batch_size": 4},
        **ENGINE,
    )
    prompts = repetitive_prompts(12, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert token_ids(off.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )
    assert spec_counts(off).num_drafts == 0  # 12 requests a step, more than 4: no drafts
    off.generate(prompts[1:2], params, use_tqdm=False)
    assert spec_counts(off).num_drafts > 0  # one request alone speculates


def test_a_seeded_request_repeats_whatever_its_neighbours(ngram):
    prompt = repetitive_prompts(2, seed=7)[1]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    alone = token_ids(ngram.generate([prompt], seeded, use_tqdm=False))[0]
    others = repetitive_prompts(8, seed=8)
    mixed = ngram.generate(
        [*others[:4], prompt, *others[4:]],
        [SamplingParams(temperature=0.9, max_tokens=30)] * 4
        + [seeded]
        + [SamplingParams(temperature=0.0, max_tokens=30)] * 4,
        use_tqdm=False,
    )
    assert list(mixed[4].outputs[0].token_ids) == alone


def _two_sample_p(a: list, b: list) -> float:
    """Chi-square test that two samples of tokens come from one distribution; categories
    seen fewer than 10 times in all are pooled."""
    ca, cb = Counter(a), Counter(b)
    total = ca + cb
    common = [t for t, n in total.items() if n >= 10]
    rows = [[ca[t] for t in common], [cb[t] for t in common]]
    rest = [len(a) - sum(rows[0]), len(b) - sum(rows[1])]
    if min(rest) > 0:
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(table.shape[1] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def test_temperature_1_outputs_keep_the_target_distribution(plain, ngram):
    """2,000 seeds at temperature 1 with and without speculation: the distribution of the
    2nd and 3rd generated tokens (the first ones that can come from verified drafts) is the
    same (p > 0.01), and most of them did go through verification."""
    prompt = list(range(3, 300)) * 2  # every likely token has an n-gram follower
    seeds = range(2000)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
    before = spec_counts(ngram).num_draft_tokens
    want = token_ids(plain.generate([prompt] * len(params), params, use_tqdm=False))
    got = token_ids(ngram.generate([prompt] * len(params), params, use_tqdm=False))
    assert spec_counts(ngram).num_draft_tokens - before > 1000
    for position in (1, 2):
        p = _two_sample_p([t[position] for t in want], [t[position] for t in got])
        assert p > 0.01, f"position {position}: p = {p:.2g}"
    joint = _two_sample_p([tuple(t[1:]) for t in want], [tuple(t[1:]) for t in got])
    assert joint > 0.01


def test_structured_output_requests_do_not_speculate_and_stay_valid(model_path):
    from ringllm.pipeline.structured.params import StructuredOutputsParams

    llm = LLM(model_path, num_gpu_blocks_override=256, speculative_config=NGRAM, **ENGINE)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma"]),
    )
    out = llm.generate([[5, 6, 7, 5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha beta", "gamma")
    assert spec_counts(llm).num_drafts == 0


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens: required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, r"in \[1, 16\]"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "draft model's folder"),
        ('{"method": "ngram", ', "not a JSON object"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(config, message):
    from ringllm.pipeline.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=config)


# ---- draft model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_path(model_factory):
    """Another model on the same tokenizer (make-model's is fixed): one layer, other weights."""
    return model_factory("llama", num_layers=1, seed=7)


def draft_config(path, k=3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("which", ["itself", "other"])
def test_draft_model_greedy_is_token_identical(plain, model_path, draft_path, which):
    """The target as its own draft accepts every draft; another model accepts some: the
    greedy outputs equal plain decoding's either way, with preemption on a small pool."""
    draft = model_path if which == "itself" else draft_path
    llm = LLM(
        model_path,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=16,
        speculative_config=draft_config(draft),
    )
    prompts = repetitive_prompts(16, seed=11)
    rng = random.Random(3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in prompts
    ]
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False)
    )
    counts = spec_counts(llm)
    assert counts.num_drafts > 0
    if which == "itself":
        assert counts.num_accepted_tokens == counts.num_draft_tokens
    else:
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_draft_model_at_temperature_1_keeps_the_target_distribution(plain, model_path, draft_path):
    """q comes from another model: the rejection sampler's residual does the work. The 2nd
    and 3rd tokens of 2,000 seeds match plain sampling's distribution (p > 0.01)."""
    llm = LLM(
        model_path,
        num_gpu_blocks_override=512,
        speculative_config=draft_config(draft_path, k=2),
        **ENGINE,
    )
    prompt = repetitive_prompts(2, seed=12)[1]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(2000)
    ]
    want = token_ids(plain.generate([prompt] * len(params), params, use_tqdm=False))
    got = token_ids(llm.generate([prompt] * len(params), params, use_tqdm=False))
    counts = spec_counts(llm)
    assert counts.num_draft_tokens > 1000 and counts.num_accepted_tokens < counts.num_draft_tokens
    for position in (1, 2):
        p = _two_sample_p([t[position] for t in want], [t[position] for t in got])
        assert p > 0.01, f"position {position}: p = {p:.2g}"


def test_a_draft_model_with_tensor_parallelism_is_refused(model_path):
    from ringllm.pipeline.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model method runs on one rank only"):
        EngineConfig.from_kwargs(
            tensor_parallel_size=2, speculative_config=draft_config(model_path)
        )


def test_requests_paused_mid_run_resume_with_the_tokens_of_an_undisturbed_run(plain, ngram):
    """A silent stream's request is paused in the engine and resumed when its client reads
    again: under speculation, and for a structured request (whose grammar state must
    survive the pause), it ends with exactly the tokens of a run never paused, and makes
    none while paused."""
    from ringllm.pipeline.structured.params import StructuredOutputsParams

    prompts = repetitive_prompts(3, seed=21)
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    regex = SamplingParams(
        temperature=0.0,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"),
    )
    params = [free, free, free, regex]
    prompts.append(prompts[0])
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    engine = ngram.llm_engine
    drafts_before = spec_counts(ngram).num_drafts
    ids = [f"paused-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {}
    made_while_paused = 0
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        if step == 3:
            engine.front_end.client.pause_requests(ids[1:])
        if step == 12:
            engine.front_end.client.resume_requests(ids[1:])
        for out in engine.step():
            grown = len(out.outputs[0].token_ids) - len(tokens.get(out.request_id, []))
            if 5 <= step < 12 and out.request_id in ids[1:]:
                made_while_paused += grown
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert [tokens[rid] for rid in ids] == want
    assert made_while_paused == 0
    assert spec_counts(ngram).num_drafts > drafts_before
