"""llmgw.server.fleet.stream: the Connect stream's gRPC listener (mutual TLS), and the refusal of
an agent of a newer release than the control plane."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from cryptography import x509

from llmgw import pki
from llmgw.agent import stream as agent_stream
from llmgw.contracts.control_planes import ControlPlaneList
from llmgw.errors import ConfigError, StoreError
from llmgw.listener import ListenerLimits
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.fleet.intake import MAX_MESSAGE_BYTES
from llmgw.server.fleet.stream import (
    STREAM_OPTIONS,
    ControlPlaneService,
    NodeSession,
    start_stream_server,
    version_refusal,
)
from llmgw.server.ha.standby import Standby
from llmgw.server.store import Store

NEEDLE = "the test servicer answered"


class _Answer(pb_grpc.ControlPlaneServicer):
    async def Connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NEEDLE)


def _identities(tmp_path: Path) -> tuple[pki.Identity, pki.Identity]:
    _ca, server, client = pki.ensure_server_identity(tmp_path / "pki", hosts=["127.0.0.1"])
    return server, client


async def _connect(port: int, ident: pki.Identity, *, with_cert: bool) -> grpc.aio.AioRpcError:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ident.ca.read_bytes(),
        private_key=ident.key.read_bytes() if with_cert else None,
        certificate_chain=ident.cert.read_bytes() if with_cert else None,
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        call = pb_grpc.ControlPlaneStub(channel).Connect(iter([pb.AgentMessage()]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        return info.value


def test_serves_the_servicer_to_a_client_holding_a_certificate_of_the_ca(tmp_path: Path) -> None:
    server_id, client_id = _identities(tmp_path)

    async def scenario() -> tuple[int, grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        server, port = await start_stream_server(
            server_id, "127.0.0.1:0", _Answer(), handshake_timeout=5.0
        )
        try:
            answered = await _connect(port, client_id, with_cert=True)
            refused = await _connect(port, client_id, with_cert=False)
        finally:
            await server.stop(grace=None)
        return port, answered, refused

    port, answered, refused = asyncio.run(scenario())
    assert port > 0
    assert answered.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert answered.details() == NEEDLE
    # No client certificate: the TLS handshake fails before the servicer sees anything.
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert NEEDLE not in (refused.details() or "")


def test_a_busy_port_is_a_config_error_naming_grpc_listen(tmp_path: Path) -> None:
    server_id, _ = _identities(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"

        async def scenario() -> None:
            await start_stream_server(server_id, listen, _Answer(), handshake_timeout=5.0)

        with pytest.raises(ConfigError) as info:
            asyncio.run(scenario())
    assert info.value.key == "grpc_listen"
    assert f"cannot listen on {listen}" in str(info.value)
    assert "free the port or change grpc_listen" in str(info.value)


# ------------------------------------------------------ an agent newer than the control plane


@pytest.mark.parametrize(
    ("agent", "server", "refused"),
    [
        ("0.1.1", "0.1.0", True),
        ("0.2.0rc1", "0.1.9", True),
        ("0.2.0.dev1", "0.1.9", True),
        ("0.1.0", "0.1.0", False),
        ("0.1.0+local", "0.1.0", False),
        ("0.1.0", "0.1.0.dev3", False),  # a control plane built from a checkout of 0.1.0
        ("0.0.9", "0.1.0", False),  # older agents are let in ('ctl nodes' warns past N-2)
        ("", "0.1.0", False),  # no version to judge
    ],
)
def test_version_refusal(agent: str, server: str, refused: bool) -> None:
    message = version_refusal(agent, server)
    assert (message is not None) is refused
    if message is not None:
        assert message == (
            f"this agent is llmgw {agent}, newer than the control plane's llmgw {server}; "
            f"upgrade the control plane to {agent} or later first (control plane first, then "
            "agents), or reinstall this node with the control plane's bundle; the agent keeps "
            "retrying meanwhile"
        )


@dataclass
class _Sessions:
    """The session life cycle, recording what the stream asked of it."""

    opened: list[str] = field(default_factory=list)

    def refusal(self, node_id: str, cert: x509.Certificate | None) -> str | None:
        return None

    def open(self, hello: pb.Hello, peer: str, cert: x509.Certificate) -> NodeSession:
        self.opened.append(hello.agent_version)
        return NodeSession(node_id=hello.node_id, dataplane_addr="", epoch=1, engines=frozenset())

    def node_state(self, node_id: str) -> str:
        return "approved"

    def after_hello(self, session: NodeSession, hello: pb.Hello) -> None:
        session.close()  # the Welcome was written: end the stream

    def close(self, session: NodeSession) -> None: ...


class _Updates:
    def on_connect(self, session: NodeSession) -> None: ...


@dataclass
class _Events:
    seen: list[tuple[str, str, str]] = field(default_factory=list)

    def add_event(self, kind: str, subject: str, message: str) -> None:
        self.seen.append((kind, subject, message))


def _stream(
    tmp_path: Path,
    agent_version: str,
    server_version: str,
    control_planes: Callable[[], ControlPlaneList] = lambda: ControlPlaneList(()),
) -> tuple[list[pb.ServerMessage], grpc.aio.AioRpcError | None, _Sessions, _Events]:
    ca, server_id, _ = pki.ensure_server_identity(tmp_path / "pki", hosts=["127.0.0.1"])
    node = pki.issue_node_cert(ca, "gpu-1", tmp_path / "node")
    sessions, events = _Sessions(), _Events()
    service = ControlPlaneService(
        cast(Store, events),
        sessions,
        _Updates(),
        messages={},
        cluster_id="c1",
        epoch=1,
        heartbeat_interval=1.0,
        cert_lifetime=3600.0,
        server_version=server_version,
        control_planes=control_planes,
    )
    hello = pb.Hello(node_id="gpu-1", agent_version=agent_version, dataplane_addr="10.0.0.1:9443")

    async def scenario() -> tuple[list[pb.ServerMessage], grpc.aio.AioRpcError | None]:
        server, port = await start_stream_server(
            server_id, "127.0.0.1:0", service, handshake_timeout=5.0
        )
        got: list[pb.ServerMessage] = []
        creds = grpc.ssl_channel_credentials(
            root_certificates=node.ca.read_bytes(),
            private_key=node.key.read_bytes(),
            certificate_chain=node.cert.read_bytes(),
        )
        try:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                call = pb_grpc.ControlPlaneStub(channel).Connect(
                    iter([pb.AgentMessage(hello=hello)]), timeout=10
                )
                try:
                    async for msg in call:
                        got.append(msg)
                except grpc.aio.AioRpcError as exc:
                    return got, exc
        finally:
            await server.stop(grace=None)
        return got, None

    got, error = asyncio.run(scenario())
    return got, error, sessions, events.seen


def test_the_stream_of_an_agent_newer_than_the_control_plane_is_refused(tmp_path: Path) -> None:
    got, error, sessions, events = _stream(tmp_path, "0.2.0", "0.1.0")
    assert got == []
    assert error is not None and error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == version_refusal("0.2.0", "0.1.0")
    assert sessions.opened == []  # never admitted: the store is not told of a newer agent
    assert events == [("stream_refused", "gpu-1", version_refusal("0.2.0", "0.1.0"))]


def test_an_agent_of_the_control_planes_release_is_welcomed_with_its_version(
    tmp_path: Path,
) -> None:
    got, error, sessions, events = _stream(tmp_path, "0.1.0+local", "0.1.0")
    assert error is None
    assert [m.WhichOneof("msg") for m in got] == ["welcome"]
    assert got[0].welcome.server_version == "0.1.0"
    assert sessions.opened == ["0.1.0+local"]
    assert events == []


# ------------------------------------------------------------------- the list of control planes

PLANES = ["cp-1.example:7443", "10.0.0.2:7443", "[fd00::3]:7443"]


def test_the_list_of_control_planes_follows_the_welcome(tmp_path: Path) -> None:
    planes = ControlPlaneList(tuple(PLANES), ("1f", "ab12"))
    got, error, _, _ = _stream(tmp_path, "0.1.0", "0.1.0", lambda: planes)
    assert error is None
    assert [m.WhichOneof("msg") for m in got] == ["welcome", "control_planes"]
    assert list(got[1].control_planes.servers) == PLANES
    assert list(got[1].control_planes.retired_serials) == ["1f", "ab12"]


def _unavailable() -> ControlPlaneList:
    raise StoreError("the database is unreachable; it comes back by itself")


@pytest.mark.parametrize(
    ("planes", "warning"),
    [
        (lambda: ControlPlaneList(()), None),  # nothing to say: nothing sent
        (
            lambda: ControlPlaneList(("cp-1.example:7443", "0.0.0.0:7443")),
            "not sending agents the list of control planes: they would refuse it",
        ),
        (
            lambda: ControlPlaneList(("cp-1.example:7443",), ("A" * 41,)),
            "not sending agents the list of control planes: they would refuse it",
        ),
        (_unavailable, "cannot list the control planes for an agent"),
    ],
)
def test_no_list_is_sent_when_there_is_none_the_agents_would_take(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    planes: Callable[[], ControlPlaneList],
    warning: str | None,
) -> None:
    """An empty list, one the agents would refuse, or none to be had: the Welcome alone,
    and the stream is not ended for it."""
    with caplog.at_level(logging.WARNING, logger="llmgw.server.stream"):
        got, error, sessions, _ = _stream(tmp_path, "0.1.0", "0.1.0", planes)
    assert error is None
    assert [m.WhichOneof("msg") for m in got] == ["welcome"]
    assert sessions.opened == ["0.1.0"]
    said = [r.getMessage() for r in caplog.records if r.name == "llmgw.server.stream"]
    assert said == ([warning] if warning else [])


def test_a_session_sends_a_list_only_when_it_names_one() -> None:
    session = NodeSession(node_id="gpu-1", dataplane_addr="", epoch=1, engines=frozenset())
    assert not session.send_control_planes(None)
    assert not session.send_control_planes(ControlPlaneList((), ("ab",)))
    assert session.queue.empty()
    assert session.send_control_planes(ControlPlaneList(("cp-1.example:7443",), ("ab",)))
    msg = session.queue.get_nowait()
    assert msg is not None and list(msg.control_planes.servers) == ["cp-1.example:7443"]
    assert list(msg.control_planes.retired_serials) == ["ab"]


# ------------------------------------------------------- keep-alive: every role takes the pings


def test_a_standby_takes_the_agents_pings_as_the_leader_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents ping every control plane they dial (with or without a call); a server
    that allows pings less often, or none without a call (gRPC's defaults: 5 min, none),
    answers GOAWAY too_many_pings. The standby's stream server gets the leader's options."""
    server_id, _ = _identities(tmp_path)
    started: list[dict[str, Any]] = []
    real = grpc.aio.server

    def spy(*args: Any, options: Any = (), **kwargs: Any) -> grpc.aio.Server:
        started.append(dict(options))
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", spy)

    async def scenario() -> None:
        standby = Standby(
            server_id,
            state_dir=tmp_path,
            grpc_listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            tls=None,
            listeners=ListenerLimits(),
            leader=lambda: ("", ""),
        )
        await standby.start(serve_http=False)
        await standby.stop()

    asyncio.run(scenario())
    [options] = started
    agent = dict(agent_stream._CHANNEL_OPTIONS)
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert agent["grpc.keepalive_permit_without_calls"] == 1
    # Half the agents' interval at most: a ping a little early is no strike.
    assert (
        2 * options["grpc.http2.min_ping_interval_without_data_ms"]
        <= agent["grpc.keepalive_time_ms"]
    )
    assert options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    for key, value in STREAM_OPTIONS:
        assert options[key] == value
