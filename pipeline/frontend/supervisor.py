"""The front end's supervisor of its engine core(s): what happens when a core dies.

    supervisor.allow()                 a death counted: False in a crash loop (`max_restarts`
                                       deaths within `window_s`), or for cores this front end
                                       did not start: the engine is then left dead
    supervisor.replace(dead, error)    blocking: the new core started (`Replacement`); a
                                       start that fails exhausts the budget and raises
    replacement.put_in_service(reqs)   on the owner's thread: the client to use from now on,
                                       and which of the unfinished sequences to replay
    supervisor.replayed(count)         the restart is over

What is decided here, once for both owners: the budget, a whole-engine restart or one
data-parallel rank's (a `RankDeadError` names it; only the sequences it held are
replayed), the warm standby core (engine/standby.py; for a single core only) and starting
the new core (`CoreClient.restart` / `restart_rank`). What differs is the owner's:
`AsyncLLM` runs `replace` on a supervisor thread and the rest on its event loop;
`LLMEngine` runs it all inside `step()`.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import CoreClient
from ringllm.pipeline.messages import EngineCoreRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 60.0


class RestartBudget:
    """How many deaths are restarted: `max_restarts` within a sliding `window_s`."""

    def __init__(self, max_restarts: int, window_s: float = DEFAULT_RESTART_WINDOW_S) -> None:
        self.max_restarts = max(0, max_restarts)
        self.window_s = window_s
        self._deaths: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        """Counts a death; True when it may be restarted, False in a crash loop."""
        if self.max_restarts == 0:
            return False
        now = time.monotonic()
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.max_restarts:
            logger.error(
                "engine core died %d times within %.0f s: a crash loop; not restarting it",
                len(self._deaths) + 1,
                self.window_s,
            )
            return False
        self._deaths.append(now)
        return True

    def exhaust(self) -> None:
        """No further restart (one failed to start)."""
        self._deaths.extend([time.monotonic()] * self.max_restarts)


@dataclass
class Replacement:
    """A new core started in place of a dead one, not yet serving: `client` is the new
    whole client, or (`rank_restart` set) the data-parallel group that keeps serving."""

    client: CoreClient
    rank_restart: Any = None  # dp_client.RankRestart

    @property
    def of_rank(self) -> bool:
        """One data-parallel core's restart (the group goes on serving meanwhile)."""
        return self.rank_restart is not None

    def put_in_service(
        self, unfinished: list[EngineCoreRequest]
    ) -> tuple[CoreClient, list[EngineCoreRequest]]:
        """On the owner's thread: the client to use from now on, and the sequences of
        `unfinished` to replay into it (all, or those the dead rank held)."""
        if self.rank_restart is None:
            return self.client, unfinished
        orphans = self.rank_restart.put_in_service()
        return self.client, [r for r in unfinished if r.request_id in orphans]

    def abandon(self) -> None:
        """Nobody is left to hand it to: the new core stops."""
        if self.rank_restart is not None:
            self.rank_restart.abandon()
        else:
            self.client.shutdown()


class Supervisor:
    def __init__(
        self,
        config: EngineConfig,
        client: CoreClient,
        max_restarts: int,
        window_s: float = DEFAULT_RESTART_WINDOW_S,
        standby: bool = False,
    ) -> None:
        """`max_restarts` counts only for core processes `client` started itself;
        `standby`: keep a warm spare core process for a single core, so that a restart
        costs the model load, not a fresh interpreter's imports."""
        self.config = config
        self.max_restarts = max_restarts if client.can_restart else 0
        self.budget = RestartBudget(self.max_restarts, window_s)
        self.num_restarts = 0
        self.last_restart_s: float | None = None  # the death noticed -> the new core ready
        self._want_standby = (
            standby and self.max_restarts > 0 and config.parallel.data_parallel_size == 1
        )
        self._closed = False
        self.standby = self._spawn_standby()

    def allow(self) -> bool:
        """Counts a death; True when it is to be restarted."""
        return not self._closed and self.budget.allow()

    def replace(self, dead: CoreClient, error: BaseException) -> Replacement:
        """The new core for `dead` (blocking: a process start and a model load): one
        data-parallel core again if `error` names its rank, else the whole engine. A start
        that fails exhausts the budget (no more tries) and raises."""
        noticed = time.monotonic()
        rank = getattr(error, "rank", None)
        try:
            if rank is not None:
                replacement = Replacement(dead, dead.restart_rank(rank))
            else:
                standby, self.standby = self.standby, None
                replacement = Replacement(dead.restart(self.config, standby))
                self.standby = self._spawn_standby()
        except BaseException:
            self.budget.exhaust()
            raise
        self.last_restart_s = time.monotonic() - noticed
        startup_s = getattr(replacement.rank_restart or replacement.client, "startup_s", {})
        logger.info(
            "engine core%s restarted in %.2f s (%s)",
            "" if rank is None else f" (data-parallel rank {rank})",
            self.last_restart_s,
            ", ".join(f"{k} {v:g}" for k, v in startup_s.items()),
        )
        return replacement

    def replayed(self, count: int) -> None:
        """The restart is over: `count` unfinished sequences went into the new core."""
        logger.info("replayed %d unfinished sequences into the new engine core", count)
        self.num_restarts += 1

    def close(self) -> None:
        """No restart will come: the spare leaves, and none is spawned again."""
        self._closed = True
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.close()

    def _spawn_standby(self):
        if not self._want_standby or self._closed:
            return None
        from ringllm.pipeline.engine.standby import StandbyCore

        try:
            return StandbyCore.spawn()
        except Exception:  # noqa: BLE001 - a restart then starts a core from scratch
            logger.exception("the standby engine core could not be started")
            return None
