""":9443 (the agent's data plane) against hostile input, on a real ``llmgw up``: even a peer
holding the control plane's own certificate that sends malformed HTTP, unknown shards or
bodies the engine cannot parse gets a 4xx, and the agent logs no traceback; peers without
that certificate do not get past TLS or get 403."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest

from llmgw import pki
from tests.integration.hostile.cluster import (
    Cluster,
    assert_still_healthy,
    raw_exchange,
    seconds_until_closed,
)

pytestmark = pytest.mark.integration


def _ctx(up: Cluster, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(up.pki_dir / "ca.crt"))
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def _control_plane(up: Cluster) -> ssl.SSLContext:
    return _ctx(up, (up.pki_dir / "client.crt", up.pki_dir / "client.key"))


def _send(up: Cluster, data: bytes, ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    status, _headers, body = raw_exchange(
        up.agent_port, data, tls=ctx or _control_plane(up), server_hostname="local"
    )
    return status, body


def _shard(up: Cluster) -> str:
    status, body = up.request("GET", "/api/replicas?model=llmgw-sim", admin=True)
    assert status == 200, body
    ready = [r for r in json.loads(body) if r["state"] == "ready"]
    assert ready, body
    return str(ready[0]["shard"])


def _post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: local\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /s/x/v1/completions HTTP/1.1\r\nHost t\r\n\r\n",
        b"GET /s/" + b"a" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        b"POST /s/x/v1 HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ],
)
def test_malformed_http_from_the_control_plane_certificate_is_400(up: Cluster, data: bytes) -> None:
    status, body = _send(up, data)
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "bad_http_request"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"model": "llmgw-sim", "messages": "\xff\xfe"}',
        b'{"model": "llmgw-sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "llmgw-sim", "max_tokens": 1e999}',
        b"not json",
    ],
    ids=["deep", "not-utf8", "lone-surrogate", "huge-number", "not-json"],
)
def test_bodies_the_engine_cannot_take_are_4xx(up: Cluster, body: bytes) -> None:
    shard = _shard(up)
    status, payload = _send(up, _post(f"/s/{shard}/v1/chat/completions", body))
    # Relayed unchanged to the engine (sim), which refuses what it cannot parse; a lone
    # surrogate is text it may answer.
    assert status < 500, payload
    if b"ud800" not in body:
        assert 400 <= status < 500, payload


def test_unknown_shards_and_paths_are_refused(up: Cluster) -> None:
    status, body = _send(up, _post("/s/no-such-shard/v1/completions", b"{}"))
    assert status == 503 and json.loads(body)["error"]["code"] == "shard_not_ready", body
    for path in ("/", "/s", "/metrics", "/etc/passwd"):
        status, body = _send(up, f"GET {path} HTTP/1.1\r\nHost: local\r\n\r\n".encode())
        assert 400 <= status < 500, (path, body)
    # A traversal is only a shard id that does not exist (503: another replica may take it).
    status, body = _send(up, b"GET /s/../../etc/passwd HTTP/1.1\r\nHost: local\r\n\r\n")
    assert status == 503 and b"root:" not in body, body


def test_other_certificates_are_refused(up: Cluster, tmp_path: Path) -> None:
    node = pki.issue_node_cert(pki.load_ca(up.pki_dir), "intruder", tmp_path / "n")
    status, body = _send(
        up, _post(f"/s/{_shard(up)}/v1/completions", b"{}"), _ctx(up, (node.cert, node.key))
    )
    assert status == 403, body
    # Without a client certificate TLS fails (TLS 1.3: at the first read) or closes.
    try:
        status, _ = _send(up, b"GET / HTTP/1.1\r\nHost: local\r\n\r\n", _ctx(up, None))
    except (ssl.SSLError, ConnectionError):
        status = 0
    assert status == 0


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x05hello"])
def test_what_is_not_tls_is_closed_quickly(up: Cluster, data: bytes) -> None:
    assert seconds_until_closed(up.agent_port, data) < 15


def test_zz_still_healthy_without_tracebacks(up: Cluster) -> None:
    assert_still_healthy(up)
    assert "Traceback" not in (up.state_dir / "logs" / "agent.log").read_text(errors="replace")
