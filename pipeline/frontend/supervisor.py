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
    supervisor.hold_back(replays)      which of those to replay now: the other suspects of
                                       the death wait in the front end, unsent
    supervisor.replayed(count)         the restart is over
    supervisor.release_held(outs, ...) while `holding`, after each output batch and
                                       abort: the held suspects to replay now

What is decided here, once for both owners: the budget, a whole-engine restart or one
data-parallel rank's (a `RankDeadError` names it; only the sequences it held are
replayed), the warm standby core (engine/standby.py; for a single core only) and starting
the new core (`CoreClient.restart` / `restart_rank`). A request that kills the core each
time it runs (a poison request) is not replayed for ever: `PoisonTriage` bisects the
sequences in flight at consecutive deaths (half replayed, half held back) until one is
left, the owner ends it (RequestFailedError) and replays the others, and the deaths of
one triage run cost the budget one death, so a poison is isolated among any number of
innocents however small the budget, while a broken engine (deaths with no common
request, or with nothing in flight) still ends in a crash loop. What differs is the
owner's: `AsyncLLM` runs `replace` on a supervisor thread and the rest on its event
loop; `LLMEngine` runs it all inside `step()`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import CoreClient
from ringllm.pipeline.messages import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 60.0
# how long the suspects a poison triage replayed run again, the core alive, before they
# are cleared (with a token each)
TRIAL_SETTLE_S = 1.0


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
        """The newest `num_deaths` deaths belong to a poison triage's run, which counts
        as one death: they no longer count against the engine."""
        for _ in range(min(num_deaths, len(self._deaths))):
            self._deaths.pop()


class PoisonTriage:
    """Which sequence kills the core. The suspects of a run of deaths are the sequences in
    flight at its first death, all replayed; each later death keeps those of them in
    flight at it (a death with none in flight, or more than `window_s` after the last,
    starts a new run), so one suspect left at the run's second death or later is the
    poison. So that innocents in flight at every death (a busy server) are told from it,
    from the second death on the owner replays only half of the suspects (with every
    other sequence) and holds the other half back in the front end (`hold_back`: never
    sent, their clients waiting). A death with the replayed half in flight keeps those of
    it (the held half is cleared, and replayed). The replayed half passes once each of it
    has ended, or has had a token from the new core and `settle_s` have passed since the
    replay: it is cleared, and the held half becomes the suspects, half of it replayed,
    the rest held again.

        idle          --death, in flight F---------> suspects F, all replayed
        suspects S    --death, S' of S in flight---> suspects S': half replayed, half held
                                                     (the held before: cleared; one left
                                                     at the 2nd death or later: quarantined,
                                                     idle)
        held H        --the replayed half passes---> suspects H: half replayed, half held

        death 1  in flight {a b c d e f p}   suspects {a b c d e f p}, all replayed
        death 2  in flight {a b c d e f p}   the same: {a b c d} replayed, {e f p} held
        a b c d each have a token, 1 s on    suspects {e f p}: {e f} replayed, {p} held
        e f each have a token, 1 s on        suspects {p}, replayed
        death 3  in flight {p a b ...}       p quarantined; a b ... replayed

    A lone death holds nothing back (a one-off crash costs nobody a wait), and each death
    after it halves the suspects, so a run has at most 2 + log2(suspects) deaths; every
    suspect was in flight at each death of the run. Only what the owner replays can be held
    (a data-parallel rank's restart leaves the other cores' sequences running), so a run
    that has not narrowed its suspects to one within 2 + bit_length(first suspects) deaths
    quarantines all that are left.

    NOTE: `settle_s` stands for "past the point where it died": a poison that kills the
    core a little after it runs again (a few tokens on) is still caught. The triage
    assumes one poison at a time: a second one, arriving during a run, can point a death
    at an innocent suspect."""

    def __init__(self, window_s: float, settle_s: float = TRIAL_SETTLE_S) -> None:
        self.window_s = window_s
        self.settle_s = settle_s
        self.suspects: set[str] = set()  # of the run, but the held ones: in the core
        self.held: set[str] = set()  # suspects kept back in the front end
        self.num_deaths = 0  # in the current run
        self._max_deaths = 0
        self._last_death_s = -float("inf")
        self._silent: set[str] = set()  # replayed suspects with no token seen yet
        self._replayed_s = 0.0

    def after_death(self, in_flight: Iterable[str]) -> set[str]:
        """The sequences to quarantine after this death (usually none); `in_flight`: the
        front end's unfinished sequences (the held ones, never sent, are not counted)."""
        now = time.monotonic()
        in_flight = set(in_flight) - self.held
        common = self.suspects & in_flight
        if common and now - self._last_death_s <= self.window_s:
            self.suspects, self.num_deaths = common, self.num_deaths + 1
        else:
            self.suspects, self.num_deaths = in_flight, 1
            self._max_deaths = 2 + len(in_flight).bit_length()
        self._last_death_s = now
        self.held = set()
        narrowed = len(self.suspects) == 1 or self.num_deaths >= self._max_deaths
        if self.num_deaths < 2 or not narrowed:
            return set()
        poison, self.suspects = self.suspects, set()
        return poison

    def hold_back(self, replayable: Iterable[str]) -> set[str]:
        """Which of `replayable` (the sequences about to be replayed) to hold back: from the
        second death of a run on, half of the suspects, from those among them."""
        among = sorted(self.suspects.intersection(replayable))
        num_held = min(len(among), len(self.suspects) // 2) if self.num_deaths > 1 else 0
        held = set(among[len(among) - num_held :])
        self.suspects -= held
        self.held |= held
        self._silent = set(self.suspects)
        self._replayed_s = time.monotonic()
        return held

    def progressed(self, request_ids: Iterable[str], live: Container[str]) -> set[str]:
        """While some are held: `request_ids` had tokens from the core, the sequences not
        in `live` ended. Returns the held suspects to replay now: usually none, half of
        them once the replayed half passes."""
        self.suspects = {rid for rid in self.suspects if rid in live}
        self.held = {rid for rid in self.held if rid in live}
        self._silent.intersection_update(self.suspects)
        self._silent.difference_update(request_ids)
        if self._silent or not self.held:
            return set()
        if self.suspects and time.monotonic() - self._replayed_s < self.settle_s:
            return set()
        self.suspects, self.held = self.held, set()
        self.hold_back(self.suspects)
        return set(self.suspects)


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
        when it is to be restarted. The deaths of one run of the poison triage count as
        one: each forgives the run's one before."""
        if self._closed or self.max_restarts == 0:
            return False
        poison = self.triage.after_death(in_flight)
        if self.triage.num_deaths > 1:
            self.budget.forgive(1)
        if poison:
            logger.error(
                "engine core died %d times in a row with %s in flight: quarantined, not replayed",
                self.triage.num_deaths,
                ", ".join(sorted(poison)),
            )
            self._quarantined |= poison
        return self.budget.allow()

    def take_quarantined(self) -> set[str]:
        """The sequences the last deaths quarantined (the owner ends them, replays none)."""
        quarantined, self._quarantined = self._quarantined, set()
        return quarantined

    @property
    def holding(self) -> bool:
        """Suspects of a death are held back: the owner reports its outputs (`release_held`)."""
        return bool(self.triage.held)

    def hold_back(self, replays: list[EngineCoreRequest]) -> list[EngineCoreRequest]:
        """Of the sequences to replay, those to replay now: the others are suspects held
        back (the owner keeps them, unsent, until `release_held` names them)."""
        held = self.triage.hold_back(r.request_id for r in replays)
        if held:
            logger.warning(
                "%d suspects of the engine core's death held back while %d are tried again",
                len(held),
                len(self.triage.suspects),
            )
        return [r for r in replays if r.request_id not in held]

    def release_held(self, outputs: Iterable[EngineCoreOutput], live: Container[str]) -> set[str]:
        """While `holding`, after each output batch (and abort): `live`, the sequences
        still unfinished. Returns the held suspects to replay now (usually none)."""
        progressed = (out.request_id for out in outputs if out.new_token_ids or out.finished)
        released = self.triage.progressed(progressed, live)
        if released:
            logger.info("the suspects tried again passed: %d held ones replayed", len(released))
        return released

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
