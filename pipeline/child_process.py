"""What every child process of the engine does first: die with its parent, and (under a
test switch) refuse pickle once started.

The engine core process and each tensor-parallel rank are started as fresh interpreters
(`python -m ...`), never by forking or by multiprocessing's spawn of the caller's
`__main__`. `die_with_parent` makes the kernel SIGTERM them when the process that started
them dies, so a `kill -9` of a server never leaves an engine or a rank behind.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal

FORBID_PICKLE_ENV = "RINGLLM_FORBID_PICKLE"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the liveness checks still notice an orphan's dead peers
    if os.getppid() == 1:
        raise SystemExit(0)  # the parent died before the request above took effect


def forbid_pickle_if_asked(where: str) -> None:
    """Test hook: with RINGLLM_FORBID_PICKLE=1, any later pickling in this process fails."""
    if os.environ.get(FORBID_PICKLE_ENV) != "1":
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"pickle used on {where}'s hot path")

    pickle.dumps = pickle.loads = pickle.dump = pickle.load = refuse  # type: ignore[assignment]
