""":8080 (gateway /v1, admin API /api, bundles, /healthz) against hostile input, on a real
``llmgw up``: every answer a 4xx JSON error (never a 5xx), one log line, no traceback;
Hypothesis-generated request lines, headers and JSON bodies (>= 1,000 cases a run)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.hostile.cluster import (
    Cluster,
    assert_still_healthy,
    json_error,
    raw_exchange,
)

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def _raw(cluster: Cluster, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    status, _headers, payload = raw_exchange(cluster.http_port, head + body)
    return status, payload


def _post_raw(cluster: Cluster, path: str, auth: bytes, body: bytes) -> tuple[int, bytes]:
    head = (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nAuthorization: " + auth + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    return _raw(cluster, head, body)


# -- the findings of the review, one by one --------------------------------------------------


def test_invalid_utf8_in_a_bearer_token_is_401_not_500(up: Cluster) -> None:
    needle_gw = "refused a request without a valid API key"
    needle_admin = "refused an admin request without the admin token"
    before_gw, before_admin = up.log_count(needle_gw), up.log_count(needle_admin)
    body = json.dumps({"model": "llmgw-sim", "messages": []}).encode()
    for path, needle, before in (
        (CHAT, needle_gw, before_gw),
        ("/api/keys", needle_admin, before_admin),
    ):
        status, payload = _post_raw(up, path, b"Bearer \xff\xfe\xc3(sk-\x80", body)
        assert status == 401, payload
        error = json_error(payload)
        assert error["code"] in ("invalid_api_key", "unauthorized")
        # One line in the log for the refusal, and no traceback (checked at the end).
        assert up.log_count(needle, at_least=before + 1) == before + 1
    status, payload = _raw(up, b"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: \xff\r\n\r\n")
    assert status == 401, payload


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(up: Cluster, scheme: str) -> None:
    status, body = up.request(
        "GET", "/v1/models", headers={"Authorization": f"{scheme} {up.api_key}"}
    )
    assert status == 200, body
    assert [m["id"] for m in json.loads(body)["data"]] == ["llmgw-sim"]
    token = up.admin_token
    status, body = up.request("GET", "/api/status", headers={"Authorization": f"{scheme}  {token}"})
    assert status == 200, body
    # The scheme is not the credential: another scheme with the right secret is refused.
    status, _ = up.request("GET", "/v1/models", headers={"Authorization": f"Basic {up.api_key}"})
    assert status == 401


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"model": "llmgw-sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["arrays", "objects", "deep-messages"],
)
def test_json_nested_deep_is_400_on_the_gateway_and_the_admin_api(up: Cluster, body: bytes) -> None:
    gateway_before = up.log_count("refused a request body")
    admin_before = up.log_count("refused an admin request")
    status, payload = _post_raw(up, CHAT, f"Bearer {up.api_key}".encode(), body)
    assert status == 400, payload
    error = json_error(payload)
    assert error["code"] == "invalid_json" and "nested too deep" in error["message"]
    assert error["type"] == "invalid_request_error"
    status, payload = _post_raw(up, "/api/keys", f"Bearer {up.admin_token}".encode(), body)
    assert status == 400, payload
    assert "nested too deep" in json_error(payload)["message"]
    # One log line each.
    assert up.log_count("refused a request body", at_least=gateway_before + 1) == (
        gateway_before + 1
    )
    assert up.log_count("refused an admin request", at_least=admin_before + 1) == (admin_before + 1)


def test_admin_bodies_that_parse_but_cannot_be_stored_are_400(up: Cluster) -> None:
    auth = f"Bearer {up.admin_token}".encode()
    for body in (
        b'{"name": "\\ud800"}',  # a lone surrogate
        b'{"name": "k\xff"}',  # not UTF-8
        b"\xef\xbb\xbf{}",  # a byte-order mark
        b"NaN",
        b'"just a string"',
        b"",
    ):
        status, payload = _post_raw(up, "/api/keys", auth, body)
        assert status == 400, (body, payload)
        json_error(payload)


def test_a_missing_bundle_is_404_without_the_bundle_directory(up: Cluster) -> None:
    for rid in ("linux-x64", "linux-arm64"):
        status, body = up.request("GET", f"/agent/bundles/{rid}.tar.gz")
        assert status == 404, body
        assert str(up.state_dir) not in body.decode()
        assert "bundle_dir" in json_error(body)["message"]


def test_unknown_paths_and_methods_are_json_errors(up: Cluster) -> None:
    for method, path, expected in (
        ("GET", "/nope", 404),
        ("GET", "/v1/nope", 404),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/healthz", 405),
        ("GET", "/api/../../etc/passwd", 404),
    ):
        status, body = up.request(method, path)
        assert status == expected, (method, path, body)
        assert json_error(body)["code"] in ("not_found", "method_not_allowed")


@pytest.mark.parametrize(
    "head",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost t\r\n\r\n",
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 500 + b"\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        b"POST /api/keys HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nX: \x00\r\n\r\n",
    ],
)
def test_malformed_requests_are_a_json_400(up: Cluster, head: bytes) -> None:
    status, body = _raw(up, head)
    assert status == 400, body
    assert json_error(body)["code"] == "bad_http_request"


# -- Hypothesis: request lines, headers, JSON bodies -----------------------------------------

_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/healthz",
    "/metrics",
    "/agent/bundles",
    "/agent/bundles/linux-x64.tar.gz",
    "/api/status",
    "/api/keys",
    "/api/nodes",
    "/api/events",
    "/api/models/llmgw-nope",
    "/api/nodes/nope/approve",
    "/api/join-tokens",
    "/api/replicas",
]
_METHODS = st.sampled_from(
    [b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT"]
) | st.binary(min_size=1, max_size=10)
_TARGETS = st.one_of(
    st.sampled_from([p.encode() for p in _PATHS]),
    st.tuples(st.sampled_from([p.encode() for p in _PATHS]), st.binary(max_size=30)).map(b"".join),
    st.tuples(
        st.sampled_from([p.encode() for p in _PATHS]),
        st.text(max_size=30).map(lambda t: b"?" + t.encode("utf-8", "surrogatepass")),
    ).map(b"".join),
    st.binary(max_size=40),
)
_VERSIONS = st.sampled_from(
    [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"", b"http/1.1"]
) | st.binary(max_size=8)


def _auth_values(key: str, token: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from(
        [
            f"Bearer {key}".encode(),
            f"bearer {token}".encode(),
            b"Bearer",
            b"Bearer ",
            b"Bearer \xff\xfe",
            b"Basic dXNlcjpwYXNz",
            f"Bearer {key}\x00".encode(),
            f"Bearer {key[:-1]}".encode(),
        ]
    ) | st.binary(max_size=40)


_HEADER_NAMES = st.sampled_from(
    [
        b"Content-Type",
        b"Accept-Encoding",
        b"Content-Encoding",
        b"Connection",
        b"Expect",
        b"Upgrade",
        b"Cookie",
        b"X-Forwarded-For",
        b"Range",
        b"If-None-Match",
        b"Accept",
    ]
) | st.binary(min_size=1, max_size=16)
_HEADER_VALUES = st.sampled_from(
    [
        b"application/json",
        b"gzip",
        b"deflate, br",
        b"keep-alive",
        b"close",
        b"100-continue",
        b"websocket",
        b"bytes=0-1,5-2",
        b"text/event-stream",
    ]
) | st.binary(max_size=60)

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=30)
    | st.sampled_from(["\ud800", "llmgw-sim", "a" * 300]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_CHAT_KEYS = ["model", "messages", "stream", "max_tokens", "n", "seed", "stream_options", "prompt"]
_MUTATIONS = st.lists(
    st.tuples(st.sampled_from(_CHAT_KEYS) | st.text(max_size=8), _JSON), max_size=3
)
_ADMIN_POSTS = ["/api/keys", "/api/join-tokens", "/api/nodes/nope/approve", "/api/engines/install"]


def _valid_chat() -> dict[str, Any]:
    return {"model": "llmgw-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


def test_fuzz_request_lines_headers_and_json_bodies(up: Cluster) -> None:
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    key, token = up.api_key, up.admin_token

    def check(data: bytes, *, head_only: bool = False) -> None:
        status, headers, body = raw_exchange(
            up.http_port, data, method="HEAD" if head_only else None
        )
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (data[:300], status, body[:500])
        if status >= 400 and not head_only:
            assert headers.get("content-type", "").startswith("application/json"), body[:300]
            json_error(body)

    common = dict(
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )

    @settings(max_examples=400, **common)  # type: ignore[arg-type]
    @given(
        method=_METHODS,
        target=_TARGETS,
        version=_VERSIONS,
        auth=_auth_values(key, token),
        headers=st.lists(st.tuples(_HEADER_NAMES, _HEADER_VALUES), max_size=4),
        body=st.binary(max_size=200),
    )
    def raw_requests(
        method: bytes,
        target: bytes,
        version: bytes,
        auth: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        counts["raw"] = counts.get("raw", 0) + 1
        head = method + b" " + target + b" " + version + b"\r\nHost: t\r\n"
        head += b"Authorization: " + auth + b"\r\n"
        for name, value in headers:
            head += name + b": " + value + b"\r\n"
        head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        check(head + body, head_only=method == b"HEAD")

    @settings(max_examples=450, **common)  # type: ignore[arg-type]
    @given(
        path=st.sampled_from([CHAT, "/v1/completions"]),
        base=st.sampled_from(["valid", "json"]),
        value=_JSON,
        mutations=_MUTATIONS,
        stream=st.booleans(),
        good_key=st.sampled_from([True, True, True, False]),
    )
    def gateway_bodies(
        path: str,
        base: str,
        value: Any,
        mutations: list[tuple[str, Any]],
        stream: bool,
        good_key: bool,
    ) -> None:
        counts["gateway"] = counts.get("gateway", 0) + 1
        body: Any = _valid_chat() if base == "valid" else value
        if isinstance(body, dict):
            for name, item in mutations:
                body[name] = item
            if body.get("model") == "llmgw-sim":
                body["max_tokens"] = 4  # a real completion, kept short
                body["stream"] = stream
                body.pop("n", None)
        data = _json_bytes(body)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {key if good_key else key[:-2]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        check(head + data)

    @settings(max_examples=300, **common)  # type: ignore[arg-type]
    @given(
        path=st.sampled_from(_ADMIN_POSTS),
        method=st.sampled_from(["POST", "PUT", "DELETE"]),
        value=_JSON,
        fields=st.dictionaries(
            st.sampled_from(["name", "node", "ttl", "rekey", "address", "fingerprint", "nodes"]),
            _JSON,
            max_size=4,
        ),
    )
    def admin_bodies(path: str, method: str, value: Any, fields: dict[str, Any]) -> None:
        counts["admin"] = counts.get("admin", 0) + 1
        body = fields if fields else value
        data = _json_bytes(body)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        check(head + data)

    raw_requests()
    gateway_bodies()
    admin_bodies()
    assert sum(counts.values()) >= 1000, counts
    # The fuzz reached handlers (2xx), their refusals (4xx) and the parser's (400).
    assert any(200 <= s < 300 for s in statuses), statuses
    assert statuses.get(400, 0) and statuses.get(401, 0), statuses
    assert any(statuses.get(s, 0) for s in (404, 405, 409)), statuses


def test_zz_still_healthy_without_tracebacks(up: Cluster) -> None:
    assert_still_healthy(up)
