"""The data plane (:9443) serves only the control plane's client certificate: one that carries
the control plane's extended key usage, not merely a name, and is not a retired instance's.
Real listener, real TLS."""

from __future__ import annotations

import asyncio
import datetime as dt
import http.client
import json
import logging
import ssl
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw import pki
from llmgw.agent.dataplane import DataPlane, server_ssl_context
from llmgw.pki import issue

pytestmark = pytest.mark.usefixtures("each_loop")

Answer = tuple[int, dict[str, object]]
_CLIENT_FILES = ("client.crt", "client.key", "ca.crt")  # the control plane's, in its pki dir


def _get(
    port: int,
    client: pki.Identity,
    requests: int = 1,
    between: Callable[[], None] = lambda: None,
) -> list[Answer]:
    ctx = ssl.create_default_context(cafile=str(client.ca))
    ctx.load_cert_chain(client.cert, client.key)
    ctx.check_hostname = False  # what is under test is the data plane's view of its client
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    answers = []
    try:
        for _ in range(requests):  # one connection, several requests
            conn.request("GET", "/s/shard-1/v1/models")
            response = conn.getresponse()
            answers.append((response.status, json.loads(response.read())))
            between()
    finally:
        conn.close()
    return answers


def _serve_and_ask(
    agent: pki.Identity,
    client: pki.Identity,
    requests: int = 1,
    *,
    retired: Collection[str] = (),
    between: Callable[[], None] = lambda: None,
) -> list[Answer]:
    async def main() -> list[Answer]:
        # No shard is ready: the control plane gets 503 shard_not_ready, anyone else 403.
        plane = DataPlane(
            "127.0.0.1:0",
            server_ssl_context(agent.cert, agent.key, agent.ca),
            lambda s: None,
            retired=lambda serial: serial in retired,
        )
        await plane.start()
        try:
            return await asyncio.to_thread(_get, plane.bound_port, client, requests, between)
        finally:
            await plane.stop()

    return asyncio.run(main())


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[pki.Authority, pki.Identity]:
    ca, _, _ = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp.example"])
    return ca, pki.issue_node_cert(ca, "gpu-1", tmp_path / "agent")


def test_the_control_plane_client_certificate_is_served(
    cluster: tuple[pki.Authority, pki.Identity], tmp_path: Path
) -> None:
    ca, agent = cluster
    (answer,) = _serve_and_ask(agent, pki.Identity(*(ca.directory / f for f in _CLIENT_FILES)))
    assert answer[0] == 503 and answer[1]["error"]["code"] == "shard_not_ready"  # type: ignore[index]


def test_a_node_named_like_the_control_plane_is_refused(
    cluster: tuple[pki.Authority, pki.Identity],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ca, agent = cluster
    impostor = pki.issue_node_cert(ca, "cp.example", tmp_path / "impostor")
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.dataplane"):
        answers = _serve_and_ask(agent, impostor, requests=3)
    for status, body in answers:
        assert status == 403
        assert body["error"]["code"] == "forbidden"  # type: ignore[index]
    refusals = [r for r in caplog.records if r.name == "llmgw.agent.dataplane"]
    assert len(refusals) == 1, "one line per connection, not per request"
    reason = refusals[0].fields["reason"]  # type: ignore[attr-defined]
    assert "CN=cp.example" in reason and pki.CONTROL_PLANE_OID.dotted_string in reason


def test_the_control_plane_name_without_the_oid_is_refused(
    cluster: tuple[pki.Authority, pki.Identity], tmp_path: Path
) -> None:
    """A certificate is not the control plane's because of its common name: this one has the
    control plane's CN and clientAuth, as certificates did before the OID (and as any mistaken
    issuance might), and is refused until the control plane's restart reissues it."""
    ca, agent = cluster
    key = pki.new_private_key()
    cert = issue._leaf(
        ca,
        key.public_key(),
        common_name=pki.CONTROL_PLANE_CN,
        sans=[],
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime=dt.timedelta(days=30),
    )
    (tmp_path / "named").mkdir()
    named = issue._write_identity(ca, tmp_path / "named", "client", key, cert)
    ((status, body),) = _serve_and_ask(agent, named)
    assert status == 403, body
    assert body["error"]["code"] == "forbidden"  # type: ignore[index]


# ------------------------------------------------------------------ retired instances


def _serial(identity: pki.Identity) -> str:
    return pki.serial_hex(pki.load_cert(identity.cert))


def test_a_retired_instances_certificate_is_refused_and_a_current_one_served(
    cluster: tuple[pki.Authority, pki.Identity],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two instances' client certificates of one CA, both with the control plane's usage:
    the retired one's serial is refused on every request (one line per connection, naming
    the serial), the other's served."""
    ca, agent = cluster
    retired = pki.Identity(*(ca.directory / f for f in _CLIENT_FILES))
    current = pki.issue_control_plane_client_cert(ca, tmp_path / "cp2")
    gone = {_serial(retired)}
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.dataplane"):
        refused = _serve_and_ask(agent, retired, requests=3, retired=gone)
        served = _serve_and_ask(agent, current, requests=2, retired=gone)
    for status, body in refused:
        assert status == 403
        error = body["error"]
        assert error["code"] == "forbidden"  # type: ignore[index]
        assert error["message"] == (  # type: ignore[index]
            f"this certificate (serial {_serial(retired)}) is a retired control-plane "
            "instance's; only current instances may use the data plane"
        )
    assert [status for status, _ in served] == [503, 503]  # shard_not_ready: it got through
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.agent.dataplane"]
    assert lines == [
        f"refused a data-plane request from a retired control-plane instance's certificate "
        f"(serial {_serial(retired)}); only current instances are served"
    ]


def test_an_open_connection_is_refused_once_its_instance_is_retired(
    cluster: tuple[pki.Authority, pki.Identity],
) -> None:
    ca, agent = cluster
    client = pki.Identity(*(ca.directory / f for f in _CLIENT_FILES))
    gone: set[str] = set()
    answers = _serve_and_ask(
        agent, client, requests=2, retired=gone, between=lambda: gone.add(_serial(client))
    )
    assert [status for status, _ in answers] == [503, 403]
