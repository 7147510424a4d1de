"""Signing in to the console and the guards (llmgw.server.console.auth, .security): a page
without a session goes to the login page and comes back; a login right, wrong, throttled;
the cookies' attributes (Secure under TLS, no life beyond the session's); an expired
session said so; CSRF and Origin refused; a viewer reads but never acts; logout ends it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.server.accounts.logins import LoginPolicy
from llmgw.server.console.security import (
    CSP,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    csrf_matches,
    foreign_origin,
    local_next,
)
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import VIEWER_PW, Browser, ConsoleRig, csrf_of


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    return ConsoleRig(store, clock, tmp_path)


def _cookie(resp: object, name: str) -> str:
    """The Set-Cookie header of ``name`` as the server wrote it."""
    headers = resp.headers.getall("Set-Cookie", [])  # type: ignore[attr-defined]
    found = [h for h in headers if h.startswith(f"{name}=")]
    assert len(found) == 1, headers
    return str(found[0])


# ---------------------------------------------------------------- pure checks


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/ui/nodes?state=pending", "/ui/nodes?state=pending"),
        ("/ui/nodes/gpu-1", "/ui/nodes/gpu-1"),
        (None, "/ui/"),
        ("", "/ui/"),
        ("https://evil.example/ui/", "/ui/"),
        ("//evil.example/ui/", "/ui/"),
        ("/ui/../api/keys", "/ui/"),
        ("/api/keys", "/ui/"),
        ("/ui/\\evil", "/ui/"),
        ("/ui/\r\nSet-Cookie: x", "/ui/"),
        ("/ui/" + "a" * 3000, "/ui/"),
    ],
)
def test_next_is_only_a_local_console_path(value: str | None, expected: str) -> None:
    assert local_next(value) == expected


def test_origin_check() -> None:
    assert not foreign_origin(None, "cp:8080", "http")  # no Origin: the CSRF token decides
    assert not foreign_origin("http://cp:8080", "cp:8080", "http")
    assert not foreign_origin("http://CP:8080", "cp:8080", "http")
    assert foreign_origin("https://cp:8080", "cp:8080", "http")  # another scheme
    assert foreign_origin("http://evil.example", "cp:8080", "http")
    assert foreign_origin("http://cp:8081", "cp:8080", "http")
    assert foreign_origin("null", "cp:8080", "http")
    assert foreign_origin("http://cp:8080/path", "cp:8080", "http")
    assert foreign_origin("http://cp:8080", None, "http")


def test_csrf_compare() -> None:
    assert csrf_matches("abc", "abc")
    assert not csrf_matches("abd", "abc")
    assert not csrf_matches("", "abc")
    assert not csrf_matches(None, "abc")
    assert not csrf_matches("abc", "")  # a session without a token (ctl) never matches
    assert not csrf_matches("\udcff", "abc")  # bytes that are not UTF-8 still compare
    assert not csrf_matches("abc", "ab\udcff")  # on either side (the login form's cookie)


# ---------------------------------------------------------------- redirects and login


def test_a_page_without_a_session_goes_to_the_login_and_back(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        status, _, resp = await b.get("/ui/nodes?state=pending")
        assert status == 303
        assert resp.headers["Location"] == "/ui/login?next=%2Fui%2Fnodes%3Fstate%3Dpending"
        assert "expired" not in resp.headers["Location"]
        status, page, resp = await b.get(resp.headers["Location"])
        assert status == 200
        assert 'name="next" value="/ui/nodes?state=pending"' in page
        assert "login-cleartext" not in page  # loopback or TLS: nothing to warn of
        login_cookie = _cookie(resp, LOGIN_COOKIE)
        assert "HttpOnly" in login_cookie and "SameSite=Strict" in login_cookie
        assert "Path=/ui/" in login_cookie
        status, _, resp = await b.post(
            "/ui/login",
            {
                "csrf": csrf_of(page),
                "next": "/ui/nodes?state=pending",
                "name": "admin",
                "password": rig.admin_pw,
            },
        )
        assert status == 303 and resp.headers["Location"] == "/ui/nodes?state=pending"
        status, page, _ = await b.get("/ui/nodes?state=pending")
        assert status == 200 and "<h1>Nodes</h1>" in page

    rig.run(scenario)
    (event,) = [e for e in rig.store.list_events() if e.kind == "operator_login"]
    assert event.subject == "admin"


def test_a_foreign_next_is_ignored(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        _, page, _ = await b.get("/ui/login?next=https%3A%2F%2Fevil.example%2F")
        assert 'name="next" value="/ui/"' in page
        _, _, resp = await b.post(
            "/ui/login",
            {
                "csrf": csrf_of(page),
                "next": "https://evil.example/",
                "name": "admin",
                "password": rig.admin_pw,
            },
        )
        assert resp.headers["Location"] == "/ui/"

    rig.run(scenario)


def test_the_session_cookie(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> str:
        resp = await b.login()
        assert resp.status == 303
        return _cookie(resp, SESSION_COOKIE)

    cookie = rig.run(scenario)
    attrs = [a.strip() for a in cookie.split(";")]
    assert "HttpOnly" in attrs and "SameSite=Strict" in attrs and "Path=/ui/" in attrs
    assert "Secure" not in attrs  # served over plain HTTP: a Secure cookie would not come back
    (max_age,) = [a for a in attrs if a.startswith("Max-Age=")]
    assert int(max_age.split("=")[1]) == int(LoginPolicy().session_lifetime)


def test_the_session_cookie_is_secure_under_tls(store: Store, clock: Clock, tmp_path: Path) -> None:
    rig = ConsoleRig(store, clock, tmp_path, scheme="https")

    async def scenario(b: Browser) -> tuple[str, str]:
        _, page, resp = await b.get("/ui/login")
        login = _cookie(resp, LOGIN_COOKIE)
        # The test client speaks plain HTTP: the Origin it would send is its own.
        _, _, resp = await b.post(
            "/ui/login",
            {"csrf": csrf_of(page), "name": "admin", "password": rig.admin_pw},
            cookies={LOGIN_COOKIE: csrf_of(page)},
        )
        return login, _cookie(resp, SESSION_COOKIE)

    login, session = rig.run(scenario)
    assert "Secure" in [a.strip() for a in login.split(";")]
    assert "Secure" in [a.strip() for a in session.split(";")]


def test_a_wrong_password_is_refused_generically(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        resp = await b.login("admin", "not the password")
        assert resp.status == 401
        page = await resp.text()
        assert "wrong name or password" in page
        assert SESSION_COOKIE not in resp.cookies
        assert 'value="admin"' in page  # the name kept, the password not
        resp = await b.login("nobody", "not the password")
        assert resp.status == 401 and "wrong name or password" in await resp.text()

    rig.run(scenario)


def test_logins_are_throttled_with_when_to_retry(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = ConsoleRig(store, clock, tmp_path, policy=LoginPolicy(failures_per_account=2))

    async def scenario(b: Browser) -> None:
        for _ in range(2):
            assert (await b.login("admin", "wrong")).status == 401
        resp = await b.login("admin")  # the right password, refused while locked
        assert resp.status == 429
        retry = int(resp.headers["Retry-After"])
        assert 0 < retry <= 900
        # 900 s of lockout read as minutes (a lock under two minutes in seconds).
        assert f"try again in {-(-retry // 60)} min" in await resp.text()
        assert SESSION_COOKIE not in resp.cookies

    rig.run(scenario)


def test_the_login_form_needs_its_pre_session_token(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        await b.get("/ui/login")  # the cookie, but the form's token is not sent
        for form in (
            {"name": "admin", "password": rig.admin_pw},
            {"csrf": "forged", "name": "admin", "password": rig.admin_pw},
        ):
            status, page, resp = await b.post("/ui/login", form)
            assert status == 403 and "sign-in form expired" in page
            assert SESSION_COOKIE not in resp.cookies

    rig.run(scenario)
    assert not [e for e in rig.store.list_events() if e.kind == "operator_login"]


def test_a_login_from_another_origin_is_refused(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        _, page, _ = await b.get("/ui/login")
        status, body, resp = await b.post(
            "/ui/login",
            {"csrf": csrf_of(page), "name": "admin", "password": rig.admin_pw},
            headers={"Origin": "http://evil.example"},
        )
        assert status == 403 and "another site" in body
        assert SESSION_COOKIE not in resp.cookies

    rig.run(scenario)


def test_an_expired_session_says_so(rig: ConsoleRig, clock: Clock) -> None:
    async def scenario(b: Browser) -> None:
        await b.login()
        clock.advance(LoginPolicy().session_idle + 1)
        status, _, resp = await b.get("/ui/nodes")
        assert status == 303
        assert resp.headers["Location"] == "/ui/login?next=%2Fui%2Fnodes&expired=1"
        assert "Max-Age=0" in _cookie(resp, SESSION_COOKIE)  # the dead cookie cleared
        _, page, _ = await b.get(resp.headers["Location"])
        assert "your session expired, sign in again" in page

    rig.run(scenario)


def test_logout_is_a_post_that_ends_the_session(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> None:
        await b.login()
        status, _, _ = await b.get("/ui/logout")
        assert status == 404  # a link cannot sign anyone out
        assert (await b.get("/ui/"))[0] == 200
        status, _, resp = await b.post("/ui/logout", {"csrf": "wrong"})
        assert status == 403
        status, _, resp = await b.post("/ui/logout", {"csrf": b.csrf})
        assert status == 303 and resp.headers["Location"] == "/ui/login?signed_out=1"
        assert "Max-Age=0" in _cookie(resp, SESSION_COOKIE)
        status, _, _ = await b.get("/ui/", cookies={SESSION_COOKIE: "x"})
        assert status == 303

    rig.run(scenario)


# ---------------------------------------------------------------- actions


def test_a_post_without_or_with_a_wrong_csrf_token_is_refused(rig: ConsoleRig) -> None:
    rig.add_node("gpu-1")

    async def scenario(b: Browser) -> None:
        await b.login()
        for form in ({"confirm": "gpu-1"}, {"confirm": "gpu-1", "csrf": b.csrf + "x"}):
            status, page, _ = await b.post("/ui/nodes/gpu-1/drain", form)
            assert status == 403
            assert "reload the page" in page
        # The header a script would send works like the field.
        status, _, _ = await b.post(
            "/ui/nodes/gpu-1/drain", {"confirm": "gpu-1"}, headers={"X-CSRF-Token": b.csrf}
        )
        assert status == 303

    rig.run(scenario)
    drains = [e for e in rig.store.list_events() if e.kind == "node_drain"]
    assert [(e.subject, e.actor) for e in drains] == [("gpu-1", "admin")]


def test_a_post_from_another_origin_is_refused(rig: ConsoleRig) -> None:
    rig.add_node("gpu-1")

    async def scenario(b: Browser) -> None:
        await b.login()
        status, page, _ = await b.post(
            "/ui/nodes/gpu-1/drain",
            {"confirm": "gpu-1", "csrf": b.csrf},
            headers={"Origin": "http://evil.example"},
        )
        assert status == 403 and "another site" in page
        status, _, _ = await b.post(
            "/ui/nodes/gpu-1/drain",
            {"confirm": "gpu-1", "csrf": b.csrf},
            headers={"Origin": b.origin},
        )
        assert status == 303

    rig.run(scenario)
    assert len([e for e in rig.store.list_events() if e.kind == "node_drain"]) == 1


def test_a_viewer_reads_but_cannot_act(rig: ConsoleRig) -> None:
    rig.add_node("gpu-1")

    async def scenario(b: Browser) -> None:
        await b.login("vera", VIEWER_PW)
        status, page, _ = await b.get("/ui/nodes/gpu-1")
        assert status == 200 and "gpu-1" in page
        assert "<button" in page  # sign out
        assert 'id="node-actions"' not in page and "/ui/nodes/gpu-1/" not in page
        for action in ("drain", "uncordon", "revoke"):
            status, body, _ = await b.post(
                f"/ui/nodes/gpu-1/{action}", {"confirm": "gpu-1", "csrf": b.csrf}
            )
            assert status == 403 and "is a viewer" in body
        # The viewer may still sign out.
        status, _, _ = await b.post("/ui/logout", {"csrf": b.csrf})
        assert status == 303

    rig.run(scenario)
    assert rig.store.get_node("gpu-1").state == "approved"
    assert not rig.store.get_node("gpu-1").draining


def test_an_admin_sees_the_actions(rig: ConsoleRig) -> None:
    rig.add_node("gpu-1")

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        return page

    page = rig.run(scenario)
    assert 'id="action-drain"' in page and 'id="action-revoke"' in page
    assert 'data-confirm="Revoke node gpu-1?' in page


def test_every_answer_carries_the_security_headers(rig: ConsoleRig) -> None:
    rig.add_node("gpu-1")

    async def scenario(b: Browser) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for path in ("/ui/", "/ui/login", "/ui/nodes", "/ui/nope"):
            out.append((path, (await b.get(path))[2]))
        out.append(("POST /ui/nodes/gpu-1/drain", (await b.post("/ui/nodes/gpu-1/drain"))[2]))
        await b.login()
        for path in (
            "/ui/",
            "/ui/?fragment=summary",
            "/ui/nodes",
            "/ui/nodes/gpu-1",
            "/ui/nodes/nobody",
            "/ui/events",
            "/ui/nope",
            "/ui/?fragment=nope",
        ):
            out.append((path, (await b.get(path))[2]))
        out.append(("POST /ui/nodes", (await b.post("/ui/nodes"))[2]))
        out.append(("bad csrf", (await b.post("/ui/nodes/gpu-1/drain", {"csrf": "x"}))[2]))
        return out

    for what, resp in rig.run(scenario):
        headers = resp.headers  # type: ignore[attr-defined]
        assert headers["Content-Security-Policy"] == CSP, what
        assert headers["X-Frame-Options"] == "DENY", what
        assert headers["X-Content-Type-Options"] == "nosniff", what
        assert headers["Referrer-Policy"] == "same-origin", what
        if resp.status != 303:  # type: ignore[attr-defined]
            assert headers["Cache-Control"] == "no-store", what
            assert headers["Content-Type"].startswith("text/html"), what


def test_an_oversized_form_is_refused_as_a_page(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> tuple[int, str, str]:
        await b.login()
        status, body, resp = await b.post(
            "/ui/nodes/gpu-1/drain", {"csrf": b.csrf, "confirm": "x" * (70 * 1024)}
        )
        return status, resp.headers["Content-Type"], body

    status, content_type, body = rig.run(scenario)
    assert status == 413 and content_type.startswith("text/html")
    assert "larger than the console takes" in body


def test_the_bare_console_path_goes_to_its_root(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        status, _, resp = await b.get("/ui")
        return status, resp.headers["Location"]

    assert rig.run(scenario) == (308, "/ui/")
