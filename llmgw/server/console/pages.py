"""The console's read pages: Overview, Nodes, a node, Events. Each is one URL with its
filters in the query string (bookmarkable, the same after a reload); each live part is a
fragment of the same URL (``?fragment=NAME``) that console.js re-fetches.

What a page shows is what the admin API answers (:mod:`llmgw.server.admin.nodes`' functions),
read fresh on every request; nothing here keeps state."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from llmgw.contracts.disagg import split_pool
from llmgw.errors import NotFound
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext
from llmgw.server.admin.gpus import node_gpus
from llmgw.server.admin.models import listed_models
from llmgw.server.admin.nodes import list_nodes, node_detail
from llmgw.server.console.charts import Line, line_chart
from llmgw.server.console.site import Site
from llmgw.server.store import Event
from llmgw.server.store.states import NodeState, ReplicaState

__all__ = ["EVENT_FILTERS", "Pages", "event_json", "matches", "model_path"]

CHART_STEP_S: Final = 60
MAX_CHARTED: Final = 24  # models charted on the overview (the busiest last-hour ones first)
RECENT_EVENTS: Final = 15
EVENTS_SHOWN: Final = 200
MAX_QUERY: Final = 200
EVENT_FILTERS: Final = ("kind", "subject", "actor")

Fragment = Callable[[web.Request], dict[str, Any]]


def model_path(name: str) -> str:
    """A model's page (a model name may hold ``/``: it stays a path separator)."""
    return "/ui/models/" + quote(name, safe="/")


def event_json(event: Event) -> dict[str, Any]:
    """An event as the Events page's rows and its live stream show it."""
    return {
        "id": event.id,
        "ts": event.ts,
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(event.ts)),
        "kind": event.kind,
        "subject": event.subject,
        "actor": event.actor,
        "message": event.message,
    }


def matches(event: Event, filters: Mapping[str, str]) -> bool:
    """Whether ``event`` passes the Events page's filters (each an exact match)."""
    return all(getattr(event, name) == value for name, value in filters.items() if value)


def _query(request: web.Request, name: str) -> str:
    return request.query.get(name, "").strip()[:MAX_QUERY]


@dataclass(frozen=True)
class NodeFilter:
    """The Nodes page's filters: a state and a text found in a node's id, address, agent
    version or GPU names."""

    state: str = ""
    text: str = ""

    def keeps(self, node: Mapping[str, Any]) -> bool:
        if self.state and self.state not in (node["state"], node["health"]):
            return False
        if not self.text:
            return True
        needle = self.text.lower()
        haystack = [
            node["id"],
            node.get("dataplane_addr") or "",
            node.get("agent_version") or "",
            *(str(g.get("name", "")) for g in node.get("gpus", [])),
        ]
        return any(needle in value.lower() for value in haystack)


NODE_STATE_CHOICES: Final = (
    *(s.value for s in NodeState),
    "healthy",
    "degraded",
    "offline",
)


class Pages:
    """The read pages and their fragments."""

    def __init__(self, site: Site, *, clock: Callable[[], float] = time.time) -> None:
        self.site = site
        self.clock = clock

    @property
    def ctx(self) -> AdminContext:
        return self.site.ctx

    def _answer(
        self,
        request: web.Request,
        template: str,
        fragments: Mapping[str, str],
        values: Callable[[], dict[str, Any]],
        *,
        status: int = 200,
        **extra: Any,
    ) -> web.Response:
        """The page (answered with ``status``: a refused form's page is not a 200), or one
        of its ``fragments`` (name -> template) when asked for."""
        wanted = request.query.get("fragment")
        if wanted is not None:
            part = fragments.get(wanted)
            if part is None:
                raise NotFound(
                    f"this page has no live part {wanted[:40]!r}; "
                    f"it has {', '.join(sorted(fragments))}"
                )
            return self.site.fragment(part, **values(), **extra)
        return self.site.page(request, template, status=status, **values(), **extra)

    answer = _answer
    """The same for the pages of the console's other modules (Models, API keys)."""

    def _is_admin(self, request: web.Request) -> bool:
        return principal_of(request).is_admin

    # -- overview ----------------------------------------------------------------------------

    def _overview(self) -> dict[str, Any]:
        ctx = self.ctx
        now = self.clock()
        nodes = list_nodes(ctx)
        states = Counter(n["state"] for n in nodes)
        health = Counter(n["health"] for n in nodes if n["state"] == NodeState.APPROVED)
        gpus_total = sum(len(n["gpus"]) for n in nodes if n["state"] == NodeState.APPROVED)
        shards = ctx.store.list_shards()
        gpus_used = sum(len(sh.gpus) for sh in shards)
        ready: Counter[str] = Counter(
            r.model for r in ctx.store.list_replicas() if r.state == ReplicaState.READY
        )
        unplaceable = ctx.scheduler.unplaceable
        everything = ctx.store.list_models()
        deployed = listed_models(ctx.store)
        # A disaggregated model counts its pools' replicas (the rows named MODEL#role).
        pools: dict[str, list[str]] = {}
        for m in everything:
            pair = split_pool(m.name)
            if pair is not None:
                pools.setdefault(pair[0], []).append(m.name)
        wanted = {m.name: m.replicas for m in everything}
        models = []
        for m in deployed:
            names = [m.name, *pools.get(m.name, [])]
            why = next((unplaceable[n].reason for n in names if n in unplaceable), "")
            models.append(
                {
                    "name": m.name,
                    "url": model_path(m.name),
                    "profile": m.profile,
                    "ready": sum(ready.get(n, 0) for n in names),
                    "desired": sum(wanted[n] for n in names),
                    "unplaceable": why,
                }
            )
        return {
            "states": [(s.value, states.get(s.value, 0)) for s in NodeState],
            "health": [(h, health.get(h, 0)) for h in ("healthy", "degraded", "offline")],
            "node_count": len(nodes),
            "gpus_used": gpus_used,
            "gpus_total": gpus_total,
            "models": models,
            "charts": self._charts([m.name for m in deployed], now),
            "events": [event_json(e) for e in ctx.store.list_events(limit=RECENT_EVENTS)],
        }

    def _charts(self, deployed: list[str], now: float) -> list[dict[str, str]]:
        """Per model (deployed or served in the last hour), its requests per second and its
        TTFT p50/p99 over the hour, as SVG: this instance's gateway traffic only."""
        history = self.ctx.history
        names = sorted({*deployed, *history.models(now)})
        series = {name: history.series(name, now, step=CHART_STEP_S) for name in names}
        busiest = sorted(names, key=lambda n: -sum(p.requests for p in series[n]))
        out = []
        for name in sorted(busiest[:MAX_CHARTED]):
            points = series[name]
            rps = line_chart(
                f"{name}: requests per second",
                [Line("requests/s", [(p.t, p.rps) for p in points])],
                unit="req/s",
                now=now,
            )
            ttft = line_chart(
                f"{name}: time to first token",
                [
                    Line("p50", [(p.t, _ms(p.ttft_p50)) for p in points]),
                    Line("p99", [(p.t, _ms(p.ttft_p99)) for p in points]),
                ],
                unit="ms",
                now=now,
            )
            out.append({"model": name, "rps": rps, "ttft": ttft})
        return out

    async def overview(self, request: web.Request) -> web.Response:
        return self._answer(
            request,
            "overview.html",
            {
                "summary": "_overview_summary.html",
                "charts": "_overview_charts.html",
                "events": "_events_rows.html",
            },
            self._overview,
            page="overview",
        )

    # -- nodes --------------------------------------------------------------------------------

    async def nodes(self, request: web.Request) -> web.Response:
        wanted = NodeFilter(state=_query(request, "state"), text=_query(request, "q"))

        def values() -> dict[str, Any]:
            nodes = list_nodes(self.ctx)
            shown = [n for n in nodes if wanted.keeps(n)]
            return {"nodes": shown, "total": len(nodes)}

        return self._answer(
            request,
            "nodes.html",
            {"table": "_nodes_table.html"},
            values,
            page="nodes",
            filters=wanted,
            state_choices=NODE_STATE_CHOICES,
        )

    async def node(self, request: web.Request) -> web.Response:
        return self.node_page(request, request.match_info["node"])

    def node_page(
        self, request: web.Request, node_id: str, *, status: int = 200, made: Any = None
    ) -> web.Response:
        """A node's page, or its live part (``made``: the rekey token a POST just minted,
        whose command this answer alone shows)."""

        def values() -> dict[str, Any]:
            ctx = self.ctx
            node = node_detail(ctx, node_id)  # NotFound: the 404 page names it
            gpus = node_gpus(ctx, node_id)
            replicas = {r.id: r for r in ctx.store.list_replicas()}
            shards = [
                {
                    "shard": sh,
                    "model": replicas[sh.replica_id].model if sh.replica_id in replicas else "",
                }
                for sh in ctx.store.list_shards(node_id=node_id)
            ]
            return {
                "node": node,
                "shards": shards,
                "events": [
                    event_json(e)
                    for e in ctx.store.list_events(limit=RECENT_EVENTS, subject=node_id)
                ],
                "refusals": ctx.scheduler.refusals_on(node_id),
                "drain": ctx.scheduler.drain_progress(node_id) if node["draining"] else None,
                # Each GPU's state by uuid (else index), and why a move off one waits.
                "gpu_states": {str(g["uuid"] or g["index"]): g for g in gpus["gpus"]},
                "gpu_blocked": gpus["blocked"],
            }

        return self._answer(
            request,
            "node.html",
            {"detail": "_node_detail.html"},
            values,
            status=status,
            page="nodes",
            is_admin=self._is_admin(request),
            made=made,
        )

    # -- events -------------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.Response:
        filters = {name: _query(request, name) for name in EVENT_FILTERS}
        store = self.ctx.store
        rows = store.list_events(
            limit=EVENTS_SHOWN,
            subject=filters["subject"] or None,
            kind=filters["kind"] or None,
            actor=filters["actor"] or None,
        )
        newest = store.list_events(limit=1)
        return self.site.page(
            request,
            "events.html",
            page="events",
            filters=filters,
            events=[event_json(e) for e in rows],
            # The stream starts after the newest event there is, filtered or not.
            after=newest[0].id if newest else 0,
            stream_query="&".join(
                f"{name}={_quote(value)}" for name, value in filters.items() if value
            ),
        )


def _quote(value: str) -> str:
    return quote(value, safe="")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
