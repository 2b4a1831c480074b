"""Speculative decoding in the worker: the proposer interface, and the n-gram proposer on it.

After a step samples, the worker asks its proposer for the next drafts of every request
that sampled (and may speculate); they go back to the scheduler in the step's
`ModelRunnerOutput.spec_token_ids`, the scheduler fits them into the next step's token
budget (`SchedulerOutput.scheduled_spec_tokens`), and that step scores them all in one
forward pass and verifies them (pipeline/sample/speculative.py).

    step t:    [last token] -> sample -> propose d0..dk-1 ─┐
    step t+1:  [last token, d0 .. dk-1] (k + 1 query tokens)  -> k + 1 logits rows
               -> rejection sampler: accepted d0..da-1 + one token -> propose again ...

A proposer (`Proposer`) is one file: `ngram` (prompt lookup, here) and `draft_model`
(pipeline/worker/draft_proposer.py). An EAGLE-style head or suffix decoding would be one
more class with these methods, chosen in `make_proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.worker.ngram_proposer import NgramProposer


@dataclass
class Proposals:
    """Drafts of the rows asked, in their order."""

    token_ids: list[np.ndarray]  # int32 drafts per row (possibly none)
    # q per row: float32 [len(drafts), vocab] (the distribution each draft was drawn
    # from), or None for a proposer that is certain of its drafts (n-gram)
    probs: list[torch.Tensor | None] | None = None


class Proposer(Protocol):
    # KV slots past a step's scheduled tokens the proposer writes (the scheduler allocates
    # blocks for them): a draft model computes its drafts' keys and values ahead
    num_lookahead_slots: int
    # extra KV-cache bytes per block (a draft model's own cache over the same block ids)
    kv_bytes_per_block: int

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def release_kv_cache(self) -> None: ...

    def start(self, request_id: str) -> None:
        """The request is new, or resumed after preemption: nothing of it is cached."""

    def finish(self, request_id: str) -> None:
        """The request is gone."""

    def propose(self, batch, rows: np.ndarray, request_ids: list[str]) -> Proposals:
        """Drafts to follow each row's known tokens (`batch.token_ids[row, :num_tokens]`,
        the step's sampled tokens included), at most `num_speculative_tokens` each."""


class NgramDrafter:
    """Prompt lookup over each request's own tokens (no model, no KV)."""

    num_lookahead_slots = 0
    kv_bytes_per_block = 0

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(num_speculative_tokens, min_n, max_n)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def release_kv_cache(self) -> None:
        pass

    def start(self, request_id: str) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass

    def propose(self, batch, rows: np.ndarray, request_ids: list[str]) -> Proposals:
        tokens, lengths = batch.token_ids, batch.num_tokens
        return Proposals([self.ngram.propose(tokens[row, : lengths[row]]) for row in rows.tolist()])


def make_proposer(config: EngineConfig, runner) -> Proposer | None:
    """The proposer the engine's speculative config names (None: no speculation)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        return NgramDrafter(
            spec.num_speculative_tokens,
            spec.get("prompt_lookup_min"),
            spec.get("prompt_lookup_max"),
        )
    from ringllm.pipeline.worker.draft_proposer import DraftModelProposer

    return DraftModelProposer(config, runner)
