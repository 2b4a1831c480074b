"""Speculative decoding, as the scheduler accounts for it (the drafts themselves are
proposed by the workers: pipeline/worker/spec_decode.py).

A running request's drafts (proposed after its last step, `Request.spec_token_ids`) are
scheduled with its next token, within the token budget (drafts past it are dropped:
`drafts_in_chunk`) and within its max_tokens and the context (`keep_drafts`, when they
arrive). After the step the rejected drafts' slots are given back (`roll_back`:
`num_computed_tokens` rolled back, emptied blocks freed by spec_blocks_kept, the rule the
workers apply too). A draft model's lookahead slots (`lookahead`) are allocated past every
step that samples.
"""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import spec_blocks_kept
from ringllm.pipeline.stats import SpecDecodingStats


class Speculation:
    def __init__(
        self, num_lookahead_slots: int, max_model_len: int, stats: SpecDecodingStats | None
    ) -> None:
        """`num_lookahead_slots`: KV slots a draft model writes past a step's tokens;
        `stats`: where verified drafts are counted (None: the workers propose none)."""
        self.num_lookahead_slots = num_lookahead_slots
        self.max_model_len = max_model_len
        self.stats = stats

    def lookahead(self, request: Request, num_new: int, num_computed: int) -> int:
        """KV slots to reserve past this step's `num_new` tokens from `num_computed`: a
        draft model's, when the step samples (it drafts right after), within the context."""
        if not self.num_lookahead_slots:
            return 0
        end = num_computed + num_new
        if end < request.num_tokens:
            return 0  # a prompt chunk: nothing is drafted after it
        return max(0, min(self.num_lookahead_slots, self.max_model_len - end))

    def roll_back(
        self, request: Request, kv: KVCacheManager, num_drafts: int, num_accepted: int
    ) -> None:
        """The rejected drafts' slots are given back: their keys and values are not the
        request's; blocks left holding nothing it needs are freed."""
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.stats is not None:
            self.stats.observe(num_drafts, num_accepted)
        kept = spec_blocks_kept(
            request.num_computed_tokens, self.num_lookahead_slots, kv.block_size
        )
        kv.trim(request, kept)

    def keep_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """Keeps the worker's proposals for the request's next step, as many as can be
        emitted: an accepted run plus one token within max_tokens and the context."""
        if not drafts:
            return
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        request.spec_token_ids = list(drafts[: max(room - 1, 0)])


def drafts_in_chunk(request: Request, num_new: int) -> list[int]:
    """The drafts a chunk of `num_new` tokens holds after the request's own tokens."""
    num_own = request.num_tokens - request.num_computed_tokens
    return request.spec_token_ids[: max(num_new - num_own, 0)]
