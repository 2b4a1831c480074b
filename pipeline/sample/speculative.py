"""Verifying drafts: the target's logits at every draft position -> the tokens a request emits.

Request b verified k_b drafts; its logits rows are k_b + 1 consecutive rows of `logits`
(position j scores the token after draft j - 1; row k_b is the bonus position). Each
position is processed as the plain sampler would process it had the drafts before it been
sampled: logit_bias, min_tokens (stop tokens masked while the output, drafts before the
position included, is short) and penalties (counting those drafts) per position, then
temperature / top-k / top-p / min-p. The rejection sampler (rejection_sampler.py) then
keeps the target's distribution exactly; a greedy request accepts a draft only if it is
the processed argmax, the same `argmax_rows` the plain sampler takes, so greedy tokens
are those of decoding without speculation.

Logprobs are the target's raw logprobs (as the plain sampler reports them) of each emitted
token at its position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ringllm.pipeline.ops.cpu import argmax_rows
from ringllm.pipeline.sample.rejection_sampler import NO_TOKEN, rejection_sample, verified_run
from ringllm.pipeline.sample.sampler import (
    LogprobRows,
    Sampler,
    SamplingRequestState,
    gather_logprobs,
)


@dataclasses.dataclass
class Verified:
    token_ids: list[list[int]]  # per request: accepted drafts, then one more token
    logprobs: list[LogprobRows | None]  # per request, one row per emitted token
    num_accepted: list[int]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    states: Sequence[SamplingRequestState],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> Verified:
    """`logits` float32 [sum(k_b + 1), V], request b's rows in order; `drafts[b]` its k_b
    >= 1 drafts; `draft_probs[b]` float [k_b, V] (the q each was drawn from) or None (a
    certain proposer)."""
    num_reqs = len(states)
    counts = [len(d) for d in drafts]
    if logits.shape[0] != sum(counts) + num_reqs:
        raise ValueError(
            f"logits: {logits.shape[0]} rows for {num_reqs} requests and {sum(counts)} drafts"
        )
    position_states = [
        _at_position(state, d, j)
        for state, d in zip(states, drafts, strict=True)
        for j in range(len(d) + 1)
    ]
    processed = sampler.process_logits(logits, position_states)
    k_max = max(counts)
    device = logits.device
    starts = np.concatenate([[0], np.cumsum(np.asarray(counts) + 1)])
    # padded [B, K + 1] index of each (request, position) row; row 0 past its drafts
    pos = np.arange(k_max + 1)
    index = starts[:-1, None] + pos[None, :]
    valid = pos[None, :] <= np.asarray(counts)[:, None]
    flat = torch.from_numpy(np.where(valid, index, 0).ravel()).to(device)
    greedy_flags = [s.params.is_greedy for s in states]
    greedy = torch.tensor(greedy_flags, device=device)
    padded = np.full((num_reqs, k_max), NO_TOKEN, np.int64)
    for b, d in enumerate(drafts):
        padded[b, : len(d)] = d
    draft_ids = torch.from_numpy(padded).to(device)
    num_drafts = torch.tensor(counts, dtype=torch.long, device=device)
    top = None
    if any(greedy_flags):
        top = argmax_rows(processed).index_select(0, flat).view(num_reqs, k_max + 1)
    if all(greedy_flags):
        out = _verify_greedy(top, draft_ids, num_drafts)
    else:
        out = _verify_random(
            sampler, processed, states, position_states, drafts, draft_probs, starts,
            top, greedy, draft_ids, num_drafts,
        )  # fmt: skip
    emitted = out.num_emitted.tolist()
    token_rows = out.token_ids.tolist()
    tokens = [token_rows[b][: emitted[b]] for b in range(num_reqs)]
    logprobs: list[LogprobRows | None] = [None] * num_reqs
    asked = [b for b in range(num_reqs) if states[b].params.logprobs is not None]
    if asked:
        rows = np.concatenate([np.arange(starts[b], starts[b] + emitted[b]) for b in asked])
        raw = logits[torch.from_numpy(rows).to(device)].log_softmax(dim=-1)
        ids = torch.tensor([t for b in asked for t in tokens[b]], dtype=torch.long, device=device)
        num_top = max(states[b].params.logprobs for b in asked)
        every = gather_logprobs(raw, ids, num_top)
        offset = 0
        for b in asked:
            n = emitted[b]
            logprobs[b] = LogprobRows(*(t[offset : offset + n] for t in every))
            offset += n
    return Verified(tokens, logprobs, out.num_accepted.tolist())


def _verify_greedy(top: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor):
    """Every request greedy: a draft is accepted while it is the target's argmax; the
    token after the run is the argmax there. No probabilities, no random draws."""
    k_max = draft_ids.shape[1]
    position = torch.arange(k_max, device=draft_ids.device)
    match = (top[:, :k_max] == draft_ids) & (position[None, :] < num_drafts[:, None])
    num_accepted = match.long().cumprod(1).sum(1)
    emitted = top.gather(1, num_accepted[:, None]).squeeze(1)
    return verified_run(draft_ids, num_accepted, emitted)


def _verify_random(
    sampler, processed, states, position_states, drafts, draft_probs, starts, top, greedy,
    draft_ids, num_drafts,
):  # fmt: skip
    """Rejection sampling over the target's filtered distributions (greedy rows as one-hot
    at their argmax, which the sampler then treats as greedy)."""
    num_reqs, k_max = draft_ids.shape
    vocab = processed.shape[1]
    device = processed.device
    counts = num_drafts.tolist()
    target = torch.zeros(num_reqs, k_max + 1, vocab, device=device)
    if top is not None:
        one_hot = torch.nn.functional.one_hot(top[greedy], vocab).to(target.dtype)
        target[greedy] = one_hot
    random_reqs = [b for b in range(num_reqs) if not states[b].params.is_greedy]
    rows = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in random_reqs])
    params = [position_states[r].params for r in rows.tolist()]
    probs = sampler.filtered_probs(processed[torch.from_numpy(rows).to(device)], params)
    offset = 0
    for b in random_reqs:
        n = counts[b] + 1
        target[b, :n] = probs[offset : offset + n]
        offset += n
    q = None
    if draft_probs is not None and any(p is not None for p in draft_probs):
        q = torch.zeros(num_reqs, k_max, vocab, device=device)
        for b, p in enumerate(draft_probs):
            if p is None:  # a certain proposal among drawn ones: q one-hot at the draft
                q[b, : counts[b]] = torch.nn.functional.one_hot(
                    draft_ids[b, : counts[b]], vocab
                ).to(q.dtype)
            else:
                q[b, : counts[b]] = p[: counts[b]].to(device=device, dtype=q.dtype)
    return rejection_sample(
        target,
        draft_ids,
        num_drafts,
        draft_probs=q,
        greedy=greedy,
        generators=[s.generator for s in states],
        default_generator=sampler.generator_for(device),
    )


def _at_position(state: SamplingRequestState, drafts: Sequence[int], j: int):
    """The request's sampling state as it would be at draft position j (drafts before j
    sampled): a copy only when min_tokens or penalties look at the output."""
    if j == 0:
        return state
    params = state.params
    counts_output = (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or (len(state.output_token_ids) < params.min_tokens and state.stop_token_ids)
    )
    if not counts_output:
        return state
    return dataclasses.replace(state, output_token_ids=[*state.output_token_ids, *drafts[:j]])
