"""Which sources each node keeps in its page cache: those of the models with ``prefetch:
true`` (:mod:`llmgw.contracts.scaling`) whose deployed profile placement may put on the
node (:meth:`Cluster.eligible`: the very test a placement makes, free GPUs aside).

Worked out again every few seconds from the store and the live nodes, and told to each
agent on every HeartbeatAck (``warm``): a set, not an order, so that a node that reconnects
or a leader that takes over needs nothing but its next ack (:mod:`llmgw.agent.warming`
reads them). A fleet where no model asks for it reads nothing but the models.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from llmgw.contracts.scaling import policy_of
from llmgw.errors import ConfigError, Fenced, StoreUnavailable
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.placement import Cluster, NodeView
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.store import Model, Store

__all__ = ["INTERVAL", "Warming"]

log = logging.getLogger("llmgw.server.warming")

INTERVAL = 10.0
"""Seconds between two looks at which node should keep what warm."""


class Warming:
    """The set of sources each node keeps warm, for its HeartbeatAcks."""

    def __init__(
        self,
        store: Store,
        *,
        views: Callable[[], Iterable[NodeView]],
        profile: Callable[[Model], PlacementProfile],
        interval: float = INTERVAL,
    ) -> None:
        self.store = store
        # Every node as placement sees it, and a model's profile as placement is asked for
        # it (llmgw.server.fleet.scheduler.Scheduler.node_views, placement_profile).
        self.views = views
        self.profile = profile
        self.interval = interval
        # node id -> the sources it should keep warm; None until the first look (an ack
        # then says nothing of it, and the agent keeps what it has).
        self._sets: dict[str, tuple[pb.WarmSource, ...]] | None = None
        self._empty = pb.WarmSources()

    def for_node(self, node_id: str) -> pb.WarmSources | None:
        """What a HeartbeatAck to the node carries: its whole set (empty: nothing); None
        before this leader's first look."""
        if self._sets is None:
            return None
        sources = self._sets.get(node_id)
        return pb.WarmSources(sources=sources) if sources else self._empty

    def refresh(self) -> dict[str, tuple[pb.WarmSource, ...]]:
        """Work the sets out again from the store; each node's set, nodes with none left out."""
        wanted: list[tuple[Model, PlacementProfile]] = []
        for model in self.store.list_models():
            try:
                policy = policy_of(model.scaling)
                if policy is None or not policy.prefetch:
                    continue
                profile = self.profile(model)
            except ConfigError as exc:
                log.warning(
                    "cannot tell where to keep a model's weights warm",
                    extra=kv(model=model.name, error=str(exc)),
                )
                continue
            if profile.source is not None:
                wanted.append((model, profile))
        sets: dict[str, dict[tuple[str, str], pb.WarmSource]] = {}
        if wanted:
            cluster = Cluster(self.views(), ())
            for _model, profile in wanted:
                source = profile.source
                assert source is not None
                key = (source.text, source.sha256)
                for node_id in cluster.eligible(profile):
                    sets.setdefault(node_id, {})[key] = pb.WarmSource(
                        source=source.text, sha256=source.sha256
                    )
        result = {node: tuple(by_key[k] for k in sorted(by_key)) for node, by_key in sets.items()}
        if result != self._sets:
            log.info(
                "sources to keep warm",
                extra=kv(
                    nodes=len(result), sources=len({s.source for v in result.values() for s in v})
                ),
            )
        self._sets = result
        return result

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled."""
        while True:
            try:
                self.refresh()
            except (StoreUnavailable, Fenced):
                pass  # the scheduler says so; the sets stay as they were
            except Exception:
                log.exception("working out the sources to keep warm failed; trying again")
            await asyncio.sleep(self.interval)
