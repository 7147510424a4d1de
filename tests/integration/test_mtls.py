"""mTLS end to end: the control plane's gRPC stream (:7443) and an agent's data plane (:9443).

Real processes, real certificates, real sockets. One control plane serves the whole module;
each test starts (and always stops) its own agents.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw import pki
from tests.integration.harness import (
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

WAIT = 30.0  # every wait is bounded well under a minute

# What a peer that refuses a client certificate can do to us: fail the handshake with an
# alert, or (TLS 1.3, where the client finishes first) send the alert or close on first read.
REFUSED = (ssl.SSLError, ConnectionError)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("mtls-server"))
    try:
        yield srv
    finally:
        stop_process(srv.proc)


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents a test started; stopped afterwards whatever happened."""
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            if agent.proc is not None:
                stop_process(agent.proc)


def _run(agent: Agent, agents: list[Agent]) -> Agent:
    agents.append(agent)
    return start_agent(agent)


@pytest.fixture(scope="module")
def rogue_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second CA that has nothing to do with the cluster."""
    d = tmp_path_factory.mktemp("rogue") / "ca"
    pki.init_ca(d)
    return d


# --------------------------------------------------------------------------- helpers


def _log_lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def _reconnects(agent: Agent) -> list[str]:
    return _log_lines(agent.log(), "control plane stream ended; reconnecting")


def _assert_alive(agent: Agent) -> None:
    assert agent.proc is not None
    assert agent.proc.poll() is None, f"agent exited with {agent.proc.returncode}:\n{agent.log()}"


def _node_ids(server: Server) -> set[str]:
    return {n["id"] for n in server.nodes()}


def _client_context(
    ca: Path, cert: tuple[Path, Path] | None, *, alpn: list[str] | None = None
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def _grpc_port_answers(server: Server, cert: tuple[Path, Path] | None) -> bytes:
    """TLS to the control plane's gRPC port, send the HTTP/2 preface, return what comes back.

    A refused client certificate shows as an exception from REFUSED or as b"" (closed)."""
    ctx = _client_context(server.pki_dir / "ca.crt", cert, alpn=["h2"])
    with (
        socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(H2_PREFACE + H2_EMPTY_SETTINGS)
        return tls.recv(4096)


def _grpc_port_refuses(server: Server, cert: tuple[Path, Path] | None) -> str:
    try:
        data = _grpc_port_answers(server, cert)
    except REFUSED as exc:
        return f"{type(exc).__name__}: {exc}"
    assert data == b"", f"the gRPC port answered a refused client: {data!r}"
    return "closed"


def _dataplane_get(
    agent: Agent, server: Server, path: str, cert: tuple[Path, Path] | None
) -> tuple[int, bytes]:
    """GET ``path`` on the agent's data plane, verifying its certificate as the node id."""
    ctx = _client_context(server.pki_dir / "ca.crt", cert)
    with (
        socket.create_connection(("127.0.0.1", agent.dataplane_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=agent.node_id) as tls,
    ):
        conn = http.client.HTTPConnection("127.0.0.1", agent.dataplane_port, timeout=10)
        conn.sock = tls  # already connected and verified against the node id
        try:
            conn.request("GET", path, headers={"Host": agent.node_id})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.sock = None


# --------------------------------------------------------------------------- the stream (:7443)


def test_stream_refused_when_hello_node_id_differs_from_certificate_cn(
    server: Server, agents: list[Agent], tmp_path: Path
) -> None:
    agent = _run(make_agent(tmp_path, server, "node-a", cert_node_id="node-b"), agents)

    refused = wait_for(
        lambda: [
            line
            for line in _log_lines(server.log(), "refused a stream")
            if "claimed=node-a" in line and "cert_cn=node-b" in line
        ],
        timeout=WAIT,
        what="the server's 'refused a stream' line for node-a/node-b",
    )
    assert "level=warning" in refused[0]

    reasons = wait_for(
        lambda: [
            line
            for line in _reconnects(agent)
            if "refused by" in line and "node-a" in line and "node-b" in line
        ],
        timeout=WAIT,
        what="the agent's reconnect line with the PERMISSION_DENIED details",
    )
    assert "stream claims node id 'node-a'" in reasons[0], reasons[0]
    assert "certificate is for 'node-b'" in reasons[0], reasons[0]

    # Let it retry at least once more, then check it never got in under either name.
    wait_for(lambda: len(_reconnects(agent)) >= 2, timeout=WAIT, what="a second refusal")
    _assert_alive(agent)
    assert "connected to the control plane" not in agent.log()
    nodes = server.nodes()
    assert not [n for n in nodes if n["id"] in ("node-a", "node-b")], nodes
    assert "node connected" not in "\n".join(
        line for line in server.log().splitlines() if "node-a" in line or "node-b" in line
    )

    events = server.api("GET", "/api/events?limit=1000")
    mine = [e for e in events if e["kind"] == "stream_refused" and e["subject"] == "node-a"]
    assert mine, events
    assert "node-b" in mine[0]["message"], mine[0]
    assert not [e for e in events if e["kind"] == "node_connected" and e["subject"] == "node-a"]


def _start_rogue_agent(
    server: Server, agents: list[Agent], tmp_path: Path, rogue_ca: Path
) -> tuple[Agent, list[str]]:
    """An agent whose certificate comes from another CA (it still trusts our server's CA),
    left to fail at least twice; returns it and its reconnect lines."""
    agent = _run(make_agent(tmp_path, server, "node-rogue", ca_dir=rogue_ca), agents)
    lines = wait_for(
        lambda: _reconnects(agent) if len(_reconnects(agent)) >= 2 else None,
        timeout=WAIT,
        what="two reconnect attempts of the rogue agent",
    )
    return agent, lines


def test_stream_refuses_certificate_from_another_ca(
    server: Server, agents: list[Agent], tmp_path: Path, rogue_ca: Path
) -> None:
    agent, lines = _start_rogue_agent(server, agents, tmp_path, rogue_ca)
    _assert_alive(agent)
    assert "connected to the control plane" not in agent.log()
    assert "node-rogue" not in _node_ids(server)
    # Refused at the TLS layer: the stream never got as far as a Hello the server could read.
    assert not _log_lines(server.log(), "claimed=node-rogue")
    events = server.api("GET", "/api/events?limit=1000")
    assert not [e for e in events if e["subject"] == "node-rogue"], events
    # The agent is told nothing by a PERMISSION_DENIED: the server never answered an RPC.
    assert not [line for line in lines if "refused by" in line], "\n".join(lines)


def test_agent_says_why_a_certificate_from_another_ca_fails(
    server: Server, agents: list[Agent], tmp_path: Path, rogue_ca: Path
) -> None:
    _agent, lines = _start_rogue_agent(server, agents, tmp_path, rogue_ca)
    # Every attempt says why: a TLS/handshake/certificate failure, not "is it running?".
    why = re.compile(r"tls|ssl|handshake|certificate", re.IGNORECASE)
    assert all(why.search(line) for line in lines), "\n".join(lines)
    assert not [line for line in lines if "is the control plane running" in line]


def test_grpc_port_requires_a_client_certificate_from_the_cluster_ca(
    server: Server, tmp_path: Path, rogue_ca: Path
) -> None:
    ca = pki.load_ca(server.pki_dir)
    good = pki.issue_node_cert(ca, "node-direct", tmp_path / "good")
    rogue = pki.issue_node_cert(pki.load_ca(rogue_ca), "node-direct", tmp_path / "rogue")

    # Control: a cluster certificate gets through TLS and the server speaks HTTP/2 (SETTINGS).
    answer = _grpc_port_answers(server, (good.cert, good.key))
    assert len(answer) >= 9 and answer[3] == 0x04, answer

    assert _grpc_port_refuses(server, (rogue.cert, rogue.key))
    assert _grpc_port_refuses(server, None)


# --------------------------------------------------------------------------- the data plane (:9443)


def test_dataplane_accepts_only_the_control_plane_certificate(
    server: Server, agents: list[Agent], tmp_path: Path, rogue_ca: Path
) -> None:
    agent = _run(make_agent(tmp_path, server, "node-dp"), agents)
    wait_for(
        lambda: any(n["id"] == "node-dp" and n["connected"] for n in server.nodes()),
        timeout=WAIT,
        what="node-dp connected",
    )
    server.approve_pending(1)
    server.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 1})
    ready = wait_for(
        lambda: [r for r in server.replicas("m") if r["state"] == "ready"],
        timeout=WAIT,
        what="a ready replica of m",
    )
    assert ready[0]["node"] == "node-dp", ready
    path = f"/s/{ready[0]['shard']}/v1/models"

    # a. the control plane's own client certificate
    status, body = _dataplane_get(
        agent, server, path, (server.pki_dir / "client.crt", server.pki_dir / "client.key")
    )
    assert status == 200, body
    assert "data" in json.loads(body), body

    # b. another node's certificate from the same CA: TLS passes, the data plane says 403
    other = pki.issue_node_cert(pki.load_ca(server.pki_dir), "node-x", tmp_path / "x")
    status, body = _dataplane_get(agent, server, path, (other.cert, other.key))
    assert status == 403, body
    error = json.loads(body)["error"]
    assert error["code"] == "forbidden", error
    assert "control plane" in error["message"], error
    wait_for(
        lambda: _log_lines(agent.log(), "refused a data-plane request"),
        timeout=WAIT,
        what="the agent's log line about the refused data-plane request",
    )

    # c. a certificate from another CA, even one with the control plane's CN: handshake fails
    rogue = pki.issue_control_plane_client_cert(pki.load_ca(rogue_ca), tmp_path / "r")
    with pytest.raises(REFUSED):
        _dataplane_get(agent, server, path, (rogue.cert, rogue.key))

    # d. no client certificate at all
    with pytest.raises(REFUSED):
        _dataplane_get(agent, server, path, None)

    # The refusals did not hurt the data plane: the control plane's certificate still works.
    status, _ = _dataplane_get(
        agent, server, path, (server.pki_dir / "client.crt", server.pki_dir / "client.key")
    )
    assert status == 200
    _assert_alive(agent)
