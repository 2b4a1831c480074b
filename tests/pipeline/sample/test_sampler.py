"""Batched sampler against hand-computed values, numpy references and torch.log_softmax.

Distributions are checked with many draws taken in ONE batched call (one row per draw)
and a fixed sampler seed, with a tolerance of several standard deviations: the result is
deterministic, and a correct sampler passes by a wide margin.
"""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ringllm.pipeline.ops.cpu import draws_on_kernels, kernel_sets
from ringllm.pipeline.sample.logits_filters import (
    TOP_P_PROBE,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    filter_thresholds,
    pad_token_ids,
)
from ringllm.pipeline.sample.sampler import Sampler, SamplingRequestState, compute_prompt_logprobs
from ringllm.pipeline.sampling_params import SamplingParams

V = 11
# Distinct values, so every rank and top-k set is unambiguous.
LOGITS = torch.tensor([1.0, 3.0, -0.5, 2.2, 0.1, 2.9, -2.0, 0.7, 1.8, -1.0, 2.5])
NUM_DRAWS = 20_000
MAX_FREQ_ERROR = 0.02  # 20k draws: one standard deviation is at most 0.0036


def states_for(params_list, prompt=(1, 2), eos=None):
    return [SamplingRequestState.create(p, prompt, eos) for p in params_list]


def softmax_np(logits):
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_frequencies(params, logits=LOGITS, num_draws=NUM_DRAWS, sampler_seed=0):
    sampler = Sampler(V, seed=sampler_seed)
    batch = logits.expand(num_draws, V).contiguous()
    tokens = sampler.sample(batch, states_for([params] * num_draws)).sampled_token_ids
    return np.bincount(tokens.numpy(), minlength=V) / num_draws


def restrict(probs, keep):
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def top_p_keep_reference(probs, p):
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    size = int(np.searchsorted(mass, p) + 1)  # smallest prefix with mass >= p
    keep = np.zeros(len(probs), dtype=bool)
    keep[order[:size]] = True
    return keep


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- greedy and stage skipping


def test_greedy_equals_argmax_and_leaves_logits_alone():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, seed=i) for i in range(6)]
    out = Sampler(V).sample(logits, states_for(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_all_greedy_batch_costs_one_argmax():
    """One argmax over the logits and nothing else: torch's, or on the CPU the C kernel's
    (which allocates only its output, the one op the recorder then sees)."""
    logits = torch.randn(4, V)
    with OpRecorder() as recorder:
        Sampler(V).sample(logits, states_for([SamplingParams(temperature=0)] * 4))
    assert recorder.ops in (["argmax"], ["empty"])


def test_top_k_alone_uses_topk_and_top_p_uses_sort():
    """top-k is one topk; top-p sorts the row in torch, or on the CPU kernels selects its
    threshold in C (ops/cpu.py top_p_rows: no sort, no topk); with a top-k in every row the
    torch path sorts only the k candidates."""
    logits = torch.randn(4, V)
    with OpRecorder() as recorder:
        Sampler(V, seed=0).sample(logits, states_for([SamplingParams(top_k=3)] * 4))
    assert "topk" in recorder.ops and "sort" not in recorder.ops
    assert "clone" not in recorder.ops and "scatter_add_" not in recorder.ops
    with OpRecorder() as recorder:
        Sampler(V, seed=0).sample(logits, states_for([SamplingParams(top_p=0.8)] * 4))
    if draws_on_kernels():
        assert "sort" not in recorder.ops and "topk" not in recorder.ops
    else:
        assert "sort" in recorder.ops
    # Every row has a top-k: top-p only needs those k candidates, sorted by topk.
    with_k = [SamplingParams(top_k=3, top_p=0.8), SamplingParams(top_k=5)] * 2
    with OpRecorder() as recorder:
        Sampler(V, seed=0).sample(logits, states_for(with_k))
    assert "topk" in recorder.ops and "sort" not in recorder.ops


# ---------------------------------------------------------------- distributions


def test_plain_sampling_follows_softmax():
    freqs = draw_frequencies(SamplingParams())
    assert np.abs(freqs - softmax_np(LOGITS)).max() < MAX_FREQ_ERROR


def test_temperature_scales_logits():
    for temperature in (0.5, 2.0):
        freqs = draw_frequencies(SamplingParams(temperature=temperature))
        expected = softmax_np(LOGITS.numpy() / temperature)
        assert np.abs(freqs - expected).max() < MAX_FREQ_ERROR


def test_top_k_keeps_exactly_k_tokens():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    filtered = apply_top_k(rows, torch.tensor([3, 5, 0]), max_top_k=5)
    for row, k in ((0, 3), (1, 5)):
        kept = torch.isfinite(filtered[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(torch.topk(rows[row], k).indices.tolist())
        assert torch.equal(filtered[row][kept], rows[row][kept])
    assert torch.equal(filtered[2], LOGITS)  # k = 0: off
    freqs = draw_frequencies(SamplingParams(top_k=3))
    keep = np.zeros(V, dtype=bool)
    keep[[1, 5, 10]] = True
    assert (freqs[~keep] == 0).all()
    assert np.abs(freqs - restrict(softmax_np(LOGITS), keep)).max() < MAX_FREQ_ERROR


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.9, 0.99])
def test_top_p_keeps_smallest_set_reaching_p(top_p):
    probs = softmax_np(LOGITS)
    keep = top_p_keep_reference(probs, top_p)
    # Alone, and beside a row without top-p, with top_k None or all off (k = 0).
    filtered = apply_top_k_top_p(
        torch.stack([LOGITS, LOGITS]), torch.tensor([0, 0]), torch.tensor([top_p, 1.0]), V
    )
    assert np.array_equal(torch.isfinite(filtered[0]).numpy(), keep)
    assert torch.equal(filtered[1], LOGITS)  # p = 1: off
    alone = apply_top_k_top_p(LOGITS[None], None, torch.tensor([top_p]), V)
    assert torch.equal(alone[0], filtered[0])


def test_top_p_distribution():
    freqs = draw_frequencies(SamplingParams(top_p=0.75))
    keep = top_p_keep_reference(softmax_np(LOGITS), 0.75)
    assert keep.sum() == 4
    assert (freqs[~keep] == 0).all()
    assert np.abs(freqs - restrict(softmax_np(LOGITS), keep)).max() < MAX_FREQ_ERROR


def test_top_k_then_top_p_on_renormalized_mass():
    # top-k = 4 leaves tokens 1, 5, 10, 3; top-p = 0.6 then acts on their renormalized probs.
    keep_k = np.zeros(V, dtype=bool)
    keep_k[[1, 5, 10, 3]] = True
    renormalized = restrict(softmax_np(LOGITS), keep_k)
    keep = top_p_keep_reference(renormalized, 0.6)
    for num_candidates in (4, 7, V):  # only the top 4 can survive; sorting more is the same
        filtered = apply_top_k_top_p(
            LOGITS[None], torch.tensor([4]), torch.tensor([0.6]), num_candidates
        )[0]
        assert np.array_equal(torch.isfinite(filtered).numpy(), keep)
        assert torch.equal(filtered[keep], LOGITS[keep])
    assert keep.sum() == 2  # without top-k first, p = 0.6 over all 11 tokens would keep 3
    assert top_p_keep_reference(softmax_np(LOGITS), 0.6).sum() == 3


def test_top_k_top_p_match_numpy_on_random_rows():
    rng = np.random.default_rng(0)
    vocab = 50
    logits = torch.from_numpy(rng.normal(scale=2.0, size=(24, vocab)).astype(np.float32))
    top_k = torch.from_numpy(rng.choice([0, 1, 5, 20, 49], size=24))
    top_p = torch.from_numpy(rng.choice([0.2, 0.5, 0.8, 0.95, 1.0], size=24).astype(np.float32))
    filtered = apply_top_k_top_p(logits, top_k, top_p, vocab)
    for row in range(24):
        probs = softmax_np(logits[row].numpy())
        k = int(top_k[row]) or vocab
        keep_k = np.zeros(vocab, dtype=bool)
        keep_k[np.argsort(-probs)[:k]] = True
        renormalized = restrict(probs, keep_k)
        p = float(top_p[row])
        keep = keep_k
        if p < 1.0:  # p = 1: off
            mass = np.cumsum(np.sort(renormalized)[::-1])
            assert np.abs(mass - p).min() > 1e-4  # no row sits on a boundary
            keep = top_p_keep_reference(renormalized, p) & keep_k
        assert np.array_equal(torch.isfinite(filtered[row]).numpy(), keep), row
    rows_with_k = top_k > 0
    bounded = apply_top_k_top_p(
        logits[rows_with_k], top_k[rows_with_k], top_p[rows_with_k], int(top_k.max())
    )
    assert torch.equal(bounded, filtered[rows_with_k])


def top_k_top_p_keep_reference(logits_row, k, p):
    probs = softmax_np(logits_row)
    keep_k = np.zeros(len(probs), dtype=bool)
    keep_k[np.argsort(-probs)[: k or len(probs)]] = True
    if p >= 1.0:
        return keep_k
    renormalized = restrict(probs, keep_k)
    mass = np.cumsum(np.sort(renormalized)[::-1])
    assert np.abs(mass - p).min() > 1e-5  # no row sits on a boundary
    return top_p_keep_reference(renormalized, p) & keep_k


@pytest.mark.parametrize("case", ["probe settles all", "flat row", "top-k beyond probe"])
def test_top_p_probe_on_a_large_vocab(case):
    vocab = 4 * TOP_P_PROBE
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.normal(scale=3.0, size=(5, vocab)).astype(np.float32))
    top_k = torch.tensor([0, 0, 5, 5, 0])
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.5, 0.8])
    if case == "flat row":  # the top 1024 of 4096 equal logits hold 1/4 of the mass
        logits[4] = 0.0
        top_p[4] = 0.999
    if case == "top-k beyond probe":  # mass is measured against a top-k the probe cuts
        top_k[4] = TOP_P_PROBE + 500
    with OpRecorder() as recorder:
        filtered = apply_top_k_top_p(logits, top_k, top_p, vocab)
    assert ("sort" in recorder.ops) == (case != "probe settles all")
    for row in range(4 if case == "flat row" else 5):
        keep = top_k_top_p_keep_reference(logits[row].numpy(), int(top_k[row]), float(top_p[row]))
        assert np.array_equal(torch.isfinite(filtered[row]).numpy(), keep), row
        assert torch.equal(filtered[row][keep], logits[row][keep])
    if case == "flat row":
        # smallest set of equal tokens with mass >= 0.999: ceil(4091.9) = 4092 of them
        assert torch.isfinite(filtered[4]).sum() == math.ceil(0.999 * vocab)


def test_min_p_threshold_relative_to_max_prob():
    probs = softmax_np(LOGITS)
    for min_p in (0.1, 0.3, 0.6):
        keep = probs >= min_p * probs.max()
        filtered = apply_min_p(LOGITS[None], torch.tensor([min_p]))[0]
        assert np.array_equal(torch.isfinite(filtered).numpy(), keep)
    freqs = draw_frequencies(SamplingParams(min_p=0.3))
    keep = probs >= 0.3 * probs.max()
    assert (freqs[~keep] == 0).all()
    assert np.abs(freqs - restrict(probs, keep)).max() < MAX_FREQ_ERROR


def test_mixed_greedy_and_random_rows():
    num_rows = NUM_DRAWS
    params = [SamplingParams(temperature=0.0 if row % 2 else 1.0) for row in range(num_rows)]
    batch = LOGITS.expand(num_rows, V).contiguous()
    tokens = Sampler(V, seed=1).sample(batch, states_for(params)).sampled_token_ids.numpy()
    assert (tokens[1::2] == int(LOGITS.argmax())).all()
    freqs = np.bincount(tokens[0::2], minlength=V) / (num_rows // 2)
    assert np.abs(freqs - softmax_np(LOGITS)).max() < MAX_FREQ_ERROR


def test_seeded_rows_follow_the_distribution():
    params = [SamplingParams(temperature=0.8, seed=seed) for seed in range(5000)]
    batch = LOGITS.expand(5000, V).contiguous()
    tokens = Sampler(V).sample(batch, states_for(params)).sampled_token_ids
    freqs = np.bincount(tokens.numpy(), minlength=V) / 5000
    assert np.abs(freqs - softmax_np(LOGITS.numpy() / 0.8)).max() < 0.035  # ~4.5 sigma


# ---------------------------------------------------------------- seeds


def run_steps(sampler, target_row, make_neighbours, step_logits, target):
    """Samples len(step_logits) steps with `target` at `target_row` among fresh neighbours."""
    tokens = []
    for step, row_logits in enumerate(step_logits):
        neighbours = make_neighbours(step)
        states = neighbours[:target_row] + [target] + neighbours[target_row:]
        logits = torch.randn(len(states), 50, generator=torch.Generator().manual_seed(100 + step))
        logits[target_row] = row_logits
        token = int(sampler.sample(logits, states).sampled_token_ids[target_row])
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_request_is_independent_of_batch_and_row():
    vocab = 50
    step_logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(7)) * 2
    params = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=30)

    def target():
        return SamplingRequestState.create(params, [1, 2, 3])

    alone = run_steps(Sampler(vocab, seed=0), 0, lambda step: [], step_logits, target())

    def crowd(step):
        return states_for(
            [
                SamplingParams(),
                SamplingParams(seed=99 + step, top_k=5),
                SamplingParams(temperature=0),
                SamplingParams(min_p=0.2, presence_penalty=1.0),
            ][: 1 + step % 4]
        )

    crowded = run_steps(Sampler(vocab, seed=5), 1, crowd, step_logits, target())
    assert crowded == alone
    last = run_steps(Sampler(vocab), 3, lambda s: crowd(3), step_logits, target())
    assert last == alone
    other_seed = SamplingRequestState.create(params.clone(), [1, 2, 3])
    other_seed.generator.manual_seed(4321)
    assert run_steps(Sampler(vocab, seed=0), 0, lambda s: [], step_logits, other_seed) != alone


def test_sampler_seed_makes_unseeded_rows_reproducible():
    batch = torch.randn(64, V, generator=torch.Generator().manual_seed(0))
    states = states_for([SamplingParams()] * 64)
    first = Sampler(V, seed=11).sample(batch, states).sampled_token_ids
    again = Sampler(V, seed=11).sample(batch, states).sampled_token_ids
    other = Sampler(V, seed=12).sample(batch, states).sampled_token_ids
    assert torch.equal(first, again) and not torch.equal(first, other)


# ---------------------------------------------------------------- bias, min_tokens, penalties


def test_logit_bias_adds_clamped_values():
    params = [SamplingParams(logit_bias={2: 5.0, 6: -300.0}), SamplingParams(temperature=0)]
    processed = Sampler(V).process_logits(LOGITS.expand(2, V).contiguous(), states_for(params))
    expected = LOGITS.clone()
    expected[2] += 5.0
    expected[6] -= 100.0
    assert torch.allclose(processed[0], expected)
    assert torch.equal(processed[1], LOGITS)
    greedy = SamplingParams(temperature=0, logit_bias={2: 3.6})  # -0.5 + 3.6 = 3.1 > 3.0
    tokens = Sampler(V).sample(LOGITS[None].clone(), states_for([greedy])).sampled_token_ids
    assert tokens.tolist() == [2]


def test_min_tokens_blocks_stop_tokens_until_reached():
    eos, stop = 1, 5  # the two most likely tokens
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop])
    state = SamplingRequestState.create(params, [0], eos_token_ids=eos)
    assert state.stop_token_ids == {eos, stop}
    sampler = Sampler(V)
    for expected in (10, 10, eos):  # 10 is the best token that is neither EOS nor stop
        token = int(sampler.sample(LOGITS[None].clone(), [state]).sampled_token_ids[0])
        assert token == expected
        state.output_token_ids.append(token)
    ignoring = SamplingRequestState.create(
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[stop]),
        [0],
        eos_token_ids=eos,
    )
    processed = sampler.process_logits(LOGITS[None].clone(), [ignoring])[0]
    assert processed[eos] == LOGITS[eos] and processed[stop] == float("-inf")


def test_pad_token_ids_repeats_each_rows_first_id():
    padded, lengths = pad_token_ids([[1, 3, 3], [], [7]])
    assert padded.tolist() == [[1, 3, 3], [0, 0, 0], [7, 7, 7]]
    assert lengths.tolist() == [3, 0, 1]
    padded, lengths = pad_token_ids([[], []])
    assert padded.shape == (2, 1) and lengths.tolist() == [0, 0]


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, -0.5], [2.0, -1.0, 0.5, 3.0, 1.0, -0.5]])
    # Row 0: prompt [0, 4], output [1, 3, 3]. Row 1: prompt [1], no output yet.
    seen_ids, _ = pad_token_ids([[0, 4, 1, 3, 3], [1]])
    output_ids, output_lengths = pad_token_ids([[1, 3, 3], []])
    result = apply_penalties(
        logits.clone(),
        seen_ids,
        output_ids,
        output_lengths,
        repetition=torch.tensor([2.0, 4.0]),
        frequency=torch.tensor([0.5, 0.5]),
        presence=torch.tensor([0.25, 0.25]),
    )
    # token 0 (prompt): 2/2; token 1 (output once): -1*2 - 0.5 - 0.25; token 2 untouched;
    # token 3 (output twice): 3/2 - 2*0.5 - 0.25; token 4 (prompt): 1/2; token 5 untouched.
    assert result[0].tolist() == [1.0, -2.75, 0.5, 0.25, 0.5, -0.5]
    # Row 1: only the prompt token 1 is seen (-1 * 4); the pad id 0 is left alone.
    assert result[1].tolist() == [2.0, -4.0, 0.5, 3.0, 1.0, -0.5]
    only_frequency = apply_penalties(
        logits.clone(), None, output_ids, output_lengths, frequency=torch.tensor([-1.0, 1.0])
    )
    assert only_frequency[0].tolist() == [2.0, 0.0, 0.5, 5.0, 1.0, -0.5]
    assert torch.equal(only_frequency[1], logits[1])


def test_penalties_match_dense_numpy_reference():
    rng = np.random.default_rng(1)
    vocab, rows = 40, 12
    logits = rng.normal(scale=3.0, size=(rows, vocab)).astype(np.float32)
    prompts = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, vocab, rng.integers(0, 60)).tolist() for _ in range(rows)]
    outputs[3] = []  # a row that has not produced anything yet
    rep, freq, pres = (
        rng.uniform(0.5, 2.0, rows),
        rng.uniform(-2, 2, rows),
        rng.uniform(-2, 2, rows),
    )
    rep[5], freq[6], pres[7] = 1.0, 0.0, 0.0  # neutral entries beside active ones
    expected = logits.astype(np.float64)
    for row in range(rows):
        counts = np.bincount(outputs[row], minlength=vocab)
        seen = (counts + np.bincount(prompts[row], minlength=vocab)) > 0
        x = expected[row]
        x[seen] = np.where(x[seen] > 0, x[seen] / rep[row], x[seen] * rep[row])
        x -= freq[row] * counts + pres[row] * (counts > 0)
    seen_ids, _ = pad_token_ids([p + o for p, o in zip(prompts, outputs, strict=True)])
    output_ids, output_lengths = pad_token_ids(outputs)
    result = apply_penalties(
        torch.from_numpy(logits),
        seen_ids,
        output_ids,
        output_lengths,
        *(torch.from_numpy(v.astype(np.float32)) for v in (rep, freq, pres)),
    )
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-4)


def test_penalties_in_a_batch_touch_only_their_rows():
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
    ]
    states = [SamplingRequestState.create(p, [0, 4]) for p in params]
    for state in states:
        state.output_token_ids.extend([1, 3, 3])
    processed = Sampler(V).process_logits(LOGITS.expand(3, V).contiguous(), states)
    assert torch.equal(processed[0], LOGITS)
    expected = LOGITS.clone()
    expected[0] /= 2  # prompt
    expected[4] /= 2  # prompt
    expected[1] = 3.0 / 2 - 0.5 - 0.25
    expected[3] = 2.2 / 2 - 2 * 0.5 - 0.25
    assert torch.allclose(processed[1], expected)
    expected = LOGITS.clone()
    expected[1] += 1.0
    expected[3] += 2.0
    assert torch.allclose(processed[2], expected)


def test_repetition_penalty_changes_the_greedy_choice():
    state = SamplingRequestState.create(SamplingParams(temperature=0, repetition_penalty=1.2), [1])
    # Token 1 (3.0) was in the prompt: 3.0 / 1.2 = 2.5 < 2.9, so token 5 wins.
    assert Sampler(V).sample(LOGITS[None].clone(), [state]).sampled_token_ids.tolist() == [5]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SamplingParams(logprobs=3, temperature=0.5, presence_penalty=2.0, logit_bias={0: 50}),
        SamplingParams(logprobs=0, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=1, temperature=0, repetition_penalty=1.5),
    ]
    out = Sampler(V, seed=0).sample(logits, states_for(params))
    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (4, 4) and out.logprobs.logprobs.shape == (4, 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    assert sampled[0] == 0  # the +50 bias decided the token, but logprobs stay raw
    assert torch.allclose(out.logprobs.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top = torch.sort(reference, dim=-1, descending=True)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices[:, :3])
    assert torch.allclose(out.logprobs.logprobs[:, 1:], top.values[:, :3])
    order = top.indices.tolist()
    assert out.logprobs.ranks.tolist() == [order[r].index(int(sampled[r])) + 1 for r in range(4)]


def test_logprobs_zero_gives_only_the_sampled_column():
    params = [SamplingParams(logprobs=0, temperature=0)] * 2
    out = Sampler(V).sample(LOGITS.expand(2, V).contiguous(), states_for(params))
    assert out.logprobs.token_ids.tolist() == [[1], [1]]
    assert out.logprobs.ranks.tolist() == [1, 1]


def test_logprobs_capped_at_vocab_size():
    out = Sampler(V).sample(LOGITS[None].clone(), states_for([SamplingParams(logprobs=20)]))
    assert out.logprobs.token_ids.shape == (1, 1 + V)


def test_prompt_logprobs_and_chunking():
    prompt = [3, 7, 1, 9, 0, 4, 2]
    logits = torch.randn(len(prompt), V, generator=torch.Generator().manual_seed(9))
    full = compute_prompt_logprobs(logits, prompt[1:], num_logprobs=2)
    reference = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(prompt[1:])
    assert torch.equal(full.token_ids[:, 0], targets)
    assert torch.allclose(full.logprobs[:, 0], reference.gather(1, targets[:, None])[:, 0])
    assert torch.allclose(full.logprobs[:, 1:], torch.topk(reference, 2).values)
    expected_ranks = (reference >= reference.gather(1, targets[:, None])).sum(dim=-1)
    assert torch.equal(full.ranks, expected_ranks)
    # Chunks [0, 4) and [4, 7): each chunk's logits with the ids that follow its positions.
    first = compute_prompt_logprobs(logits[:4], prompt[1:5], num_logprobs=2)
    second = compute_prompt_logprobs(logits[4:], prompt[5:], num_logprobs=2)
    assert torch.equal(torch.cat([first.token_ids, second.token_ids]), full.token_ids)
    assert torch.equal(torch.cat([first.logprobs, second.logprobs]), full.logprobs)
    assert torch.equal(torch.cat([first.ranks, second.ranks]), full.ranks)
    with pytest.raises(ValueError, match="next_token_ids: need a 1-D list of at most 3 ids"):
        compute_prompt_logprobs(logits[:3], prompt[:4], num_logprobs=0)


# ---------------------------------------------------------------- bad input


def test_bad_batches_are_refused():
    sampler = Sampler(V)
    states = states_for([SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"logits: expected shape .* = \[2, 11\], got \[2, 12\]"):
        sampler.sample(torch.zeros(2, 12), states)
    with pytest.raises(ValueError, match=r"= \[2, 11\], got \[3, 11\]"):
        sampler.sample(torch.zeros(3, V), states)
    with pytest.raises(ValueError, match="logits: expected dtype float32, got torch.float16"):
        sampler.sample(torch.zeros(2, V, dtype=torch.float16), states)
    with pytest.raises(ValueError, match="vocab_size: must be >= 1 token, got 0"):
        Sampler(0)


@pytest.mark.parametrize("seed", range(4))
def test_filter_thresholds_keep_the_filters_tokens(seed):
    """filter_thresholds (the race's form of the filters) keeps exactly the tokens the masked
    logits of apply_top_k / apply_top_k_top_p / apply_min_p keep, alone and chained, on rows
    with no ties: peaked ones (top-p settles in the probe) and flat ones (a full sort)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 8 * TOP_P_PROBE
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor(
        [[8.0], [8.0], [0.3], [3], [1], [5]]
    )
    top_k = torch.tensor([0, 5, 40, 0, 2000, 1])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.8, 0.3])
    min_p = torch.tensor([0.0, 0.2, 0.01, 0.05, 0.0, 0.5])
    kmax = int(top_k.max())

    def kept(threshold):
        return logits >= threshold[:, None]

    thr = filter_thresholds(logits, top_k, kmax, None, vocab, None)
    assert torch.equal(kept(thr), apply_top_k(logits, top_k, kmax) > float("-inf"))
    thr = filter_thresholds(logits, top_k, kmax, top_p, vocab, None)
    expected = apply_top_k_top_p(logits, top_k, top_p, vocab) > float("-inf")
    assert torch.equal(kept(thr), expected)
    thr = filter_thresholds(logits, None, 0, top_p, vocab, min_p)
    expected = apply_min_p(apply_top_k_top_p(logits, None, top_p, vocab), min_p) > float("-inf")
    assert torch.equal(kept(thr), expected)


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_the_race_never_picks_a_token_below_its_rows_threshold(kernel_set):
    from ringllm.pipeline.ops.cpu import race_rows

    logits = torch.zeros(3, 500)
    logits[:, 10:20] = 1.0
    threshold = torch.tensor([0.5, float("-inf"), 1.0])
    keys = [torch.tensor([k, k, k]) for k in range(200)]
    picks = [race_rows(logits, torch.ones(3), key, kernel_set, threshold) for key in keys]
    rows = torch.stack(picks)
    assert ((rows[:, 0] >= 10) & (rows[:, 0] < 20)).all()
    assert ((rows[:, 2] >= 10) & (rows[:, 2] < 20)).all()
    assert ((rows[:, 1] < 10) | (rows[:, 1] >= 20)).any()  # unfiltered: the rest can win


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_top_p_rows_keep_ties_and_honour_the_floor(kernel_set):
    """The C selection (ops/cpu.py top_p_rows), each kernel set's exponentials: a token tied
    with the last kept one stays; a floor (top-k's threshold) leaves the tokens under it out
    of the mass; p = 1 gives the floor back; a vocabulary's rows, peaked and flat, get the
    dense filter's kept set."""
    from functools import partial

    from ringllm.pipeline.ops.cpu import top_p_rows as rows_of_set

    top_p_rows = partial(rows_of_set, kernel_set=kernel_set)
    # probabilities 0.4, 0.2, 0.2, 0.1, 0.1 (in logits): p = 0.5 keeps 0.4 and both 0.2s
    row = torch.log(torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1]))
    logits = torch.stack([row, row, row, row])
    top_p = torch.tensor([0.5, 0.3, 1.0, 0.7])
    floor = torch.tensor([float("-inf"), float("-inf"), float(row[1]), float(row[1])])
    got = top_p_rows(logits, top_p, floor)
    assert got[0] == row[1] and got[1] == row[2]  # 0.4 alone holds 0.3
    assert got[2] == row[1]  # p = 1: the floor
    # with the floor at 0.2 the mass is 0.8: 0.7 of it needs 0.4 and both 0.2s
    assert got[3] == row[1]
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 49152, generator=gen) * torch.tensor([[9.0], [4.0], [1.0], [0.2]])
    wide[0, :100] = float("-inf")  # tokens a logit bias took out
    p = torch.tensor([0.9, 0.95, 0.5, 0.8])
    kept = wide >= top_p_rows(wide, p)[:, None]
    assert torch.equal(kept, apply_top_k_top_p(wide, None, p, 49152) > float("-inf"))
