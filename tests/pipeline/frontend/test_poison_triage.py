"""The poison triage's bisection (frontend/supervisor.py `PoisonTriage`), played by an owner
in this test against the supervisor, no processes: which sequences a death holds back, when
the held ones come back, who is quarantined, what the budget is charged. (Real deaths of a
real core: tests/server/test_poison_requests.py.)"""

from __future__ import annotations

import math

import pytest

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.frontend.supervisor import TRIAL_SETTLE_S, PoisonTriage, Supervisor
from ringllm.pipeline.messages import EngineCoreOutput
from tests.pipeline.frontend.test_supervisor import FakeClient, request

INNOCENTS = [f"r{i:02d}" for i in range(20)]


@pytest.fixture
def now(monkeypatch) -> list[float]:
    clock = [1000.0]
    monkeypatch.setattr("ringllm.pipeline.frontend.supervisor.time.monotonic", lambda: clock[0])
    return clock


def token(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [7])


def play(supervisor: Supervisor, unfinished: set[str], poison: str, now, late=False):
    """An owner whose core dies whenever it runs `poison` (`late`: after a token of each
    sequence, within the settle time); every other sequence it runs has a token. Returns
    the sequences quarantined and the deaths it took."""
    in_core, quarantined, deaths = set(unfinished), set(), 0
    while True:
        if poison in in_core:
            if late:  # a token of each, then the death: too soon to clear any
                assert not supervisor.release_held([token(r) for r in in_core], unfinished)
            deaths += 1
            assert supervisor.allow(unfinished)  # held ones included, as the owners pass it
            quarantined |= supervisor.take_quarantined()
            unfinished -= quarantined
            replays = supervisor.hold_back([request(r) for r in sorted(unfinished)])
            in_core = {r.request_id for r in replays}
            continue
        if not supervisor.holding:
            assert in_core == unfinished
            return quarantined, deaths
        now[0] += TRIAL_SETTLE_S
        released = supervisor.release_held([token(r) for r in in_core], unfinished)
        assert released and not released & in_core
        in_core |= released


@pytest.mark.parametrize("num_innocents", [1, 2, 7, 20])
@pytest.mark.parametrize("late", [False, True], ids=["dies-at-once", "dies-a-token-on"])
def test_bisection_isolates_the_poison_among_innocents_for_one_death_of_budget(
    num_innocents, late, now
):
    innocents = INNOCENTS[:num_innocents]
    bound = 2 + math.ceil(math.log2(num_innocents + 1))
    for poison in ["p", "r00a", "zz"]:  # first, among, last in the order halves are cut
        supervisor = Supervisor(EngineConfig(), FakeClient(), max_restarts=1)
        quarantined, deaths = play(supervisor, {*innocents, poison}, poison, now, late)
        assert quarantined == {poison}
        assert 3 <= deaths <= bound
        assert not supervisor.allow(["x"])  # the run cost the budget its one death


def test_a_lone_death_holds_nothing_back(now):
    """A one-off crash (kill -9, the OOM killer) costs no stream a wait."""
    supervisor = Supervisor(EngineConfig(), FakeClient(), max_restarts=3)
    assert supervisor.allow(["a", "b", "c"])
    replays = [request("a"), request("b"), request("c")]
    assert supervisor.hold_back(replays) == replays and not supervisor.holding


def test_a_death_with_the_replayed_half_in_flight_clears_the_held_half(now):
    triage = PoisonTriage(window_s=60.0)
    four = {"a", "b", "c", "d"}
    assert not triage.after_death(four)
    assert triage.hold_back(four) == set()
    assert not triage.after_death(four)  # the same four again: now told apart
    assert triage.hold_back(four) == {"c", "d"}
    assert triage.suspects == {"a", "b"}
    # the owner counts its held ones in flight: they were not sent, so not suspects
    assert not triage.after_death({*four, "e"})
    assert triage.held == set() and triage.suspects == {"a", "b"}
    assert triage.hold_back({*four, "e"}) == {"b"}  # c, d replayed
    assert triage.after_death({"a", "c", "d", "e"}) == {"a"}  # four deaths, one left


def twice_dead(triage: PoisonTriage, four: set[str]) -> None:
    """Two deaths with `four` in flight: `four`'s last two held back."""
    for _ in range(2):
        triage.after_death(four)
        held = triage.hold_back(four)
    assert held == {"c", "d"}


def test_the_held_half_comes_back_once_each_replayed_one_had_a_token_and_settled(now):
    triage = PoisonTriage(window_s=60.0, settle_s=1.0)
    four = {"a", "b", "c", "d"}
    twice_dead(triage, four)
    now[0] += 5.0
    assert not triage.progressed(["a"], four)  # b has had no token yet
    assert triage.progressed(["b"], four) == {"c"}  # d held again: half of the new suspects
    assert triage.suspects == {"c"} and triage.held == {"d"}
    now[0] += 0.5
    assert not triage.progressed(["c"], four)  # a token, but only 0.5 s since its replay
    now[0] += 0.5
    assert triage.progressed([], four) == {"d"}
    assert triage.suspects == {"d"} and not triage.held
    assert triage.after_death({"d", "e"}) == {"d"}  # the one left kills the core again


def test_a_replayed_half_that_ended_releases_at_once_and_an_aborted_held_one_is_gone(now):
    triage = PoisonTriage(window_s=60.0, settle_s=1.0)
    four = {"a", "b", "c", "d"}
    twice_dead(triage, four)
    # a finished, b (replayed) and c (held) were aborted by their clients: d comes back
    assert triage.progressed(["a"], {"d"}) == {"d"}
    assert triage.suspects == {"d"} and not triage.held


def test_a_death_without_the_suspects_in_flight_starts_a_new_run_counted_in_full(now):
    supervisor = Supervisor(EngineConfig(), FakeClient(), max_restarts=2)
    assert supervisor.allow(["a", "b"]) and supervisor.allow(["a", "b"])  # one run
    supervisor.hold_back([request("a"), request("b")])  # a replayed, b held
    assert supervisor.holding
    # a ended (its end not yet seen) and c, new, was in flight: c is the new run's suspect
    # (b, held, never ran in that core)
    assert supervisor.allow(["b", "c"])
    assert not supervisor.take_quarantined() and not supervisor.holding
    assert supervisor.triage.suspects == {"c"}
    assert not supervisor.allow(["d"])  # a third run: two have spent the budget of two


def test_deaths_with_nothing_in_flight_end_in_a_crash_loop(now):
    supervisor = Supervisor(EngineConfig(), FakeClient(), max_restarts=2)
    assert supervisor.allow([]) and supervisor.allow([])
    assert not supervisor.allow([])


def test_suspects_that_cannot_be_held_are_all_quarantined_at_the_bound(now):
    """A data-parallel rank's restart replays only what that rank held: suspects on the
    other cores stay in flight, so the run cannot halve them and ends at 2 + bit_length."""
    triage = PoisonTriage(window_s=60.0)
    assert not triage.after_death({"p", "a", "b"})  # bound: 2 + 2 deaths
    assert not triage.after_death({"p", "a", "c"})  # {p, a}: not yet told apart
    assert not triage.after_death({"p", "a"})
    assert triage.after_death({"p", "a", "d"}) == {"p", "a"}  # present at every death
    now[0] += 61.0  # a death long after the last starts a new run
    assert not triage.after_death({"q"})
    now[0] += 61.0
    assert not triage.after_death({"q"})
