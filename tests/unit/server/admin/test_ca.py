"""The admin routes of the cluster CA (llmgw.server.admin.ca): what they accept and refuse,
over real HTTP to a stand-in of the control plane's ClusterAuthority (and, for the export,
to a real one on a real PKI directory)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw import caexport, pki
from llmgw.bodies import BodyBudget
from llmgw.errors import Conflict, PasswordError
from llmgw.server.admin.ca import CARoutes
from llmgw.server.admin.context import AdminContext, guarded
from llmgw.server.fleet.authority import ClusterAuthority
from llmgw.server.store import Store

TOKEN = "admin-secret"


class FakeAuthority:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.actors: list[str] = []  # who each change was made by, as the events record it

    def status(self) -> dict[str, Any]:
        self.calls.append(("status", None))
        return {"current": {"ca_hash": "sha256:new"}}

    def rotate(self, overlap: float, *, actor: str) -> dict[str, Any]:
        self.calls.append(("rotate", overlap))
        self.actors.append(actor)
        return {"rotated": overlap}

    def finish(self, *, force: bool = False, actor: str) -> dict[str, Any]:
        self.calls.append(("finish", force))
        self.actors.append(actor)
        if not force:
            raise Conflict("nodes gpu-2 still hold certificates of the old CA")
        return {"finished": True}


def exchange(requests: list[tuple[str, str, Any]]) -> tuple[list[tuple[int, Any]], FakeAuthority]:
    authority = FakeAuthority()
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            admin_token=TOKEN, admin_token_file=Path("/s/token"), bodies=BodyBudget(1 << 20)
        ),
    )
    routes = CARoutes(ctx, cast(ClusterAuthority, authority))
    app = web.Application()
    app.router.add_get("/api/ca", guarded(ctx, routes.status))
    app.router.add_post("/api/ca/rotate", guarded(ctx, routes.rotate))
    app.router.add_post("/api/ca/finish", guarded(ctx, routes.finish))

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for method, path, body in requests:
                resp = await client.request(
                    method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario()), authority


def test_rotate_takes_a_duration_and_defaults_to_seven_days() -> None:
    answers, authority = exchange(
        [
            ("POST", "/api/ca/rotate", {"overlap": "2d"}),
            ("POST", "/api/ca/rotate", {"overlap": 3600}),
            ("POST", "/api/ca/rotate", {}),
        ]
    )
    assert [a[0] for a in answers] == [200, 200, 200]
    assert authority.calls == [
        ("rotate", 172800.0),
        ("rotate", 3600.0),
        ("rotate", 7 * 86400.0),
    ]
    assert authority.actors == ["token"] * 3  # the admin token made them


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"overlap": "30s"}, "overlap must be from 1m to 365d"),
        ({"overlap": "400d"}, "overlap must be from 1m to 365d"),
        ({"overlap": "soon"}, "overlap must be seconds, or a duration like"),
        ({"overlap": True}, "overlap must be seconds"),
        ({"overlap": "1d", "force": True}, "unknown field(s) force; send only 'overlap'"),
    ],
)
def test_rotate_refuses_what_it_cannot_use(body: dict[str, Any], words: str) -> None:
    answers, authority = exchange([("POST", "/api/ca/rotate", body)])
    status, answer = answers[0]
    assert status == 400
    assert words in answer["error"]["message"]
    assert authority.calls == []


def test_finish_is_refused_with_the_reason_unless_forced() -> None:
    answers, authority = exchange(
        [
            ("POST", "/api/ca/finish", {}),
            ("POST", "/api/ca/finish", {"force": True}),
            ("POST", "/api/ca/finish", {"force": "yes"}),
            ("GET", "/api/ca", None),
        ]
    )
    assert answers[0] == (
        409,
        {
            "error": {
                "message": "nodes gpu-2 still hold certificates of the old CA",
                "code": "conflict",
            }
        },
    )
    assert answers[1] == (200, {"finished": True})
    assert (
        answers[2][0] == 400 and "force must be true or false" in answers[2][1]["error"]["message"]
    )
    assert answers[3] == (200, {"current": {"ca_hash": "sha256:new"}})
    assert authority.calls == [("finish", False), ("finish", True), ("status", None)]


# --------------------------------------------------------------------------- the CA's export

PASSWORD = "the-admin-password"
PASSPHRASE = "a long passphrase"


class Events:
    """The store, as far as the CA's routes use it: events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.actors: list[str] = []

    def add_event(self, kind: str, subject: str, message: str, actor: str = "") -> None:
        self.events.append((kind, subject, message))
        self.actors.append(actor)


class Password:
    """The admin password check, with the refusal of the real one."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def check(
        self, password: object, *, refused: str = "nothing was signed", source: str = ""
    ) -> None:
        if password != PASSWORD:
            self.refused.append(refused)
            raise PasswordError(f"wrong admin password; {refused}. (stand-in)")


def export_exchange(
    tmp: Path, bodies: list[Any], *, rotate: bool = False
) -> tuple[list[tuple[int, Any]], Events, Password]:
    pki_dir = tmp / "pki"
    pki.ensure_server_identity(pki_dir, hosts=[])
    if rotate:
        pki.rotate_ca(pki_dir, overlap=3600)
    events, password = Events(), Password()
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            admin_token=TOKEN,
            admin_token_file=Path("/s/token"),
            bodies=BodyBudget(1 << 20),
            password=password,
            cluster_id="cluster-1",
        ),
    )
    authority = ClusterAuthority(
        pki_dir, pki.load_ca(pki_dir), cast(Store, events), sessions={}, hosts=[]
    )
    routes = CARoutes(ctx, authority)
    app = web.Application()
    app.router.add_post("/api/ca/export", guarded(ctx, routes.export))

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for body in bodies:
                resp = await client.post(
                    "/api/ca/export", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario()), events, password


def test_export_seals_the_ca_and_token_under_the_passphrase_and_records_it(
    tmp_path: Path,
) -> None:
    answers, events, _ = export_exchange(
        tmp_path, [{"password": PASSWORD, "passphrase": PASSPHRASE}], rotate=True
    )
    status, answer = answers[0]
    assert status == 200, answer
    ca = pki.load_ca(tmp_path / "pki")
    rotation = pki.read_rotation(tmp_path / "pki")
    assert rotation is not None
    assert answer["ca_hash"] == ca.ca_hash() and answer["cluster_id"] == "cluster-1"
    assert answer["rotation"] == rotation.to_json()
    export = caexport.unseal(answer["file"].encode(), PASSPHRASE, source="answer")
    assert (export.ca_hash, export.cluster_id, export.admin_token) == (
        ca.ca_hash(),
        "cluster-1",
        TOKEN,
    )
    assert pki.key_pem(export.ca_key) == pki.key_pem(ca.key)
    assert export.previous_ca_cert is not None
    assert json.loads(answer["file"])["kdf"]["n"] == 2**17  # the server seals at full cost
    assert events.events == [
        (
            "ca_exported",
            "control-plane",
            f"the CA {ca.ca_hash()} with the old CA {rotation.previous} and the admin token "
            "were exported, encrypted with a passphrase, to 127.0.0.1",
        )
    ]
    assert events.actors == ["token"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"password": "wrong", "passphrase": PASSPHRASE}, 403,
         "wrong admin password; nothing was exported."),
        ({"passphrase": PASSPHRASE}, 403, "wrong admin password; nothing was exported."),
        ({"password": PASSWORD, "passphrase": "x" * 11}, 400,
         "the passphrase of a CA export must have at least 12 characters"),
        ({"password": PASSWORD}, 400,
         "the passphrase of a CA export must have at least 12 characters"),
        ({"password": PASSWORD, "passphrase": PASSPHRASE, "out": "f"}, 400,
         "unknown field(s) out; send only 'password' and 'passphrase'"),
        ([PASSWORD, PASSPHRASE], 400, "the request body must be a JSON object"),
    ],
)  # fmt: skip
def test_export_is_refused_without_the_admin_password_or_a_long_passphrase(
    tmp_path: Path, body: Any, status: int, words: str
) -> None:
    answers, events, password = export_exchange(tmp_path, [body])
    got, answer = answers[0]
    assert got == status
    assert words in answer["error"]["message"]
    assert "file" not in answer
    assert events.events == []
    if status == 403:
        assert password.refused == ["nothing was exported"]
