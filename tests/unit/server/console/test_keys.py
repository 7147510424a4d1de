"""The API keys pages (llmgw.server.console.keys): the keys with their policy and usage, a
key's page, creating a key (its policy parsed by the admin API's own function, refusals
shown in the form with the input kept) whose secret is on the POST's own answer and never
again, and revoking one confirmed with its id; a viewer sees no form and is refused; a POST
without its CSRF token changes nothing; a hostile key name is escaped."""

from __future__ import annotations

import html
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow, usage_day
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import HOSTILE, VIEWER_PW, Browser, ConsoleRig, flash_of


@pytest.fixture
def pending() -> list[UsageRow]:
    """This instance's usage not flushed yet, as the test sets it."""
    return []


@pytest.fixture
def refreshed() -> list[str]:
    """The gateway's caches refreshed, in order."""
    return []


@pytest.fixture
def rig(
    store: Store, clock: Clock, tmp_path: Path, pending: list[UsageRow], refreshed: list[str]
) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    ctx: Any = rig.ctx  # what keys touch beyond the rig's fleet
    ctx.serving = SimpleNamespace(refresh_keys=lambda: refreshed.append("keys"))
    ctx.pending_usage = lambda: list(pending)
    return rig


_SECRET = re.compile(
    r'<textarea id="key-secret-text" class="command" readonly[^>]*>([^<]+)</textarea>'
)


async def create(b: Browser, **fields: str) -> tuple[int, str, Any]:
    return await b.post("/ui/keys", {"csrf": b.csrf, **fields})


def test_create_a_key_shows_its_secret_once(
    rig: ConsoleRig, store: Store, refreshed: list[str]
) -> None:
    async def scenario(b: Browser) -> tuple[tuple[int, str, Any], list[str]]:
        await b.login()
        answer = await create(
            b,
            name="billing-app",
            models="chat, embed",
            rpm="60",
            tpm="100k",
            max_concurrent="4",
            budget="10M/day",
            priority="high",
            expires="90d",
            resume="off",
        )
        key = store.list_api_keys()[0]
        later = [
            (await b.get(path))[1]
            for path in (
                "/ui/keys",
                "/ui/keys?fragment=table",
                f"/ui/keys/{key.id}",
                f"/ui/keys/{key.id}?fragment=detail",
                "/ui/events",
                "/ui/",
            )
        ]
        return answer, later

    (status, page, resp), later = rig.run(scenario)
    assert status == 200  # the answer itself, not a redirect a reload would show again
    assert resp.headers["Cache-Control"] == "no-store"
    found = _SECRET.search(page)
    assert found is not None
    secret = html.unescape(found.group(1))
    verified = store.verify_api_key(secret)  # the very key the gateway will accept
    assert verified is not None and verified.name == "billing-app"
    assert 'data-copy="key-secret-text"' in page and 'id="key-secret-copied"' in page
    assert "the only time its secret is shown" in page
    key = store.list_api_keys()[0]
    assert key.name == "billing-app"
    assert key.policy == KeyPolicy(
        models=("chat", "embed"),
        rpm=60,
        tpm=100_000,
        max_concurrent=4,
        budget=Budget(10_000_000, "day"),
        priority="high",
        expires_at=key.policy.expires_at,
        resume=False,
    )
    assert 'id="key-resume">off<' in later[2]  # the key's page says so
    assert key.policy.expires_at == pytest.approx(rig.clock() + 90 * 86400)
    for shown in later:
        assert secret not in shown
    assert "billing-app" in later[0] and f'data-key="{key.id}"' in later[0]
    events = [e for e in store.list_events() if e.kind == "key_created"]
    assert [(e.subject, e.actor) for e in events] == [(key.id, "admin")]
    assert secret not in events[0].message and "rpm 60" in events[0].message
    assert refreshed == ["keys"]


def test_an_empty_form_makes_an_unlimited_key(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> int:
        await b.login()
        fields = dict.fromkeys(("models", "rpm", "tpm", "max_concurrent", "budget", "expires"), "")
        return (await create(b, name="any", priority="normal", resume="on", **fields))[0]

    assert rig.run(scenario) == 200
    assert store.list_api_keys()[0].policy == KeyPolicy()


@pytest.mark.parametrize(
    ("fields", "status", "says"),
    [
        ({"name": "a", "rpm": "fast"}, 400, "rpm must be a whole number"),
        ({"name": "a", "tpm": "0"}, 400, "tpm must be between 1 and"),
        ({"name": "a", "budget": "10M/week"}, 400, "budget period must be day or month"),
        ({"name": "a", "priority": "urgent"}, 400, "priority must be one of high, normal, low"),
        ({"name": "a", "expires": "10s"}, 400, "expires must be at least 1 minute"),
        ({"name": "a", "models": "chat, no spaces!"}, 400, "is not a model name"),
        ({"name": "a", "resume": "maybe"}, 400, "resume must be true"),
        ({"name": ""}, 400, "a key needs a name of 1-64 characters"),
        ({"name": "x" * 65}, 400, "a key needs a name of 1-64 characters"),
    ],
)
def test_a_bad_policy_value_is_refused_in_the_form(
    rig: ConsoleRig, store: Store, fields: dict[str, str], status: int, says: str
) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        answer = await create(b, **fields)
        return answer[0], answer[1]

    got, page = rig.run(scenario)
    assert got == status
    problem = flash_of(page)
    assert problem.startswith("error: no key created: ") and says in problem
    for name, value in fields.items():
        if value and name not in ("priority", "resume"):  # the selects
            assert f'name="{name}" value="{html.escape(value)}"' in page  # kept
    assert not _SECRET.search(page)
    assert store.list_api_keys() == []
    assert not [e for e in store.list_events() if e.kind == "key_created"]


def test_a_name_in_use_is_refused(rig: ConsoleRig, store: Store) -> None:
    store.create_api_key("app")

    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        answer = await create(b, name="app")
        return answer[0], answer[1]

    status, page = rig.run(scenario)
    assert status == 409 and "app" in flash_of(page) and not _SECRET.search(page)
    assert len(store.list_api_keys()) == 1


def test_the_list_shows_usage_today_and_in_the_budget_period(
    rig: ConsoleRig, store: Store, pending: list[UsageRow]
) -> None:
    key, _secret = store.create_api_key("app", KeyPolicy(budget=Budget(1000, "month"), rpm=60))
    today = usage_day(rig.clock())
    store.add_usage(
        [UsageRow(today, key.id, "chat", requests=3, prompt_tokens=10, completion_tokens=20)]
    )
    pending.append(  # counted here, not flushed yet
        UsageRow(today, key.id, "chat", requests=1, prompt_tokens=5, completion_tokens=5)
    )

    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        return (await b.get("/ui/keys?fragment=table"))[1], (await b.get(f"/ui/keys/{key.id}"))[1]

    table, page = rig.run(scenario)
    assert "4 req, 40 tok" in table  # stored and not yet flushed, added
    assert f"40 of 1k/month since {today[:8]}01" in table
    assert "rpm 60, budget 1k/month" in table
    assert 'id="key-today">4 requests, 40 tokens, 0 errors<' in page
    assert "40 of 1k/month spent" in page and "960 left" in page
    assert '<th scope="row">chat</th><td class="num">4</td>' in page


def test_revoke_needs_the_key_id_then_the_key_is_marked_revoked(
    rig: ConsoleRig, store: Store
) -> None:
    key, _secret = store.create_api_key("app")

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for confirm in ("", "app", key.id):
            status, body, resp = await b.post(
                f"/ui/keys/{key.id}/revoke", {"csrf": b.csrf, "confirm": confirm}
            )
            if status == 303:
                assert resp.headers["Location"] == f"/ui/keys/{key.id}"
                _, body, _ = await b.get(f"/ui/keys/{key.id}")
            out.append((status, body))
        again = await b.post(f"/ui/keys/{key.id}/revoke", {"csrf": b.csrf, "confirm": key.id})
        out.append(again[:2])
        out.append((await b.get("/ui/keys"))[:2])
        out.append((await b.get("/ui/keys?all=1"))[:2])
        return out

    (s1, p1), (s2, p2), (s3, p3), (s4, p4), (_, active), (_, every) = rig.run(scenario)
    assert s1 == s2 == 400 and f"confirm with its id ('{key.id}')" in flash_of(p1)
    assert "nothing done" in flash_of(p2)
    assert s3 == 303 and flash_of(p3).startswith("info: API key app (")
    assert 'id="key-state">revoked' in p3 and 'id="action-revoke"' not in p3
    assert s4 == 409 and "already revoked" in flash_of(p4)
    assert f'data-key="{key.id}"' not in active and 'id="no-keys"' in active
    assert f'data-key="{key.id}"' in every and "key-revoked" in every
    assert store.get_api_key(key.id).revoked
    assert [e.actor for e in store.list_events() if e.kind == "key_revoked"] == ["admin"]


def test_an_unknown_key(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        return [
            (await b.get("/ui/keys/nope"))[:2],
            (await b.post("/ui/keys/nope/revoke", {"csrf": b.csrf, "confirm": "nope"}))[:2],
        ]

    for status, page in rig.run(scenario):
        assert status == 404 and "nope" in page and "<h1" in page


def test_a_viewer_reads_the_keys_but_cannot_create_or_revoke(rig: ConsoleRig, store: Store) -> None:
    key, _secret = store.create_api_key("app")

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login("vera", VIEWER_PW)
        return [
            (await b.get("/ui/keys"))[:2],
            (await b.get(f"/ui/keys/{key.id}"))[:2],
            (await create(b, name="mine"))[:2],
            (await b.post(f"/ui/keys/{key.id}/revoke", {"csrf": b.csrf, "confirm": key.id}))[:2],
        ]

    (s1, listed), (s2, page), (s3, created), (s4, revoked) = rig.run(scenario)
    assert s1 == s2 == 200 and "app" in listed
    assert 'id="key-form"' not in listed and 'id="action-revoke"' not in page
    for status, refused in ((s3, created), (s4, revoked)):
        assert status == 403 and "is a viewer and may only read" in refused
        assert not _SECRET.search(refused)
    assert [k.name for k in store.list_api_keys()] == ["app"] and not key.revoked


def test_a_post_without_its_csrf_token_creates_nothing(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await b.post("/ui/keys", {"name": "app"})
        return status, page

    status, page = rig.run(scenario)
    assert status == 403 and "security token is missing" in page and not _SECRET.search(page)
    assert store.list_api_keys() == []


def test_a_hostile_key_name_is_escaped(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[str]:
        await b.login()
        created = (await create(b, name=HOSTILE))[1]
        key = store.list_api_keys()[0]
        return [
            created,
            (await b.get("/ui/keys"))[1],
            (await b.get(f"/ui/keys/{key.id}"))[1],
            (await create(b, name=HOSTILE))[1],  # refused: the name is in use
        ]

    for page in rig.run(scenario):
        assert "<script>" not in page
        assert "&lt;script&gt;" in page
