"""`Request`: the engine core's view of one sequence, and its explicit state machine.

    WAITING ──schedule──> RUNNING ──finish──> FINISHED_STOPPED / _LENGTH_CAPPED
       ^                   │ │ │ ^
       │                   │ │ └─┼──abort──> FINISHED_ABORTED   (also from WAITING,
       └──resume── PREEMPTED <─┘ │ │                             PREEMPTED, SWAPPED)
                   (recompute:   │ └──swap in── SWAPPED  (swap: its KV moved to host
                    blocks freed,└──swap out──>           memory, moved back, nothing
                    computed again)                       recomputed)
                                  FINISHED_ERROR: it failed while being computed (any state)

    WAITING / RUNNING / PREEMPTED / SWAPPED ──pause──> PAUSED ──resume──> WAITING (never ran)
                                                         │                PREEMPTED (ran before)
                                                         └──abort──> FINISHED_ABORTED
    (its client reads none of its outputs: it holds no slot and no block, its computed
     tokens forgotten as by a recompute preemption; see core/queues.py)

The core knows token ids only. `num_computed_tokens` counts the tokens whose keys and
values are in the KV cache (or being computed in the current step); the request needs
`num_tokens - num_computed_tokens` more before it can sample again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from ringllm.pipeline.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    SWAPPED = 7  # not finished: its KV waits in the host tier
    PAUSED = 8  # not finished: not scheduled until its client reads (Scheduler.pause_requests)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_ENDS_ANYWHERE = {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
_PAUSES = {RequestStatus.PAUSED}
ALLOWED_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.RUNNING} | _PAUSES | _ENDS_ANYWHERE,
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED, RequestStatus.SWAPPED} | _PAUSES | _FINISHED,
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING} | _PAUSES | _ENDS_ANYWHERE,
    # PREEMPTED: the step that was to copy its KV out failed (it is recomputed instead)
    RequestStatus.SWAPPED: {RequestStatus.RUNNING, RequestStatus.PREEMPTED}
    | _PAUSES
    | _ENDS_ANYWHERE,
    # back to WAITING if it never ran, else PREEMPTED (the workers kept its row)
    RequestStatus.PAUSED: {RequestStatus.WAITING, RequestStatus.PREEMPTED} | _ENDS_ANYWHERE,
}


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds) of one request's life, for its metrics."""

    arrival: float
    first_scheduled: float | None = None
    finished: float | None = None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] | set[int] = (),
        max_tokens: int = 16,
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        mm_inputs: tuple = (),
        cache_salt: bytes = b"",
    ) -> None:
        self.request_id = request_id
        # the user request it belongs to (the scheduler's fair share counts by it)
        self.group_id = group_id or request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.max_tokens = max_tokens  # resolved against the context by the engine
        self.priority = priority
        self.times = RequestTimes(
            arrival=arrival_time if arrival_time is not None else time.monotonic()
        )
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache, once known
        self.num_preemptions = 0
        # prompt positions whose logprobs went out: a preempted request recomputes its
        # prompt, and those rows must not go out twice
        self.num_prompt_logprobs_sent = 0
        self.num_failed_steps = 0  # steps that failed with it in the batch
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of its full blocks, filled lazily
        self.cache_salt = cache_salt  # the first block's hash key (b"": none); see kv_cache_manager
        # structured outputs: its grammar's matcher, once compiled (core/structured_output.py)
        self.matcher = None
        # speculative decoding: the drafts proposed after its last step, verified in its next
        self.spec_token_ids: list[int] = []
        # images (pipeline/messages.py ImageInput, in position order) and which of them the
        # workers have encoded since the request last (re)started running: their features
        # stay in the workers' encoder cache until the image's positions are all computed
        self.mm_inputs = tuple(mm_inputs)
        self.images_encoded: set[int] = set()
        # swap preemption: the host blocks holding its KV while SWAPPED, and whether it
        # came back this step (the workers then get its whole new block list)
        self.host_blocks: list[int] = []
        self.swapped_in = False
        self.num_swaps = 0
        # pipeline parallelism: its tokens the workers of the earlier stages (which do not
        # sample) have been sent; the rest go with its next step
        self.num_tokens_synced = 0
        # batches in flight: how many hold a step of it, and (async scheduling) how many of
        # those sample a token the core does not know yet; its next step starts after them
        self.num_in_flight = 0
        self.num_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def images_in(self, start: int, end: int) -> list[int]:
        """Indices of the images with a placeholder position in [start, end)."""
        return [i for i, m in enumerate(self.mm_inputs) if m.offset < end and start < m.end]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def transition(self, status: RequestStatus) -> None:
        if status not in ALLOWED_TRANSITIONS.get(self.status, ()):
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.status.name} -> {status.name}"
            )
        self.status = status

    def sort_key(self, policy: str) -> tuple:
        """Queue order: FCFS by arrival; priority by (priority, arrival), lower first."""
        if policy == "priority":
            return (self.priority, self.times.arrival)
        return (self.times.arrival,)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.name}, {self.num_computed_tokens}/{self.num_tokens})"
