"""core/worker_view.py: a request's full data goes to the workers once, then only diffs;
the ids they must drop go out once, on the next step."""

from __future__ import annotations

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import SchedulerOutput
from ringllm.pipeline.core.worker_view import WorkerView
from ringllm.pipeline.sampling_params import SamplingParams

BS = 4


def test_new_then_cached_then_swapped_in_and_dropped_once():
    kv = KVCacheManager(16, BS, 64, 2)
    view = WorkerView(sync_sampled_tokens=False)
    request = Request("r", [5] * 6, SamplingParams())
    blocks = kv.allocate_slots(request, 6)
    out = SchedulerOutput()
    view.record(out, request, 6, blocks, kv)
    (new,) = out.new_requests
    assert new.block_ids == blocks and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"r": 6} and request.num_computed_tokens == 6
    request.append_output_token(9)
    more = kv.allocate_slots(request, 1)
    out = SchedulerOutput()
    view.record(out, request, 1, more, kv)
    (cached,) = out.cached_requests
    assert (cached.new_block_ids, cached.num_computed_tokens, cached.resumed) == (more, 6, False)
    assert cached.new_token_ids == []  # the workers sampled it themselves
    request.swapped_in = True
    out = SchedulerOutput()
    view.record(out, request, 1, [], kv)
    assert out.cached_requests[0].new_block_ids == kv.block_ids("r").tolist()
    assert out.cached_requests[0].resumed and not request.swapped_in
    view.forget("r")
    view.forget("never-sent")
    assert view.take_finished() == {"r"} and view.take_finished() == set()


def test_stages_that_do_not_sample_get_the_tokens_sampled_since_the_last_step():
    kv = KVCacheManager(16, BS, 64, 2)
    view = WorkerView(sync_sampled_tokens=True)
    request = Request("r", [5] * 3, SamplingParams())
    view.record(SchedulerOutput(), request, 3, kv.allocate_slots(request, 3), kv)
    request.append_output_token(8)
    out = SchedulerOutput()
    view.record(out, request, 1, kv.allocate_slots(request, 1), kv)
    assert out.cached_requests[0].new_token_ids == [8]
