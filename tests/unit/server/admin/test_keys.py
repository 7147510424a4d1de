"""The admin API's API keys with their policy and usage: POST /api/keys with a policy, the
list, GET and PATCH /api/keys/{key} (the key, its policy, today's usage, the budget spent,
the last 7 days by model; what changed), GET /api/usage; this instance's counts not flushed
yet added in; every change refreshes the gateway's keys and leaves an event. Refusals (a bad
budget, an unknown priority or field, an expiry in the past or too short, a revoked key, a
name taken or shared) change nothing, refresh nothing and say what to do."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.keypolicy import KeyPolicy, UsageRow
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.admin.keys_rig import Admin

T0 = 1_796_205_600.0  # 2026-12-02 10:00 UTC
DAY = 86400.0


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin(store)


NO_USAGE = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "errors": 0}  # fmt: skip


def _usage(requests: int, prompt: int, completion: int, cached: int = 0, errors: int = 0) -> dict[str, int]:  # fmt: skip
    return {
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "errors": errors,
    }


# ------------------------------------------------------------------------------ create


def test_a_key_is_created_with_its_policy(admin: Admin, store: Store) -> None:
    data = admin.ok(
        "POST",
        "/api/keys",
        {
            "name": " ci ",
            "models": ["llama", "qwen"],
            "rpm": 60,
            "tpm": "100k",
            "max_concurrent": 4,
            "budget": "10M/day",
            "priority": "high",
            "expires": "90d",
            "resume": False,
        },
        status=201,
    )
    key = store.get_api_key("ci")
    assert key.policy.resume is False  # as stored
    assert data == {
        "id": key.id,
        "name": "ci",
        "prefix": key.prefix,
        "key": data["key"],
        "state": "active",
        "created_at": T0,
        "updated_at": T0,
        "revoked_at": None,
        "policy": {
            "models": ["llama", "qwen"],
            "rpm": 60,
            "tpm": 100_000,
            "max_concurrent": 4,
            "budget": "10M/day",
            "priority": "high",
            "expires_at": T0 + 90 * DAY,
            "resume": False,
        },
        "policy_summary": "models llama,qwen, rpm 60, tpm 100k, 4 at once, budget 10M/day, "
        "priority high, no resume",
    }
    assert data["key"].startswith(key.prefix) and store.verify_api_key(data["key"]) == key
    assert admin.refreshed == 1
    event = store.list_events(limit=1)[0]
    assert (event.kind, event.subject, event.message) == (
        "key_created",
        key.id,
        "ci: models llama,qwen, rpm 60, tpm 100k, 4 at once, budget 10M/day, priority high, "
        "expires 2027-03-02 10:00 UTC, no resume",
    )


def test_a_key_without_a_policy_is_unlimited(admin: Admin) -> None:
    data = admin.ok("POST", "/api/keys", {"name": "laptop"}, status=201)
    assert data["policy"] == KeyPolicy().to_json()
    assert data["policy_summary"] == "unlimited"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"name": "ci", "budget": "10M/week"},
            "budget period must be day or month (calendar periods in UTC); got 'week' in "
            "'10M/week'",
        ),
        (
            {"name": "ci", "budget": 5},
            "budget must be TOKENS/PERIOD with PERIOD day or month (in UTC), e.g. 10M/day or "
            "100M/month; got 5",
        ),
        (
            {"name": "ci", "priority": "urgent"},
            "priority must be one of high, normal, low; got 'urgent'",
        ),
        (
            {"name": "ci", "expires": "30s"},
            "expires must be at least 1 minute from now (e.g. 90d); got '30s'",
        ),
        (
            {"name": "ci", "expires": "-1d"},
            "expires must be seconds, or a duration like 500ms, 30s, 5m, 2h or 30d; got '-1d' (or never)",
        ),
        ({"name": "ci", "rpm": 0}, "rpm must be between 1 and 1000000000000000; got 0"),
        (
            {"name": "ci", "rpm": True},
            "rpm must be a whole number, optionally with k, M, G or T (e.g. 500, 10k, 2M); got True",
        ),
        (
            {"name": "ci", "models": ["bad name"]},
            "'bad name' is not a model name (1-128 letters, digits and . _ : / -)",
        ),
        (
            {"name": "ci", "rate": 5},
            "unknown key policy field(s) rate; a key's policy takes models, rpm, tpm, "
            "max_concurrent, budget, priority, expires, resume",
        ),
        ({"name": ""}, "a key needs a name of 1-64 characters (who or what uses it)"),
        ({"rpm": 5}, "a key needs a name of 1-64 characters (who or what uses it)"),
    ],
)
def test_a_bad_policy_makes_no_key(
    admin: Admin, store: Store, body: dict[str, Any], message: str
) -> None:
    assert admin.refused("POST", "/api/keys", body) == message
    assert store.list_api_keys(include_revoked=True) == []
    assert (admin.refreshed, store.list_events()) == (0, [])


def test_an_active_keys_name_is_refused_a_new_key(admin: Admin, store: Store) -> None:
    first = admin.ok("POST", "/api/keys", {"name": "ci"}, status=201)
    message = admin.refused("POST", "/api/keys", {"name": "ci", "rpm": 5}, status=409)
    assert message == (
        f"an active API key is named ci already ({first['id']}); choose another name, or "
        f"revoke that key first ('llmgw ctl keys revoke {first['id']}') if this one replaces it"
    )
    assert [k.id for k in store.list_api_keys()] == [first["id"]]
    assert admin.refreshed == 1


# -------------------------------------------------------------------------- list, show


def test_the_list_gives_each_keys_policy_and_state(
    admin: Admin, store: Store, clock: Clock
) -> None:
    admin.ok("POST", "/api/keys", {"name": "ci", "rpm": 60}, status=201)
    clock.advance(1)
    admin.ok("POST", "/api/keys", {"name": "soon", "expires": "1h"}, status=201)
    clock.advance(1)
    old = admin.ok("POST", "/api/keys", {"name": "old"}, status=201)
    admin.ok("DELETE", f"/api/keys/{old['id']}")
    clock.advance(2 * 3600)
    listed = admin.ok("GET", "/api/keys")
    assert [(k["name"], k["state"], k["policy_summary"]) for k in listed] == [
        ("ci", "active", "rpm 60"),
        ("soon", "expired", "unlimited"),
    ]
    assert listed[0]["policy"]["rpm"] == 60 and "key" not in listed[0]
    assert "hash" not in listed[0]
    every = admin.ok("GET", "/api/keys?all=1")
    assert [(k["name"], k["state"]) for k in every][-1] == ("old", "revoked")


def test_show_gives_todays_usage_the_budget_spent_and_the_week_by_model(
    admin: Admin, store: Store
) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci", "budget": "1k/month"}, status=201)
    other = admin.ok("POST", "/api/keys", {"name": "lab"}, status=201)
    key = made["id"]
    store.add_usage(
        [
            UsageRow("2026-11-25", key, "llama", 9, 900, 900),  # before the week, last month
            UsageRow("2026-11-26", key, "llama", 1, 10, 20, 5),  # the week's first day
            UsageRow("2026-12-01", key, "qwen", 2, 100, 50, 0, 1),
            UsageRow("2026-12-02", key, "llama", 3, 200, 100, 50),
            UsageRow("2026-12-02", other["id"], "llama", 7, 7, 7),  # another key's
        ]
    )
    # This instance's counts not flushed yet: today's llama, and a new model.
    admin.pending = [
        UsageRow("2026-12-02", key, "llama", 1, 10, 10, 0, 1),
        UsageRow("2026-12-02", key, "mistral", 1, 5, 5),
        UsageRow("2026-12-02", other["id"], "llama", 1, 1, 1),
    ]
    shown = admin.ok("GET", "/api/keys/ci")
    assert {k: shown[k] for k in ("id", "name", "state")} == {
        "id": key,
        "name": "ci",
        "state": "active",
    }
    assert shown["usage"] == {
        "today": {"day": "2026-12-02", **_usage(5, 215, 115, 50, 1)},
        "budget": {
            "budget": "1k/month",
            "tokens": 1000,
            "period": "month",
            "since": "2026-12-01",
            "spent": 150 + 300 + 20 + 10,
            "remaining": 1000 - 480,
        },
        "last_7_days": {
            "since": "2026-11-26",
            "until": "2026-12-02",
            "models": [
                {"model": "llama", **_usage(5, 220, 130, 55, 1)},
                {"model": "mistral", **_usage(1, 5, 5)},
                {"model": "qwen", **_usage(2, 100, 50, 0, 1)},
            ],
        },
    }
    # By id and prefix the same; a key without a budget says so; one without usage, zeros.
    assert admin.ok("GET", f"/api/keys/{made['prefix']}") == shown
    lab = admin.ok("GET", f"/api/keys/{other['id']}")["usage"]
    assert lab["budget"] is None and lab["today"] == {"day": "2026-12-02", **_usage(8, 8, 8)}
    fresh = admin.ok("POST", "/api/keys", {"name": "fresh", "budget": "5k/day"}, status=201)
    unused = admin.ok("GET", f"/api/keys/{fresh['id']}")["usage"]
    assert unused["today"] == {"day": "2026-12-02", **NO_USAGE}
    assert (unused["budget"]["spent"], unused["budget"]["remaining"]) == (0, 5000)
    assert unused["last_7_days"]["models"] == []


def test_a_spent_budget_has_nothing_remaining(admin: Admin, store: Store) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci", "budget": "100/day"}, status=201)
    store.add_usage([UsageRow("2026-12-01", made["id"], "llama", 1, 500, 500)])  # yesterday
    store.add_usage([UsageRow("2026-12-02", made["id"], "llama", 1, 80, 70)])
    budget = admin.ok("GET", "/api/keys/ci")["usage"]["budget"]
    assert (budget["since"], budget["spent"], budget["remaining"]) == ("2026-12-02", 150, 0)


def test_show_of_an_unknown_or_shared_name_says_what_to_do(admin: Admin, store: Store) -> None:
    assert admin.refused("GET", "/api/keys/nope", status=404) == (
        "no API key with id, prefix or name nope; 'llmgw ctl keys list --all' lists them"
    )
    k1 = admin.ok("POST", "/api/keys", {"name": "ci"}, status=201)
    k2 = admin.ok("POST", "/api/keys", {"name": "ci2"}, status=201)
    with store.transaction():
        store.database.execute("UPDATE api_keys SET name = 'ci' WHERE id = ?", (k2["id"],))
    ids = sorted([k1["id"], k2["id"]], key=lambda i: (store.get_api_key(i).created_at, i))
    assert admin.refused("GET", "/api/keys/ci", status=409) == (
        f"2 active API keys are named ci ({', '.join(ids)}); name the key by its id"
    )


# ------------------------------------------------------------------------------ update


def test_update_changes_what_it_is_given_and_says_what_changed(
    admin: Admin, store: Store, clock: Clock
) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci", "rpm": 60, "models": "llama"}, status=201)
    clock.advance(60)
    data = admin.ok(
        "PATCH", "/api/keys/ci", {"rpm": "120", "budget": "10M/day", "expires": "never"}
    )
    assert data["changed"] == {
        "rpm": {"from": 60, "to": 120},
        "budget": {"from": None, "to": "10M/day"},
    }
    assert data["policy"] == {
        **KeyPolicy().to_json(),
        "models": ["llama"],
        "rpm": 120,
        "budget": "10M/day",
    }
    assert data["updated_at"] == T0 + 60 and data["created_at"] == T0
    assert data["usage"]["budget"]["remaining"] == 10_000_000
    assert store.get_api_key(made["id"]).policy.rpm == 120
    assert admin.refreshed == 2
    event = store.list_events(limit=1)[0]
    assert (event.kind, event.subject, event.message) == (
        "key_updated",
        made["id"],
        "ci: rpm 60 -> 120, budget none -> 10M/day",
    )
    # null (or 'none' from ctl as null) clears; models null: all of them.
    cleared = admin.ok(
        "PATCH", f"/api/keys/{made['id']}", {"rpm": None, "models": None, "expires": "30d"}
    )
    assert cleared["changed"] == {
        "models": {"from": ["llama"], "to": []},
        "rpm": {"from": 120, "to": None},
        "expires_at": {"from": None, "to": T0 + 60 + 30 * DAY},
    }
    assert store.list_events(limit=1)[0].message == (
        "ci: models llama -> all, rpm 120 -> none, expires never -> 2027-01-01 10:01 UTC"
    )


def test_resume_is_turned_off_and_on_again(admin: Admin, store: Store) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci"}, status=201)
    assert made["policy"]["resume"] is True  # the default: as the model's profile says
    data = admin.ok("PATCH", "/api/keys/ci", {"resume": False})
    assert data["changed"] == {"resume": {"from": True, "to": False}}
    assert store.get_api_key(made["id"]).policy.resume is False
    assert store.list_events(limit=1)[0].message == "ci: resume on -> off"
    # null clears it back to the default; the console's form sends on / off
    assert admin.ok("PATCH", "/api/keys/ci", {"resume": None})["policy"]["resume"] is True
    admin.ok("PATCH", "/api/keys/ci", {"resume": "off"})
    assert store.get_api_key(made["id"]).policy.resume is False


def test_an_update_that_changes_nothing_says_so_and_writes_nothing(
    admin: Admin, store: Store, clock: Clock
) -> None:
    admin.ok("POST", "/api/keys", {"name": "ci", "rpm": 60}, status=201)
    clock.advance(5)
    data = admin.ok("PATCH", "/api/keys/ci", {"rpm": "60"})
    assert data["changed"] == {} and data["updated_at"] == T0
    assert admin.refreshed == 1 and len(store.list_events()) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {},
            "nothing to change; give one or more of models, rpm, tpm, max_concurrent, budget, priority, expires, resume",
        ),
        (
            {"name": "other"},
            "a key's name does not change; to use another, create a key of that name and revoke this one",
        ),
        (
            {"budget": "lots"},
            "budget must be TOKENS/PERIOD with PERIOD day or month (in UTC), e.g. 10M/day or 100M/month; got 'lots'",
        ),
        ({"priority": "top"}, "priority must be one of high, normal, low; got 'top'"),
        (
            {"expires": "10s"},
            "expires must be at least 1 minute from now (e.g. 90d); got '10s'",
        ),
        (
            {"rpm": 5, "burst": 9},
            "unknown key policy field(s) burst; a key's policy takes models, rpm, tpm, max_concurrent, budget, priority, expires, resume",
        ),
        (
            {"resume": "sometimes"},
            "resume must be true (the model's profile decides) or false (a broken stream of "
            "this key ends with an error event, a failed answer is not retried); got 'sometimes'",
        ),
        (
            {"resume": 0},
            "resume must be true (the model's profile decides) or false (a broken stream of "
            "this key ends with an error event, a failed answer is not retried); got 0",
        ),
    ],
)
def test_a_bad_update_changes_nothing(
    admin: Admin, store: Store, body: dict[str, Any], message: str
) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci", "rpm": 60}, status=201)
    assert admin.refused("PATCH", "/api/keys/ci", body) == message
    key = store.get_api_key(made["id"])
    assert (key.policy, key.updated_at) == (KeyPolicy(rpm=60), T0)
    assert admin.refreshed == 1 and len(store.list_events()) == 1


def test_a_revoked_key_is_not_updated(admin: Admin, store: Store) -> None:
    made = admin.ok("POST", "/api/keys", {"name": "ci"}, status=201)
    admin.ok("DELETE", "/api/keys/ci")
    for body in ({"rpm": 5}, {"priority": "normal"}):  # even a change to what it has
        assert admin.refused("PATCH", "/api/keys/ci", body, status=409) == (
            f"API key {made['id']} (ci) is revoked, and a revoked key stays revoked; create a "
            "new one instead ('llmgw ctl keys create ci')"
        )
    assert store.get_api_key(made["id"]).policy == KeyPolicy()
    assert admin.refreshed == 2
    assert [e.kind for e in store.list_events()] == ["key_revoked", "key_created"]
    assert admin.refused("PATCH", "/api/keys/nope", {"rpm": 5}, status=404).startswith(
        "no API key with id, prefix or name nope"
    )


# ------------------------------------------------------------------------------- usage


@pytest.fixture
def used(admin: Admin, store: Store) -> dict[str, str]:
    ci = admin.ok("POST", "/api/keys", {"name": "ci"}, status=201)["id"]
    lab = admin.ok("POST", "/api/keys", {"name": "lab"}, status=201)["id"]
    store.add_usage(
        [
            UsageRow("2026-11-01", ci, "llama", 1, 1, 1),
            UsageRow("2026-11-25", ci, "llama", 2, 2, 2),
            UsageRow("2026-11-26", lab, "qwen", 3, 3, 3),
            UsageRow("2026-12-02", ci, "llama", 4, 4, 4),
            UsageRow("2026-12-02", lab, "llama", 5, 5, 5),
        ]
    )
    return {"ci": ci, "lab": lab}


def _rows(data: list[dict[str, Any]]) -> list[tuple[str, str, str, int]]:
    return [(r["day"], r["key"], r["model"], r["requests"]) for r in data]


def test_usage_is_read_by_key_model_and_days(admin: Admin, used: dict[str, str]) -> None:
    # Since a week ago by default (2026-11-25 through today).
    assert _rows(admin.ok("GET", "/api/usage")) == [
        ("2026-11-25", "ci", "llama", 2),
        ("2026-11-26", "lab", "qwen", 3),
        ("2026-12-02", "ci", "llama", 4),
        ("2026-12-02", "lab", "llama", 5),
    ]
    assert _rows(admin.ok("GET", "/api/usage?key=ci&since=60d")) == [
        ("2026-11-01", "ci", "llama", 1),
        ("2026-11-25", "ci", "llama", 2),
        ("2026-12-02", "ci", "llama", 4),
    ]
    assert _rows(admin.ok("GET", f"/api/usage?key={used['lab']}&model=llama&since=0d")) == [
        ("2026-12-02", "lab", "llama", 5)
    ]
    assert _rows(admin.ok("GET", "/api/usage?since=2026-11-01&until=2026-11-25")) == [
        ("2026-11-01", "ci", "llama", 1),
        ("2026-11-25", "ci", "llama", 2),
    ]
    assert _rows(admin.ok("GET", "/api/usage?until=1d")) == [
        ("2026-11-25", "ci", "llama", 2),
        ("2026-11-26", "lab", "qwen", 3),
    ]
    [row] = admin.ok("GET", "/api/usage?key=lab&model=qwen")
    assert row == {
        "day": "2026-11-26",
        "key_id": used["lab"],
        "key": "lab",
        "model": "qwen",
        **_usage(3, 3, 3),
    }


def test_usage_adds_the_counts_not_flushed_yet(admin: Admin, used: dict[str, str]) -> None:
    admin.pending = [
        UsageRow("2026-12-02", used["ci"], "llama", 10, 10, 10),
        UsageRow("2026-12-02", used["ci"], "qwen", 1, 1, 1),
        UsageRow("2026-12-02", used["lab"], "llama", 1, 1, 1),
    ]
    assert _rows(admin.ok("GET", "/api/usage?key=ci&since=0d")) == [
        ("2026-12-02", "ci", "llama", 14),
        ("2026-12-02", "ci", "qwen", 1),  # only in memory so far: named all the same
    ]
    assert _rows(admin.ok("GET", "/api/usage?model=qwen&since=0d")) == [
        ("2026-12-02", "ci", "qwen", 1)
    ]
    assert _rows(admin.ok("GET", "/api/usage?since=2026-11-01&until=2026-11-01")) == [
        ("2026-11-01", "ci", "llama", 1)
    ]


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        (
            "since=yesterday",
            400,
            "since must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d or 12h; got 'yesterday'",
        ),
        (
            "since=2026-02-30",
            400,
            "since must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d or 12h; got '2026-02-30'",
        ),
        (
            "until=soon",
            400,
            "until must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d or 12h; got 'soon'",
        ),
        (
            "since=1d&until=3d",
            400,
            "since (2026-12-01) is after until (2026-11-29); nothing is between",
        ),
        (
            "user=ci",
            400,
            "unknown parameter(s) user; /api/usage takes key, model, since, until",
        ),
        (
            "key=nope",
            404,
            "no API key with id, prefix or name nope; 'llmgw ctl keys list --all' lists them",
        ),
    ],
)
def test_a_bad_usage_query_is_refused_naming_the_forms(
    admin: Admin, used: dict[str, str], query: str, status: int, message: str
) -> None:
    assert admin.refused("GET", f"/api/usage?{query}", status=status) == message
