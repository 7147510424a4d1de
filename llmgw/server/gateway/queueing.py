"""Admission to a model's replicas: at most ``max_concurrency`` requests in flight on each,
and when every replica is full, requests wait here in per-key fair queues.

A request takes a place on the least busy replica that has one (:meth:`Admission.acquire`)
and gives it back when its answer has ended, a stream at its last chunk
(:meth:`Admission.release`). When no replica has a place, it waits, in its key's queue, for
at most ``queue_timeout``; a client that goes away leaves the queue at once (its handler is
cancelled). Each place that frees up goes to the next waiting request in a weighted round
robin over the keys that have requests waiting (deficit round robin, each key's quantum its
priority's weight, :data:`~llmgw.contracts.keypolicy.PRIORITY_WEIGHTS`), so a key that keeps
a long queue delays another key's request by a few requests, never by its whole queue. A key
that had nothing waiting goes first in the round (as fq_codel serves new flows first): a
tenant sending one request at a time waits for the next place to free up, not for a turn
behind every busy key. With ``fair`` off the queue is one line in arrival order (FIFO), for
comparison.

Each request may weigh ``tokens`` on its model (a prefill's prompt, any other request's
output, by its estimate): charged to its replica's :attr:`Endpoint.tokens` while it holds the
place, and counted while it waits (:meth:`Admission.queued_tokens`), so that the planner can
scale a model by tokens (:mod:`llmgw.contracts.scaling`'s ``target_tokens``) without any work
on the request path beyond two additions.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.policies import RouteHint
from llmgw.server.gateway.routing import Endpoint, Router

__all__ = ["Admission", "QueueTimeout"]


class QueueTimeout(Exception):
    """A request waited its whole ``queue_timeout`` without a place on a replica."""

    def __init__(self, waited: float, depth: int) -> None:
        super().__init__(f"waited {waited:.1f} s")
        self.waited = waited
        self.depth = depth


class _Waiter:
    __slots__ = ("enqueued", "exclude", "future", "hint", "key", "tokens")

    def __init__(
        self,
        key: str,
        exclude: frozenset[str],
        future: asyncio.Future[Endpoint],
        hint: RouteHint | None,
        tokens: int = 0,
    ) -> None:
        self.key = key
        self.exclude = exclude
        self.future = future
        self.hint = hint
        self.tokens = tokens
        self.enqueued = time.perf_counter()


class _ModelQueue:
    """The requests waiting for one model's replicas."""

    __slots__ = ("active", "deficit", "fifo", "queues", "size", "turn", "weights")

    def __init__(self) -> None:
        self.queues: dict[str, deque[_Waiter]] = {}
        # The keys with requests waiting, in round-robin order; the first has the turn.
        self.active: deque[str] = deque()
        self.deficit: dict[str, float] = {}
        self.weights: dict[str, int] = {}
        self.turn: str | None = None  # the key whose quantum the current turn added
        self.fifo: deque[_Waiter] = deque()
        self.size = 0

    def push(self, waiter: _Waiter, weight: int, fair: bool) -> None:
        self.size += 1
        if not fair:
            self.fifo.append(waiter)
            return
        queue = self.queues.get(waiter.key)
        if queue is None:
            queue = self.queues[waiter.key] = deque()
            self.active.appendleft(waiter.key)  # a key that had nothing waiting goes first
            self.deficit[waiter.key] = 0.0
        self.weights[waiter.key] = weight
        queue.append(waiter)

    def peek(self, fair: bool) -> _Waiter | None:
        """The waiter whose turn it is (charged in :meth:`pop`)."""
        if not fair:
            return self.fifo[0] if self.fifo else None
        active = self.active
        while active:
            key = active[0]
            if self.turn != key:  # the key's turn begins: its quantum
                self.turn = key
                self.deficit[key] += self.weights[key]
            if self.deficit[key] >= 1.0:
                return self.queues[key][0]
            active.rotate(-1)  # its turn is over: the next key's begins
            self.turn = None
        return None

    def pop(self, waiter: _Waiter, fair: bool) -> None:
        """Take ``waiter`` (the one :meth:`peek` gave) out, charging its key one turn."""
        self.size -= 1
        if not fair:
            self.fifo.popleft()
            return
        self.deficit[waiter.key] -= 1.0
        self._take(waiter)

    def remove(self, waiter: _Waiter, fair: bool) -> None:
        """``waiter`` leaves without a place (timed out, or its client went away)."""
        if not fair:
            try:
                self.fifo.remove(waiter)
            except ValueError:
                return
            self.size -= 1
            return
        queue = self.queues.get(waiter.key)
        if queue is None or waiter not in queue:
            return
        self.size -= 1
        self._take(waiter)

    def _take(self, waiter: _Waiter) -> None:
        queue = self.queues[waiter.key]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        if not queue:  # nothing left waiting: the key leaves the round, its deficit with it
            del self.queues[waiter.key]
            del self.deficit[waiter.key]
            del self.weights[waiter.key]
            self.active.remove(waiter.key)
            if self.turn == waiter.key:
                self.turn = None


class Admission:
    """Places on replicas, per model, and the queues of requests waiting for one."""

    def __init__(
        self,
        router: Router,
        limit_of: Callable[[str], int],
        metrics: Metrics,
        *,
        fair: bool = True,
    ) -> None:
        self.router = router
        # A model's max_concurrency per replica (its deployed profile's).
        self.limit_of = limit_of
        self.metrics = metrics
        self.fair = fair
        self._queues: dict[str, _ModelQueue] = {}
        # Subscribed, not set: a retiring gateway's admission keeps hearing of new replicas
        # for the requests still queued in it until it closes.
        self._unsubscribe = router.on_ready(self.dispatch)

    def close(self) -> None:
        """Stop hearing of replicas becoming ready (the gateway closed)."""
        self._unsubscribe()

    def depth(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.size if queue is not None else 0

    def queued_tokens(self) -> dict[str, int]:
        """The tokens of the requests waiting for a place, per model (those with none left
        out). Walks the queues: the planner asks once a second, the request path never."""
        out: dict[str, int] = {}
        for model, queue in self._queues.items():
            waiters = queue.fifo if not self.fair else (w for q in queue.queues.values() for w in q)
            total = sum(w.tokens for w in waiters if not w.future.done())
            if total:
                out[model] = total
        return out

    def try_acquire(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        hint: RouteHint | None = None,
        tokens: int = 0,
    ) -> Endpoint | None:
        """A place on the least busy replica that has one (or the one ``hint``'s policy
        chooses), taken and charged ``tokens``; None when all are full (or requests are
        already waiting for this model: they go first)."""
        queue = self._queues.get(model)
        if queue is not None and queue.size:
            return None
        ep = self.router.pick_free(model, self.limit_of(model), exclude, hint)
        if ep is not None:
            ep.inflight += 1
            ep.tokens += tokens
        return ep

    async def acquire(
        self,
        model: str,
        key: str,
        weight: int,
        exclude: frozenset[str],
        timeout: float,
        hint: RouteHint | None = None,
        tokens: int = 0,
    ) -> Endpoint:
        """A place on a replica of ``model``, charged ``tokens``, waiting in ``key``'s queue
        for up to ``timeout`` seconds (:class:`QueueTimeout`). The caller checked that the
        model has ready replicas."""
        ep = self.try_acquire(model, exclude, hint, tokens)
        if ep is not None:
            return ep
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue()
        future: asyncio.Future[Endpoint] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(key, exclude, future, hint, tokens)
        queue.push(waiter, weight, self.fair)
        self.metrics.queued.set((model,), queue.size)
        got: Endpoint | None = None
        try:
            async with asyncio.timeout(timeout):
                got = await future
        except TimeoutError:
            raise QueueTimeout(time.perf_counter() - waiter.enqueued, queue.size) from None
        finally:
            if got is None:
                if future.done() and not future.cancelled():
                    # Granted as the timeout or a cancellation struck: give the place back.
                    self.release(future.result(), hint, tokens)
                else:
                    future.cancel()
                    queue.remove(waiter, self.fair)
                    if not queue.size and self._queues.get(model) is queue:
                        del self._queues[model]
            self.metrics.queued.set((model,), queue.size)
        self.metrics.queue_wait.observe((model,), time.perf_counter() - waiter.enqueued)
        return got

    def release(self, ep: Endpoint, hint: RouteHint | None = None, tokens: int = 0) -> None:
        """A request on ``ep`` ended: the prefill its routing charged ``ep`` is given back
        (:meth:`RouteHint.settle`, unless its first token did already), so are the ``tokens``
        it was charged with its place, and its place goes to the next waiting request, if
        any."""
        if hint is not None:
            hint.settle()
        ep.inflight -= 1
        ep.tokens -= tokens
        queue = self._queues.get(ep.model)
        if queue is not None and queue.size:
            self.dispatch(ep.model)

    def dispatch(self, model: str) -> None:
        """Give the free places of ``model``'s replicas to waiting requests, in turn."""
        queue = self._queues.get(model)
        if queue is None:
            return
        limit = self.limit_of(model)
        fair = self.fair
        while queue.size:
            waiter = queue.peek(fair)
            if waiter is None:
                break
            if waiter.future.done():  # its timeout or cancellation is being handled
                queue.pop(waiter, fair)
                continue
            ep = self.router.pick_free(model, limit, waiter.exclude, waiter.hint)
            if ep is None:
                break
            queue.pop(waiter, fair)
            ep.inflight += 1
            ep.tokens += waiter.tokens
            waiter.future.set_result(ep)
        if not queue.size:
            del self._queues[model]
        self.metrics.queued.set((model,), queue.size)
