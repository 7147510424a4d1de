"""The control plane's :8080 over HTTPS (server.yaml ``tls:``), and the join command it prints.

A real control plane runs in the test's process on loopback ports picked free: ``tls:
cluster`` verified against its own CA by a client, ``llmgw ctl`` through the ctl.yaml the
server writes, the join one-liner run by ``sh`` with the real curl against the TLS
listener, the operator's certificate replaced on disk while it serves, and the join
command's refusal of addresses that are not host[:port].
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography import x509

from llmgw import pki
from llmgw.agent.service import bundle_download_ssl_context
from llmgw.cli import main
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config
from llmgw.server.ha import LEADER_HTTP, Role
from tests.ci import require_tools
from tests.oneliner import make_bundle, run_one_liner


def run_cp(tmp: Path, body: Callable[[ControlPlane], Awaitable[None]], **settings: object) -> None:
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(tmp / "server"),
            "http_listen": "127.0.0.1:0",
            "grpc_listen": "127.0.0.1:0",
            "enroll_listen": "127.0.0.1:0",
            "bundle_dir": str(tmp / "bundles"),
            **settings,
        },
    )

    async def main_() -> None:
        cp = ControlPlane(cfg)
        await cp.start()
        try:
            await body(cp)
        finally:
            await cp.stop()

    asyncio.run(main_())


def get(url: str, *, token: str | None = None, ca: Path | None = None, **kw: Any) -> Any:
    """A blocking request (run it off the event loop); JSON in, JSON out."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = kw.pop("json", None)
    if body is not None:
        headers["Content-Type"] = "application/json"
    headers.update(kw.pop("headers", {}))
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers=headers,
        method=kw.pop("method", "POST" if body is not None else "GET"),
    )
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def served_serial(port: int, ca: Path, name: str = "localhost") -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=name) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def fetch(url: str, context: ssl.SSLContext) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        return bytes(resp.read())


def test_update_orders_download_over_https_with_tls_cluster(tmp_path: Path) -> None:
    (tmp_path / "bundles").mkdir()
    path = make_bundle(tmp_path / "bundles", "0.1.0", "linux-x64")

    async def body(cp: ControlPlane) -> None:
        assert cp.bundles is not None and cp.ca is not None
        (bundle,) = await cp.bundles.bundles()
        url = cp.leader.updates.bundle_url(bundle)
        assert url == f"https://127.0.0.1:{cp.http_port}/agent/bundles/linux-x64.tar.gz"
        # What the agent downloads it with: its identity, trusting the cluster CA.
        node = pki.issue_node_cert(cp.ca, "gpu-01", tmp_path / "node")
        context = bundle_download_ssl_context(node.cert, node.key, node.ca)
        assert await asyncio.to_thread(fetch, url, context) == path.read_bytes()

    run_cp(tmp_path, body, tls="cluster")


def test_tls_cluster_serves_https_that_ctl_verifies_with_the_servers_ctl_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LLMGW_SERVER", "LLMGW_TOKEN", "LLMGW_CTL_CONFIG", "LLMGW_CA"):
        monkeypatch.delenv(name, raising=False)

    async def body(cp: ControlPlane) -> None:
        ca = cp.pki_dir / pki.CA_CERT
        url = f"https://127.0.0.1:{cp.http_port}"
        status, health = await asyncio.to_thread(get, url + "/healthz", ca=ca)
        assert status == 200 and health["status"] == "ok"
        # Plain HTTP gets no answer from a TLS listener.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            await asyncio.to_thread(get, f"http://127.0.0.1:{cp.http_port}/healthz")
        assert cp.store.get_meta(LEADER_HTTP) == url
        # The ctl.yaml the server wrote: https, the cluster CA, the token file.
        runner = CliRunner()
        env = {
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
            "LLMGW_STATE_DIR": str(cp.cfg.state_dir),
        }
        out = await asyncio.to_thread(runner.invoke, main, ["ctl", "--json", "nodes"], env=env)
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout) == []

    run_cp(tmp_path, body, tls="cluster")
    written = (tmp_path / "server" / "ctl.yaml").read_text()
    assert f"ca: {tmp_path / 'server' / 'pki' / 'ca.crt'}" in written
    assert "server: https://127.0.0.1:" in written


def test_join_one_liner_fetches_the_bundle_over_https_with_tls_cluster(tmp_path: Path) -> None:
    require_tools("curl", "sha256sum")
    (tmp_path / "bundles").mkdir()
    make_bundle(tmp_path / "bundles", "0.1.0", "linux-x64")

    async def body(cp: ControlPlane) -> None:
        ca = cp.pki_dir / pki.CA_CERT
        base = f"https://127.0.0.1:{cp.http_port}"
        status, listing = await asyncio.to_thread(get, base + "/agent/bundles", ca=ca)
        assert status == 200
        assert [b["url"] for b in listing] == [f"{base}/agent/bundles/linux-x64.tar.gz"]
        status, data = await asyncio.to_thread(
            get, base + "/api/join-tokens", token=cp.admin_token, ca=ca, json={"node": "gpu-01"}
        )
        assert status == 201, data
        command = data["command"]
        assert f"{base}/agent/bundles/" in command
        # The node does not trust the cluster CA yet: the hash in the command is the check.
        assert "curl -fsSL --insecure -o agent.tar.gz" in command
        assert "wget -q --no-check-certificate -O agent.tar.gz" in command
        result = await asyncio.to_thread(run_one_liner, tmp_path, command)
        assert result.returncode == 0, result.stderr
        assert "agent.tar.gz: OK" in result.stdout

    run_cp(tmp_path, body, tls="cluster")
    argv = (tmp_path / "record.argv").read_text().splitlines()
    assert argv[:3] == ["install", "--node-id", "gpu-01"]
    assert argv[3] == "--enroll-url" and argv[4].startswith("https://127.0.0.1:")


def test_the_operators_certificate_is_reloaded_when_its_files_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's CA stands in for a public one; its certificates are renewed in live/.
    own = pki.init_ca(tmp_path / "own-ca")
    hosts = ["localhost", "127.0.0.1"]
    first = pki.issue_server_cert(own, tmp_path / "a", hosts=hosts, name="one")
    second = pki.issue_server_cert(own, tmp_path / "b", hosts=hosts, name="two")
    live = tmp_path / "live"
    live.mkdir()
    for src, dst in ((first.cert, "cert.pem"), (first.key, "key.pem")):
        shutil.copyfile(src, live / dst)
    (tmp_path / "bundles").mkdir()
    make_bundle(tmp_path / "bundles", "0.1.0", "linux-x64")
    ca = tmp_path / "own-ca" / pki.CA_CERT
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the "system" trust store: the operator's CA

    async def body(cp: ControlPlane) -> None:
        port = cp.http_port
        serial = await asyncio.to_thread(served_serial, port, ca)
        assert serial == pki.load_cert(first.cert).serial_number
        for src, dst in ((second.cert, "cert.pem"), (second.key, "key.pem")):
            shutil.copyfile(src, live / f"{dst}.new")
            os.replace(live / f"{dst}.new", live / dst)
        serial = await asyncio.to_thread(served_serial, port, ca)
        assert serial == pki.load_cert(second.cert).serial_number
        # A certificate the world trusts: the one-liner checks it like any other download.
        _, data = await asyncio.to_thread(
            get,
            f"https://localhost:{port}/api/join-tokens",
            token=cp.admin_token,
            ca=ca,
            json={"node": "gpu-02", "address": "localhost"},
        )
        assert f"https://localhost:{port}/agent/bundles/" in data["command"]
        assert "--insecure" not in data["command"]
        assert "--no-check-certificate" not in data["command"]
        # An agent fetches update bundles from it too: the system trust store (here the
        # operator's CA through SSL_CERT_FILE) verifies it, besides the cluster CA.
        assert cp.bundles is not None and cp.ca is not None
        (bundle,) = await cp.bundles.bundles()
        node = pki.issue_node_cert(cp.ca, "gpu-02", tmp_path / "node")
        context = bundle_download_ssl_context(node.cert, node.key, node.ca)
        fetched = await asyncio.to_thread(fetch, cp.leader.updates.bundle_url(bundle), context)
        assert fetched == bundle.path.read_bytes()

    run_cp(tmp_path, body, tls={"cert": str(live / "cert.pem"), "key": str(live / "key.pem")})
    # ctl on this machine reaches it by the name in its certificate.
    assert "server: https://localhost:" in (tmp_path / "server" / "ctl.yaml").read_text()


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("x;id;#", "address 'x;id;#' in 'x;id;#' is not a valid host name or IP address"),
        ("cp.example.net;reboot", "is not a valid host name or IP address"),
        ("cp example", "is not a valid host name or IP address"),
        ("$(id)", "is not a valid host name or IP address"),
        ("fd00::1", "an IPv6 address needs brackets"),
        ("cp:80:80", "an IPv6 address needs brackets"),
        ("cp:http", "port 'http' in 'cp:http' must be a number"),
        ("", "address is empty"),
        (5, "address must be a string host[:port] (IPv6 in brackets)"),
    ],
)
def test_join_command_refuses_an_address_that_is_not_host_port(
    tmp_path: Path, address: object, problem: str
) -> None:
    async def body(cp: ControlPlane) -> None:
        status, data = await asyncio.to_thread(
            get,
            f"http://127.0.0.1:{cp.http_port}/api/join-tokens",
            token=cp.admin_token,
            json={"node": "gpu-01", "address": address},
        )
        assert status == 400
        assert data["error"]["code"] == "bad_request"
        assert problem in data["error"]["message"]
        assert cp.store.list_join_tokens(include_inactive=True) == [], "no token was minted"

    run_cp(tmp_path, body)


def test_join_command_host_header_fallback_is_validated_and_addresses_are_quoted(
    tmp_path: Path,
) -> None:
    async def body(cp: ControlPlane) -> None:
        url = f"http://127.0.0.1:{cp.http_port}/api/join-tokens"
        status, data = await asyncio.to_thread(
            get, url, token=cp.admin_token, json={"node": "gpu-01"}, headers={"Host": "x;id;#"}
        )
        assert status == 400, data
        assert data["error"]["message"].startswith(
            "the request's Host header 'x;id;#' in 'x;id;#' is not a valid host name"
        )
        assert "llmgw ctl join-command --address HOST" in data["error"]["message"]
        # IPv6 with its brackets, and a port: the gateway port the node downloads from.
        status, data = await asyncio.to_thread(
            get,
            url,
            token=cp.admin_token,
            json={"node": "gpu-01", "address": "[fd00::1]:18080"},
        )
        assert status == 201, data
        assert data["enroll_url"] == f"https://[fd00::1]:{cp.enroll_port}"
        # Host header fallback: its host, the gateway's own port.
        status, data = await asyncio.to_thread(
            get,
            url,
            token=cp.admin_token,
            json={"node": "gpu-02"},
            headers={"Host": "cp-1.example.net:9999"},
        )
        assert status == 201, data
        assert data["enroll_url"] == f"https://cp-1.example.net:{cp.enroll_port}"
        # Without bundles: the plain join command, each value one shell word.
        words = shlex.split(data["command"])
        assert words == [
            f"LLMGW_JOIN_TOKEN={data['token']}",
            "llmgw",
            "agent",
            "join",
            "--node-id",
            "gpu-02",
            "--enroll-url",
            data["enroll_url"],
            "--ca-hash",
            data["ca_hash"],
        ]

    run_cp(tmp_path, body)


def test_the_printed_join_command_runs_as_one_word_per_value(tmp_path: Path) -> None:
    """What ``llmgw ctl join-command`` prints, pasted into sh with a stand-in llmgw."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "record"
    (bindir / "llmgw").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" >{shlex.quote(str(record))}\n'
        f'printf "%s" "$LLMGW_JOIN_TOKEN" >{shlex.quote(str(record))}.token\n'
    )
    (bindir / "llmgw").chmod(0o755)

    async def body(cp: ControlPlane) -> None:
        env = {
            "LLMGW_SERVER": f"http://127.0.0.1:{cp.http_port}",
            "LLMGW_TOKEN": cp.admin_token,
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        }
        out = await asyncio.to_thread(
            CliRunner().invoke,
            main,
            ["ctl", "join-command", "--rekey", "gpu-03", "--address", "[::1]"],
            env=env,
        )
        assert out.exit_code == 0, out.output
        lines = out.stdout.splitlines()
        printed["command"] = lines[lines.index("run on the node:") + 2].strip()
        printed["enroll_url"] = f"https://[::1]:{cp.enroll_port}"
        printed["ca_hash"] = cp.ca.ca_hash() if cp.ca else ""

    async def with_node(cp: ControlPlane) -> None:
        cp.store.upsert_node(
            "gpu-03", dataplane_addr="", agent_version="", inventory={}, connected=False
        )
        await body(cp)

    printed: dict[str, str] = {}
    run_cp(tmp_path, with_node)
    command = printed["command"]
    check = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    ran = subprocess.run(
        ["sh", "-c", command],
        env={"PATH": f"{bindir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 0, ran.stderr
    assert record.read_text().splitlines() == [
        "agent",
        "join",
        "--node-id",
        "gpu-03",
        "--enroll-url",
        printed["enroll_url"],
        "--ca-hash",
        printed["ca_hash"],
        "--rekey",
    ]
    assert Path(f"{record}.token").read_text().startswith("llmgwjt_")


def test_a_standby_answers_over_https_too(tmp_path: Path) -> None:
    async def body(cp: ControlPlane) -> None:
        standby = ControlPlane(cp.cfg)  # the same state directory: it waits as a standby
        await standby.start()
        try:
            assert standby.roles.role is Role.STANDBY
            ca = cp.pki_dir / pki.CA_CERT
            status, data = await asyncio.to_thread(
                get, f"https://127.0.0.1:{standby.http_port}/healthz", ca=ca
            )
            assert status == 503
            assert data["leader"] == f"https://127.0.0.1:{cp.http_port}"
        finally:
            await standby.stop()

    run_cp(tmp_path, body, tls="cluster")
