""":7443 (the agents' gRPC stream) against hostile input, on a real ``llmgw up``: bytes that are
not an AgentMessage, from a peer holding a valid node certificate, end the stream with
INVALID_ARGUMENT, one log line, no traceback, and no Python class name sent to the peer;
what is not TLS, or not HTTP/2, is closed."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmgw import pki
from llmgw.proto import control_pb2 as pb
from tests.integration.hostile.cluster import Cluster, assert_still_healthy, seconds_until_closed

pytestmark = pytest.mark.integration

CONNECT = "/llmgw.v1.ControlPlane/Connect"
NEEDLE = "refused a stream: a message on it is not an llmgw AgentMessage"
# What the peer must never see: Python's class names or the words of a traceback.
LEAKS = ("<class", "DecodeError", "Traceback", "Exception", "Error parsing")


def _channel(up: Cluster, ident: pki.Identity) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ident.ca.read_bytes(),
        private_key=ident.key.read_bytes(),
        certificate_chain=ident.cert.read_bytes(),
    )
    return grpc.secure_channel(f"127.0.0.1:{up.grpc_port}", creds)


@pytest.fixture(scope="module")
def node_identity(up: Cluster, tmp_path_factory: pytest.TempPathFactory) -> pki.Identity:
    """A genuine node certificate of this cluster: the hostile peer got past mTLS."""
    out = tmp_path_factory.mktemp("hostile-node")
    ident = pki.issue_node_cert(pki.load_ca(up.pki_dir), "hostile-1", out)
    return ident


def _send(up: Cluster, ident: pki.Identity, messages: list[bytes]) -> grpc.RpcError:
    with _channel(up, ident) as channel:
        call = channel.stream_stream(CONNECT)  # no serializers: the bytes go out as given

        def requests() -> Iterator[bytes]:
            yield from messages
            time.sleep(2)  # keep the stream open: the server ends it, not us

        with pytest.raises(grpc.RpcError) as info:
            for _answer in call(requests(), timeout=20):
                pass
        return info.value


@pytest.mark.parametrize(
    "first",
    [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x08" + b"\xff" * 11, b"garbage" * 100],
    ids=["ff", "truncated-field", "bad-varint", "text"],
)
def test_garbage_as_the_first_message_is_invalid_argument_without_a_traceback(
    up: Cluster, node_identity: pki.Identity, first: bytes
) -> None:
    before = up.log_count(NEEDLE)
    error = _send(up, node_identity, [first])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    details = error.details() or ""
    assert "not an llmgw AgentMessage" in details
    assert not [leak for leak in LEAKS if leak in details], details
    assert up.log_count(NEEDLE, at_least=before + 1) == before + 1  # one line in the log
    assert "Traceback" not in up.logs()


def test_garbage_after_a_hello_ends_the_stream_the_same_way(
    up: Cluster, node_identity: pki.Identity
) -> None:
    hello = pb.AgentMessage(
        hello=pb.Hello(node_id="hostile-1", agent_version="0", dataplane_addr="127.0.0.1:1")
    ).SerializeToString()
    before = up.log_count(NEEDLE)
    error = _send(up, node_identity, [hello, b"\xff\xff\xff"])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    details = error.details() or ""
    assert not [leak for leak in LEAKS if leak in details], details
    assert up.log_count(NEEDLE, at_least=before + 1) == before + 1
    assert "Traceback" not in up.logs()


def test_a_wrong_first_message_and_a_foreign_node_id_are_refused_by_name(
    up: Cluster, node_identity: pki.Identity
) -> None:
    heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat()).SerializeToString()
    wrong = _send(up, node_identity, [heartbeat])
    assert wrong.code() == grpc.StatusCode.FAILED_PRECONDITION, wrong
    claim = pb.AgentMessage(hello=pb.Hello(node_id="local")).SerializeToString()
    foreign = _send(up, node_identity, [claim])
    assert foreign.code() == grpc.StatusCode.PERMISSION_DENIED, foreign
    for error in (wrong, foreign):
        assert not [leak for leak in LEAKS if leak in (error.details() or "")]


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: t\r\n\r\n",
        b"\x00" * 64,
        b"\x16\x03\x01\x00\x05hello",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
)
def test_what_is_not_tls_is_closed(up: Cluster, data: bytes) -> None:
    # Closed well before grpc's own two-minute handshake default.
    assert seconds_until_closed(up.grpc_port, data, timeout=20) < 15


def test_tls_without_a_client_certificate_is_refused(up: Cluster, tmp_path: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(up.pki_dir / "ca.crt"))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", up.grpc_port), timeout=20) as raw,
        pytest.raises((ssl.SSLError, ConnectionError)),
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        if not tls.recv(4096):
            raise ConnectionError("closed")


def test_zz_still_healthy_without_tracebacks(up: Cluster) -> None:
    assert_still_healthy(up)
