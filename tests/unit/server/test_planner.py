"""The planner: a model that scales by demand gets the count its demand asks for, up at once,
down one step after the window; a fixed count is never touched; each change an event with
its figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.planner import Planner
from llmgw.server.gateway.capacity import Demand
from llmgw.server.store import Store


class Rig:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.demand: dict[str, Demand] = {}
        self.now = 1000.0  # monotonic
        self.wall = 1_700_000_000.0  # UNIX seconds
        self.kicks = 0
        self.unplaceable: dict[str, str] = {}
        self.metrics = Metrics()
        self.planner = Planner(
            store,
            demand=lambda: self.demand,
            kick_scheduler=self._kick,
            metrics=self.metrics,
            why_unplaceable=self.unplaceable.get,
            clock=lambda: self.now,
            wall_clock=lambda: self.wall,
        )

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds

    def new_leader(self, clock: float) -> Planner:
        """The planner a new leader builds on the same store: its own monotonic clock."""
        self.now = clock
        return Planner(
            self.store,
            demand=lambda: self.demand,
            kick_scheduler=self._kick,
            clock=lambda: self.now,
            wall_clock=lambda: self.wall,
        )

    def _kick(self) -> None:
        self.kicks += 1

    def deploy(self, name: str, policy: ScalingPolicy | None, replicas: int) -> None:
        self.store.put_model(name, engine="sim", params={}, replicas=replicas)
        self.store.set_scaling(name, policy.to_json() if policy else {}, replicas=replicas)

    def count(self, name: str) -> int:
        return self.store.get_model(name).replicas

    def events(self, kind: str) -> list[str]:
        return [e.message for e in self.store.list_events(limit=100) if e.kind == kind]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    store = Store.open(tmp_path / "state.db")
    yield Rig(store)
    store.close()


def test_demand_scales_up_at_once_with_an_event_that_gives_the_figures(rig: Rig) -> None:
    rig.deploy("llama", ScalingPolicy(min=0, max=8, target_inflight=16), replicas=2)
    rig.demand["llama"] = Demand(inflight=61, queued=12)
    rig.planner.plan()
    assert rig.count("llama") == 5  # ceil(73 / 16)
    assert rig.kicks == 1
    assert rig.events("scaled_up") == [
        "llama 2 → 5: 61 in flight + 12 queued, target 16 per replica"
    ]
    assert rig.metrics.scaling_decisions.values[("llama", "up", "demand")] == 1


def test_never_above_max_and_the_plan_says_why(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=3, target_inflight=1), replicas=0)
    rig.demand["m"] = Demand(inflight=0, waiting=9)
    rig.planner.plan()
    assert rig.count("m") == 3
    assert rig.planner.plans["m"].holding == "max reached (3)"
    assert "9 waiting for a replica" in rig.events("scaled_up")[0]


def test_a_request_waiting_for_a_model_at_zero_gets_it_one(rig: Rig) -> None:
    rig.deploy("cold", ScalingPolicy(min=0, max=2), replicas=0)
    rig.planner.plan()
    assert rig.count("cold") == 0  # no demand, nothing placed
    rig.demand["cold"] = Demand(waiting=1)
    rig.planner.plan()
    assert rig.count("cold") == 1


def test_down_only_after_the_window_one_step_at_a_time(rig: Rig) -> None:
    policy = ScalingPolicy(min=0, max=8, target_inflight=4, scale_down_after=300)
    rig.deploy("m", policy, replicas=3)
    rig.demand["m"] = Demand(inflight=1)  # asks for 1
    rig.planner.plan()
    assert rig.count("m") == 3
    assert rig.planner.plans["m"].holding == "cooling down: 5m before one fewer"
    rig.now += 299
    rig.planner.plan()
    assert rig.count("m") == 3
    rig.now += 1
    rig.planner.plan()
    assert rig.count("m") == 2  # one step
    assert rig.events("scaled_down") == [
        "m 3 → 2: 1 in flight + 0 queued, target 4 per replica; low for 5m"
    ]
    rig.now += 100
    rig.planner.plan()
    assert rig.count("m") == 2  # the next step waits the window again
    rig.now += 200
    rig.planner.plan()
    assert rig.count("m") == 1
    rig.now += 1000
    rig.planner.plan()
    assert rig.count("m") == 1  # what demand asks for: no further


def test_demand_that_comes_back_restarts_the_window(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=8, target_inflight=4, scale_down_after=60), 2)
    rig.planner.plan()  # no demand: the window starts
    rig.now += 50
    rig.demand["m"] = Demand(inflight=8)  # asks for 2: as many as it has
    rig.planner.plan()
    rig.demand["m"] = Demand()
    rig.planner.plan()  # low again: the window starts again
    rig.now += 50
    rig.planner.plan()
    assert rig.count("m") == 2  # low for 50 s since it came back, not 100
    rig.now += 10
    rig.planner.plan()
    assert rig.count("m") == 1


def test_to_zero_and_never_below_min(rig: Rig) -> None:
    rig.deploy("zero", ScalingPolicy(min=0, max=2, scale_down_after=0), replicas=1)
    rig.deploy("one", ScalingPolicy(min=1, max=2, scale_down_after=0), replicas=1)
    rig.planner.plan()
    assert (rig.count("zero"), rig.count("one")) == (0, 1)


def test_a_ttft_over_the_objective_adds_a_replica(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=1, max=4, target_inflight=100, ttft_slo=2.0), 1)
    rig.demand["m"] = Demand(inflight=3, ttft_p90=3.5)
    rig.planner.plan()
    assert rig.count("m") == 2
    assert "TTFT p90 3.50 s over the objective 2s" in rig.events("scaled_up")[0]
    rig.demand["m"] = Demand(inflight=0, ttft_p90=3.5)  # slow but idle: nothing to add
    rig.planner.plan()
    assert rig.count("m") == 2


def test_a_fixed_count_is_never_touched(rig: Rig) -> None:
    rig.deploy("fixed", None, replicas=3)
    rig.demand["fixed"] = Demand(inflight=500)
    rig.planner.plan()
    rig.demand["fixed"] = Demand()
    rig.now += 10_000
    rig.planner.plan()
    assert rig.count("fixed") == 3
    assert rig.kicks == 0
    assert "fixed" not in rig.planner.plans


def test_a_count_outside_the_bounds_is_brought_inside(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=2, max=4), replicas=6)
    rig.planner.plan()
    assert rig.count("m") == 4
    assert rig.events("scaled_down") == ["m 6 → 4: outside 2-4"]


def test_the_plan_says_what_placement_holds_back(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=4), replicas=1)
    rig.demand["m"] = Demand(waiting=1)
    rig.unplaceable["m"] = "no node has 1 free GPU"
    rig.planner.plan()
    assert rig.planner.plans["m"].holding == "cannot place: no node has 1 free GPU"
    assert rig.planner.plans["m"].to_json()["demand"] == {
        "inflight": 0,
        "queued": 0,
        "waiting": 1,
        "ttft_p90": None,
        "tokens": 0,
    }


def test_each_model_by_demand_is_sampled_every_ten_seconds_for_an_hour(rig: Rig) -> None:
    wall = [5000.0]
    rig.planner.wall_clock = lambda: wall[0]
    rig.planner.ready = lambda model: 1
    rig.deploy("m", ScalingPolicy(min=0, max=8, target_inflight=4), replicas=1)
    rig.deploy("fixed", None, replicas=1)
    rig.demand["m"] = Demand(inflight=3)
    rig.planner.plan()
    wall[0] += 5
    rig.planner.plan()  # within the step: no new point
    wall[0] += 5
    rig.demand["m"] = Demand(inflight=6)
    rig.planner.plan()
    points = list(rig.planner.history["m"])
    assert [(p.t, p.replicas, p.ready, p.demand) for p in points] == [
        (5000.0, 1, 1, 3),
        (5010.0, 2, 1, 6),
    ]
    assert "fixed" not in rig.planner.history
    for _ in range(400):
        wall[0] += 10
        rig.planner.plan()
    assert len(rig.planner.history["m"]) == 360  # the last hour


def test_a_new_leaders_planner_continues_the_window_a_former_leader_stored(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=8, target_inflight=4, scale_down_after=300), 3)
    rig.demand["m"] = Demand(inflight=1)  # asks for 1
    rig.planner.plan()  # the window starts
    assert rig.store.scale_down_windows() == {"m": rig.wall}
    rig.advance(200)
    rig.planner.plan()
    # The leader dies; another takes over, its monotonic clock unrelated to the first's.
    planner = rig.new_leader(clock=7.0)
    planner.plan()
    assert rig.count("m") == 3
    assert planner.plans["m"].holding == "cooling down: 100s before one fewer"  # not 5m
    rig.advance(99)
    planner.plan()
    assert rig.count("m") == 3
    rig.advance(1)
    planner.plan()
    assert rig.count("m") == 2  # the first leader's window, continued
    assert rig.events("scaled_down") == [
        "m 3 → 2: 1 in flight + 0 queued, target 4 per replica; low for 5m"
    ]
    assert rig.store.scale_down_windows() == {"m": rig.wall}  # the next step's window


def test_the_stored_window_is_cleared_when_demand_returns(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=8, target_inflight=4, scale_down_after=60), 2)
    rig.planner.plan()  # no demand: the window starts
    assert set(rig.store.scale_down_windows()) == {"m"}
    rig.advance(50)
    rig.demand["m"] = Demand(inflight=8)  # asks for 2: as many as it has
    rig.planner.plan()
    assert rig.store.scale_down_windows() == {}
    # A new leader now starts a whole window when demand falls again.
    rig.advance(50)
    planner = rig.new_leader(clock=3.0)
    rig.demand["m"] = Demand()
    planner.plan()
    assert planner.plans["m"].holding == "cooling down: 1m before one fewer"
    rig.advance(59)
    planner.plan()
    assert rig.count("m") == 2


def test_the_window_is_written_only_when_it_changes(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[tuple[str, float | None]] = []
    real = rig.store.set_scale_down_window

    def counted(model: str, since: float | None) -> None:
        writes.append((model, since))
        real(model, since)

    monkeypatch.setattr(rig.store, "set_scale_down_window", counted)
    rig.deploy("m", ScalingPolicy(min=0, max=8, target_inflight=4, scale_down_after=60), 2)
    rig.deploy("fixed", None, replicas=2)
    start = rig.wall
    for _ in range(5):  # low for 40 s: one write, when the window starts
        rig.planner.plan()
        rig.advance(10)
    assert writes == [("m", start)]
    rig.advance(20)
    rig.planner.plan()  # a step: the window again, from now
    assert writes[1:] == [("m", rig.wall)] and rig.count("m") == 1
    rig.demand["m"] = Demand(inflight=4)  # asks for 1: as many as it has
    rig.planner.plan()
    rig.planner.plan()
    assert writes[2:] == [("m", None)]  # cleared once


def test_a_window_stored_for_a_model_that_no_longer_scales_by_demand_is_cleared(
    rig: Rig,
) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=8, scale_down_after=60), 2)
    rig.planner.plan()
    rig.store.set_scaling("m", {}, replicas=2)  # a fixed count now
    planner = rig.new_leader(clock=1.0)
    planner.plan()
    assert rig.store.scale_down_windows() == {} and planner.low_since == {}


def test_a_stored_start_ahead_of_this_instances_clock_starts_the_window_now(rig: Rig) -> None:
    rig.deploy("m", ScalingPolicy(min=0, max=8, scale_down_after=60), 2)
    rig.store.set_scale_down_window("m", rig.wall + 30)  # the former leader's clock ran ahead
    planner = rig.new_leader(clock=1.0)
    planner.plan()
    assert planner.plans["m"].holding == "cooling down: 1m before one fewer"


# ------------------------------------------- pools by tokens (target_tokens)


def test_a_prefill_pool_scales_up_on_queued_prompt_tokens_requests_alone_would_not(
    rig: Rig,
) -> None:
    policy = ScalingPolicy(min=1, max=8, target_inflight=8, target_tokens=8000)
    rig.deploy("m#prefill", policy, replicas=1)
    # Three 8k prompts (one under prefill, two queued): 3 requests ask for one replica, their
    # 24,500 tokens for four.
    rig.demand["m#prefill"] = Demand(inflight=1, queued=2, tokens=24_500)
    rig.planner.plan()
    assert rig.count("m#prefill") == 4
    assert rig.events("scaled_up") == [
        "m#prefill 1 → 4: 24500 tokens (1 in flight + 2 queued), target 8000 tokens per replica"
    ]
    assert rig.metrics.scaling_decisions.values[("m#prefill", "up", "tokens")] == 1
    assert rig.planner.plans["m#prefill"].to_json()["demand"]["tokens"] == 24_500  # type: ignore[index]
    # Without target_tokens the same demand is requests alone: nothing moves.
    rig.deploy("n#prefill", ScalingPolicy(min=1, max=8, target_inflight=8), replicas=1)
    rig.demand["n#prefill"] = Demand(inflight=1, queued=2, tokens=24_500)
    rig.planner.plan()
    assert rig.count("n#prefill") == 1


def test_a_decode_pool_scales_on_tokens_in_flight_and_down_after_the_window(rig: Rig) -> None:
    policy = ScalingPolicy(
        min=1, max=8, target_inflight=64, target_tokens=4096, scale_down_after=300
    )
    rig.deploy("m#decode", policy, replicas=1)
    rig.demand["m#decode"] = Demand(inflight=10, tokens=10_000)  # ceil(10000 / 4096) = 3
    rig.planner.plan()
    assert rig.count("m#decode") == 3
    assert rig.events("scaled_up")[0].startswith("m#decode 1 → 3: 10000 tokens")
    # The streams end: a few short ones left; the tokens ask one, down after the window.
    rig.demand["m#decode"] = Demand(inflight=2, tokens=300)
    rig.planner.plan()
    assert rig.count("m#decode") == 3
    assert rig.planner.plans["m#decode"].holding == "cooling down: 5m before one fewer"
    rig.now += 300
    rig.planner.plan()
    assert rig.count("m#decode") == 2  # one step
    assert rig.events("scaled_down") == [
        "m#decode 3 → 2: 2 in flight + 0 queued (300 tokens), target 64 per replica; low for 5m"
    ]


def test_requests_still_ask_when_they_ask_more_than_the_tokens(rig: Rig) -> None:
    policy = ScalingPolicy(min=0, max=8, target_inflight=4, target_tokens=100_000)
    rig.deploy("m", policy, replicas=0)
    rig.demand["m"] = Demand(inflight=10, tokens=2000)
    rig.planner.plan()
    assert rig.count("m") == 3  # ceil(10 / 4)
    assert rig.events("scaled_up") == [
        "m 0 → 3: 10 in flight + 0 queued (2000 tokens), target 4 per replica"
    ]
    assert rig.metrics.scaling_decisions.values[("m", "up", "demand")] == 1


def test_max_reached_by_tokens_is_said(rig: Rig) -> None:
    rig.deploy("m#prefill", ScalingPolicy(min=0, max=2, target_tokens=1000), replicas=0)
    rig.demand["m#prefill"] = Demand(queued=1, tokens=50_000)
    rig.planner.plan()
    assert rig.count("m#prefill") == 2
    assert rig.planner.plans["m#prefill"].holding == "max reached (2)"
