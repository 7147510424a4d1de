"""llmgw.server.stream.start_stream_server: the Connect stream's gRPC listener, mutual TLS."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmgw import pki
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.stream import start_stream_server

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
