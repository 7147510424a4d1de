"""The login lockout over real HTTP against a real control plane (issue 36): logins sent at
once to ``POST /api/login`` and to the console's form are checked at most the limit's times
and then all get the same locked answer, the right password too; guessing the admin password
through the CA export locks it like logins do (signed updates and role grants then too); a
locked account still signs in from a fresh address with its ctl token; ``X-Forwarded-For``
counts only from the trusted proxies; cookies and headers that are not UTF-8 get 400/401,
never a 500; and a listener serving plain HTTP beyond loopback says so at start and on the
login page.

One control plane serves the module, in a thread of the test's process, with ``http_listen:
0.0.0.0`` in its configuration but its socket bound to 127.0.0.1 by the test (the tests
listen on loopback only); ``trusted_proxies`` is 127.0.0.1. Each test signs in from its own
loopback address (127.0.0.x, bound by the client) and its own accounts, so that their
counters do not meet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import pytest

from llmgw.listener import listening_socket
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config

T = TypeVar("T")

OPS_PW = "the operators' long password"
LIMIT = 5  # console.login_failures_per_account's default
PROXY = "127.0.0.1"  # trusted_proxies


@dataclass
class Running:
    """The control plane, its event loop's thread, and what it logged."""

    cp: ControlPlane
    loop: asyncio.AbstractEventLoop
    base: str
    port: int
    admin_token: str
    admin_pw: str
    records: list[logging.LogRecord]

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run a coroutine on the control plane's loop (its store is that thread's)."""

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=60)

    def events(self, kind: str) -> list[tuple[str, str]]:
        async def read() -> list[tuple[str, str]]:
            return [
                (e.subject, e.message)
                for e in self.cp.store.list_events(limit=1000)
                if e.kind == kind
            ]

        return self.call(read)


class _Records(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("lockout")
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(tmp / "server"),
            "http_listen": "0.0.0.0:0",  # what the configuration says; the socket is loopback
            "grpc_listen": "127.0.0.1:0",
            "enroll_listen": "127.0.0.1:0",
            "bundle_dir": str(tmp / "bundles"),
            "trusted_proxies": [f"{PROXY}/32"],
        },
    )
    records: list[logging.LogRecord] = []
    handler = _Records(records)
    logger = logging.getLogger("llmgw")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="control-plane", daemon=True)
    thread.start()
    plane = ControlPlane(cfg)
    plane.http_sock = listening_socket("127.0.0.1", 0)
    port = plane.http_sock.getsockname()[1]
    running = Running(plane, loop, f"http://127.0.0.1:{port}", port, "", "", records)
    try:
        running.call(plane.start)
        running.admin_token = (tmp / "server" / "admin.token").read_text().strip()
        running.admin_pw = (tmp / "server" / "admin.password").read_text().strip()
        for name in ("ops", "ops-console", "ops-ctl", "ops-proxied"):
            running.call(
                lambda n=name: plane.leader.operators.add(n, "viewer", OPS_PW, actor="admin")
            )
        yield running
    finally:
        running.call(plane.stop)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
        logger.removeHandler(handler)
        logger.setLevel(level)


def _client(source: str) -> aiohttp.ClientSession:
    """A client whose connections come from *source* (an address of 127.0.0.0/8)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(local_addr=(source, 0), force_close=True),
        cookie_jar=aiohttp.CookieJar(unsafe=True),
    )


async def _api_login(
    http: aiohttp.ClientSession, base: str, name: str, password: str, **headers: str
) -> tuple[int, dict[str, Any], str]:
    async with http.post(
        f"{base}/api/login", json={"name": name, "password": password}, headers=headers
    ) as resp:
        return resp.status, await resp.json(), resp.headers.get("Retry-After", "")


_WHEN = re.compile(r"locked for \d+ (s|min): try again then \(at [0-9:]+ UTC\)")


def _same(message: str) -> str:
    """A locked answer without the time left (which ticks while the answers are made)."""
    return _WHEN.sub("locked for N: try again then (at T)", message)


# ------------------------------------------------------------------------- the race


def test_logins_sent_at_once_are_checked_at_most_the_limit_then_all_locked_alike(
    cp: Running,
) -> None:
    async def burst() -> list[tuple[int, dict[str, Any], str]]:
        async with _client("127.0.0.10") as http:
            attempts = [f"wrong guess number {i}" for i in range(39)] + [OPS_PW]
            return await asyncio.gather(*(_api_login(http, cp.base, "ops", pw) for pw in attempts))

    answers = asyncio.run(burst())
    statuses = [a[0] for a in answers]
    locked = [a for a in answers if a[0] == 429]
    assert set(statuses) <= {401, 201, 429}
    # At most the limit's failures are checked; all of them when the right password, sent
    # last, came after the lock (had it come among them, its refund reopens one place).
    assert statuses.count(401) == LIMIT or (statuses[-1] == 201 and statuses.count(401) <= LIMIT)
    # Every locked answer is the same, whatever the password: the right one's included.
    assert {(a[1]["error"]["code"], _same(a[1]["error"]["message"])) for a in locked} == {
        (
            "too_many_logins",
            "too many failed logins for account 'ops'; logins and password confirmations "
            "are locked for N: try again then (at T), or ask an admin to check the events",
        )
    }
    assert all(int(a[2]) > 800 for a in locked)
    if statuses[-1] == 201:  # it was among the first checked
        return

    # Locked now: the right password from a fresh address is refused as a wrong one is.
    async def after() -> list[tuple[int, dict[str, Any], str]]:
        async with _client("127.0.0.11") as http:
            return await asyncio.gather(
                *(_api_login(http, cp.base, "ops", pw) for pw in [OPS_PW, "guess"] * 5)
            )

    later = asyncio.run(after())
    assert {(a[0], _same(a[1]["error"]["message"])) for a in later} == {
        (429, _same(locked[0][1]["error"]["message"]))
    }
    assert [s for s, m in cp.events("login_locked") if s == "ops"] == ["ops"]


def test_console_sign_ins_sent_at_once_are_locked_alike(cp: Running) -> None:
    async def burst() -> list[tuple[int, str]]:
        async with _client("127.0.0.12") as http:
            async with http.get(f"{cp.base}/ui/login") as resp:
                page = await resp.text()
            found = re.search(r'name="csrf" value="([^"]+)"', page)
            assert found is not None

            async def sign_in(password: str) -> tuple[int, str]:
                form = {"csrf": found.group(1), "next": "/ui/", "name": "ops-console"}
                async with http.post(
                    f"{cp.base}/ui/login",
                    data=form | {"password": password},
                    headers={"Origin": cp.base},
                    allow_redirects=False,
                ) as resp:
                    text = await resp.text()
                    problem = re.search(r'id="login-problem">([^<]*)<', text)
                    return resp.status, problem.group(1) if problem else ""

            attempts = [f"wrong guess number {i}" for i in range(39)] + [OPS_PW]
            return await asyncio.gather(*(sign_in(pw) for pw in attempts))

    answers = asyncio.run(burst())
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {401, 303, 429}
    assert statuses.count(401) == LIMIT or (statuses[-1] == 303 and statuses.count(401) <= LIMIT)
    problems = {re.sub(r"\d+ (s|min)", "N", a[1]) for a in answers if a[0] == 429}
    assert problems == {"too many failed sign-ins; try again in N"}


# --------------------------------------------------------------- second secrets


def test_guessing_the_admin_password_through_the_ca_export_locks_it(cp: Running) -> None:
    async def guesses() -> list[tuple[int, dict[str, Any]]]:
        out = []
        auth = {"Authorization": f"Bearer {cp.admin_token}"}
        async with _client("127.0.0.13") as http:

            async def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                async with http.post(f"{cp.base}{path}", json=body, headers=auth) as resp:
                    return resp.status, await resp.json()

            passphrase = "a passphrase long enough to seal"
            for i in range(30):
                out.append(
                    await post(
                        "/api/ca/export", {"password": f"guess {i}", "passphrase": passphrase}
                    )
                )
            out.append(
                await post("/api/ca/export", {"password": cp.admin_pw, "passphrase": passphrase})
            )
            # The same lock holds for every confirmation of the admin password.
            out.append(
                await post(
                    "/api/updates", {"all": True, "version": "9.9.9", "password": cp.admin_pw}
                )
            )
            out.append(
                await post(
                    "/api/users",
                    {
                        "name": "eve",
                        "role": "admin",
                        "password": OPS_PW,
                        "confirm_password": cp.admin_pw,
                    },
                )
            )
        return out

    answers = asyncio.run(guesses())
    statuses = [s for s, _ in answers]
    assert statuses == [403] * LIMIT + [429] * (30 - LIMIT) + [429, 429, 429]
    assert all(a[1]["error"]["code"] == "too_many_attempts" for a in answers[LIMIT:])
    assert len({_same(a[1]["error"]["message"]) for a in answers[LIMIT:]}) == 1
    assert "file" not in answers[30][1]  # nothing exported
    locks = [m for s, m in cp.events("login_locked") if s == "admin"]
    assert len(locks) == 1 and "admin password confirmation" in locks[0]
    assert not [e for e in cp.events("ca_exported")]


# ------------------------------------------------------- the owner is not locked out


def test_a_locked_account_signs_in_from_a_fresh_address_with_its_ctl_token(cp: Running) -> None:
    async def scenario() -> dict[str, int]:
        out: dict[str, int] = {}
        async with _client("127.0.0.15") as http:
            status, body, _ = await _api_login(http, cp.base, "ops-ctl", OPS_PW)
            assert status == 201
            token = body["token"]
        async with _client("127.0.0.16") as http:  # the guesser
            for i in range(LIMIT):
                out[f"guess {i}"] = (await _api_login(http, cp.base, "ops-ctl", f"guess {i}"))[0]
            bearer = {"Authorization": f"Bearer {token}"}
            out["token, failed address"] = (
                await _api_login(http, cp.base, "ops-ctl", OPS_PW, **bearer)
            )[0]
        async with _client("127.0.0.17") as http:  # the owner, elsewhere
            out["no token"] = (await _api_login(http, cp.base, "ops-ctl", OPS_PW))[0]
            admin = {"Authorization": f"Bearer {cp.admin_token}"}  # not ops-ctl's own
            out["admin token"] = (await _api_login(http, cp.base, "ops-ctl", OPS_PW, **admin))[0]
            out["token"] = (await _api_login(http, cp.base, "ops-ctl", OPS_PW, **bearer))[0]
        async with _client("127.0.0.18") as http:  # a wrong password makes it a failed one
            out["token, wrong"] = (await _api_login(http, cp.base, "ops-ctl", "guess", **bearer))[0]
            out["token, after"] = (await _api_login(http, cp.base, "ops-ctl", OPS_PW, **bearer))[0]
        return out

    assert asyncio.run(scenario()) == {
        **{f"guess {i}": 401 for i in range(LIMIT)},
        "token, failed address": 429,
        "no token": 429,
        "admin token": 429,
        "token": 201,
        "token, wrong": 401,
        "token, after": 429,
    }


# --------------------------------------------------------------- trusted proxies


def test_x_forwarded_for_counts_only_from_a_trusted_proxy(cp: Running) -> None:
    async def logins() -> None:
        hops = {
            PROXY: ["198.51.100.7", "203.0.113.5, 127.0.0.1", "2001:db8:7:8::1"],
            "127.0.0.19": ["198.51.100.8"],  # not a trusted proxy: its header is ignored
        }
        for source, values in hops.items():
            async with _client(source) as http:
                for value in values:
                    status, _, _ = await _api_login(
                        http, cp.base, "ops-proxied", OPS_PW, **{"X-Forwarded-For": value}
                    )
                    assert status == 201

    asyncio.run(logins())
    seen = [m for s, m in cp.events("operator_login") if s == "ops-proxied"]
    assert sorted(seen) == sorted(
        f"cli login from {a}"
        for a in ("198.51.100.7", "203.0.113.5", "2001:db8:7:8::1", "127.0.0.19")
    )


# ------------------------------------------------------------------- bad cookies


def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0]
    return int(head.split(b" ", 2)[1]), head


def test_cookies_and_headers_that_are_not_utf8_get_400_or_401_never_a_500(cp: Running) -> None:
    before = len(cp.records)
    bad = b"\xff\xfe"
    body = json.dumps({"name": "nobody-here", "password": "not the password"}).encode()

    def req(method: str, path: str, *headers: bytes, payload: bytes = b"") -> bytes:
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", *headers]
        lines += [b"Content-Length: %d" % len(payload), b"Connection: close"]
        return b"\r\n".join(lines) + b"\r\n\r\n" + payload

    session = b"Cookie: llmgw_session=" + bad
    status, head = _raw(cp.port, req("GET", "/ui/", session))
    assert status == 400 and b'Set-Cookie: llmgw_session=""' in head
    assert _raw(cp.port, req("POST", "/ui/logout", session))[0] == 400
    status, head = _raw(cp.port, req("GET", "/ui/login", session))
    assert status == 200 and b'Set-Cookie: llmgw_session=""' in head  # the form, cleared
    form = b"csrf=ab%FF&name=admin&password=not+the+password"
    login_cookie = b"Cookie: llmgw_login=ab" + bad
    form_type = b"Content-Type: application/x-www-form-urlencoded"
    assert _raw(cp.port, req("POST", "/ui/login", login_cookie, form_type, payload=form))[0] == 403
    json_type = b"Content-Type: application/json"
    for header in (
        b"Authorization: Bearer " + bad,
        b"User-Agent: " + bad,
        b"X-Llmgw-Client-Addr: " + bad,
    ):
        headers = (header, b"X-Llmgw-Client-Mac: 00", json_type)
        assert _raw(cp.port, req("POST", "/api/login", *headers, payload=body))[0] == 401
    failures = [r for r in cp.records[before:] if r.exc_info or r.levelno >= logging.ERROR]
    assert failures == []


# ------------------------------------------------------------------ plain HTTP


def test_a_plain_http_listener_beyond_loopback_says_so(cp: Running) -> None:
    warned = [r for r in cp.records if "plain HTTP beyond loopback" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    fields = getattr(warned[0], "fields", {})
    assert fields["listen"].startswith("0.0.0.0:") and "tls: cluster" in fields["fix"]

    async def page() -> str:
        async with _client("127.0.0.20") as http, http.get(f"{cp.base}/ui/login") as resp:
            return await resp.text()

    notice = re.search(r'<p [^>]*id="login-cleartext">(.*?)</p>', asyncio.run(page()), re.S)
    assert notice is not None
    assert "travels in clear" in notice.group(1) and "<code>tls:</code>" in notice.group(1)
