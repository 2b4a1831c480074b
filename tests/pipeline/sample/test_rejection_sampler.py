"""The rejection sampler keeps the target distribution: a chi-square test (p > 0.01) of the
first emitted token against the target's p over 100,000 samples, for draft models q (with
zeros where p is not, and the reverse) and for certain proposals (n-gram); greedy rows give
the target's argmax run exactly; a seeded row's own generator makes it reproducible."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline.sample.rejection_sampler import NO_TOKEN, rejection_sample

NUM_SAMPLES = 100_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) for the counts of categories against probabilities `probs`;
    a category of probability 0 must not occur at all."""
    total = counts.sum()
    impossible = probs == 0
    assert counts[impossible].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[~impossible].double() * total
    observed = counts[~impossible].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(expected) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


P_Q_PAIRS = {
    "close": ([0.1, 0.2, 0.3, 0.25, 0.15, 0.0], [0.15, 0.2, 0.25, 0.25, 0.1, 0.05]),
    "q misses tokens p has": ([0.3, 0.3, 0.2, 0.1, 0.05, 0.05], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]),
    "q far from p": ([0.05, 0.05, 0.05, 0.05, 0.1, 0.7], [0.7, 0.1, 0.05, 0.05, 0.05, 0.05]),
    "q equals p": ([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
}


@pytest.mark.parametrize("name", list(P_Q_PAIRS))
def test_a_draft_model_keeps_the_target_distribution(name):
    p, q = (torch.tensor(x) for x in P_Q_PAIRS[name])
    generator = torch.Generator().manual_seed(len(name))
    k = 2
    target = p.expand(NUM_SAMPLES, k + 1, len(p)).contiguous()
    draft = q.expand(NUM_SAMPLES, k, len(q)).contiguous()
    drafts = torch.multinomial(q, NUM_SAMPLES * k, replacement=True, generator=generator).view(
        NUM_SAMPLES, k
    )
    out = rejection_sample(
        target, drafts, torch.full((NUM_SAMPLES,), k), draft, default_generator=generator
    )
    for position in range(k + 1):  # every emitted position is distributed as p
        emitted = out.token_ids[:, position]
        emitted = emitted[emitted != NO_TOKEN]
        counts = torch.bincount(emitted, minlength=len(p))
        assert chi_square_p_value(counts, p) > 0.01, (name, position, counts)
    assert ((out.num_emitted >= 1) & (out.num_emitted <= k + 1)).all()


@pytest.mark.parametrize("proposal", [0, 2, 5])
def test_a_certain_proposal_keeps_the_target_distribution(proposal):
    """n-gram proposes one token for sure (q one-hot): accepted with probability p(d)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15, 0.0])
    generator = torch.Generator().manual_seed(proposal)
    target = p.expand(NUM_SAMPLES, 2, len(p)).contiguous()
    drafts = torch.full((NUM_SAMPLES, 1), proposal)
    out = rejection_sample(
        target, drafts, torch.ones(NUM_SAMPLES, dtype=torch.long), default_generator=generator
    )
    counts = torch.bincount(out.token_ids[:, 0], minlength=len(p))
    assert chi_square_p_value(counts, p) > 0.01, counts
    accepted = out.num_accepted.double().mean()
    assert abs(accepted - p[proposal]) < 0.01  # the acceptance rate is p(d)


def test_greedy_rows_emit_the_targets_argmax_run():
    vocab, k = 7, 4
    argmax = torch.tensor([[3, 1, 4, 1, 5], [2, 6, 5, 3, 5], [0, 0, 0, 0, 0]])
    target = torch.full((3, k + 1, vocab), 0.01)
    target.scatter_(2, argmax[..., None], 0.9)
    drafts = torch.tensor([[3, 1, 4, 1], [2, 6, 0, 3], [1, -1, -1, -1]])
    num_drafts = torch.tensor([4, 4, 1])
    out = rejection_sample(target, drafts, num_drafts, greedy=torch.ones(3, dtype=torch.bool))
    assert out.num_accepted.tolist() == [4, 2, 0]
    assert out.token_ids.tolist() == [
        [3, 1, 4, 1, 5],  # all accepted, then the bonus token
        [2, 6, 5, -1, -1],  # refused at position 2: the target's argmax there
        [0, -1, -1, -1, -1],  # refused at once
    ]


def test_a_seeded_row_is_reproducible_and_independent_of_its_neighbours():
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    target = p[None].expand(4, 3, 50).contiguous()
    drafts = torch.tensor([[7, 9]] * 4)
    num = torch.full((4,), 2)

    def run(seed_for_row_2: int, shared_seed: int) -> list[int]:
        generators = [None, None, torch.Generator().manual_seed(seed_for_row_2), None]
        out = rejection_sample(
            target, drafts, num, generators=generators,
            default_generator=torch.Generator().manual_seed(shared_seed),
        )  # fmt: skip
        return out.token_ids[2].tolist()

    assert run(11, 0) == run(11, 1) == run(11, 2)
    assert len({tuple(run(seed, 0)) for seed in range(20)}) > 1
