"""Where the gateway sends a request: the ready replicas of each model, least outstanding first,
or as the model's routing policy chooses (:mod:`llmgw.server.gateway.policies`) when the request
carries a hint.

This table lives in memory and is updated by the stream handlers as shards become ready,
fail, stop or lose their node, so the request path never touches the state store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.proto import control_pb2 as pb
from llmgw.server.gateway.policies import RouteHint, RoutingPolicies

__all__ = ["Endpoint", "Router"]


@dataclass(eq=False)
class Endpoint:
    """One ready replica, reached through its node's data plane."""

    model: str
    replica_id: str
    shard_id: str
    node_id: str
    addr: str  # host:port of the node's data plane
    inflight: int = 0
    # Uncached prompt tokens of the requests sent here that have no first token yet.
    pending: int = 0
    # The output tokens the requests on it may still generate (a disaggregated model's decode
    # replicas are chosen by it, least first: llmgw.server.gateway.disagg).
    decoding: int = 0
    # The tokens the requests holding a place on it weigh for the planner (a prefill pool's:
    # their prompts; any other model's: their outputs, by the requests' estimates;
    # llmgw.server.gateway.queueing charges them with the place).
    tokens: int = 0
    # host:port of its engine's KV transfer (a disaggregated pool's replica: SGLang's
    # bootstrap server, vLLM's side channel); "" when it has none.
    transfer_addr: str = ""

    def url(self, path: str) -> str:
        return f"https://{self.addr}/s/{self.shard_id}{path}"


class Router:
    def __init__(self, policies: RoutingPolicies | None = None) -> None:
        self.policies = policies if policies is not None else RoutingPolicies()
        self.prefixes = self.policies.prefixes
        self._by_model: dict[str, list[Endpoint]] = {}
        self._by_shard: dict[str, Endpoint] = {}
        self._tiebreak: dict[str, int] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        # Told the model whose replica just became ready (each gateway's admission: its
        # queues take the new places). Several at once while a retiring gateway drains.
        self._on_ready: list[Callable[[str], None]] = []
        # Told each KvEvents placed (node, model, message): the leader's relay to standbys.
        self.on_kv_events: Callable[[str, str, pb.KvEvents], None] | None = None

    def set_ready(self, ep: Endpoint) -> None:
        old = self._by_shard.get(ep.shard_id)
        if old is not None:
            if old.addr == ep.addr and old.node_id == ep.node_id:
                return
            self.remove_shard(ep.shard_id)
        self._by_shard[ep.shard_id] = ep
        self._by_model.setdefault(ep.model, []).append(ep)
        for waiter in self._waiters.pop(ep.model, []):
            if not waiter.done():
                waiter.set_result(None)
        for listener in list(self._on_ready):
            listener(ep.model)

    def on_ready(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener`` with the model of each replica that becomes ready; returns what
        stops it (its owner calls that when it closes)."""
        self._on_ready.append(listener)

        def unsubscribe() -> None:
            if listener in self._on_ready:
                self._on_ready.remove(listener)

        return unsubscribe

    def kv_events(self, node_id: str, msg: pb.KvEvents) -> str | None:
        """A shard's engine's cache changes, from the agent of ``node_id``: the prefix
        indexes place them by the model and node the router has for the shard. Returns the
        model they were placed under (None: refused, no such shard ready on that node)."""
        where = self._where(msg.shard_id)
        self.prefixes.apply(node_id, msg, where)
        if where is None or where[1] != node_id:
            return None
        if self.on_kv_events is not None:
            self.on_kv_events(node_id, where[0], msg)
        return where[0]

    def kv_relayed(self, msg: pb.KvRelayed) -> None:
        """Cache changes the leader placed and relayed (a standby's
        :mod:`llmgw.server.ha.kvrelay`): indexed under the leader's model and node, whether
        or not this router has the shard yet (its replica may reach this instance's table a
        moment after its first events; a shard it never has is never a candidate)."""
        self.prefixes.apply(msg.node_id, msg.events, (msg.model, msg.node_id))

    def kv_snapshot(self, chunk: int) -> list[pb.KvRelayed]:
        """Every indexed shard's whole set, as relayed messages of at most ``chunk`` keys:
        ``cleared`` first, then its keys (what a standby that just subscribed is sent)."""
        out: list[pb.KvRelayed] = []
        for model, index in self.prefixes.events.items():
            size = self.prefixes.block_size.get(model, 0)
            for shard_id, held in index.held.items():
                ep = self._by_shard.get(shard_id)
                if ep is None:
                    continue
                keys = list(held)
                for at in range(0, max(len(keys), 1), chunk):
                    events = pb.KvEvents(
                        shard_id=shard_id,
                        block_size=size,
                        cleared=at == 0,
                        stored=keys[at : at + chunk],
                    )
                    out.append(pb.KvRelayed(node_id=ep.node_id, model=model, events=events))
        return out

    def _where(self, shard_id: str) -> tuple[str, str] | None:
        ep = self._by_shard.get(shard_id)
        return None if ep is None else (ep.model, ep.node_id)

    def remove_shard(self, shard_id: str) -> None:
        ep = self._by_shard.pop(shard_id, None)
        if ep is None:
            return
        self.prefixes.drop_shard(shard_id, ep.model)
        eps = self._by_model.get(ep.model, [])
        if ep in eps:
            eps.remove(ep)
        if not eps:
            self._by_model.pop(ep.model, None)

    def remove_node(self, node_id: str) -> None:
        for shard_id in [s for s, ep in self._by_shard.items() if ep.node_id == node_id]:
            self.remove_shard(shard_id)

    def remove_model(self, model: str) -> None:
        for ep in list(self._by_model.get(model, [])):
            self.remove_shard(ep.shard_id)

    def pick(self, model: str, exclude: frozenset[str] = frozenset()) -> Endpoint | None:
        """The ready replica with the fewest requests in flight; ties rotate."""
        return self.pick_free(model, None, exclude)

    def pick_free(
        self,
        model: str,
        limit: int | None,
        exclude: frozenset[str] = frozenset(),
        hint: RouteHint | None = None,
    ) -> Endpoint | None:
        """The ready replica with the fewest output tokens to generate
        (:attr:`Endpoint.decoding`: a decode pool's; 0 elsewhere), then the fewest requests in
        flight, fewer than ``limit`` (None: any), not among ``exclude``; ties rotate. With a
        ``hint``, the one its policy chooses among those (:meth:`RoutingPolicies.choose`,
        which charges the choice)."""
        eps = self._by_model.get(model)
        if not eps:
            return None
        if hint is not None:
            candidates = [
                ep
                for ep in eps
                if ep.shard_id not in exclude and (limit is None or ep.inflight < limit)
            ]
            if not candidates:
                return None
            return self.policies.choose(model, candidates, eps, hint)
        if len(eps) == 1:  # the common case, without the scan
            ep = eps[0]
            if (limit is not None and ep.inflight >= limit) or ep.shard_id in exclude:
                return None
            return ep
        best: Endpoint | None = None
        ties = 0
        for ep in eps:
            if ep.shard_id in exclude or (limit is not None and ep.inflight >= limit):
                continue
            if best is None or (ep.decoding, ep.inflight) < (best.decoding, best.inflight):
                best, ties = ep, 1
            elif ep.inflight == best.inflight and ep.decoding == best.decoding:
                ties += 1
        if best is None or ties == 1:
            return best
        turn = self._tiebreak.get(model, 0)
        self._tiebreak[model] = turn + 1
        level = (best.decoding, best.inflight)
        tied = [
            ep for ep in eps if (ep.decoding, ep.inflight) == level and ep.shard_id not in exclude
        ]
        return tied[turn % len(tied)]

    def has_ready(self, model: str, exclude: frozenset[str] = frozenset()) -> bool:
        """Whether ``model`` has a ready replica not among ``exclude``."""
        eps = self._by_model.get(model)
        if not eps:
            return False
        return not exclude or any(ep.shard_id not in exclude for ep in eps)

    async def wait_ready(self, model: str, timeout: float) -> Endpoint | None:
        """The least busy ready replica of ``model``, waiting up to ``timeout`` for one."""
        ep = self.pick(model)
        if ep is not None or timeout <= 0:
            return ep
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(model, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return None
        finally:
            waiters = self._waiters.get(model, [])
            if waiter in waiters:
                waiters.remove(waiter)
        return self.pick(model)

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        if model is None:
            return list(self._by_shard.values())
        return list(self._by_model.get(model, []))
