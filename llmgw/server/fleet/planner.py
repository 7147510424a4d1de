"""The planner: each model that scales by demand (``replicas: {min, max, ...}``,
:mod:`llmgw.contracts.scaling`) gets the replica count its demand asks for; the scheduler
then places or retires replicas to that count.

Runs on the leader, once a second and at once when a request starts waiting for a model with
no ready replica (a cold start). Demand is what the gateways see (requests in flight, queued
for a place, waiting for a replica to exist; :class:`~llmgw.server.gateway.capacity.Demand`),
summed over the instances whose figures reach the leader. Up: at once, to what demand asks
(``ceil(demand / target_inflight)`` within min and max; with ``target_tokens``, the larger
of that and ``ceil(tokens / target_tokens)``: a prefill pool by the prompt tokens waiting
for or under prefill, a decode pool by the output tokens in flight), one more while the TTFT
p90 is over ``ttft_slo``. Down: only after demand stayed below the current count for
``scale_down_after``, one replica at a time (each step waits the window again), and the
scheduler drains the replica it retires before stopping it (make-before-break). Every change
is an event with its figures, naming the one that asked (requests or tokens). A model with a fixed count is never touched.

The count it sets is the model's stored ``replicas``: a new leader starts from it (nothing
restarted, nothing flaps). Each model's scale-down window is in the store too (wall-clock
time, written when it starts, steps or ends): a new leader continues it rather than waiting
a whole window again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.contracts.scaling import ScalingPolicy, policy_of
from llmgw.durations import format_duration
from llmgw.errors import ConfigError, Fenced, StoreUnavailable
from llmgw.log import kv
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.dozing import Dozing
from llmgw.server.fleet.preemption import Preemption
from llmgw.server.gateway.capacity import Capacity, Demand
from llmgw.server.store import Model, Store

__all__ = ["Plan", "Planner", "Sample"]

log = logging.getLogger("llmgw.server.planner")

INTERVAL = 1.0  # seconds between passes


HISTORY_STEP = 10.0  # seconds between the points of a model's last hour
HISTORY_POINTS = 360


@dataclass(frozen=True)
class Sample:
    """One point of a model's last hour: its count, its ready replicas and its demand."""

    t: float  # UNIX seconds
    replicas: int
    ready: int
    demand: int


@dataclass(frozen=True)
class Plan:
    """What the planner thinks of one model now, for ``ctl models`` and the console."""

    policy: ScalingPolicy
    demand: Demand
    wanted: int  # what demand asks for, within the bounds
    replicas: int  # the count set now
    # Why the count is not what demand alone would make it ("max reached", "cooling down
    # 2m", ...); '' when it is.
    holding: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            **self.policy.to_json(),
            "demand": {
                "inflight": self.demand.inflight,
                "queued": self.demand.queued,
                "waiting": self.demand.waiting,
                "ttft_p90": self.demand.ttft_p90,
                "tokens": self.demand.tokens,
            },
            "wanted": self.wanted,
            "holding": self.holding,
        }


class Planner:
    """Sets the replica count of each model that scales by demand."""

    def __init__(
        self,
        store: Store,
        *,
        demand: Callable[[], Mapping[str, Demand]],
        kick_scheduler: Callable[[], None],
        metrics: Metrics | None = None,
        why_unplaceable: Callable[[str], str | None] = lambda _model: None,
        preemption: Preemption | None = None,
        dozing: Dozing | None = None,
        capacity: Capacity | None = None,
        ready: Callable[[str], int] = lambda _model: 0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        interval: float = INTERVAL,
    ) -> None:
        self.store = store
        self.demand = demand
        self.kick_scheduler = kick_scheduler
        self.metrics = metrics
        self.why_unplaceable = why_unplaceable
        # Room for a model's demand taken from lower priorities (None: not shared so).
        self.preemption = preemption
        # Idle replicas put to sleep, woken by demand (None: none sleep).
        self.dozing = dozing
        # The gateway's requests waiting for a replica to exist: answered with why when no
        # room can be had (None: nobody waits here).
        self.capacity = capacity
        self.clock = clock
        self.interval = interval
        # Since when each model's demand stayed below its count (monotonic), or since its
        # last step down; kept in the store as wall-clock time, read on the first pass.
        self.low_since: dict[str, float] = {}
        self._windows_read = False
        self.plans: dict[str, Plan] = {}
        self._kick = asyncio.Event()
        # Each model's last hour (one sample per HISTORY_STEP), for the console's chart of
        # its replicas against its demand; and the ready replicas of a model, to sample.
        self.ready = ready
        self.wall_clock = wall_clock
        self.history: dict[str, deque[Sample]] = {}
        self._sampled = 0.0
        # The models a scheduler pass found no room for since the last plan: only such a
        # fresh verdict answers a waiting request (room may have come free since an older).
        self._no_room: set[str] = set()

    def kick(self, _model: str = "") -> None:
        """Plan now (a request waits for a model with no ready replica)."""
        self._kick.set()

    def no_room(self, model: str) -> None:
        """A scheduler pass just found no room for a replica of ``model``: plan now (room
        from a lower priority, else the requests waiting for it are answered)."""
        self._no_room.add(model)
        self._kick.set()

    async def run(self) -> None:
        while True:
            try:
                self.plan()
            except (StoreUnavailable, Fenced):
                pass  # the scheduler says so; a leader that lost its lease steps down
            except Exception:
                log.exception("planning failed; trying again")
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.interval)
            except TimeoutError:
                pass
            self._kick.clear()

    def plan(self) -> None:
        """One pass over every model."""
        if not self._windows_read:
            self._read_windows()
        demand = self.demand()
        plans: dict[str, Plan] = {}
        for model in self.store.list_models():
            try:
                policy = policy_of(model.scaling)
            except ConfigError as exc:
                log.warning(
                    "a stored scaling policy this llmgw cannot read; the model keeps its count",
                    extra=kv(model=model.name, error=str(exc)),
                )
                continue
            if self.metrics is not None:
                self.metrics.desired_replicas.set((model.name,), model.replicas)
            if policy is None:
                self._end_window(model.name)
                continue
            plans[model.name] = self._plan_model(model, policy, demand.get(model.name, Demand()))
        for gone in set(self.low_since) - set(plans):
            self._end_window(gone)
        self.plans = plans
        self._sample(plans)
        if self.preemption is not None:
            self.preemption.step({name: plan.demand for name, plan in plans.items()})
        if self.dozing is not None:
            self.dozing.step(
                {name: plan.demand.total for name, plan in plans.items()},
                {name: plan.demand.tokens for name, plan in plans.items()},
            )
        self._refuse_the_waiting(plans)

    def _read_windows(self) -> None:
        """The windows a former leader left in the store, continued: each stored start
        (wall clock) made this clock's (monotonic), none later than now (another
        instance's clock may be ahead)."""
        now, wall = self.clock(), self.wall_clock()
        stored = self.store.scale_down_windows()
        for name, since in stored.items():
            self.low_since[name] = now - max(0.0, wall - since)
        self._windows_read = True
        if stored:
            log.info(
                "scale-down windows continued from the store",
                extra=kv(models=",".join(sorted(stored))),
            )

    def _start_window(self, name: str, now: float) -> None:
        """``name``'s window (re)starts at ``now``, here and in the store."""
        self.low_since[name] = now
        self.store.set_scale_down_window(name, self.wall_clock())

    def _end_window(self, name: str) -> None:
        """``name``'s window ends (demand came back, or it no longer scales by demand)."""
        if self.low_since.pop(name, None) is not None:
            self.store.set_scale_down_window(name, None)

    def _sample(self, plans: Mapping[str, Plan]) -> None:
        now = self.wall_clock()
        if now - self._sampled < HISTORY_STEP:
            return
        self._sampled = now
        for name, plan in plans.items():
            ring = self.history.get(name)
            if ring is None:
                ring = self.history[name] = deque(maxlen=HISTORY_POINTS)
            ring.append(Sample(now, plan.replicas, self.ready(name), plan.demand.total))
        for gone in set(self.history) - set(plans):
            del self.history[gone]

    def _refuse_the_waiting(self, plans: Mapping[str, Plan]) -> None:
        """The requests waiting for a model that has no replica, none coming and no room
        (none to be had from a lower priority either) are answered now, with why."""
        capacity, fresh = self.capacity, self._no_room
        self._no_room = set()
        if capacity is None:
            return
        waiting = [name for name in plans if name in fresh and capacity.waiting(name)]
        if not waiting:
            return
        counts = self.store.count_replicas()
        making_room = self.preemption.making_room if self.preemption is not None else {}
        for name in waiting:
            reason = self.why_unplaceable(name)
            if reason is not None and not counts.get(name) and name not in making_room:
                capacity.refuse(name, reason)

    def _plan_model(self, model: Model, policy: ScalingPolicy, demand: Demand) -> Plan:
        current = model.replicas
        wanted = policy.wanted(demand.total, demand.tokens)
        # The figure that asks for the count: the tokens when they ask for more replicas
        # than the requests do (a few long prompts), else the requests.
        by_tokens = policy.by_tokens(demand.tokens) > policy.by_requests(demand.total)
        reason = "tokens" if by_tokens else "demand"
        slow = (
            policy.ttft_slo is not None
            and demand.ttft_p90 is not None
            and demand.total > 0
            and demand.ttft_p90 > policy.ttft_slo
        )
        if slow and wanted <= current:
            wanted = policy.clamp(current + 1)
            reason = "ttft_slo"
        if current < policy.min or current > policy.max:
            wanted = policy.clamp(current)
            reason = "bounds"
        holding = self._holding(model, policy, demand, wanted)
        if wanted > current:
            self._end_window(model.name)
            self._set(model, current, wanted, policy, demand, reason, by_tokens)
            return Plan(policy, demand, wanted, wanted, holding)
        if wanted == current:
            self._end_window(model.name)
            return Plan(policy, demand, wanted, current, holding)
        now = self.clock()
        since = self.low_since.get(model.name)
        if since is None:
            since = now
            self._start_window(model.name, now)
        left = policy.scale_down_after - (now - since)
        if left > 0 and reason != "bounds":
            holding = f"cooling down: {format_duration(max(1, round(left)))} before one fewer"
            return Plan(policy, demand, wanted, current, holding)
        step = policy.clamp(current - 1) if reason != "bounds" else wanted
        if since != now:
            self._start_window(model.name, now)  # the next step waits the window again
        idle = reason in ("demand", "tokens")
        self._set(model, current, step, policy, demand, "idle" if idle else reason, by_tokens)
        return Plan(policy, demand, wanted, step, holding)

    def _holding(self, model: Model, policy: ScalingPolicy, demand: Demand, wanted: int) -> str:
        """Why the count stays under what demand asks for, as an operator reads it."""
        asked = policy.asked(demand.total, demand.tokens)
        if asked > policy.max:
            return f"max reached ({policy.max})"
        reason = self.why_unplaceable(model.name)
        if reason is not None and wanted > 0:
            return f"cannot place: {reason}"
        return ""

    def _set(
        self,
        model: Model,
        current: int,
        count: int,
        policy: ScalingPolicy,
        demand: Demand,
        reason: str,
        by_tokens: bool = False,
    ) -> None:
        self.store.set_replicas(model.name, count)
        direction = "up" if count > current else "down"
        figures = _figures(policy, demand, by_tokens)
        if reason == "ttft_slo":
            assert demand.ttft_p90 is not None and policy.ttft_slo is not None
            figures += (
                f"; TTFT p90 {demand.ttft_p90:.2f} s over the objective "
                f"{format_duration(policy.ttft_slo)}"
            )
        elif reason == "idle":
            figures += f"; low for {format_duration(policy.scale_down_after)}"
        elif reason == "bounds":
            figures = f"outside {policy.min}-{policy.max}"
        text = f"{model.name} {current} → {count}: {figures}"
        self.store.add_event(f"scaled_{direction}", model.name, text, "planner")
        log.info(
            "scaled a model by demand",
            extra=kv(model=model.name, before=current, after=count, reason=reason),
        )
        if self.metrics is not None:
            self.metrics.scaling_decisions.inc((model.name, direction, reason))
            self.metrics.desired_replicas.set((model.name,), count)
        self.kick_scheduler()


def _figures(policy: ScalingPolicy, demand: Demand, by_tokens: bool) -> str:
    """The figures of a scale event, the one that asked first: the requests and their target
    (the tokens beside them when the policy has a ``target_tokens``), or the tokens and
    theirs."""
    if policy.target_tokens is None:
        return f"{demand.describe()}, target {policy.target_inflight} per replica"
    if by_tokens:
        return (
            f"{demand.tokens} tokens ({demand.describe()}), "
            f"target {policy.target_tokens} tokens per replica"
        )
    return (
        f"{demand.describe()} ({demand.tokens} tokens), target {policy.target_inflight} per replica"
    )
