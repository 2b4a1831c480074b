"""frontend/supervisor.py's decisions, against a fake core client: the budget, a whole
restart or one data-parallel rank's, a start that fails (the poison triage's bisection:
test_poison_triage.py). (Real restarts of real cores:
tests/pipeline/engine/test_engine_process.py, test_data_parallel.py,
tests/server/test_engine_restart.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.dp_client import RankDeadError
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.frontend.supervisor import RestartBudget, Supervisor


class FakeRankRestart:
    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.in_service = False
        self.abandoned = False

    def put_in_service(self) -> set[str]:
        self.in_service = True
        return self.held

    def abandon(self) -> None:
        self.abandoned = True


class FakeClient:
    """The supervision half of the CoreClient protocol, recording what it is asked."""

    def __init__(self, can_restart: bool = True, fails: bool = False, held=()) -> None:
        self.can_restart = can_restart
        self.fails = fails
        self.held = set(held)
        self.restarts: list[object] = []  # the standby each whole restart was given
        self.rank_restarts: list[int] = []
        self.shut_down = False

    def restart(self, config, standby=None) -> FakeClient:
        self.restarts.append(standby)
        if self.fails:
            raise RuntimeError("the engine core failed to start")
        return FakeClient()

    def restart_rank(self, rank: int) -> FakeRankRestart:
        self.rank_restarts.append(rank)
        if self.fails:
            raise RuntimeError("the engine core failed to start")
        return FakeRankRestart(self.held)

    def shutdown(self) -> None:
        self.shut_down = True


def request(request_id: str):
    return SimpleNamespace(request_id=request_id)


@pytest.fixture
def config() -> EngineConfig:
    return EngineConfig()


def test_deaths_past_the_budget_leave_the_engine_dead(config):
    supervisor = Supervisor(config, FakeClient(), max_restarts=2, window_s=60.0)
    assert supervisor.allow() and supervisor.allow()
    assert not supervisor.allow()  # the third death within the window: a crash loop


def test_deaths_outside_the_window_are_forgotten(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("ringllm.pipeline.frontend.supervisor.time.monotonic", lambda: now[0])
    budget = RestartBudget(1, window_s=10.0)
    assert budget.allow()
    now[0] += 11.0
    assert budget.allow()
    assert not budget.allow()


def test_cores_it_did_not_start_are_never_restarted(config):
    supervisor = Supervisor(config, FakeClient(can_restart=False), max_restarts=3)
    assert supervisor.max_restarts == 0 and not supervisor.allow()


def test_a_closed_supervisor_restarts_nothing(config):
    supervisor = Supervisor(config, FakeClient(), max_restarts=3)
    supervisor.close()
    assert not supervisor.allow()


def test_a_whole_engine_death_starts_a_new_client_and_replays_everything(config):
    dead = FakeClient()
    supervisor = Supervisor(config, dead, max_restarts=3)
    replacement = supervisor.replace(dead, EngineDeadError("gone"))
    assert dead.restarts == [None] and not replacement.of_rank
    unfinished = [request("a"), request("b")]
    client, replays = replacement.put_in_service(unfinished)
    assert client is not dead and replays == unfinished
    assert supervisor.last_restart_s is not None and supervisor.num_restarts == 0
    supervisor.replayed(len(replays))
    assert supervisor.num_restarts == 1


def test_a_rank_death_restarts_that_rank_only_and_replays_what_it_held(config):
    group = FakeClient(held={"b"})
    supervisor = Supervisor(config, group, max_restarts=3)
    replacement = supervisor.replace(group, RankDeadError("core 1 died", rank=1))
    assert group.rank_restarts == [1] and group.restarts == [] and replacement.of_rank
    client, replays = replacement.put_in_service([request("a"), request("b")])
    assert client is group  # the group goes on serving
    assert [r.request_id for r in replays] == ["b"]
    assert replacement.rank_restart.in_service


def test_a_failed_start_exhausts_the_budget(config):
    dead = FakeClient(fails=True)
    supervisor = Supervisor(config, dead, max_restarts=3)
    assert supervisor.allow()
    with pytest.raises(RuntimeError, match="failed to start"):
        supervisor.replace(dead, EngineDeadError("gone"))
    assert not supervisor.allow()


def test_a_failed_rank_start_exhausts_the_budget(config):
    group = FakeClient(fails=True)
    supervisor = Supervisor(config, group, max_restarts=3)
    with pytest.raises(RuntimeError):
        supervisor.replace(group, RankDeadError("core 0 died", rank=0))
    assert not supervisor.allow()


def test_an_abandoned_replacement_stops_its_new_core(config):
    dead = FakeClient()
    supervisor = Supervisor(config, dead, max_restarts=3)
    whole = supervisor.replace(dead, EngineDeadError("gone"))
    whole.abandon()
    assert whole.client.shut_down
    rank = supervisor.replace(dead, RankDeadError("core 0 died", rank=0))
    rank.abandon()
    assert rank.rank_restart.abandoned and not dead.shut_down


def test_the_standby_goes_to_a_whole_restart_and_a_new_one_is_spawned(config, monkeypatch):
    spares = iter(["spare-1", "spare-2"])
    monkeypatch.setattr(
        "ringllm.pipeline.engine.standby.StandbyCore.spawn", classmethod(lambda cls: next(spares))
    )
    dead = FakeClient()
    supervisor = Supervisor(config, dead, max_restarts=3, standby=True)
    assert supervisor.standby == "spare-1"
    supervisor.replace(dead, EngineDeadError("gone"))
    assert dead.restarts == ["spare-1"] and supervisor.standby == "spare-2"


def test_the_one_request_in_flight_at_two_deaths_in_a_row_is_quarantined(config):
    supervisor = Supervisor(config, FakeClient(), max_restarts=1)
    assert supervisor.allow(["p", "a", "b"]) and not supervisor.take_quarantined()
    # its two deaths cost the budget one: the poison is isolated within a budget of one
    assert supervisor.allow(["p", "c"])
    assert supervisor.take_quarantined() == {"p"} and not supervisor.take_quarantined()
    assert not supervisor.allow(["d"])  # the budget's one death is spent: a crash loop


def test_deaths_with_nothing_in_common_are_an_engine_fault_not_a_poison(config):
    supervisor = Supervisor(config, FakeClient(), max_restarts=2)
    assert supervisor.allow(["a"]) and supervisor.allow(["b"])
    assert not supervisor.allow(["c"]) and not supervisor.take_quarantined()
