"""The nodes admin routes: each node's health beside its state (healthy, degraded with its
reasons, offline), for ``llmgw ctl nodes`` and the console, and one node in full."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmgw.contracts.inventory import inventory_dict
from llmgw.errors import NotFound, StoreUnavailable
from llmgw.proto import control_pb2 as pb
from llmgw.server.admin.context import AdminContext
from llmgw.server.admin.nodes import NodeRoutes
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import Store

BROKEN = pb.DegradedReason(
    code="engine",
    engine="vllm",
    message="engine vllm (/opt/vllm) will not run: libcudart.so.12 => not found; install ...",
)
FABRIC = pb.DegradedReason(code="fabric", fabric="ib-a", message="fabric ib-a is down: ...")


def _inventory(*reasons: pb.DegradedReason) -> pb.Inventory:
    return pb.Inventory(
        hostname="h",
        engines=["sim"],
        engine_details=[
            pb.EngineInfo(name="sim", ok=True),
            pb.EngineInfo(name="vllm", path="/opt/vllm", ok=False, problem="libcudart"),
        ],
        fabrics=[pb.Fabric(name="ib-a", hcas=["mlx5_0"], healthy=False)],
        warnings=["fabric ib-a: adapter mlx5_0 has no ACTIVE port"],
        degraded=list(reasons),
    )


class Fleet:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.sessions: dict[str, NodeSession] = {}
        self.lost: set[str] = set()
        ctx = SimpleNamespace(
            store=store,
            sessions=self.sessions,
            lost=self.lost,
            updates=SimpleNamespace(status_of=lambda node_id: None, all_status=dict),
        )
        self.routes = NodeRoutes(cast(AdminContext, ctx))

    def add(self, node_id: str, inv: pb.Inventory, *, state: str, connected: bool) -> None:
        self.store.upsert_node(
            node_id,
            dataplane_addr="10.0.0.1:9443",
            agent_version="0.1.0",
            inventory=inventory_dict(inv) if state != "pending" else {},
            connected=connected,
        )
        self.store.set_node_state(node_id, state)
        if connected:
            self.sessions[node_id] = NodeSession(
                node_id=node_id,
                dataplane_addr="10.0.0.1:9443",
                epoch=1,
                engines=frozenset(inv.engines),
                approved=state == "approved",
            )
            if state == "pending":
                self.sessions[node_id].held_inventory = inv

    def get(self, path: str, **match: str) -> Any:
        request = make_mocked_request("GET", path, match_info=match)
        handler = self.routes.node if match else self.routes.nodes
        response = asyncio.run(handler(request))
        assert isinstance(response, web.Response) and response.body is not None
        return json.loads(cast(bytes, response.body))


@pytest.fixture
def fleet(store: Store) -> Fleet:
    fleet = Fleet(store)
    fleet.add("ok", _inventory(), state="approved", connected=True)
    fleet.add("bad", _inventory(BROKEN, FABRIC), state="approved", connected=True)
    fleet.add("gone", _inventory(BROKEN), state="approved", connected=False)
    fleet.add("new", _inventory(BROKEN), state="pending", connected=True)
    return fleet


def test_the_list_gives_health_beside_state(fleet: Fleet) -> None:
    nodes = {n["id"]: n for n in fleet.get("/api/nodes")}
    assert {k: (n["state"], n["health"]) for k, n in nodes.items()} == {
        "ok": ("approved", "healthy"),
        "bad": ("approved", "degraded"),
        "gone": ("approved", "offline"),
        # What a pending node's session holds: an operator sees it before approving.
        "new": ("pending", "degraded"),
    }
    assert nodes["ok"]["degraded"] == []
    assert nodes["bad"]["degraded"] == [
        {"code": "engine", "engine": "vllm", "fabric": "", "message": BROKEN.message},
        {"code": "fabric", "engine": "", "fabric": "ib-a", "message": FABRIC.message},
    ]
    # Offline, the reasons it last gave are still there to read.
    assert [r["code"] for r in nodes["gone"]["degraded"]] == ["engine"]


def test_a_lost_node_is_offline(fleet: Fleet) -> None:
    fleet.lost.add("bad")
    nodes = {n["id"]: n for n in fleet.get("/api/nodes")}
    assert nodes["bad"]["health"] == "offline"


def test_one_node_in_full(fleet: Fleet) -> None:
    node = fleet.get("/api/nodes/bad", node="bad")
    assert (node["id"], node["state"], node["health"]) == ("bad", "approved", "degraded")
    assert [r["code"] for r in node["degraded"]] == ["engine", "fabric"]
    assert node["engine_details"][1] == {
        "name": "vllm",
        "path": "/opt/vllm",
        "version": "",
        "ok": False,
        "problem": "libcudart",
    }
    assert node["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0"], "healthy": False}]
    assert node["warnings"] == ["fabric ib-a: adapter mlx5_0 has no ACTIVE port"]
    assert node["sleepers_host_memory_bytes"] == 0
    # A replica asleep there holding 512 MiB, as its engine said.
    fleet.store.put_model("m", engine="sim", params={}, replicas=1)
    shard = fleet.store.add_shard(fleet.store.add_replica("m").id, "bad", rank=0)
    fleet.store.update_shard(shard.id, state="asleep", sleep_level=1, host_memory_mib=512)
    node = fleet.get("/api/nodes/bad", node="bad")
    assert node["sleepers_host_memory_bytes"] == 512 << 20
    # A pending node: its reasons from its session, the rest from the summary stored.
    pending = fleet.get("/api/nodes/new", node="new")
    assert (pending["health"], pending["engine_details"]) == ("degraded", [])
    assert pending["degraded"][0]["message"] == BROKEN.message


def test_a_pending_nodes_reasons_are_bounded(fleet: Fleet) -> None:
    flood = pb.DegradedReason(code="engine" * 20, engine="e" * 100, message="m" * 5000)
    fleet.sessions["new"].held_inventory = _inventory(*[flood] * 50)
    node = fleet.get("/api/nodes/new", node="new")
    assert len(node["degraded"]) == 8
    assert {len(r["message"]) for r in node["degraded"]} == {1000}
    assert {(len(r["code"]), len(r["engine"])) for r in node["degraded"]} == {(32, 32)}


def test_an_unknown_node_says_where_to_look(fleet: Fleet) -> None:
    with pytest.raises(NotFound, match="no node named nope; 'llmgw ctl nodes' lists them"):
        fleet.get("/api/nodes/nope", node="nope")


def test_each_gpu_shows_its_utilisation_live_from_the_session(store: Store) -> None:
    fleet = Fleet(store)
    gpus = [
        pb.Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", memory_total_mib=81559)
        for i in range(3)
    ]
    inv = pb.Inventory(hostname="h", engines=["sim"], gpus=gpus)
    inv.gpus[0].utilization_percent = 12  # the inventory's sample: never what is shown
    fleet.add("up", inv, state="approved", connected=True)
    fleet.add("down", inv, state="approved", connected=False)
    # The latest heartbeat said: GPU 0 busy, GPU 1 idle, GPU 2 cannot tell.
    fleet.sessions["up"].gpu_utilization = {"GPU-0": 88, "GPU-1": 0, "GPU-2": None, "GPU-9": 5}
    nodes = {n["id"]: n for n in fleet.get("/api/nodes")}
    assert [g["utilization_percent"] for g in nodes["up"]["gpus"]] == [88, 0, None]
    assert nodes["up"]["gpus"][0] == {
        "index": 0,
        "uuid": "GPU-0",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_mib": 81559,
        "memory_used_mib": 0,
        "utilization_percent": 88,
    }
    # Not connected: no figure (the store never has one), whatever it last said.
    assert [g["utilization_percent"] for g in nodes["down"]["gpus"]] == [None, None, None]
    one = fleet.get("/api/nodes/up", node="up")
    assert [g["utilization_percent"] for g in one["gpus"]] == [88, 0, None]
    # A new heartbeat is shown at the next read; the stored inventory is left as it was.
    fleet.sessions["up"].gpu_utilization = {"GPU-0": 3}
    one = fleet.get("/api/nodes/up", node="up")
    assert [g["utilization_percent"] for g in one["gpus"]] == [3, None, None]
    assert "utilization_percent" not in store.get_node("up").inventory["gpus"][0]


class _Away:
    """The store with its database away: every read raises as PostgreSQL's does then."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.database = SimpleNamespace(unreachable_since=time.time())

    def __getattr__(self, name: str) -> Any:
        def unavailable(*_args: Any, **_kwargs: Any) -> Any:
            raise StoreUnavailable("database llmgw unreachable since 03:04:05")

        return unavailable


def test_the_leader_lists_the_nodes_from_memory_while_the_database_is_away(fleet: Fleet) -> None:
    """The list once read; then the database goes away, "ok" drops its stream and a node
    connects anew: the list is the one read, with the connections as they are now."""
    before = {n["id"]: n for n in fleet.get("/api/nodes")}
    ctx = cast(Any, fleet.routes.ctx)
    ctx.store = _Away(fleet.store)
    del fleet.sessions["ok"]
    fleet.sessions["late"] = NodeSession(
        node_id="late", dataplane_addr="10.0.0.9:9443", epoch=1, engines=frozenset({"sim"}),
        approved=True,
    )  # fmt: skip
    nodes = {n["id"]: n for n in fleet.get("/api/nodes")}
    assert sorted(nodes) == ["bad", "gone", "late", "new", "ok"]
    assert (nodes["ok"]["connected"], nodes["ok"]["health"]) == (False, "offline")
    assert (nodes["bad"]["health"], nodes["bad"]["shards"]) == ("degraded", before["bad"]["shards"])
    assert nodes["bad"]["fingerprint"] == before["bad"]["fingerprint"]
    assert (nodes["late"]["state"], nodes["late"]["health"]) == ("approved", "healthy")
    assert nodes["late"]["dataplane_addr"] == "10.0.0.9:9443"


def test_status_says_the_database_is_away(fleet: Fleet) -> None:
    ctx = cast(Any, fleet.routes.ctx)
    ctx.cluster_id, ctx.epoch = "c", 3
    ctx.listening = SimpleNamespace(http_addr="127.0.0.1:8080", grpc_port=7443)

    def status() -> dict[str, Any]:
        response = asyncio.run(fleet.routes.status(make_mocked_request("GET", "/api/status")))
        return cast(dict[str, Any], json.loads(cast(bytes, response.body)))

    assert "database" not in status()
    ctx.store = _Away(fleet.store)
    assert status()["database"].startswith("unreachable since ")
