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
PARENT_PID_ENV = "RINGLLM_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that calls `die_with_parent`: names this process as its
    parent, so the child can tell whether its parent is already gone."""
    env = dict(os.environ if env is None else env)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


def die_with_parent() -> None:
    """SIGTERM from the kernel when the parent dies; exit now if it died already.

    "Already" is exact: the parent's pid comes from the starter (`child_env`), since a
    parent pid of 1 proves nothing (the parent may be PID 1 of a container or a PID
    namespace, and an orphan goes to a subreaper, not always to 1). Without it, nothing
    is assumed. NOTE: the kernel signals when the *thread* that started the child ends,
    so start children from a thread that lives as long as they should (the main one)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the liveness checks still notice an orphan's dead peers
    expected = os.environ.get(PARENT_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        raise SystemExit(0)  # the parent died before the request above took effect


def forbid_pickle_if_asked(where: str) -> None:
    """Test hook: with RINGLLM_FORBID_PICKLE=1, any later pickling in this process fails."""
    if os.environ.get(FORBID_PICKLE_ENV) != "1":
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"pickle used on {where}'s hot path")

    pickle.dumps = pickle.loads = pickle.dump = pickle.load = refuse  # type: ignore[assignment]
