"""The engine's own errors, shared by every role.

`EngineDeadError`: the engine core (or one of its worker ranks) is gone. A front end raises
it to every request it holds and to every new one, the server turns it into 503
`engine_dead`. It is a `PeerDeadError` of the transport (the rings noticed the dead peer),
so code that catches the transport's errors catches it too.
"""

from __future__ import annotations

from ringllm.ipc.errors import PeerDeadError


class EngineDeadError(PeerDeadError):
    """The engine core process died; raised to clients of the engine."""
