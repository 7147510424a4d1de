"""The admin routes of the control-plane instances (llmgw.server.admin.instances), over real
HTTP to a real store: on PostgreSQL the list (the lease's holder leads) and a retirement,
with each refusal (the leader, an unknown id, a running instance, one retired already) and
its event; on SQLite both routes say that instances need PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.server.admin.context import AdminContext, guarded
from llmgw.server.admin.instances import ALONE, InstanceRoutes
from llmgw.server.store import Store
from llmgw.server.store.location import parse_location

TOKEN = "admin-secret"
SILENT = 0.3  # the instance_stale_after of these tests: seconds before one counts as stopped


def exchange(store: Store, requests: list[tuple[str, str]]) -> list[tuple[int, Any]]:
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            admin_token=TOKEN,
            admin_token_file=Path("/s/token"),
            bodies=BodyBudget(1 << 20),
            store=store,
            instance_stale_after=SILENT,
        ),
    )
    routes = InstanceRoutes(ctx)
    app = web.Application()
    app.router.add_get("/api/instances", guarded(ctx, routes.instances))
    app.router.add_post("/api/instances/{instance}/retire", guarded(ctx, routes.retire))

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for method, path in requests:
                resp = await client.request(
                    method, path, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario())


@pytest.fixture
def pg_store(pg_cluster: Any, tmp_path: Path) -> Iterator[Store]:
    name = pg_cluster.fresh_database()
    store = Store.open(
        parse_location(
            pg_cluster.url(name, password=False), password_file=pg_cluster.password_file(tmp_path)
        )
    )
    yield store
    store.close()


def _register(store: Store, instance_id: str, serials: tuple[str, str]) -> None:
    store.register_instance(instance_id, f"host/{instance_id}/a", stale_after=SILENT, version="1.2")
    store.set_instance_addresses(
        instance_id,
        stream=f"{instance_id}:7443",
        http=f"http://{instance_id}:8080",
        enroll="",
        ca_hash="sha256:x",
        server_serial=serials[0],
        client_serial=serials[1],
    )


def _message(answer: tuple[int, Any]) -> str:
    status, body = answer
    assert status == 409, answer
    assert body["error"]["code"] == "conflict"
    return str(body["error"]["message"])


def test_the_list_names_the_leader_and_a_stopped_one_is_retired(pg_store: Store) -> None:
    store = pg_store
    assert store.take_lease("cp1", 60) is not None
    for n in (1, 2, 3):
        _register(store, f"cp{n}", (f"5{n}", f"c{n}"))
    time.sleep(SILENT + 0.2)  # cp3 stopped; cp1 and cp2 run on
    assert store.touch_instance("cp1", "host/cp1/a")
    assert store.touch_instance("cp2", "host/cp2/a")

    answers = exchange(
        store,
        [
            ("GET", "/api/instances"),
            ("POST", "/api/instances/cp1/retire"),
            ("POST", "/api/instances/cp2/retire"),
            ("POST", "/api/instances/cp9/retire"),
            ("POST", "/api/instances/cp3/retire"),
            ("POST", "/api/instances/cp3/retire"),
            ("GET", "/api/instances"),
        ],
    )
    status, listed = answers[0]
    assert status == 200
    assert [(i["id"], i["role"], i["stream"], i["version"]) for i in listed] == [
        ("cp1", "leader", "cp1:7443", "1.2"),
        ("cp2", "standby", "cp2:7443", "1.2"),
        ("cp3", "silent", "cp3:7443", "1.2"),
    ]
    assert listed[2]["seen_s_ago"] >= SILENT and listed[2]["retired_at"] is None
    assert (listed[2]["server_serial"], listed[2]["client_serial"]) == ("53", "c3")

    assert _message(answers[1]).startswith("instance cp1 is the leader; stop it first")
    running = _message(answers[2])
    assert running.startswith("instance cp2 was seen 0 s ago: it is running; stop it first:")
    assert "systemctl stop llmgw-server on that machine" in running
    assert _message(answers[3]) == (
        "no instance 'cp9' is registered; 'llmgw ctl instances' lists them"
    )
    status, retired = answers[4]
    assert status == 200, retired
    assert (retired["id"], retired["role"], retired["retired_serials"]) == (
        "cp3",
        "retired",
        ["53", "c3"],
    )
    assert "was retired already, on" in _message(answers[5])
    assert [(i["id"], i["role"]) for i in answers[6][1]] == [
        ("cp1", "leader"),
        ("cp2", "standby"),
        ("cp3", "retired"),
    ]
    # One event, naming both serials; the refusals recorded none.
    events = [e for e in store.list_events() if e.kind == "instance_retired"]
    assert [(e.subject, e.message) for e in events] == [
        (
            "cp3",
            "instance cp3 retired; agents refuse its certificates from now on (server serial "
            "53, client serial c3)",
        )
    ]
    assert store.retired_serials(10) == ("53", "c3")


def test_on_sqlite_there_are_no_instances(store: Store) -> None:
    answers = exchange(store, [("GET", "/api/instances"), ("POST", "/api/instances/cp1/retire")])
    for status, body in answers:
        assert status == 409
        assert body["error"]["message"] == ALONE
    assert "several control planes on one PostgreSQL database" in ALONE
    assert [e.kind for e in store.list_events()] == []
