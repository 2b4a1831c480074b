"""What a step's result makes of one request (`take_result`): its new tokens checked one by
one for a stop (nothing past a stop goes out), its new prompt-logprob rows, its queueing
time, the output the front end gets.

Prompt logprobs go out once per prompt position: a preempted request recomputes its
prompt, and the rows its client already has are dropped (`num_prompt_logprobs_sent`).
"""

from __future__ import annotations

import logging

from ringllm.pipeline.core.kv_cache_manager import KVCacheManager
from ringllm.pipeline.core.request import Request, RequestStatus
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.core.speculation import Speculation
from ringllm.pipeline.messages import EngineCoreOutput, LogprobRow

logger = logging.getLogger(__name__)


def append_tokens(
    request: Request, tokens: list[int], logprobs: list[LogprobRow | None], max_model_len: int
) -> tuple[list[int], list[LogprobRow], RequestStatus | None]:
    """Appends a step's tokens (an accepted run of drafts, then the sampled one) up to the
    first that stops the request: (the tokens appended, their logprobs, the finish status
    or None)."""
    new_tokens, new_logprobs, status = [], [], None
    for token, lp in zip(tokens, logprobs, strict=True):
        request.append_output_token(token)
        new_tokens.append(token)
        if request.matcher is not None and not request.matcher.accept([token]):
            logger.warning("request %s: token %d is outside its grammar", request.request_id, token)
        if lp is not None:
            new_logprobs.append(lp)
        status = check_stop(request, max_model_len)
        if status is not None:
            break  # nothing past a stop goes out
    return new_tokens, new_logprobs, status


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status its last token finishes the request with (None: it goes on)."""
    params = request.sampling_params
    token = request.all_token_ids[-1]
    if request.matcher is not None and request.matcher.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # the grammar's end (EOS, if it came, too)
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def new_prompt_logprobs(
    request: Request, start: int, rows: list[LogprobRow] | None
) -> list[LogprobRow] | None:
    """This step's prompt-logprob rows the client does not have yet (row k is prompt
    position `start` + k, the step's first position; a recompute after preemption repeats
    rows already sent)."""
    if rows is None:
        return None
    sent = request.num_prompt_logprobs_sent
    request.num_prompt_logprobs_sent = max(sent, start + len(rows))
    if sent > start:
        rows = rows[sent - start :]
    return rows or None


def queued_s(request: Request) -> float | None:
    """Seconds from arrival to first scheduled (None: not scheduled yet)."""
    times = request.times
    return None if times.first_scheduled is None else times.first_scheduled - times.arrival


def take_result(
    request: Request,
    sched: SchedulerOutput,
    result: ModelRunnerOutput,
    i: int,
    spec: Speculation,
    kv: KVCacheManager,
    max_model_len: int,
) -> tuple[EngineCoreOutput, RequestStatus | None] | None:
    """What the step's `result` (row i) makes of `request`: its output and the status it
    finishes with (None: it goes on), or None when there is nothing to send. A request
    that verified drafts gives back the rejected drafts' slots (`spec.roll_back`) and
    emits its accepted run, then its sampled token."""
    rid = request.request_id
    token = result.sampled_token_ids[i]
    rows = result.prompt_logprobs.get(rid)
    # where the step began, from its own record (a later step in flight may have moved on)
    start = sched.start_of(rid) if rows is not None else 0
    prompt_logprobs = new_prompt_logprobs(request, start, rows)
    pooled = result.pooled.get(rid)
    if token is None and prompt_logprobs is None and pooled is None:
        return None
    new_tokens, new_logprobs, status = [], [], None
    if pooled is not None:  # a pooling request ends with its prompt: no token
        status = RequestStatus.FINISHED_STOPPED
    elif token is not None:
        tokens, logprobs = [token], [result.logprobs[i]]
        drafts = sched.scheduled_spec_tokens.get(rid)
        if drafts:
            accepted = result.accepted_token_ids.get(rid, [])
            spec.roll_back(request, kv, len(drafts), len(accepted))
            tokens = [*accepted, token]
            logprobs = [*result.accepted_logprobs.get(rid, [None] * len(accepted))]
            logprobs.append(result.logprobs[i])
        new_tokens, new_logprobs, status = append_tokens(request, tokens, logprobs, max_model_len)
        if status is None:
            spec.keep_drafts(request, result.spec_token_ids.get(rid))
    first = len(new_tokens) == request.num_output_tokens
    output = EngineCoreOutput(
        request_id=rid,
        new_token_ids=new_tokens,
        new_logprobs=new_logprobs or None,
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=status.finish_reason if status else None,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        queued_s=queued_s(request) if first else None,
        pooled=pooled,
    )
    return output, status
