"""HTTPS on :8080 with the operator's certificate: a real TLS listener whose certificate is
replaced on disk while it runs (an ACME renewal), a broken renewal, a pair that never loaded."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509

from llmgw import pki
from llmgw.errors import CertificateError
from llmgw.pki import Identity
from llmgw.server.common.config import TLSConfig
from llmgw.server.common.tls import ServingCertificate, serving_certificate


def issue(ca: pki.Authority, directory: Path, name: str) -> Identity:
    return pki.issue_server_cert(ca, directory, hosts=["127.0.0.1", "localhost"], name=name)


def install(identity: Identity, live: Path, *, cert: bool = True, key: bool = True) -> None:
    """Put a pair where the server reads it the way certbot's deploy does: new files renamed
    over the old names."""
    live.mkdir(exist_ok=True)
    for wanted, src, dst in ((cert, identity.cert, "cert.pem"), (key, identity.key, "key.pem")):
        if wanted:
            shutil.copyfile(src, live / f".{dst}.new")
            os.replace(live / f".{dst}.new", live / dst)


def served_serial(port: int, cafile: Path, server_name: str | None) -> int:
    """Serial of the certificate a fresh connection gets (verified against ``cafile``); an
    IP address as the name sends no SNI, as curl does for https://127.0.0.1."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name or "127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serve(serving: ServingCertificate, body: Callable[[int], Awaitable[None]]) -> None:
    async def main() -> None:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=serving.context)
        await site.start()
        port = runner.addresses[0][1]
        try:
            await body(port)
        finally:
            await runner.cleanup()

    asyncio.run(main())


@pytest.fixture
def ca(tmp_path: Path) -> pki.Authority:
    return pki.init_ca(tmp_path / "ca")


def test_a_renewed_certificate_is_served_without_a_restart(
    tmp_path: Path, ca: pki.Authority
) -> None:
    first, second = issue(ca, tmp_path / "a", "one"), issue(ca, tmp_path / "b", "two")
    live = tmp_path / "live"
    install(first, live)
    serving = ServingCertificate(live / "cert.pem", live / "key.pem")
    serial_1 = pki.load_cert(first.cert).serial_number
    serial_2 = pki.load_cert(second.cert).serial_number
    cafile = tmp_path / "ca" / pki.CA_CERT

    async def body(port: int) -> None:
        for name in (None, "localhost"):  # without SNI and with it
            assert await asyncio.to_thread(served_serial, port, cafile, name) == serial_1
        install(second, live)
        for name in (None, "localhost"):
            assert await asyncio.to_thread(served_serial, port, cafile, name) == serial_2
        assert serving.reloads == 1  # loaded once, not per connection

    serve(serving, body)


def test_a_broken_renewal_keeps_the_old_pair_and_says_why(
    tmp_path: Path, ca: pki.Authority, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = issue(ca, tmp_path / "a", "one"), issue(ca, tmp_path / "b", "two")
    live = tmp_path / "live"
    install(first, live)
    serving = ServingCertificate(live / "cert.pem", live / "key.pem")
    serial_1 = pki.load_cert(first.cert).serial_number
    serial_2 = pki.load_cert(second.cert).serial_number
    cafile = tmp_path / "ca" / pki.CA_CERT
    caplog.set_level(logging.INFO, logger="llmgw.server.tls")

    async def body(port: int) -> None:
        install(second, live, key=False)  # the new certificate, the old key: no pair
        for _ in range(3):
            assert await asyncio.to_thread(served_serial, port, cafile, None) == serial_1
        refusals = [r for r in caplog.records if "cannot be loaded" in r.getMessage()]
        assert len(refusals) == 1, "logged once per change, not per connection"
        assert "still serving the previous one" in refusals[0].getMessage()
        (live / "cert.pem").unlink()  # mid-renewal: a file is missing for a moment
        assert await asyncio.to_thread(served_serial, port, cafile, None) == serial_1
        install(second, live)  # the key arrives: the pair is whole again
        assert await asyncio.to_thread(served_serial, port, cafile, None) == serial_2
        assert serving.reloads == 1

    serve(serving, body)


def test_a_pair_that_does_not_load_at_start_is_refused_naming_both_files(
    tmp_path: Path, ca: pki.Authority
) -> None:
    first, second = issue(ca, tmp_path / "a", "one"), issue(ca, tmp_path / "b", "two")
    with pytest.raises(CertificateError) as info:
        ServingCertificate(first.cert, second.key)
    message = str(info.value)
    assert f"tls: cannot load the certificate {first.cert} with the key {second.key}" in message
    assert "belong together" in message
    with pytest.raises(CertificateError) as info:
        ServingCertificate(tmp_path / "missing.pem", second.key)
    assert "No such file or directory" in str(info.value)


def test_what_tls_in_server_yaml_serves(tmp_path: Path, ca: pki.Authority) -> None:
    cluster = issue(ca, tmp_path / "pki", "server")
    own = issue(ca, tmp_path / "own", "own")
    assert serving_certificate(None, cluster) is None
    serving = serving_certificate(TLSConfig(), cluster)
    assert serving is not None and serving.cert == cluster.cert and serving.key == cluster.key
    serving = serving_certificate(TLSConfig(cert=own.cert, key=own.key), cluster)
    assert serving is not None and serving.cert == own.cert and serving.key == own.key


# --------------------------------------------------------------------------- the gRPC stream


def test_the_stream_takes_a_rotated_certificate_and_trust_without_a_restart(
    tmp_path: Path,
) -> None:
    """llmgw.server.common.tls.StreamCredentials under a real gRPC server: after a CA rotation new
    streams get the reissued certificate (which an agent trusting only the old CA accepts
    through the cross-certificate) and nodes of the new CA are accepted; after the drop, a
    node certificate of the old CA is refused."""
    import grpc

    from llmgw.netaddr import CONTROL_PLANE_NAME
    from llmgw.proto import control_pb2 as pb
    from llmgw.proto import control_pb2_grpc as pb_grpc
    from llmgw.server.fleet.stream import start_stream_server

    d = tmp_path / "cp"
    old, server_id, _ = pki.ensure_server_identity(d, hosts=["127.0.0.1"])
    old_trust = pki.cert_pem(old.cert)
    old_node = pki.issue_node_cert(old, "gpu-1", tmp_path / "old-node")

    class Echo(pb_grpc.ControlPlaneServicer):
        async def Connect(
            self, request_iterator: object, context: grpc.aio.ServicerContext
        ) -> None:
            await context.write(pb.ServerMessage(welcome=pb.Welcome()))

    async def scenario() -> list[str]:
        server, port = await start_stream_server(
            server_id, "127.0.0.1:0", Echo(), handshake_timeout=5.0
        )
        results: list[str] = []

        async def dial(trust: bytes, node: Identity) -> None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=trust,
                private_key=node.key.read_bytes(),
                certificate_chain=node.cert.read_bytes(),
            )
            options = [("grpc.ssl_target_name_override", CONTROL_PLANE_NAME)]
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options) as ch:
                try:
                    call = pb_grpc.ControlPlaneStub(ch).Connect(iter([pb.AgentMessage()]))
                    async for _msg in call:
                        results.append("ok")
                        break
                except grpc.aio.AioRpcError:
                    results.append("refused")

        try:
            await dial(old_trust, old_node)
            pki.rotate_ca(d, overlap=3600)
            new, _, _ = pki.ensure_server_identity(d, hosts=["127.0.0.1"])
            new_node = pki.issue_node_cert(new, "gpu-1", tmp_path / "new-node")
            await dial(old_trust, old_node)  # an agent on the old CA, during the overlap
            await dial(old_trust, new_node)
            await dial(pki.cert_pem(new.cert), new_node)
            pki.finish_rotation(d)
            pki.ensure_server_identity(d, hosts=["127.0.0.1"])
            await dial(pki.cert_pem(new.cert), old_node)  # the old CA is dropped
            await dial(pki.cert_pem(new.cert), new_node)
        finally:
            await server.stop(0)
        return results

    assert asyncio.run(scenario()) == ["ok", "ok", "ok", "ok", "refused", "ok"]
