"""The engine's own errors, shared by every role.

`EngineDeadError`: the engine core (or one of its worker ranks) is gone. A front end raises
it to every request it holds and to every new one, the server turns it into 503
`engine_dead`. It is a `PeerDeadError` of the transport (the rings noticed the dead peer),
so code that catches the transport's errors catches it too.

`HostLostError`: an `EngineDeadError` whose cause is a host of the engine's ranks gone
(pipeline/executor/remote_hosts.py): a supervising front end fails the requests at once and
waits for the host, never for a restart that cannot finish without it.

`EngineBusyError`: the request could not be handed over now (a full request ring); the
engine is fine.

`EngineSleepingError`: the engine was put to sleep (sleep mode); new requests are refused
until it is woken up.

`RequestFailedError`: the engine failed while computing one request (an exception in the
model or the sampler): that request ends with it, the engine goes on.

Faults on purpose, for the tests of what a failure costs (nothing is armed otherwise):
`RINGLLM_TEST_FAULTS="point=seed,..."` makes the named point raise `InjectedFault` for a
request whose `SamplingParams.seed` is that value: a request a test marks, in a real engine
process, without a mock. The points:

    add       EngineCore.add_request      (the core taking a request in)
    forward   Worker.execute              (before the model runs the step)
    crash     Worker.execute              (the same place, but the process exits at once,
                                           as a segfault would end it: a poison request)
    sample    Worker._sample              (before the sampler runs the step)

Read once, when this module is imported (the engine process reads its own environment);
unset, `FAULTS_ARMED` is False and each point costs one attribute test.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ringllm.ipc.errors import PeerDeadError

# What a client whose request failed in a step is told (the cause goes to the log).
STEP_FAILED_MESSAGE = (
    "the engine failed while computing this request; it was ended, and the engine goes on "
    "(the cause is in the server's log)"
)


class EngineDeadError(PeerDeadError):
    """The engine core process died; raised to clients of the engine."""


class EngineRestartingError(EngineDeadError):
    """The engine core died and a new one is being started; its requests will be replayed
    into it. A new request waits for it; a health check says so (503, retry shortly)."""


class HostLostError(EngineDeadError):
    """A host that runs some of the engine's ranks is gone (it died, left, or its network
    dropped). The requests it served end with it, and new ones are refused at once, until
    the host is back (`ringllm serve --headless` there again) and the engine is rebuilt;
    the message names the host and when it was lost (the server answers 503 `host_lost`)."""


class EngineBusyError(RuntimeError):
    """The engine core's request ring is full for now: the request was not sent (nothing of
    it is in the engine). Try again shortly; the server answers 503 with Retry-After."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode: its weights and KV cache given back); it takes new
    requests again after `wake_up`. The server answers 503 `engine_sleeping`."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing this request and ended it; other requests go on.
    The cause is in the engine's log (the server answers 500 `request_failed`)."""


class SlowReaderError(RuntimeError):
    """A request's reader left too many outputs unread; the request was aborted."""


def too_long_message(field: str, num_prompt_tokens: int, max_model_len: int) -> str:
    """The refusal of a prompt that fills the context alone (admission and front end)."""
    return (
        f"{field}: {num_prompt_tokens} tokens leave no room for output within max_model_len "
        f"{max_model_len} tokens; shorten the prompt"
    )


FAULTS_ENV = "RINGLLM_TEST_FAULTS"
FAULT_POINTS = ("add", "forward", "sample", "crash")
CRASH_EXIT_CODE = 70


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


def _parse_faults(text: str) -> dict[str, int]:
    seeds = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, seed = item.partition("=")
        if point not in FAULT_POINTS or not seed.lstrip("-").isdigit():
            raise ValueError(
                f"{FAULTS_ENV}: {item!r} is not point=seed with point in {FAULT_POINTS}"
            )
        seeds[point] = int(seed)
    return seeds


_FAULT_SEEDS = _parse_faults(os.environ.get(FAULTS_ENV, ""))
FAULTS_ARMED = bool(_FAULT_SEEDS)


def check_fault(point: str, seeds: Iterable[int | None]) -> None:
    """InjectedFault when `point` is armed and one of `seeds` is its seed (the "crash"
    point: the process exits, nothing of it runs on)."""
    seed = _FAULT_SEEDS.get(point)
    if seed is not None and seed in seeds:
        if point == "crash":
            os._exit(CRASH_EXIT_CODE)
        raise InjectedFault(f"fault injected at {point!r} for the request with seed {seed}")
