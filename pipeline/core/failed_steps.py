"""A step that raised (the model or the sampler failed) costs only the request that caused
it.

The workers' state for the step's requests is no longer trusted: each is taken back
(blocks freed, the workers told to drop it, recomputed from its tokens) and becomes a
suspect. While there are suspects, each step runs one of them alone; one that fails alone
is ended with FINISHED_ERROR ("error"), one that samples a token is cleared. A request in
MAX_FAILED_STEPS failed steps ends with an error too, so a failure that needs company
cannot loop forever. A step of one request that fails ends it at once.

These functions sort a failed step's requests out; the scheduler (`Scheduler.step_failed`)
moves them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.scheduler_output import SchedulerOutput

MAX_FAILED_STEPS = 3  # failed steps a request may be part of before it ends with an error


def uncache_failed_writes(
    num_scheduled_tokens: Mapping[str, int],
    requests: Mapping[str, Request],
    kv: KVCacheManager,
    sched: SchedulerOutput | None = None,
) -> list[str]:
    """What the failed step was to write is not there: no prefix hit may land on it. The
    ids of the step's requests that still exist. `sched`: the failed step, whose records
    say where each request's tokens began (a later step in flight may have moved it on)."""
    ids = [rid for rid in num_scheduled_tokens if rid in requests]
    for rid in ids:
        request = requests[rid]
        if sched is not None:
            start = sched.start_of(rid)
        else:
            start = request.num_computed_tokens - num_scheduled_tokens[rid]
        kv.uncache_from(request, start)
    return ids


def sort_out_failed(
    requests: Sequence[Request], step_size: int | None = None
) -> tuple[list[Request], list[Request]]:
    """(to end with an error, to take back as suspects) among a failed step's requests:
    a lone request is the culprit; else each counts one more failed step and ends once it
    has MAX_FAILED_STEPS. `step_size`: the requests the step ran, where `requests` are fewer
    (async scheduling: those taken back after an earlier step failed are not sorted here,
    and the one left is no culprit for that)."""
    if (len(requests) if step_size is None else step_size) == 1:
        return list(requests), []
    failed, suspects = [], []
    for request in requests:
        request.num_failed_steps += 1
        if request.num_failed_steps >= MAX_FAILED_STEPS:
            failed.append(request)
        else:
            suspects.append(request)
    return failed, suspects


def next_suspect(waiting: Sequence[Request], suspects: Container[str]) -> int | None:
    """The index in `waiting` of the first suspect (None: none is waiting)."""
    return next((i for i, r in enumerate(waiting) if r.request_id in suspects), None)
