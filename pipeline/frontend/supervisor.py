"""The front end's supervisor of its engine core(s): what happens when a core dies.

    supervisor.allow(in_flight)        a death counted: False in a crash loop (`max_restarts`
                                       deaths within `window_s`), or for cores this front end
                                       did not start: the engine is then left dead
    supervisor.take_quarantined()      the sequences of `in_flight` not to replay: the
                                       poison the crashes point at (`PoisonTriage`)
    supervisor.replace(dead, error)    blocking: the new core started (`Replacement`); a
                                       start that fails exhausts the budget and raises
    replacement.put_in_service(reqs)   on the owner's thread: the client to use from now on,
                                       and which of the unfinished sequences to replay
    supervisor.replayed(count)         the restart is over

What is decided here, once for both owners: the budget, a whole-engine restart or one
data-parallel rank's (a `RankDeadError` names it; only the sequences it held are
replayed), the warm standby core (engine/standby.py; for a single core only) and starting
the new core (`CoreClient.restart` / `restart_rank`). A request that kills the core each time it runs (a poison request) is not replayed
for ever: `PoisonTriage` names it from the sequences in flight at consecutive deaths, the
owner ends it (RequestFailedError) and replays the others, and the deaths it caused cost
the budget one death, so a poison is isolated however small the budget, while a broken
engine (deaths with no common request) still ends in a crash loop. What differs is the
owner's:
`AsyncLLM` runs `replace` on a supervisor thread and the rest on its event loop;
`LLMEngine` runs it all inside `step()`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import CoreClient
from ringllm.pipeline.messages import EngineCoreRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 60.0
# consecutive deaths that leave more than one suspect before all of them are quarantined
MAX_SUSPECT_DEATHS = 3


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

    def forgive(self, num_deaths: int) -> None:
        """The newest `num_deaths` deaths were a poison request's, now quarantined: they
        no longer count against the engine."""
        for _ in range(min(num_deaths, len(self._deaths))):
            self._deaths.pop()


class PoisonTriage:
    """Which sequence kills the core: the suspects are the sequences in flight at each of
    a run of consecutive deaths (each death's set intersected with the run's; a death
    that shares none with it starts a new run, as does one more than `window_s` after the
    last). One suspect left after two or more deaths is the poison; several left after
    `MAX_SUSPECT_DEATHS` are all quarantined (each was present at every one of them).

        death 1 {a, b, p}     suspects {a, b, p}      all replayed
        death 2 {b, p, c}     suspects {b, p}         all replayed
        death 3 {p, d}        suspects {p}            p quarantined, d replayed
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._suspects: set[str] = set()
        self._num_deaths = 0  # in the current run
        self._last_death_s = -float("inf")

    def after_death(self, in_flight: Iterable[str]) -> tuple[set[str], int]:
        """The sequences to quarantine after this death (usually none), and how many
        deaths of the run they caused (0 when none)."""
        now = time.monotonic()
        in_flight = set(in_flight)
        common = self._suspects & in_flight
        if not common or now - self._last_death_s > self.window_s:
            self._suspects, self._num_deaths = in_flight, 1
        else:
            self._suspects, self._num_deaths = common, self._num_deaths + 1
        self._last_death_s = now
        if self._num_deaths < 2 or not self._suspects:
            return set(), 0
        if len(self._suspects) > 1 and self._num_deaths < MAX_SUSPECT_DEATHS:
            return set(), 0
        poison, num_deaths = self._suspects, self._num_deaths
        self._suspects, self._num_deaths = set(), 0
        return poison, num_deaths


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
        self.triage = PoisonTriage(window_s)
        self._quarantined: set[str] = set()
        self.num_restarts = 0
        self.last_restart_s: float | None = None  # the death noticed -> the new core ready
        self._want_standby = (
            standby and self.max_restarts > 0 and config.parallel.data_parallel_size == 1
        )
        self._closed = False
        self.standby = self._spawn_standby()

    def allow(self, in_flight: Iterable[str] = ()) -> bool:
        """Counts a death with the engine-core ids of the sequences `in_flight` at it; True
        when it is to be restarted. The run of deaths a poison caused (`take_quarantined`)
        counts as one."""
        if self._closed or self.max_restarts == 0:
            return False
        poison, num_deaths = self.triage.after_death(in_flight)
        if not poison:
            return self.budget.allow()
        logger.error(
            "engine core died %d times in a row with %s in flight: quarantined, not replayed",
            num_deaths,
            ", ".join(sorted(poison)),
        )
        self._quarantined |= poison
        self.budget.forgive(num_deaths - 1)  # the run's earlier ones; this one counts
        return self.budget.allow()

    def take_quarantined(self) -> set[str]:
        """The sequences the last deaths quarantined (the owner ends them, replays none)."""
        quarantined, self._quarantined = self._quarantined, set()
        return quarantined

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
