"""Requests waiting for a model to have a ready replica at all (a cold start: a model scaled
to zero, or one whose replicas are all starting), and why a model cannot get one.

The gateway counts such a request here while it waits (:meth:`Capacity.wait`), so that the
planner sees it as demand (:meth:`Capacity.demand`), and the leader is told at once
(:meth:`Capacity.on_waiting`): its planner gives a model at zero a replica, its scheduler
tries to place what is missing. The wait ends when a replica of the model becomes ready (the
router says so), when the scheduler finds no room for one (:meth:`Capacity.refuse`: the
waiters get the reason then, within a pass, not after their timeout), or at the timeout.
Nothing is refused from an earlier pass's verdict: room may have come free since.

A model's demand also counts its tokens (:attr:`Demand.tokens`, for a policy's
``target_tokens``): those its requests weigh on its replicas and in its queue
(:attr:`~llmgw.server.gateway.routing.Endpoint.tokens`,
:meth:`~llmgw.server.gateway.queueing.Admission.queued_tokens`): a prefill pool's the prompts
waiting for or under prefill, a decode pool's (and any other model's) the output tokens being
generated. They are summed when the planner asks, not on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.errors import StoreError
from llmgw.log import kv
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store

log = logging.getLogger("llmgw.server.gateway")

__all__ = ["Capacity", "Demand", "NoRoom", "fleet_demand"]

# The TTFT p90 the planner compares with a model's ttft_slo is over this many seconds.
TTFT_WINDOW = 60
PUBLISH_EVERY = 1.0  # seconds: a standby's demand written for the leader's planner
FRESH_FOR = 3.0  # seconds: another instance's demand counts while written within these


class NoRoom(Exception):
    """No replica of the model can be placed now: ``reason`` says why."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(reason)
        self.model = model
        self.reason = reason


@dataclass(frozen=True)
class Demand:
    """A model's demand as one gateway sees it: requests on its replicas, queued for a place
    on one, and waiting for a replica to exist; the TTFT p90 of the last minute (None:
    no streamed answer in it); the tokens of its requests in flight and queued (a prefill
    pool's: prompt tokens; any other model's: output tokens)."""

    inflight: int = 0
    queued: int = 0
    waiting: int = 0
    ttft_p90: float | None = None
    tokens: int = 0

    @property
    def total(self) -> int:
        return self.inflight + self.queued + self.waiting

    def __add__(self, other: Demand) -> Demand:
        ttft = [t for t in (self.ttft_p90, other.ttft_p90) if t is not None]
        return Demand(
            self.inflight + other.inflight,
            self.queued + other.queued,
            self.waiting + other.waiting,
            max(ttft) if ttft else None,
            self.tokens + other.tokens,
        )

    def describe(self) -> str:
        text = f"{self.inflight} in flight + {self.queued} queued"
        if self.waiting:
            text += f" + {self.waiting} waiting for a replica"
        return text


class Capacity:
    """The requests waiting for a replica to exist, per model, and the models that cannot get
    one now."""

    def __init__(
        self,
        router: Router,
        history: RequestHistory,
        *,
        queued: Callable[[str], int] = lambda _model: 0,
        queued_tokens: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.router = router
        self.history = history
        self.queued = queued
        self.queued_tokens = queued_tokens
        # Told when a request starts waiting for a model with no ready replica (the
        # leader's planner, subscribed while it leads: a model at zero gets one at once).
        self._listeners: list[Callable[[str], None]] = []
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self._unsubscribe = router.on_ready(self._ready)

    def close(self) -> None:
        self._unsubscribe()

    def on_waiting(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(model)`` when a request starts waiting for ``model``; returns the
        unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def waiting(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def refuse(self, model: str, reason: str) -> None:
        """The scheduler found no room for a replica of ``model`` (none placed, none
        coming): the requests waiting for one are answered now, with ``reason``."""
        for future in self._waiting.get(model, ()):
            if not future.done():
                future.set_exception(NoRoom(model, reason))

    async def wait(self, model: str, timeout: float) -> bool:
        """Wait up to ``timeout`` for a ready replica of ``model``: True when one is ready,
        False at the timeout; :class:`NoRoom` when the scheduler finds none can be placed."""
        if self.router.has_ready(model):
            return True
        if timeout <= 0:
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(model, set())
        waiters.add(future)
        try:
            for listener in list(self._listeners):
                listener(model)
            async with asyncio.timeout(timeout):
                await future
            return True
        except TimeoutError:
            return self.router.has_ready(model)
        finally:
            waiters.discard(future)
            if not waiters and self._waiting.get(model) is waiters:
                del self._waiting[model]

    def _ready(self, model: str) -> None:
        for future in self._waiting.get(model, ()):
            if not future.done():
                future.set_result(None)

    def demand(self, now: float | None = None) -> dict[str, Demand]:
        """Each model's demand as this gateway sees it now (models with none left out,
        except those whose TTFT was measured in the last minute)."""
        inflight: dict[str, int] = {}
        tokens = dict(self.queued_tokens())
        for ep in self.router.endpoints():
            if ep.inflight:
                inflight[ep.model] = inflight.get(ep.model, 0) + ep.inflight
            if ep.tokens > 0:
                tokens[ep.model] = tokens.get(ep.model, 0) + ep.tokens
        history = self.history
        models = set(inflight) | set(self._waiting) | set(self.router.models())
        models |= set(history.models(now))
        out = {}
        for model in models:
            ttft = history.recent_ttft(model, 0.9, seconds=TTFT_WINDOW, now=now)
            demand = Demand(
                inflight.get(model, 0),
                self.queued(model),
                self.waiting(model),
                ttft,
                tokens.get(model, 0),
            )
            if demand.total or ttft is not None:
                out[model] = demand
        return out

    async def publish(self, store: Store, instance: str) -> None:
        """A standby's loop: its demand written for the leader's planner every second
        (while it has any; once more when it has none left)."""
        said: dict[str, Demand] = {}
        while True:
            now = self.demand()
            if now or said:
                try:
                    store.put_demand(
                        instance,
                        {
                            m: (d.inflight, d.queued, d.waiting, d.ttft_p90, d.tokens)
                            for m, d in now.items()
                        },
                        time.time(),
                    )
                    said = now
                except StoreError as exc:
                    log.warning("cannot store this gateway's demand", extra=kv(error=str(exc)))
            await asyncio.sleep(PUBLISH_EVERY)


def fleet_demand(
    own: Mapping[str, Demand], store: Store, instance: str, *, now: float | None = None
) -> dict[str, Demand]:
    """``own`` (this instance's) plus what the other instances wrote in the last
    :data:`FRESH_FOR` seconds, per model."""
    total = dict(own)
    since = (time.time() if now is None else now) - FRESH_FOR
    for row in store.list_demand(since=since, excluding=instance):
        theirs = Demand(row.inflight, row.queued, row.waiting, row.ttft_p90, row.tokens)
        total[row.model] = total[row.model] + theirs if row.model in total else theirs
    return total
