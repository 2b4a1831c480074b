"""The engine's own errors, shared by every role.

`EngineDeadError`: the engine core (or one of its worker ranks) is gone. A front end raises
it to every request it holds and to every new one, the server turns it into 503
`engine_dead`. It is a `PeerDeadError` of the transport (the rings noticed the dead peer),
so code that catches the transport's errors catches it too.

`EngineBusyError`: the request could not be handed over now (a full request ring); the
engine is fine.

`EngineSleepingError`: the engine was put to sleep (sleep mode); new requests are refused
until it is woken up.

`RequestFailedError`: the engine failed while computing one request (an exception in the
model or the sampler): that request ends with it, the engine goes on.
"""

from __future__ import annotations

from ringllm.ipc.errors import PeerDeadError


class EngineDeadError(PeerDeadError):
    """The engine core process died; raised to clients of the engine."""


class EngineRestartingError(EngineDeadError):
    """The engine core died and a new one is being started; its requests will be replayed
    into it. A new request waits for it; a health check says so (503, retry shortly)."""


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
