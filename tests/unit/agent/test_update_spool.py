"""The agent's side of a signed update: download over TLS verified by the cluster CA (with
the node's client certificate), check the SHA-256, spool atomically, report progress, and
pass the root helper's verdict from status.json on."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llmgw import pki
from llmgw.agent.update_spool import IN_CONTAINER, Spooler
from llmgw.contracts.update_order import REQUEST, STATUS
from llmgw.errors import UpdateError
from llmgw.pki import Authority, Identity
from llmgw.server.fleet.updates import sign_order

NODE = "gpu-1"
BUNDLE = b"pretend this is a bundle" * 1000


class Reports(list[tuple[str, int, str, str, str]]):
    def __call__(self, op_id: str, counter: int, version: str, state: str, message: str) -> bool:
        self.append((op_id, counter, version, state, message))
        return True

    @property
    def states(self) -> list[str]:
        return [r[3] for r in self]


@pytest.fixture(scope="module")
def node_identity(authority: Authority, tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return pki.issue_node_cert(authority, NODE, tmp_path_factory.mktemp("node"))


class BundleServer:
    """An HTTPS server for /agent/bundles/linux-x64.tar.gz that wants a client certificate
    from the cluster CA."""

    def __init__(self, authority: Authority, directory: Path) -> None:
        self.server_id = pki.issue_server_cert(authority, directory, hosts=["127.0.0.1"])
        self.body = BUNDLE
        self.requests = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None

    async def _bundle(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.Response(body=self.body)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/agent/bundles/linux-x64.tar.gz", self._bundle)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.server_id.ca))
        ctx.load_cert_chain(self.server_id.cert, self.server_id.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/agent/bundles/linux-x64.tar.gz"


def order_for(url: str, **changes: Any) -> dict[str, Any]:
    order: dict[str, Any] = {
        "node_id": NODE,
        "version": "0.2.0",
        "counter": 3,
        "sha256": hashlib.sha256(BUNDLE).hexdigest(),
        "url": url,
        "arch": "x64",
        "expires": int(time.time()) + 3600,
    }
    order.update(changes)
    return order


@pytest.fixture
def bundles(authority: Authority, tmp_path: Path) -> Iterator[BundleServer]:
    server = BundleServer(authority, tmp_path / "server-pki")
    server.loop.run_until_complete(server.start())
    yield server
    if server.runner is not None:
        server.loop.run_until_complete(server.runner.cleanup())
    server.loop.close()


def spooler(tmp_path: Path, identity: Identity, reports: Reports) -> Spooler:
    def tls() -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(identity.ca))
        ctx.load_cert_chain(identity.cert, identity.key)
        return ctx

    return Spooler(
        node_id=NODE,
        spool=tmp_path / "state" / "update",
        report=reports,
        ssl_context=tls,
        cluster_ca=identity.ca,  # as the agent's service wires it
    )


def run(bundles: BundleServer, coro: Any) -> Any:
    return bundles.loop.run_until_complete(coro())


def test_an_order_is_downloaded_checked_and_spooled(
    tmp_path: Path, authority: Authority, node_identity: Identity, bundles: BundleServer
) -> None:
    reports = Reports()
    s = spooler(tmp_path, node_identity, reports)

    async def go() -> tuple[bytes, bytes]:
        data, sig = sign_order(authority.key, order_for(bundles.url))
        await s.handle("op-1", data, sig)
        return data, sig

    data, sig = run(bundles, go)
    request = tmp_path / "state" / "update" / REQUEST
    assert (request / "bundle.tar.gz").read_bytes() == BUNDLE
    assert (request / "order.json").read_bytes() == data
    assert (request / "order.sig").read_bytes() == sig
    assert sorted(os.listdir(request.parent)) == [REQUEST]  # no incoming.* left
    assert reports.states == ["downloading", "spooled"]
    assert reports[0][:3] == ("op-1", 3, "0.2.0")


def test_a_request_already_waiting_makes_it_busy(
    tmp_path: Path, authority: Authority, node_identity: Identity, bundles: BundleServer
) -> None:
    (tmp_path / "state" / "update" / REQUEST).mkdir(parents=True)
    reports = Reports()
    s = spooler(tmp_path, node_identity, reports)
    data, sig = sign_order(authority.key, order_for(bundles.url))
    run(bundles, lambda: s.handle("op-2", data, sig))
    assert reports.states == ["busy"]
    assert "still waiting for the update helper" in reports[0][4]
    assert bundles.requests == 0
    assert os.listdir(tmp_path / "state" / "update" / REQUEST) == []


@pytest.mark.parametrize(
    ("changes", "state", "words"),
    [
        ({"node_id": "gpu-2"}, "refused", "is for node gpu-2, and this is gpu-1"),
        ({"sha256": "ab" * 32}, "failed", "not the abab"),
    ],
)
def test_an_order_that_cannot_be_spooled_is_reported_and_leaves_nothing(
    tmp_path: Path,
    authority: Authority,
    node_identity: Identity,
    bundles: BundleServer,
    changes: dict[str, Any],
    state: str,
    words: str,
) -> None:
    reports = Reports()
    s = spooler(tmp_path, node_identity, reports)
    data, sig = sign_order(authority.key, order_for(bundles.url, **changes))
    with pytest.raises(UpdateError, match=words):
        run(bundles, lambda: s.handle("op-3", data, sig))
    assert reports.states[-1] == state
    assert words in reports[-1][4]
    spool = tmp_path / "state" / "update"
    assert not spool.exists() or os.listdir(spool) == []


def test_an_agent_in_its_container_refuses_updates_and_says_how_it_is_upgraded(
    tmp_path: Path, authority: Authority, node_identity: Identity, bundles: BundleServer
) -> None:
    """No root helper in the agent's image: a spooled request would wait there for ever."""
    reports = Reports()
    s = spooler(tmp_path, node_identity, reports)
    s.refusal = IN_CONTAINER
    data, sig = sign_order(authority.key, order_for(bundles.url))
    with pytest.raises(UpdateError, match="load the new image"):
        run(bundles, lambda: s.handle("op-9", data, sig))
    assert reports.states == ["refused"] and "docker compose up -d" in reports[0][4]
    assert bundles.requests == 0
    assert not (tmp_path / "state" / "update").exists()


def test_a_server_the_cluster_ca_did_not_sign_is_not_trusted(
    tmp_path: Path,
    authority: Authority,
    node_identity: Identity,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    impostor = BundleServer(
        pki.init_ca(tmp_path_factory.mktemp("impostor") / "pki"), tmp_path / "x"
    )
    try:
        reports = Reports()
        s = spooler(tmp_path, node_identity, reports)

        async def go() -> None:
            await impostor.start()
            data, sig = sign_order(authority.key, order_for(impostor.url))
            await s.handle("op-4", data, sig)

        with pytest.raises(UpdateError, match=r"downloading the bundle from .* failed"):
            impostor.loop.run_until_complete(go())
        assert reports.states == ["downloading", "failed"]
        assert "certificate" in reports[-1][4].lower()
        assert impostor.requests == 0
    finally:
        if impostor.runner is not None:
            impostor.loop.run_until_complete(impostor.runner.cleanup())
        impostor.loop.close()


def test_a_node_named_like_the_control_plane_serves_no_bundle(
    tmp_path: Path,
    authority: Authority,
    node_identity: Identity,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node enrolled under the control plane's host name passes TLS for that name with its
    certificate from the cluster CA; without the control plane's OID the download stops."""
    impostor = BundleServer(authority, tmp_path / "x")
    impostor.server_id = pki.issue_node_cert(authority, "cp.example", tmp_path / "impostor")
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.0.1" if host == "cp.example" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        reports = Reports()
        s = spooler(tmp_path, node_identity, reports)

        async def go() -> None:
            await impostor.start()
            url = f"https://cp.example:{impostor.port}/agent/bundles/linux-x64.tar.gz"
            data, sig = sign_order(authority.key, order_for(url))
            await s.handle("op-5", data, sig)

        with pytest.raises(UpdateError) as info:
            impostor.loop.run_until_complete(go())
        assert "was refused before it was asked for: the server is not the control plane (its " in (
            str(info.value)
        )
        assert pki.CONTROL_PLANE_OID.dotted_string in str(info.value)
        assert reports.states == ["downloading", "failed"]
        assert impostor.requests == 0  # the handshake ended it
        assert not (tmp_path / "state" / "update" / REQUEST).exists()
        assert [p.name for p in (tmp_path / "state" / "update").iterdir()] == []
    finally:
        if impostor.runner is not None:
            impostor.loop.run_until_complete(impostor.runner.cleanup())
        impostor.loop.close()


def test_the_helpers_verdict_is_reported_once_and_again_after_a_reconnect(
    tmp_path: Path, node_identity: Identity
) -> None:
    reports = Reports()
    s = spooler(tmp_path, node_identity, reports)
    s.poll()
    assert reports == []  # no status.json yet
    spool = tmp_path / "state" / "update"
    spool.mkdir(parents=True)
    status = {"counter": 3, "version": "0.2.0", "state": "applying", "message": "m", "time": 1}
    (spool / STATUS).write_text(json.dumps(status))
    s.poll()
    s.poll()
    assert reports == [("", 3, "0.2.0", "applying", "m")]
    (spool / STATUS).write_text(json.dumps({**status, "state": "done", "message": "upgraded"}))
    s.poll()
    assert reports[-1] == ("", 3, "0.2.0", "done", "upgraded")
    s.connected()
    assert len(reports) == 3 and reports[-1] == reports[-2]
    # Garbage and symlinks are not reported.
    (spool / STATUS).unlink()
    (tmp_path / "other.json").write_text(json.dumps({**status, "state": "refused"}))
    os.symlink(tmp_path / "other.json", spool / STATUS)
    s.connected()
    assert len(reports) == 3
