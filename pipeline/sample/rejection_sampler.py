"""Speculative decoding's rejection sampler: verify a run of proposed tokens against the
target model in one batch, keeping the target's distribution exactly (Leviathan et al. 2023,
Chen et al. 2023).

For request b with k = num_drafts[b] proposed tokens d_0..d_{k-1}:

    target_probs[b, i]   the target's distribution at draft position i (i <= k: row k is
                         the position after the last draft, the "bonus")
    draft_probs[b, i]    the proposer's distribution q_i it drew d_i from; None for a
                         proposer that is certain (n-gram: q_i is one-hot at d_i)

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order, until one is refused;
    at the first refusal emit a token drawn from max(0, p_i - q_i), normalized; if all k are
    accepted, emit a bonus token drawn from p_k.

So each step emits between 1 and k + 1 tokens and every emitted token has exactly the
distribution the target alone would have sampled it from. A greedy row accepts d_i only if
it is the target's argmax, and emits the target's argmax where it stops: the tokens of
greedy decoding without speculation, bit for bit.

Everything is batched over requests and positions ([B, K] and [B, K + 1, V] tensors, a
variable k per request padded with -1). Randomness: a request with its own generator (a
seeded request) draws its uniforms and its exponentials from it, so its tokens depend on its
seed and on the proposals only; the others share the sampler's generator. On the CPU
kernels a row's exponentials come from one key it draws (ops/cpu.py exponential_rows: 1.0 ms
for 16 rows of 49,152 where torch's generator took 13.6). (A seeded request is then
deterministic, but not token-identical to the same seed without speculation: the two
consume their random streams differently. The distribution is the same.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringllm.pipeline.ops.cpu import draws_on_kernels, exponential_rows

# Smallest positive float32: exponential draws are clamped to it (argmax of p / q with q = 0
# would divide by zero), and so is a residual's mass before it is normalized.
_TINY = torch.finfo(torch.float32).tiny
NO_TOKEN = -1


@dataclass
class VerifiedTokens:
    token_ids: torch.Tensor  # int64 [B, K + 1]: accepted drafts, then the emitted token; -1 after
    num_emitted: torch.Tensor  # int64 [B]: accepted drafts + 1
    num_accepted: torch.Tensor  # int64 [B]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> VerifiedTokens:
    """`target_probs` float [B, K + 1, V]; `draft_token_ids` int64 [B, K] (-1 past
    num_drafts[b]); `num_drafts` int64 [B]; `draft_probs` float [B, K, V] or None (certain
    proposals); `greedy` bool [B] (rows decoded by argmax); `generators[b]`: request b's own
    generator, or None for the shared `default_generator`."""
    batch, positions, vocab = target_probs.shape
    k_max = positions - 1
    if draft_token_ids.shape != (batch, k_max):
        raise ValueError(
            f"draft_token_ids: shape {tuple(draft_token_ids.shape)}, expected {(batch, k_max)}"
        )
    device = target_probs.device
    greedy = torch.zeros(batch, dtype=torch.bool, device=device) if greedy is None else greedy
    position = torch.arange(k_max, device=device)
    valid = position[None, :] < num_drafts[:, None]  # [B, K]
    drafts = draft_token_ids.clamp(min=0)
    target_at = target_probs[:, :k_max]  # [B, K, V]
    p_draft = target_at.gather(2, drafts[..., None]).squeeze(-1)  # p_i(d_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    uniforms, exponentials = _draw(
        batch, k_max, vocab, device, generators, default_generator, num_drafts, greedy
    )
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=_TINY), torch.zeros_like(p_draft))
    accept = uniforms < ratio.clamp(max=1.0)
    accept = torch.where(greedy[:, None], target_at.argmax(-1) == drafts, accept) & valid
    num_accepted = accept.long().cumprod(1).sum(1)  # the run of accepted drafts from the start
    # the emitted token's distribution: the residual at the first refusal, else the bonus row
    stop = num_accepted  # position of the emitted token (== num_drafts when all accepted)
    rows = torch.arange(batch, device=device)
    p_stop = target_probs[rows, stop]  # [B, V]
    refused = stop < num_drafts
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop)
        stop_draft = drafts[rows, stop.clamp(max=max(k_max - 1, 0))] if k_max else stop
        q_stop[refused] = torch.nn.functional.one_hot(stop_draft[refused], vocab).to(p_stop.dtype)
    else:
        q_stop = torch.zeros_like(p_stop)
        if k_max:
            q_stop[refused] = draft_probs[rows, stop.clamp(max=k_max - 1)][refused]
    residual = torch.where(refused[:, None], (p_stop - q_stop).clamp(min=0.0), p_stop)
    # a residual with no mass left (p == q there): p itself is the right distribution
    empty = residual.sum(-1) <= _TINY
    residual = torch.where(empty[:, None], p_stop, residual)
    emitted = torch.where(
        greedy,
        p_stop.argmax(-1),
        (residual / exponentials).argmax(-1),  # argmax p / Exp(1) ~ Categorical(p)
    )
    return verified_run(draft_token_ids, num_accepted, emitted)


def verified_run(
    draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, emitted: torch.Tensor
) -> VerifiedTokens:
    """Each row's accepted drafts, then its emitted token at position num_accepted; -1 after."""
    batch, k_max = draft_token_ids.shape
    device = draft_token_ids.device
    position = torch.arange(k_max, device=device)
    token_ids = torch.full((batch, k_max + 1), NO_TOKEN, dtype=torch.long, device=device)
    keep = position[None, :] < num_accepted[:, None]
    token_ids[:, :k_max] = torch.where(keep, draft_token_ids, token_ids[:, :k_max])
    token_ids[torch.arange(batch, device=device), num_accepted] = emitted
    return VerifiedTokens(token_ids, num_accepted + 1, num_accepted)


def _keyed(device) -> bool:
    return torch.device(device).type == "cpu" and draws_on_kernels()


def _keyed_exponentials(uniforms, vocab, generators, default_generator, own, shared, counts):
    """_draw's exponentials on the CPU kernels: each racing row draws its uniforms (written
    into `uniforms`), then one key, and its V values come from the key's stream in C
    (ops/cpu.py exponential_rows; torch's CPU generator draws one value at a time). Greedy
    rows draw nothing; where there are none, the values are drawn in place."""
    batch, k_max = uniforms.shape
    keys = torch.zeros(batch, dtype=torch.int64)
    for b in own:
        uniforms[b, : counts[b]].uniform_(generator=generators[b])
        keys[b : b + 1].random_(generator=generators[b])
    if shared:
        index = torch.tensor(shared)
        uniforms[index] = torch.empty(len(shared), k_max).uniform_(generator=default_generator)
        keys[index] = torch.empty(len(shared), dtype=torch.int64).random_(
            generator=default_generator
        )
    racing = len(own) + len(shared)
    if racing == batch:
        exponentials = torch.empty(batch, vocab)
        exponential_rows(exponentials, keys)
        return exponentials
    exponentials = torch.ones(batch, vocab)  # greedy rows: never read
    if racing:
        rows = torch.tensor(sorted(own + shared))
        draws = torch.empty(racing, vocab)
        exponential_rows(draws, keys[rows])
        exponentials[rows] = draws
    return exponentials


def _draw(batch, k_max, vocab, device, generators, default_generator, num_drafts, greedy):
    """Uniforms [B, K] and exponentials [B, V] for the rows that are not greedy: per request
    from its own generator (exactly one uniform per draft it has and V exponentials, or on
    the CPU kernels one key for them, whatever the rest of the batch holds), the rest in one
    call from the shared one."""
    uniforms = torch.ones(batch, k_max, device=device)  # past a row's drafts: never read
    flags = greedy.tolist()
    own = [
        b
        for b in range(batch)
        if generators is not None and generators[b] is not None and not flags[b]
    ]
    own_rows = set(own)
    shared = [b for b in range(batch) if b not in own_rows and not flags[b]]
    counts = num_drafts.tolist() if own else []
    if _keyed(device):
        return uniforms, _keyed_exponentials(
            uniforms, vocab, generators, default_generator, own, shared, counts
        )
    exponentials = torch.ones(batch, vocab, device=device)  # greedy rows: never read
    for b in own:
        uniforms[b, : counts[b]].uniform_(generator=generators[b])
        exponentials[b].exponential_(generator=generators[b])
    if shared:
        index = torch.tensor(shared, device=device)
        u = torch.empty(len(shared), k_max, device=device).uniform_(generator=default_generator)
        e = torch.empty(len(shared), vocab, device=device).exponential_(generator=default_generator)
        uniforms[index] = u
        exponentials[index] = e
    return uniforms, exponentials.clamp(min=_TINY)
