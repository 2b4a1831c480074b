"""What the scheduler tells the workers each step, and what the workers answer.

Only what changed is sent: a request's full data once (`NewRequestData`, when it is
first scheduled), then per step just its new blocks and its computed-token count
(`CachedRequestData`). Workers keep each request's tokens and sampling state until its
id appears in `finished_request_ids`. A request resumed after preemption is a cached
request with `resumed=True` whose `new_block_ids` is its whole new block list.

The interface between the engine core and the workers: both import this module, it
imports neither (the workers' rules shared with the scheduler, such as `spec_blocks_kept`,
live here too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringllm.pipeline.messages import LogprobRow
from ringllm.pipeline.sampling_params import SamplingParams


@dataclass
class KVTransfers:
    """One step's copies between tiers, which the workers make before the forward pass in
    this field order; core/kv_tiers.py decides them and says why the order is safe."""

    to_disk: list[tuple[int, int, int]] = field(default_factory=list)  # host, slot, hash
    to_host: list[tuple[int, int]] = field(default_factory=list)  # device block, host block
    from_disk: list[tuple[int, int, int]] = field(default_factory=list)  # slot, device, hash
    to_device: list[tuple[int, int]] = field(default_factory=list)  # host block, device block
    # what the engine core must undo if the step fails before the copies are done
    swapped_out: list[str] = field(default_factory=list)  # request ids
    swapped_in: list[str] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)  # hashes newly cached in host / disk

    @property
    def is_empty(self) -> bool:
        return not (self.to_disk or self.to_host or self.from_disk or self.to_device)


def spec_blocks_kept(num_computed_tokens: int, num_lookahead_slots: int, block_size: int) -> int:
    """Blocks a request keeps after its drafts were verified: those of its computed tokens,
    its next token's position and the lookahead slots a draft model writes next."""
    return -(-(num_computed_tokens + 1 + num_lookahead_slots) // block_size)


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # every known token: prompt, then outputs (if resumed)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    # its images (pipeline/messages.py ImageInput, pixel values included), in position order
    mm_inputs: tuple = ()


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False
    # pipeline parallelism: the tokens sampled since it was last scheduled, for the stages
    # that do not sample (the last stage has them already)
    new_token_ids: list[int] = field(default_factory=list)


class GrammarBitmask:
    """Structured outputs: for each constrained request that samples in the step, the
    tokens its grammar allows (pipeline/structured/grammar.py's bitmask rows; the worker masks its
    logits with them before sampling).

    The rows may still be being filled when the step starts (a future: the grammar backend
    fills them while the model runs); `bitmask` waits for them."""

    def __init__(self, request_ids: list[str], bitmask) -> None:
        self.request_ids = request_ids
        self._bitmask = bitmask  # int32 [len(request_ids), ceil(vocab / 32)], or its future

    @property
    def bitmask(self) -> np.ndarray:
        if not isinstance(self._bitmask, np.ndarray):
            self._bitmask = self._bitmask.result()
        return self._bitmask


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    grammar: GrammarBitmask | None = None
    # speculative decoding: the drafts each request's step verifies (its last
    # len(drafts) scheduled tokens); requests without drafts are absent
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV copies between tiers the workers make before the forward (core/kv_tiers.py)
    kv_transfers: KVTransfers | None = None
    # async scheduling (engine core only, never sent): the requests whose step here samples a
    # token that a later batch in flight already counts on (Request.num_placeholders)
    placeholders: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def start_of(self, request_id: str) -> int:
        """The request's computed tokens before this step (where its scheduled ones begin)."""
        for data in (*self.new_requests, *self.cached_requests):
            if data.request_id == request_id:
                return data.num_computed_tokens
        raise KeyError(request_id)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in the order of `req_ids`.

    Speculative decoding: a request that verified drafts emits its accepted drafts
    (`accepted_token_ids[rid]`, with their logprobs in `accepted_logprobs[rid]`) and then
    its sampled token; `spec_token_ids[rid]` are the drafts proposed for its next step."""

    req_ids: list[str]
    sampled_token_ids: list[int | None]  # None: a prompt chunk that did not reach its end
    logprobs: list[LogprobRow | None]
    prompt_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the pooling requests whose prompt the step ended: their vectors (float32)
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
