"""core/speculation.py: lookahead slots past a step that samples, drafts kept within
max_tokens and the context, and the rejected drafts' slots given back."""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import spec_blocks_kept
from ringllm.pipeline.core.speculation import Speculation, drafts_in_chunk
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SpecDecodingStats

BS = 4


def test_lookahead_only_after_a_step_that_samples_and_within_the_context():
    spec = Speculation(3, 20, None)
    request = Request("r", [5] * 10, SamplingParams())
    assert spec.lookahead(request, 4, 0) == 0  # a prompt chunk
    assert spec.lookahead(request, 10, 0) == 3
    request.all_token_ids.extend([6] * 8)  # 18 tokens
    assert spec.lookahead(request, 1, 17) == 2  # the context ends at 20
    assert Speculation(0, 20, None).lookahead(request, 1, 17) == 0


def test_drafts_kept_leave_room_for_the_sampled_token():
    spec = Speculation(0, 12, None)
    request = Request("r", [5] * 8, SamplingParams(), max_tokens=3)
    spec.keep_drafts(request, [1, 2, 3, 4])
    assert request.spec_token_ids == [1, 2]  # 3 tokens left to emit: 2 drafts + 1
    spec.keep_drafts(request, None)
    assert request.spec_token_ids == [1, 2]  # no proposal: nothing changes
    request.max_tokens = 16
    spec.keep_drafts(request, [1, 2, 3, 4, 5])
    assert request.spec_token_ids == [1, 2, 3]  # the context: 12 - 8 = 4 left


def test_drafts_in_chunk_are_those_past_the_requests_own_tokens():
    request = Request("r", [5] * 8, SamplingParams())
    request.num_computed_tokens = 7
    request.spec_token_ids = [1, 2, 3]
    assert drafts_in_chunk(request, 3) == [1, 2]
    assert drafts_in_chunk(request, 1) == []


def test_roll_back_gives_back_the_rejected_drafts_slots():
    kv = KVCacheManager(16, BS, 64, 2)
    stats = SpecDecodingStats()
    spec = Speculation(0, 64, stats)
    request = Request("r", [5] * 6, SamplingParams())
    assert kv.allocate_slots(request, 6 + 5) is not None  # 6 own tokens and 5 drafts
    request.num_computed_tokens = 11
    assert len(kv.block_ids("r")) == 3
    spec.roll_back(request, kv, num_drafts=5, num_accepted=1)
    assert request.num_computed_tokens == 7
    assert len(kv.block_ids("r")) == spec_blocks_kept(7, 0, BS) == 2
    assert stats.take() is not None
