"""Logits filters: the tensor stages of sampling, each over a whole [R, V] batch.

Penalties (repetition, presence, frequency) touch only the token ids a row has seen;
top-k is one topk up to the largest k; top-p sorts only the top-k candidates when every
row has a top-k, else first probes the most likely tokens (as many as can hold its set, at
most TOP_P_PROBE) and sorts a whole row only when they do not hold p of the mass; min-p
masks tokens below min_p * max prob. `filter_thresholds` gives the same kept sets as one
threshold per row, for the sampler's race on the CPU kernels.
The `Sampler` (pipeline/sample/sampler.py) decides which stages a batch needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ringllm.pipeline.ops.cpu import rows_on_kernels, top_p_rows

# Candidates top-p tries (one topk) before sorting a whole row; see _probe_top_p_candidates.
TOP_P_PROBE = 1024


def pad_token_ids(id_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] int64 ids (L >= 1) and [R] int64 lengths; each row is padded with its own first id.

    NOTE: a pad repeats an id the row really holds (0 for an empty row), so a scatter_ at a
    pad is a duplicate of a real write with the very same value and can never clobber it.
    """
    lengths = [len(ids) for ids in id_lists]
    padded = np.zeros((len(id_lists), max(max(lengths, default=0), 1)), dtype=np.int64)
    for row, ids in enumerate(id_lists):
        if len(ids):
            padded[row, : len(ids)] = ids
            padded[row, len(ids) :] = ids[0]
    return torch.from_numpy(padded), torch.tensor(lengths, dtype=torch.int64)


def apply_penalties(
    logits: torch.Tensor,
    seen_ids: torch.Tensor | None,
    output_ids: torch.Tensor,
    output_lengths: torch.Tensor,
    repetition: torch.Tensor | None = None,
    frequency: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
) -> torch.Tensor:
    """Applies the penalties to `logits` [R, V] in place (and returns it).

    repetition [R]: tokens in `seen_ids` (prompt + output, padded as by pad_token_ids) get
    positive logits divided by it and negative ones multiplied (> 1 pushes away from the
    token either way). presence [R] subtracts p once from each token in `output_ids`;
    frequency [R] subtracts f per occurrence. A penalty passed as None is used by no row.
    Only the [R, L] seen positions are touched, never a dense [R, V] count: a step with
    256 rows of 50k logits and a few hundred tokens each moves kilobytes, not 100s of MB.
    """
    if repetition is not None:
        assert seen_ids is not None
        values = logits.gather(1, seen_ids)
        rep = repetition[:, None]
        logits.scatter_(1, seen_ids, torch.where(values > 0, values / rep, values * rep))
    if presence is not None:
        # Duplicates write the same value, so p lands once per distinct token. A row with
        # no output holds only the pad id 0, which must stay untouched: weight 0.
        has_output = (output_lengths > 0).to(logits.dtype)
        values = logits.gather(1, output_ids)
        logits.scatter_(1, output_ids, values - (presence * has_output)[:, None])
    if frequency is not None:
        position = torch.arange(output_ids.shape[1], device=logits.device)
        per_occurrence = (position < output_lengths[:, None]) * -frequency[:, None]
        logits.scatter_add_(1, output_ids, per_occurrence)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[R, V] logits with tokens below each row's k-th largest set to -inf.

    top_k: [R] int64 in [0, V), 0 = off for that row; max_top_k: its largest entry (given by
    the caller, who knows it without a device sync). torch.topk up to the largest k is far
    cheaper than a full sort. Tokens tied with the k-th largest are all kept.
    """
    largest_k = torch.topk(logits, max_top_k, dim=-1).values
    kth_value = largest_k.gather(1, (top_k.clamp(min=1) - 1)[:, None])
    kth_value = torch.where(top_k[:, None] > 0, kth_value, float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """[R, V] logits keeping each row's top-k, then the smallest set of those whose mass reaches p.

    top_k: [R] int64, 0 = off (or None: off everywhere); top_p: [R] float, 1.0 = off.
    num_candidates: how many of each row's most likely tokens can survive: V when some row
    has no top-k, else the largest k. Then only that many are sorted (topk), not all V.
    """
    values, token_ids = _top_k_top_p_kept(logits, top_k, top_p, num_candidates)
    return torch.full_like(logits, float("-inf")).scatter_(1, token_ids, values)


def filter_thresholds(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    num_candidates: int,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """top-k, top-p and min-p (each None: used by no row) as one threshold per row, float32
    [R]: a token survives them all when its logit reaches its row's threshold (-inf: every
    token). The kept sets of apply_top_k / apply_top_k_top_p / apply_min_p, except that a
    token tied with top-p's last kept one is kept too (top-k keeps its ties already), with no
    [R, V] tensor written: the sampler's race (ops/cpu.py race_rows) takes the thresholds."""
    rows = logits.shape[0]
    threshold = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    if top_p is not None and not rows_on_kernels(logits):
        values, _ = _top_k_top_p_kept(logits, top_k, top_p, num_candidates)
        # the candidates are sorted: the last finite one is the smallest kept
        return _with_min_p(
            logits, values.masked_fill(values == float("-inf"), float("inf")).amin(dim=-1), min_p
        )
    if top_k is not None:
        largest_k = torch.topk(logits, max_top_k, dim=-1).values
        kth_value = largest_k.gather(1, (top_k.clamp(min=1) - 1)[:, None])[:, 0]
        threshold = torch.where(top_k > 0, kth_value, threshold)
    if top_p is not None:  # on the C kernels: a radix selection per row, no sort
        floor = None if top_k is None else threshold.contiguous()
        threshold = top_p_rows(logits, top_p.to(torch.float32).contiguous(), floor)
    return _with_min_p(logits, threshold, min_p)


def _with_min_p(
    logits: torch.Tensor, threshold: torch.Tensor, min_p: torch.Tensor | None
) -> torch.Tensor:
    if min_p is not None:
        # prob >= min_p * max prob  <=>  logit >= max logit + ln(min_p) (the max survives the
        # other filters, and the row's mass cancels)
        floor = logits.amax(dim=-1) + torch.log(min_p.to(torch.float32))
        threshold = torch.maximum(threshold, torch.where(min_p > 0, floor, float("-inf")))
    return threshold.to(torch.float32).contiguous()


def _top_k_top_p_kept(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p's candidates: values [R, C] sorted descending, the dropped ones
    -inf, and their token ids [R, C]."""
    vocab_size = logits.shape[-1]
    k = None if top_k is None else torch.where(top_k > 0, top_k, vocab_size)
    row_log_mass = None  # log of each row's whole mass, when the candidates are not all of it
    if num_candidates < vocab_size:
        values, token_ids = torch.topk(logits, num_candidates, dim=-1)
    else:
        probe = _probe_top_p_candidates(logits, k, top_p)
        if probe is None:
            values, token_ids = logits.sort(dim=-1, descending=True)
        else:
            values, token_ids, row_log_mass = probe
    if k is not None:
        position = torch.arange(values.shape[-1], device=logits.device)
        values = values.masked_fill(position >= k[:, None], float("-inf"))
    # top-p measures mass against the row's top-k when it has one (all among the candidates),
    # else against the whole row.
    log_mass = values.logsumexp(dim=-1)
    if row_log_mass is not None:
        log_mass = (
            row_log_mass if k is None else torch.where(k < vocab_size, log_mass, row_log_mass)
        )
    probs = (values - log_mass[:, None]).exp()
    # Token j stays while the more likely tokens alone hold < p of that mass.
    mass_before = torch.zeros_like(probs)
    mass_before[:, 1:] = probs[:, :-1].cumsum(dim=-1)
    # p = 1 means off: compare against inf so rounding in the cumsum never drops a token.
    limit = torch.where(top_p < 1.0, top_p, float("inf"))
    return values.masked_fill(mass_before >= limit[:, None], float("-inf")), token_ids


def _probe_top_p_candidates(
    logits: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's top candidates (descending; as many as the neediest row needs, at most
    TOP_P_PROBE) and log mass, if they settle every row.

    A row is settled when its top-k fits in the probe, or when the probe's tokens before
    the last already hold p of the row's mass (so the last one, and all after, go).
    Otherwise None, and the caller sorts the whole vocabulary.
    NOTE: LM next-token distributions are usually peaked enough for p = 0.9 to be reached
    within the top 1024 tokens; then the whole top-p stage at [256, 50k] is ~5x faster on
    the CPU than with a full sort. Flat rows (or high temperatures) fall back to the sort.
    """
    vocab_size = logits.shape[-1]
    if vocab_size < 4 * TOP_P_PROBE:
        return None
    row_log_mass = logits.logsumexp(dim=-1)
    # How many candidates a row needs: its tokens of probability under (1 - p) / V hold less
    # than 1 - p of its mass together, so the ones above that (a prefix of the sorted row)
    # hold more than p, and its top-p set is among them (half that floor, for rounding). A
    # peaked row needs tens to hundreds, and a topk of that many costs a fraction of one of
    # TOP_P_PROBE (11 ms at [64, 49152] on 2 cores, against 3.6 with 200).
    floor = row_log_mass + torch.log(
        (1.0 - top_p.to(logits.dtype)).clamp(min=1e-30) / (2 * vocab_size)
    )
    need = (logits >= floor[:, None]).sum(dim=-1)
    if k is not None:
        need = torch.where(k < vocab_size, torch.minimum(need, k), need)
    # NOTE: a device sync, as below; +1: the check's last. More than the probe: the probe,
    # whose tokens may still hold p (the floor is a bound, not the set)
    candidates = min(int(need.max()) + 1, TOP_P_PROBE)
    values, token_ids = torch.topk(logits, candidates, dim=-1)
    held = (values[:, :-1] - row_log_mass[:, None]).exp().sum(dim=-1)
    settled = (top_p < 1.0) & (held >= top_p)
    if k is not None:
        settled = torch.where(k < vocab_size, k <= candidates, settled)
    if not bool(settled.all()):  # NOTE: a device sync; the step syncs for its tokens anyway
        return None
    return values, token_ids, row_log_mass


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] logits with tokens whose prob < min_p * (the row's max prob) set to -inf."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
