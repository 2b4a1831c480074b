"""Front-end output processing: engine-core outputs (token ids) -> `RequestOutput`s (text).

Per request it keeps an incremental detokenizer and a stop-string checker. A stop string
found here finishes the request with finish_reason "stop" and asks the engine core to
abort it (the core knows ids only and cannot see text). With n > 1 the children's
outputs are gathered into their parent's `RequestOutput`.

Output kinds (SamplingParams.output_kind): CUMULATIVE (all text and tokens so far),
DELTA (only what is new), FINAL_ONLY (one output at the end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ringllm.pipeline.errors import RequestFailedError
from ringllm.pipeline.frontend.detokenizer import IncrementalDetokenizer
from ringllm.pipeline.frontend.stats import IterationStats
from ringllm.pipeline.frontend.stop_checker import StopChecker, StopUpdate
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.messages import EngineCoreOutput, EngineCoreRequest, LogprobRow
from ringllm.pipeline.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """Gathers the n children of one user request."""

    request_id: str
    n: int
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class RequestState:
    request_id: str
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    # every position's logprobs; a DELTA request keeps only those not yet handed out (a
    # position with top logprobs is a dict of Logprob objects, about 1.5 KB at 5: kept for
    # a long stream's every token, they were most of what silent streams held here)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""  # what the client may see so far (held-back stop-string prefixes excluded)
    text_delta: str = ""  # what this step added to `text`
    sent_tokens: int = 0  # for DELTA outputs
    num_cached_tokens: int = 0
    pooled: object = None  # a pooling request's vector (np.ndarray), once it came
    # the sequence as the core got it (FrontEnd.replay_requests sends it to a new core)
    core_request: EngineCoreRequest | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
        core_request: EngineCoreRequest | None = None,
    ) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self.states[request_id] = RequestState(
            request_id=request_id,
            index=index,
            parent=parent,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detokenizer,
            stop_checker=StopChecker(params.stop, params.include_stop_str_in_output),
            metrics=RequestMetrics(arrival_time=arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            core_request=core_request,
        )
        if parent is not None:
            self.parents[parent.request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        """The engine-core ids of a user request (itself, or its n children)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return [request_id] if request_id in self.states else []
        return [rid for rid, s in self.states.items() if s.parent is parent]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for child in self.child_ids(rid):
                self.states.pop(child, None)
            self.parents.pop(rid, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the request outputs to hand out and the ids the core must abort (stop strings)."""
        request_outputs, to_abort = [], []
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the user
            if out.error is not None:
                request_outputs.append(self._fail(state, out, to_abort))
                continue
            finish_reason, stop_reason = self._update(state, out, now, stats)
            if finish_reason is not None and out.finish_reason is None:
                to_abort.append(out.request_id)
            if finish_reason is not None:
                del self.states[out.request_id]
                self._finish_metrics(state, now, stats)
            result = self._make_output(state, finish_reason, stop_reason)
            if result is not None:
                request_outputs.append(result)
        return request_outputs, to_abort

    def _fail(
        self, state: RequestState, out: EngineCoreOutput, to_abort: list[str]
    ) -> RequestOutput:
        """A request that ended with an error: the whole user request ends with it (its
        other children are aborted in the core)."""
        error_type = ValueError if out.refused else RequestFailedError
        parent = state.parent
        request_id = parent.request_id if parent is not None else state.request_id
        siblings = [rid for rid in self.child_ids(request_id) if rid != state.request_id]
        to_abort.extend(siblings)
        self.abort([request_id])
        completion = CompletionOutput(
            state.index, state.text, list(state.token_ids), None, None, finish_reason="error"
        )
        return RequestOutput(
            request_id,
            state.prompt,
            state.prompt_token_ids,
            None,
            [completion],
            True,
            metrics=state.metrics,
            error=error_type(out.error),
        )

    def _update(
        self, state: RequestState, out: EngineCoreOutput, now: float, stats
    ) -> tuple[str | None, object]:
        state.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            state.pooled = out.pooled
        if out.queued_s is not None and state.metrics.time_in_queue_s is None:
            state.metrics.time_in_queue_s = out.queued_s
            if stats is not None:
                stats.queue_times_s.append(out.queued_s)
        if out.new_prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._to_dicts(out.new_prompt_logprobs))
        finished = out.finish_reason is not None
        update, num_kept = self._take_text(state, out.new_token_ids, finished)
        new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        if num_kept < len(new_token_ids):  # a stop string inside a speculative run
            new_token_ids = new_token_ids[:num_kept]
            new_logprobs = new_logprobs[:num_kept] if new_logprobs else new_logprobs
        if new_token_ids:
            self._record_token_times(state, now, len(new_token_ids), stats)
        state.token_ids.extend(new_token_ids)
        if new_logprobs and state.logprobs is not None:
            state.logprobs.extend(self._to_dicts(new_logprobs))
            state.cumulative_logprob += sum(lp.logprobs[0] for lp in new_logprobs)
        state.text_delta = update.text_delta
        state.text += update.text_delta
        if update.stopped:
            return "stop", update.stop_reason
        return out.finish_reason, out.stop_reason

    def _take_text(
        self, state: RequestState, new_token_ids: list[int], finished: bool
    ) -> tuple[StopUpdate, int]:
        """The text the new tokens give the client, and how many of them the request keeps
        (all, unless a stop string completes before the last).

        NOTE: a speculative step delivers an accepted run of several tokens at once. A stop
        string that one of them completes ends the request at that token, as it would have
        had the tokens come one a step: the tokens after it are not the output's (their
        ids, logprobs and counts are dropped). So with stop strings a run is detokenized
        and checked token by token, min_tokens counted at each.
        """
        num_before, num_new = len(state.token_ids), len(new_token_ids)
        if not state.stop_checker.stop_strings or num_new <= 1:
            return self._take_tokens_text(state, new_token_ids, num_before, finished), num_new
        deltas = []
        for k, token_id in enumerate(new_token_ids):
            last = k == num_new - 1
            update = self._take_tokens_text(state, [token_id], num_before + k, finished and last)
            deltas.append(update.text_delta)
            if update.stopped:
                return StopUpdate("".join(deltas), True, update.stop_reason), k + 1
        return StopUpdate("".join(deltas)), num_new

    def _take_tokens_text(
        self, state: RequestState, token_ids: list[int], num_before: int, finished: bool
    ) -> StopUpdate:
        """Detokenizes `token_ids` (the output held `num_before` tokens) and checks the text
        for stop strings once the request is past its min_tokens."""
        delta = state.detokenizer.update(token_ids)
        if finished:
            delta += state.detokenizer.flush()
        check = num_before + len(token_ids) >= state.params.min_tokens
        return state.stop_checker.update(delta, finished=finished, check_stop=check)

    def _record_token_times(self, state: RequestState, now: float, count: int, stats) -> None:
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.ttft_s = now - m.arrival_time
            if stats is not None:
                stats.ttfts_s.append(m.ttft_s)
                stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif m.last_token_time is not None:
            gap = now - m.last_token_time
            m.inter_token_latencies_s.append(gap)
            if stats is not None:
                stats.inter_token_latencies_s.append(gap)
        m.last_token_time = now
        if stats is not None:
            stats.num_generation_tokens += count

    def _finish_metrics(self, state: RequestState, now: float, stats) -> None:
        m = state.metrics
        m.finished_time = now
        m.e2e_latency_s = now - m.arrival_time
        n = len(state.token_ids)
        if n > 1 and m.first_token_time is not None:
            m.tpot_s = (now - m.first_token_time) / (n - 1)
        if stats is not None:
            stats.e2e_latencies_s.append(m.e2e_latency_s)

    def _to_dicts(self, rows: list[LogprobRow]) -> list[PositionLogprobs]:
        result = []
        for row in rows:
            d: PositionLogprobs = {}
            for k, (tid, lp) in enumerate(zip(row.token_ids, row.logprobs, strict=True)):
                if tid in d:
                    continue
                rank = row.rank if k == 0 else k
                d[tid] = Logprob(lp, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
            result.append(d)
        return result

    def _make_output(self, state: RequestState, finish_reason, stop_reason) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, kind, finish_reason, stop_reason)
        parent = state.parent
        if parent is None:
            return self._request_output(state, state.request_id, [completion], finished)
        parent.outputs[state.index] = completion
        parent.num_finished += finished
        all_done = parent.num_finished == parent.n
        if all_done:
            self.parents.pop(parent.request_id, None)
        if kind == RequestOutputKind.DELTA:
            return self._request_output(state, parent.request_id, [completion], all_done)
        if kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        ordered = [parent.outputs[i] for i in sorted(parent.outputs)]
        return self._request_output(state, parent.request_id, ordered, all_done)

    def _completion(
        self, state: RequestState, kind, finish_reason, stop_reason
    ) -> CompletionOutput:
        if kind == RequestOutputKind.DELTA:
            start = state.sent_tokens
            text = state.text_delta
            state.sent_tokens = len(state.token_ids)
            token_ids = state.token_ids[start:]
            logprobs = state.logprobs
            if logprobs is not None:  # handed out, not kept (see RequestState.logprobs)
                state.logprobs = []
        else:
            text = state.text
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    def _request_output(
        self, state: RequestState, request_id: str, outputs, finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            pooled=state.pooled,
        )
