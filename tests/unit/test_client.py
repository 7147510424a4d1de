"""How ``llmgw ctl`` reaches a control plane: https verified (system trust, --ca, the ctl.yaml's
CA), no admin token or password in clear to anything but loopback, the ctl.yaml of
LLMGW_STATE_DIR, and what it says when nothing answers.

The admin API here is a small real aiohttp server on 127.0.0.1 (plain or TLS) that records
what reached it; a name that is not loopback is only ever written into a URL and, where a
request must go through, resolved to 127.0.0.1 by a patched resolver: no traffic leaves the
machine."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from click.testing import CliRunner

from llmgw import pki
from llmgw.cli import main
from llmgw.client import is_loopback_url
from llmgw.server.common.tls import ServingCertificate

TOKEN = "llmgw-admin-test-token"


@dataclass
class AdminStub:
    port: int
    seen: list[dict[str, Any]] = field(default_factory=list)


def _run_stub(tls: ServingCertificate | None) -> Iterator[AdminStub]:
    loop = asyncio.new_event_loop()
    stub = AdminStub(port=0)
    ready = threading.Event()

    async def nodes(request: web.Request) -> web.Response:
        stub.seen.append({"path": request.path, "auth": request.headers.get("Authorization")})
        return web.json_response([])

    async def status(request: web.Request) -> web.Response:
        # `ctl nodes` (not --json) compares each agent's version with the control plane's.
        stub.seen.append({"path": request.path, "auth": request.headers.get("Authorization")})
        return web.json_response({"version": "0.1.0"})

    async def password(request: web.Request) -> web.Response:
        stub.seen.append({"path": request.path, "body": await request.json()})
        return web.json_response({"ok": True})

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/api/nodes", nodes)
        app.router.add_get("/api/status", status)
        app.router.add_put("/api/admin/password", password)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context if tls else None)
        await site.start()
        stub.port = runner.addresses[0][1]
        return runner

    runner: web.AppRunner | None = None

    def thread() -> None:
        nonlocal runner
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    worker = threading.Thread(target=thread, daemon=True)
    worker.start()
    assert ready.wait(10)
    try:
        yield stub
    finally:
        assert runner is not None
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        worker.join(10)
        loop.close()


@pytest.fixture
def plain() -> Iterator[AdminStub]:
    yield from _run_stub(None)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    pki.init_ca(tmp_path / "pki")
    return tmp_path / "pki"


@pytest.fixture
def https(ca_dir: Path) -> Iterator[AdminStub]:
    ident = pki.issue_server_cert(pki.load_ca(ca_dir), ca_dir, hosts=["127.0.0.1", "localhost"])
    yield from _run_stub(ServingCertificate(ident.cert, ident.key))


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No operator's ctl.yaml, no llmgw variables from the environment running the tests."""
    for name in (
        "LLMGW_SERVER",
        "LLMGW_TOKEN",
        "LLMGW_CTL_CONFIG",
        "LLMGW_STATE_DIR",
        "LLMGW_CA",
        "LLMGW_INSECURE_HTTP",
    ):
        monkeypatch.delenv(name, raising=False)
    return {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "XDG_DATA_HOME": str(tmp_path / "data")}


def ctl(env: dict[str, str], *args: str) -> Any:
    return CliRunner().invoke(main, ["ctl", *args], env=env)


@pytest.fixture
def no_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError(f"ctl looked up {args[0]!r}: it was about to connect")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8080", True),
        ("http://127.3.2.1:8080", True),  # all of 127.0.0.0/8
        ("http://[::1]:8080", True),
        ("http://localhost:8080", True),
        ("http://LocalHost.:8080/", True),
        ("http://0.0.0.0:8080", False),
        ("http://10.0.0.5:8080", False),
        ("http://[fd00::1]:8080", False),
        ("http://cp.example.net:8080", False),
        ("http://localhost.example.net:8080", False),  # a name is not looked up
        ("http://127.0.0.1.nip.io:8080", False),
        ("http://[::1:8080", False),  # not a URL
    ],
)
def test_what_counts_as_loopback(url: str, loopback: bool) -> None:
    assert is_loopback_url(url) is loopback


def test_ctl_refuses_the_admin_token_over_plain_http_to_a_host_that_is_not_loopback(
    env: dict[str, str], no_lookups: None
) -> None:
    out = ctl(env, "--server", "http://cp.example.net:8080", "--token", TOKEN, "nodes")
    assert out.exit_code == 1
    assert out.stderr == (
        "error: refusing to send the admin token in clear over plain HTTP to "
        "http://cp.example.net:8080 (from --server/LLMGW_SERVER), which is not a loopback "
        "address; turn TLS on in the control plane's server.yaml (tls: cluster, or tls: "
        "{cert: FILE, key: FILE}) and use https://, or pass --insecure-http (env: "
        "LLMGW_INSECURE_HTTP=1) to send it anyway\n"
    )
    # The admin password (no token given) is refused the same way, before it is sent.
    env = {**env, "LLMGW_ADMIN_PASSWORD": "old", "LLMGW_NEW_ADMIN_PASSWORD": "new-password-1"}
    out = ctl(env, "--server", "http://10.0.0.5:8080", "admin", "password")
    assert out.exit_code == 1
    assert "refusing to send the admin password in clear over plain HTTP" in out.stderr
    env = {**env, "LLMGW_TOKEN": TOKEN}
    out = ctl(env, "--server", "http://10.0.0.5:8080", "update", "--all", "--version", "0.9.0")
    assert out.exit_code == 1
    assert (
        "refusing to send the admin token and the admin password in clear over plain HTTP to "
        "http://10.0.0.5:8080" in out.stderr
    )


def test_insecure_http_sends_it_anyway_and_loopback_needs_no_flag(
    env: dict[str, str], plain: AdminStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = socket.getaddrinfo

    def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        # cp.example.net is this test's stand-in server on loopback; nothing else resolves.
        assert host in ("cp.example.net", "127.0.0.1"), host
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    url = f"http://cp.example.net:{plain.port}"
    out = ctl(env, "--server", url, "--token", TOKEN, "--insecure-http", "--json", "nodes")
    assert out.exit_code == 0, out.stderr
    out = ctl({**env, "LLMGW_INSECURE_HTTP": "1"}, "--server", url, "--token", TOKEN, "nodes")
    assert out.exit_code == 0, out.stderr
    out = ctl(env, "--server", f"http://127.0.0.1:{plain.port}", "--token", TOKEN, "nodes")
    assert out.exit_code == 0, out.stderr
    assert [s["auth"] for s in plain.seen if s["path"] == "/api/nodes"] == [f"Bearer {TOKEN}"] * 3
    assert {s["auth"] for s in plain.seen} == {f"Bearer {TOKEN}"}


def test_https_is_verified_against_the_system_store_or_the_ca_given(
    env: dict[str, str], https: AdminStub, ca_dir: Path, tmp_path: Path
) -> None:
    url = f"https://127.0.0.1:{https.port}"
    out = ctl(env, "--server", url, "--token", TOKEN, "nodes")
    assert out.exit_code == 1
    assert out.stderr.startswith(
        f"error: cannot verify the certificate of {url} (from --server/LLMGW_SERVER) against "
        "the system trust store: unable to get local issuer certificate; pass --ca FILE "
        "(env: LLMGW_CA) with the CA that signed it"
    )
    assert https.seen == [], "nothing was sent to a server that was not verified"
    cafile = ca_dir / pki.CA_CERT
    out = ctl(env, "--server", url, "--token", TOKEN, "--ca", str(cafile), "--json", "nodes")
    assert out.exit_code == 0, out.stderr
    assert out.stdout == "[]\n"
    out = ctl({**env, "LLMGW_CA": str(cafile)}, "--server", url, "--token", TOKEN, "nodes")
    assert out.exit_code == 0, out.stderr
    # The CA a ctl.yaml names (relative to the file), as the server's own ctl.yaml does.
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = tmp_path / "ctl.yaml"
    config.write_text(
        yaml.safe_dump({"server": url, "token_file": str(tmp_path / "token"), "ca": "pki/ca.crt"})
    )
    out = ctl(env, "--config", str(config), "nodes")
    assert out.exit_code == 0, out.stderr
    assert [s["auth"] for s in https.seen if s["path"] == "/api/nodes"] == [f"Bearer {TOKEN}"] * 3
    # A CA file that is not one is a usage problem, said as such.
    out = ctl(env, "--server", url, "--token", TOKEN, "--ca", str(tmp_path / "token"), "nodes")
    assert out.exit_code == 2
    assert f"cannot load the CA certificate {tmp_path / 'token'} (--ca/LLMGW_CA)" in out.stderr


def test_plain_http_to_an_https_control_plane_says_so(
    env: dict[str, str], https: AdminStub
) -> None:
    out = ctl(env, "--server", f"http://127.0.0.1:{https.port}", "--token", TOKEN, "nodes")
    assert out.exit_code == 1
    assert "(a control plane with tls: in server.yaml speaks https://)" in out.stderr


def test_ctl_uses_the_ctl_yaml_of_llmgw_state_dir(
    env: dict[str, str], plain: AdminStub, tmp_path: Path
) -> None:
    state = tmp_path / "my cluster"
    state.mkdir()
    (state / "admin.token").write_text(TOKEN + "\n")
    (state / "ctl.yaml").write_text(
        yaml.safe_dump(
            {"server": f"http://127.0.0.1:{plain.port}", "token_file": str(state / "admin.token")}
        )
    )
    out = ctl({**env, "LLMGW_STATE_DIR": str(state)}, "--json", "nodes")
    assert out.exit_code == 0, out.stderr
    out = ctl(env, "--state-dir", str(state), "--json", "nodes")
    assert out.exit_code == 0, out.stderr
    assert [s["auth"] for s in plain.seen] == [f"Bearer {TOKEN}"] * 2
    # A state directory without one is named, not silently replaced by another cluster.
    empty = tmp_path / "empty"
    out = ctl({**env, "LLMGW_STATE_DIR": str(empty)}, "nodes")
    assert out.exit_code == 2
    assert out.stderr.startswith(f"error: {empty / 'ctl.yaml'}: no such file")
    assert "unset LLMGW_STATE_DIR" in out.stderr


def test_cannot_reach_ends_with_a_newline(env: dict[str, str]) -> None:
    out = ctl(env, "--server", "http://127.0.0.1:9", "nodes")
    assert out.exit_code == 1
    assert out.stderr.startswith("error: cannot reach a control plane; tried:\n")
    assert out.stderr.endswith(
        "\nstart one ('llmgw up' or 'llmgw server') or pass --server URL / set LLMGW_SERVER\n"
    )
    assert not out.stderr.endswith("\n\n")


def test_a_node_certified_for_the_servers_name_is_not_the_control_plane(
    env: dict[str, str], ca_dir: Path, tmp_path: Path, resolve_to_loopback: None
) -> None:
    """A node enrolled as cp.example holds a certificate of the cluster CA for that name:
    TLS passes, and only the control plane's usage (which it lacks) tells them apart. The
    token is never sent to it."""
    node = pki.issue_node_cert(pki.load_ca(ca_dir), "cp.example", tmp_path / "node")
    for stub in _run_stub(ServingCertificate(node.cert, node.key)):
        url = f"https://cp.example:{stub.port}"
        cafile = str(ca_dir / pki.CA_CERT)
        out = ctl(env, "--server", url, "--token", TOKEN, "--ca", cafile, "nodes")
        assert out.exit_code == 1
        assert out.stderr.startswith(
            f"error: refusing {url} (from --server/LLMGW_SERVER): the cluster CA certified it, "
            "but not as the control plane: its certificate (CN=cp.example, serial "
        )
        assert pki.CONTROL_PLANE_OID.dotted_string in out.stderr
        assert "nothing was sent" in out.stderr
        assert stub.seen == []


def test_the_control_plane_and_a_company_cas_server_are_trusted_as_before(
    env: dict[str, str], ca_dir: Path, tmp_path: Path, resolve_to_loopback: None
) -> None:
    """The control plane's own certificate passes; so does a server certificate of an
    operator's own CA (tls: {cert, key}), which carries no llmgw usage and needs none."""
    server = pki.issue_server_cert(pki.load_ca(ca_dir), tmp_path / "cp", hosts=["cp.example"])
    company = pki.init_ca(tmp_path / "company", common_name="Example Corp CA")
    own = pki.issue_node_cert(company, "cp.example", tmp_path / "own")  # no llmgw usage
    for ident, cafile in ((server, ca_dir / pki.CA_CERT), (own, tmp_path / "company" / "ca.crt")):
        for stub in _run_stub(ServingCertificate(ident.cert, ident.key)):
            url = f"https://cp.example:{stub.port}"
            out = ctl(
                env, "--server", url, "--token", TOKEN, "--ca", str(cafile), "--json", "nodes"
            )
            assert out.exit_code == 0, out.stderr
            assert [s["auth"] for s in stub.seen] == [f"Bearer {TOKEN}"]
