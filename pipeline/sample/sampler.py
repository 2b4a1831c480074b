"""Batched sampler: one step's logits [R, V] -> one token per running request.

Owns `SamplingRequestState` (what the sampler needs from a request across steps),
`Sampler` (the per-step pipeline), the logprob outputs, and `compute_prompt_logprobs`.

Every stage works on whole [R, V] tensors and is skipped outright when no row in the
batch uses it, so an all-greedy batch without penalties costs one argmax:

    logits (raw, never written) ─────────────────────► log_softmax ─► logprobs
      │                                                (only when a row asked; vLLM V1's
      │  clone, only if one of the next three runs      default "raw" logprobs)
      ├─ logit_bias    one index_put over (row, token, bias) triples
      ├─ min_tokens    stop tokens -> -inf while len(output) < min_tokens
      ├─ penalties     repetition, presence, frequency: gather/scatter at seen ids only
      │
      ├─ greedy rows   argmax
      └─ random rows   / temperature -> top-k -> top-p -> min-p -> softmax
                       -> argmax(probs / q), q ~ Exp(1)
                       (CPU: the filters, then argmax(logits / T - ln q) in one C pass)

top-k alone is a torch.topk up to the largest k; top-p sorts, but only the largest-k
candidates (topk) when every row has a top-k, the whole vocabulary otherwise.

The exponential trick: if q_i ~ Exp(1) independently, argmax_i p_i / q_i is distributed as
Categorical(p), so sampling needs no cumulative sum and no per-row Python.

Invariants:
- The caller's logits are never modified.
- A seeded request draws its q from its own `torch.Generator`, the same number of values
  per step it samples in, so its tokens do not depend on its row or on its neighbours. The
  state (and so the generator) must outlive a preemption for the stream to continue
  unchanged.
- Unseeded random rows draw their q in one batched call from the sampler's generator.
- On the CPU the generators draw one 63-bit key per row and step, and the C kernels draw
  the row's V values from the stream of that key (ops/cpu.py: SplitMix64, vectorized; torch's
  CPU generator draws one value at a time). The race itself then runs in one C pass
  (`race_rows`, the Gumbel form: no softmax, no draws kept): 1.6 ms for a step of 64 rows on
  a 49,152-token vocabulary, 9.3 ms before. On a GPU the generators draw all V values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ringllm.pipeline.ops.cpu import argmax_rows, exponential_rows, race_rows, rows_on_kernels
from ringllm.pipeline.sample.logits_filters import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    filter_thresholds,
    pad_token_ids,
)
from ringllm.pipeline.sampling_params import SamplingParams

# Smallest positive float32: exponential draws are clamped to it so that probs / q never
# divides by zero (0 / 0 would be NaN, and argmax picks NaN).
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


class LogprobRows(NamedTuple):
    """Logprob rows of R positions, as tensors; column 0 is the chosen token, then the top-N."""

    token_ids: torch.Tensor  # [R, 1 + N] int64
    logprobs: torch.Tensor  # [R, 1 + N] float32
    ranks: torch.Tensor  # [R] int64: 1-based rank of column 0's token in its row


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobRows | None  # None unless some request asked for logprobs


@dataclass
class SamplingRequestState:
    """Per running request, kept by the engine across steps; it appends to output_token_ids."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # EOS ids (unless ignore_eos) + params.stop_token_ids: masked while min_tokens is unmet.
    stop_token_ids: set[int] = field(default_factory=set)
    generator: torch.Generator | None = None  # only for seeded requests
    _prompt_ids_array: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: int | Sequence[int] | None = None,
        device: str | torch.device = "cpu",
    ) -> SamplingRequestState:
        """Builds the state; `device` should be where the logits live (the generator's home)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            params=params,
            prompt_token_ids=list(prompt_token_ids),
            stop_token_ids=params.all_stop_token_ids(eos_token_ids),
            generator=generator,
        )

    def prompt_ids_array(self) -> np.ndarray:
        # NOTE: cached because the prompt never changes and may be thousands of tokens;
        # converting the list again every step would dominate the penalty stage.
        if self._prompt_ids_array is None:
            self._prompt_ids_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_ids_array


@dataclass
class _BatchPlan:
    """What each stage must do for this batch, gathered in one pass over the states."""

    greedy_rows: list[int] = field(default_factory=list)
    random_rows: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_token_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    min_tokens_rows: list[int] = field(default_factory=list)
    min_tokens_token_ids: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    num_logprobs: int | None = None  # the batch's max top-N; None when no row asked


def _plan_batch(states: Sequence[SamplingRequestState]) -> _BatchPlan:
    plan = _BatchPlan()
    for row, state in enumerate(states):
        params = state.params
        (plan.greedy_rows if params.is_greedy else plan.random_rows).append(row)
        if params.logit_bias:
            plan.bias_rows.extend([row] * len(params.logit_bias))
            plan.bias_token_ids.extend(params.logit_bias.keys())
            plan.bias_values.extend(params.logit_bias.values())
        if len(state.output_token_ids) < params.min_tokens and state.stop_token_ids:
            plan.min_tokens_rows.extend([row] * len(state.stop_token_ids))
            plan.min_tokens_token_ids.extend(state.stop_token_ids)
        if (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        ):
            plan.penalty_rows.append(row)
        if params.logprobs is not None:
            plan.num_logprobs = max(plan.num_logprobs or 0, params.logprobs)
    return plan


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobRows:
    """Column 0: each row's `token_ids` entry; then the row's top-`num_logprobs`."""
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    # vLLM's rank: how many tokens are at least as likely (ties count against the token).
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    num_top = min(num_logprobs, logprobs.shape[-1])
    if num_top == 0:
        return LogprobRows(token_ids[:, None].clone(), token_logprobs, ranks)
    top = torch.topk(logprobs, num_top, dim=-1)
    return LogprobRows(
        torch.cat([token_ids[:, None], top.indices], dim=1),
        torch.cat([token_logprobs, top.values], dim=1),
        ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int] | torch.Tensor, num_logprobs: int
) -> LogprobRows:
    """Logprobs of the actual next prompt tokens (+ top-N) from raw prompt logits.

    `logits[i]` is the model's output at prompt position s + i, which predicts prompt
    token s + i + 1 = `next_token_ids[i]`. For a whole prompt pass logits[:-1] (or all of
    them) with prompt[1:]; for a chunk [s, e) pass its logits with prompt[s + 1 : e + 1].
    The last chunk has one id fewer than logits rows: its last row predicts the first
    output token, and only the first len(next_token_ids) rows are used.
    """
    targets = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    num_positions = logits.shape[0]
    if targets.dim() != 1 or targets.numel() > num_positions:
        raise ValueError(
            f"next_token_ids: need a 1-D list of at most {num_positions} ids "
            f"(one per logits row), got shape {tuple(targets.shape)}"
        )
    logprobs = logits[: targets.numel()].float().log_softmax(dim=-1)
    return gather_logprobs(logprobs, targets, num_logprobs)


def _fill_exponential(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fills `out` with Exp(1) draws from `generator`."""
    if out.device.type == "cpu":
        # NOTE: torch's CPU exponential_ is ~5x slower than uniform_ + log_ (measured at
        # [256, 50k]); -log(U) with U ~ Uniform[0, 1) is Exp(1) too (U = 0 gives inf: a
        # token that cannot win this draw, with probability 2**-24).
        return out.uniform_(generator=generator).log_().neg_()
    return out.exponential_(generator=generator)


def _on_cpu(generator: torch.Generator) -> torch.Generator:
    if generator.device.type != "cpu":
        raise ValueError(
            f"a seeded request's generator is on {generator.device}, its logits on the CPU"
        )
    return generator


class Sampler:
    """Samples one token per row; see the module docstring for the stages."""

    def __init__(self, vocab_size: int, seed: int | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1 token, got {vocab_size}")
        self.vocab_size = vocab_size
        self._seed = seed  # for unseeded requests; None: a fresh random seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingRequestState]) -> SamplerOutput:
        """One token per row of `logits` [R, V] float32 (row i belongs to states[i])."""
        self._check_batch(logits, states)
        plan = _plan_batch(states)
        processed = self._process_logits(logits, states, plan)
        sampled = self._sample_rows(processed, states, plan)
        if plan.num_logprobs is None:
            return SamplerOutput(sampled, None)
        raw_logprobs = logits.float().log_softmax(dim=-1)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, plan.num_logprobs))

    def process_logits(
        self, logits: torch.Tensor, states: Sequence[SamplingRequestState]
    ) -> torch.Tensor:
        """The logits after logit_bias, min_tokens and penalties (before temperature)."""
        self._check_batch(logits, states)
        return self._process_logits(logits, states, _plan_batch(states))

    def _check_batch(self, logits: torch.Tensor, states: Sequence[SamplingRequestState]) -> None:
        expected = (len(states), self.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise ValueError(
                f"logits: expected shape [num_requests, vocab_size] = {list(expected)}, "
                f"got {list(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits: expected dtype float32, got {logits.dtype}")

    def _process_logits(
        self, logits: torch.Tensor, states: Sequence[SamplingRequestState], plan: _BatchPlan
    ) -> torch.Tensor:
        """logit_bias, min_tokens and penalties, on a copy made only when one applies."""
        if not (plan.bias_rows or plan.min_tokens_rows or plan.penalty_rows):
            return logits
        logits = logits.clone()
        device = logits.device
        if plan.bias_rows:
            rows = torch.tensor(plan.bias_rows, device=device)
            cols = torch.tensor(plan.bias_token_ids, device=device)
            values = torch.tensor(plan.bias_values, dtype=logits.dtype, device=device)
            logits.index_put_((rows, cols), values, accumulate=True)
        if plan.min_tokens_rows:
            rows = torch.tensor(plan.min_tokens_rows, device=device)
            cols = torch.tensor(plan.min_tokens_token_ids, device=device)
            logits[rows, cols] = float("-inf")
        if plan.penalty_rows:
            self._penalize_rows(
                logits, [states[row] for row in plan.penalty_rows], plan.penalty_rows
            )
        return logits

    def _penalize_rows(
        self, logits: torch.Tensor, states: list[SamplingRequestState], rows: list[int]
    ) -> None:
        device = logits.device
        factors: dict[str, torch.Tensor | None] = {}
        for name, neutral in (("repetition", 1.0), ("frequency", 0.0), ("presence", 0.0)):
            values = [getattr(s.params, name + "_penalty") for s in states]
            used = any(v != neutral for v in values)
            factors[name] = torch.tensor(values, device=device) if used else None
        output_ids, output_lengths = pad_token_ids([s.output_token_ids for s in states])
        seen_ids = None
        if factors["repetition"] is not None:
            seen_ids, _ = pad_token_ids(
                [
                    np.concatenate((s.prompt_ids_array(), np.asarray(s.output_token_ids, np.int64)))
                    for s in states
                ]
            )
            seen_ids = seen_ids.to(device)
        whole_batch = len(rows) == logits.shape[0]
        index = torch.tensor(rows, device=device)
        penalized = apply_penalties(
            logits if whole_batch else logits[index],
            seen_ids,
            output_ids.to(device),
            output_lengths.to(device),
            **factors,
        )
        if not whole_batch:
            logits[index] = penalized

    def _sample_rows(
        self, logits: torch.Tensor, states: Sequence[SamplingRequestState], plan: _BatchPlan
    ) -> torch.Tensor:
        if not plan.random_rows:
            return argmax_rows(logits)
        num_rows = logits.shape[0]
        whole_batch = len(plan.random_rows) == num_rows
        if whole_batch:
            random_logits = logits
        else:
            random_index = torch.tensor(plan.random_rows, device=logits.device)
            random_logits = logits[random_index]
        random_states = [states[row] for row in plan.random_rows]
        params = [s.params for s in random_states]
        if rows_on_kernels(random_logits):
            # one C pass: temperature (where no filter needs it first) and the race
            scaled, inv_temp, min_score = self._race_inputs(random_logits, params)
            keys = self._draw_keys([s.generator for s in random_states])
            random_tokens = race_rows(scaled.contiguous(), inv_temp, keys, min_score=min_score)
        else:
            probs = self.filtered_probs(random_logits, params)
            exponentials = self.draw_exponentials(probs, [s.generator for s in random_states])
            random_tokens = probs.div_(exponentials).argmax(dim=-1)
        if whole_batch:
            return random_tokens
        sampled = argmax_rows(logits)  # right for the greedy rows; random rows overwritten
        sampled[random_index] = random_tokens
        return sampled

    def _race_inputs(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the race takes: the logits, each row's 1 / temperature, and with top-k,
        top-p or min-p in the batch each row's threshold on the tempered logits (then the
        logits come tempered, as the filters see them, and the factors are 1)."""
        inv_temp = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
        top_k_values = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        use_p, use_min_p = any(p.top_p < 1.0 for p in params), any(p.min_p > 0 for p in params)
        if not (any(top_k_values) or use_p or use_min_p):
            return logits, inv_temp, None
        if any(p.temperature != 1.0 for p in params):
            logits = logits * inv_temp[:, None]
        top_k = torch.tensor(top_k_values) if any(top_k_values) else None
        top_p = torch.tensor([p.top_p for p in params]) if use_p else None
        every_row_has_k = all(top_k_values)
        threshold = filter_thresholds(
            logits,
            top_k,
            max(top_k_values),
            top_p,
            max(top_k_values) if every_row_has_k else self.vocab_size,
            torch.tensor([p.min_p for p in params]) if use_min_p else None,
        )
        return logits, torch.ones(len(params)), threshold

    def filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p (each only if used)."""
        # softmax allocates a fresh tensor, so later in-place work never touches the caller's.
        return self.filtered_logits(logits, params).softmax(dim=-1)

    def filtered_logits(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Logits after temperature, top-k, top-p and min-p (each only if used; filtered
        tokens at -inf); `logits` itself when none applies."""
        device = logits.device
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            logits = logits / torch.tensor(temperatures, device=device)[:, None]
        # top_k >= V keeps everything, exactly like off.
        top_k_values = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        top_k = torch.tensor(top_k_values, device=device) if any(top_k_values) else None
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if top_p is not None:
            every_row_has_k = all(top_k_values)
            num_candidates = max(top_k_values) if every_row_has_k else self.vocab_size
            logits = apply_top_k_top_p(logits, top_k, top_p, num_candidates)
        elif top_k is not None:
            logits = apply_top_k(logits, top_k, max(top_k_values))
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        return logits

    def draw_exponentials(
        self, like: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Exp(1) draws shaped like `like`: one batched call, then each seeded row redrawn
        (on the CPU: one key per row, from its generator or the sampler's, and one call)."""
        draws = torch.empty_like(like)
        if rows_on_kernels(draws):
            exponential_rows(draws, self._draw_keys(generators))
            return draws
        if any(g is None for g in generators):
            _fill_exponential(draws, self.generator_for(like.device))
        for row, generator in enumerate(generators):
            if generator is None:
                continue
            if generator.device == draws.device:
                _fill_exponential(draws[row], generator)
            else:
                own = torch.empty(like.shape[-1], device=generator.device)
                draws[row].copy_(_fill_exponential(own, generator))
        return draws.clamp_(min=_MIN_EXPONENTIAL)

    def _draw_keys(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One 63-bit key per row (int64 [R]): a seeded row's from its own generator, the
        others' in one call from the sampler's."""
        keys = torch.empty(len(generators), dtype=torch.int64)
        if any(g is None for g in generators):
            keys.random_(generator=self.generator_for(keys.device))
        for row, generator in enumerate(generators):
            if generator is not None:
                keys[row : row + 1].random_(generator=_on_cpu(generator))
        return keys

    def generator_for(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]
