""":8443 (enrolment) against hostile input, on a real ``llmgw up``: malformed HTTP inside TLS,
bodies that are not JSON or nested too deep, what is not TLS at all; every answer a 4xx JSON
error with one log line, never a 5xx or a traceback. (The enrolment request's fields are
fuzzed in tests/unit/server/test_enroll.py.)"""

from __future__ import annotations

import json
import ssl

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.hostile.cluster import (
    Cluster,
    assert_still_healthy,
    json_error,
    raw_exchange,
    seconds_until_closed,
)

pytestmark = pytest.mark.integration


def _tls(up: Cluster) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(up.pki_dir / "ca.crt"))


def _send(up: Cluster, data: bytes) -> tuple[int, bytes]:
    status, _headers, body = raw_exchange(up.enroll_port, data, tls=_tls(up))
    return status, body


def _post(up: Cluster, body: bytes, path: str = "/enroll") -> tuple[int, bytes]:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return _send(up, head + body)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"[" * 5000 + b"]" * 5000, "bad_json"),
        (b'{"token": "\xff\xfe"}', "bad_json"),
        (b'{"token": "\\ud800", "node_id": "a", "csr": "x"}', None),
        (b"null", "bad_request"),
        (b'{"token": 1, "node_id": [], "csr": {}}', "bad_request"),
        (b"x" * 70_000, "body_too_large"),
        (b"", "bad_json"),
    ],
    ids=["deep", "not-utf8", "lone-surrogate", "null", "wrong-types", "too-large", "empty"],
)
def test_bad_enrolment_bodies_are_4xx_json_with_one_log_line(
    up: Cluster, body: bytes, code: str | None
) -> None:
    before = up.log_count("enrolment refused")
    status, payload = _post(up, body)
    assert 400 <= status < 500, payload
    error = json_error(payload)
    if code is not None:
        assert error["code"] == code, error
    assert up.log_count("enrolment refused", at_least=before + 1) == before + 1


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /enroll HTTP/1.1\r\nHost t\r\n\r\n",
        b"POST /enroll HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n",
        b"GET /enroll/" + b"a" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        b"POST /enroll HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n\r\n",
    ],
)
def test_malformed_http_inside_tls_is_a_json_400(up: Cluster, data: bytes) -> None:
    status, body = _send(up, data)
    assert status == 400, body
    assert json_error(body)["code"] == "bad_http_request"


def test_unknown_paths_and_methods_are_json_errors(up: Cluster) -> None:
    for head, expected in (
        (b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404),
        (b"DELETE /enroll HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 405),
        (b"GET /enroll/../../etc/passwd HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404),
    ):
        status, body = _send(up, head)
        assert status == expected, body
        json_error(body)


@pytest.mark.parametrize(
    "data",
    [b"GET /enroll/ca HTTP/1.1\r\nHost: t\r\n\r\n", b"\x16\x03\x01\x00\x05hello", b"\x00" * 32],
)
def test_what_is_not_tls_is_closed_quickly(up: Cluster, data: bytes) -> None:
    assert seconds_until_closed(up.enroll_port, data) < 15  # the 10 s handshake timeout at most


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD"]) | st.binary(min_size=1, max_size=8),
    target=st.sampled_from([b"/enroll", b"/enroll/ca", b"/"]) | st.binary(max_size=30),
    headers=st.lists(
        st.tuples(st.binary(min_size=1, max_size=12), st.binary(max_size=40)), max_size=3
    ),
    body=st.binary(max_size=300),
)
def test_fuzz_raw_requests_inside_tls(
    up: Cluster, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    head = method + b" " + target + b" HTTP/1.1\r\nHost: t\r\n"
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    status, _headers, payload = raw_exchange(
        up.enroll_port, head + body, tls=_tls(up), method="HEAD" if method == b"HEAD" else None
    )
    assert status < 500, (head[:200], status, payload[:300])
    if status >= 400 and method != b"HEAD":
        json_error(payload)


def test_zz_still_healthy_without_tracebacks(up: Cluster) -> None:
    assert_still_healthy(up)
    # Nothing above enrolled anything.
    status, body = up.request("GET", "/api/nodes", admin=True)
    assert status == 200 and [n["id"] for n in json.loads(body)] == ["local"], body
