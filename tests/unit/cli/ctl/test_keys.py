"""``llmgw ctl keys create|update|show|list|revoke`` and ``llmgw ctl usage`` against the
real admin API on a real store (answered in process): the policy options as the server reads
them ('none' clears), what the operator reads (the policy column, a key's limits and usage,
the usage table and its total), --json, and refusals with their fix."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.contracts.keypolicy import KeyPolicy, UsageRow, usage_day
from llmgw.server.store import Store
from tests.unit.cli.ctl.fakeapi import FakeAPI, Status
from tests.unit.clock import Clock
from tests.unit.server.admin.keys_rig import Admin

DAY = 86400.0


@pytest.fixture
def clock() -> Clock:
    # The real time, so that ctl's "5m ago" and "in 90d" read the store's stamps right.
    return Clock(time.time())


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db", clock=clock)
    yield s
    s.close()


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin(store)


@pytest.fixture
def api(admin: Admin) -> FakeAPI:
    return FakeAPI(lambda method, path, body: Status(*admin.call(method, path, body)))


def ok(api: FakeAPI, *args: str) -> str:
    out = api.ctl(*args)
    assert out.exit_code == 0, out.output
    return out.output


# ------------------------------------------------------------------------------ create


def test_create_sends_the_policy_and_shows_it_with_the_key(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    out = ok(api,
        "keys", "create", "ci", "--models", "llama,qwen", "--rpm", "60", "--tpm", "100k",
        "--max-concurrent", "4", "--budget", "10M/day", "--priority", "high", "--expires", "90d",
        "--no-resume",
    )  # fmt: skip
    key = store.get_api_key("ci")
    assert api.calls == [
        (
            "POST",
            "/api/keys",
            {
                "name": "ci",
                "models": "llama,qwen",
                "rpm": "60",
                "tpm": "100k",
                "max_concurrent": "4",
                "budget": "10M/day",
                "priority": "high",
                "expires": "90d",
                "resume": False,
            },
        )
    ]
    secret = out.splitlines()[1]
    assert store.verify_api_key(secret) == key
    assert out == (
        f"created key {key.id} for ci:\n"
        f"{secret}\n"
        "store it now: it is not shown again (only its hash is kept)\n"
        "policy: models llama,qwen, rpm 60, tpm 100k, 4 at once, budget 10M/day, priority "
        "high, no resume (expires in 90d)\n"
    )
    assert key.policy.resume is False
    assert key.policy.budget is not None and key.policy.budget.tokens == 10_000_000


def test_create_without_options_makes_an_unlimited_key(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    out = ok(api, "keys", "create", "laptop")
    assert api.calls == [("POST", "/api/keys", {"name": "laptop"})]
    assert out.endswith("policy: unlimited\n")
    assert store.get_api_key("laptop").policy == KeyPolicy()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--budget", "10M/week"),
            "error: budget period must be day or month (calendar periods in UTC); got 'week' "
            "in '10M/week'\n",
        ),
        (
            ("--rpm", "lots"),
            "error: rpm must be a whole number, optionally with k, M, G or T (e.g. 500, 10k, 2M); got 'lots'\n",
        ),
        (
            ("--expires", "10s"),
            "error: expires must be at least 1 minute from now (e.g. 90d); got '10s'\n",
        ),
    ],
)
def test_a_bad_option_makes_no_key(
    api: FakeAPI, admin: Admin, store: Store, args: tuple[str, ...], message: str
) -> None:
    out = api.ctl("keys", "create", "ci", *args)
    assert (out.exit_code, out.output) == (1, message)
    assert store.list_api_keys() == []


def test_an_unknown_priority_is_refused_before_the_server_is_asked(
    api: FakeAPI, admin: Admin
) -> None:
    out = api.ctl("keys", "create", "ci", "--priority", "urgent")
    assert out.exit_code == 2
    assert "Invalid value for '--priority': 'urgent' is not one of 'high', 'normal', 'low'." in (
        out.output
    )
    assert api.calls == []


def test_a_name_an_active_key_has_is_refused_with_the_fix(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    ok(api, "keys", "create", "ci")
    key = store.get_api_key("ci")
    out = api.ctl("keys", "create", "ci")
    assert (out.exit_code, out.output) == (
        1,
        f"error: an active API key is named ci already ({key.id}); choose another name, or "
        f"revoke that key first ('llmgw ctl keys revoke {key.id}') if this one replaces it\n",
    )


# ------------------------------------------------------------------------------ update


def test_update_changes_what_is_given_and_none_clears(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    ok(api, "keys", "create", "ci", "--rpm", "60", "--models", "llama", "--expires", "30d")
    key = store.get_api_key("ci")
    out = ok(api, "keys", "update", "ci", "--rpm", "120", "--budget", "1M/month")
    assert api.calls[-1] == (
        "PATCH",
        "/api/keys/ci",
        {"rpm": "120", "budget": "1M/month"},
    )
    assert out == (
        f"updated key {key.id} (ci): rpm 60 -> 120, budget none -> 1M/month\n"
        "policy: models llama, rpm 120, budget 1M/month (expires in 30d)\n"
    )
    out = ok(api,
        "keys", "update", key.prefix, "--rpm", "none", "--budget", "none", "--models", "all",
        "--expires", "never",
    )  # fmt: skip
    assert api.calls[-1][2] == {"rpm": None, "budget": None, "models": None, "expires": "never"}
    assert out.startswith(f"updated key {key.id} (ci): models llama -> all, rpm 120 -> none, ")
    assert out.endswith("policy: unlimited\n")
    assert store.get_api_key(key.id).policy == KeyPolicy()
    out = ok(api, "keys", "update", "ci", "--priority", "normal")
    assert out == (
        f"key {key.id} (ci) already has that policy; nothing changed\npolicy: unlimited\n"
    )
    out = ok(api, "keys", "update", "ci", "--no-resume")
    assert api.calls[-1][2] == {"resume": False}
    assert out == f"updated key {key.id} (ci): resume on -> off\npolicy: no resume\n"
    lines = ok(api, "keys", "show", "ci").splitlines()
    assert (
        "resume          off: a broken stream ends with an error event, a failed answer is "
        "not retried"
    ) in lines
    ok(api, "keys", "update", "ci", "--resume")
    assert api.calls[-1][2] == {"resume": True}
    assert store.get_api_key(key.id).policy == KeyPolicy()


def test_update_without_a_change_is_a_usage_error(api: FakeAPI, admin: Admin) -> None:
    out = api.ctl("keys", "update", "ci")
    assert out.exit_code == 2
    assert (
        "nothing to change; give one or more of --models, --rpm, --tpm, --max-concurrent, "
        "--budget, --priority, --expires"
    ) in out.output
    assert api.calls == []


def test_update_of_a_revoked_key_is_refused(api: FakeAPI, admin: Admin, store: Store) -> None:
    ok(api, "keys", "create", "ci")
    key = store.get_api_key("ci")
    ok(api, "keys", "revoke", "ci")
    out = api.ctl("keys", "update", "ci", "--rpm", "5")
    assert (out.exit_code, out.output) == (
        1,
        f"error: API key {key.id} (ci) is revoked, and a revoked key stays revoked; create a "
        "new one instead ('llmgw ctl keys create ci')\n",
    )


def test_a_name_with_odd_characters_travels_quoted(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    ok(api, "keys", "create", "team a/b")
    ok(api, "keys", "update", "team a/b", "--rpm", "5")
    assert api.calls[-1][1] == "/api/keys/team%20a%2Fb"
    assert store.get_api_key("team a/b").policy.rpm == 5


# ------------------------------------------------------------------------ list, show


def test_the_list_has_a_policy_and_an_expiry_column(
    api: FakeAPI, admin: Admin, store: Store, clock: Clock
) -> None:
    ok(api, "keys", "create", "ci", "--rpm", "60", "--budget", "10M/day")
    clock.advance(1)
    ok(api, "keys", "create", "lab", "--expires", "12h")
    ci, lab = store.get_api_key("ci"), store.get_api_key("lab")
    out = ok(api, "keys", "list")
    assert out == (
        "ID            NAME  PREFIX         POLICY                  EXPIRES  CREATED  STATE\n"
        f"{ci.id}  ci    {ci.prefix}…  rpm 60, budget 10M/day  never    0s ago   active\n"
        f"{lab.id}  lab   {lab.prefix}…  unlimited               in 12h   0s ago   active\n"
    )
    assert [k["name"] for k in json.loads(ok(api, "--json", "keys", "list"))] == ["ci", "lab"]


def test_show_gives_the_limits_and_the_usage(
    api: FakeAPI, admin: Admin, store: Store, clock: Clock
) -> None:
    ok(api, "keys", "create", "ci", "--rpm", "60", "--budget", "1M/day", "--models", "llama,qwen")
    key = store.get_api_key("ci")
    today, yesterday = usage_day(clock.t), usage_day(clock.t - DAY)
    week = usage_day(clock.t - 6 * DAY)
    store.add_usage(
        [
            UsageRow(today, key.id, "llama", 3, 1500, 2500, 1000, 1),
            UsageRow(yesterday, key.id, "qwen", 2, 20, 30, 0, 0),
        ]
    )
    admin.pending = [UsageRow(today, key.id, "llama", 1, 500, 500)]
    out = ok(api, "keys", "show", "ci")
    assert out == (
        f"key             ci ({key.id}, {key.prefix}…)\n"
        "state           active, created 0s ago\n"
        "models          llama, qwen\n"
        "rpm             60 requests a minute\n"
        "tpm             unlimited\n"
        "max concurrent  unlimited\n"
        f"budget          1M/day: 5,000 spent since {today} (UTC), 995,000 left\n"
        "priority        normal\n"
        "resume          as the model's profile says\n"
        "expires         never\n"
        "\n"
        f"today ({today}, UTC): 4 requests, 2,000 prompt + 3,000 completion tokens "
        "(1,000 cached), 1 error\n"
        f"last 7 days ({week} to {today}):\n"
        "MODEL  REQUESTS  PROMPT  COMPLETION  CACHED  ERRORS\n"
        "llama  4         2,000   3,000       1,000   1\n"
        "qwen   2         20      30          0       0\n"
    )
    for args in (("keys", "show", key.id, "--json"), ("--json", "keys", "show", key.prefix)):
        data = json.loads(ok(api, *args))
        assert data["usage"]["budget"]["remaining"] == 995_000


def test_show_of_an_unused_expiring_key(
    api: FakeAPI, admin: Admin, store: Store, clock: Clock
) -> None:
    ok(api, "keys", "create", "lab", "--expires", "90d", "--max-concurrent", "2")
    lines = ok(api, "keys", "show", "lab").splitlines()
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(clock.t + 90 * DAY))
    assert lines[5:11] == [
        "max concurrent  2 requests at once",
        "budget          none",
        "priority        normal",
        "resume          as the model's profile says",
        f"expires         {expires} (in 90d)",
        "",
    ]
    assert lines[11:] == [
        f"today ({usage_day(clock.t)}, UTC): 0 requests, 0 prompt + 0 completion tokens "
        "(0 cached), 0 errors",
        f"last 7 days ({usage_day(clock.t - 6 * DAY)} to {usage_day(clock.t)}):",
        "  no requests",
    ]


def test_show_of_an_unknown_key_says_how_to_list_them(api: FakeAPI, admin: Admin) -> None:
    out = api.ctl("keys", "show", "nope")
    assert (out.exit_code, out.output) == (
        1,
        "error: no API key with id, prefix or name nope; 'llmgw ctl keys list --all' lists them\n",
    )


# ------------------------------------------------------------------------------- usage


@pytest.fixture
def used(api: FakeAPI, admin: Admin, store: Store, clock: Clock) -> dict[str, str]:
    ok(api, "keys", "create", "ci")
    ok(api, "keys", "create", "lab")
    ci, lab = store.get_api_key("ci").id, store.get_api_key("lab").id
    today, yesterday = usage_day(clock.t), usage_day(clock.t - DAY)
    old = usage_day(clock.t - 30 * DAY)
    store.add_usage(
        [
            UsageRow(old, ci, "llama", 100, 100, 100),
            UsageRow(yesterday, ci, "llama", 1, 1000, 2000, 500, 0),
            UsageRow(today, ci, "llama", 2, 3000, 4000, 0, 1),
            UsageRow(today, ci, "qwen", 1, 10, 20),
            UsageRow(today, lab, "llama", 5, 50, 50, 0, 2),
        ]
    )
    return {"ci": ci, "lab": lab, "today": today, "yesterday": yesterday, "old": old}


def test_usage_sums_the_window_per_key_and_model_with_a_total(
    api: FakeAPI, admin: Admin, used: dict[str, str]
) -> None:
    out = ok(api, "usage")
    assert api.calls[-1] == ("GET", "/api/usage?since=7d", None)
    assert out == (
        "KEY    MODEL  REQUESTS  PROMPT  COMPLETION  CACHED  ERRORS\n"
        "ci     llama  3         4,000   6,000       500     1\n"
        "ci     qwen   1         10      20          0       0\n"
        "lab    llama  5         50      50          0       2\n"
        "TOTAL         9         4,060   6,070       500     3\n"
    )


def test_usage_by_day_for_one_key_and_model(
    api: FakeAPI, admin: Admin, used: dict[str, str]
) -> None:
    out = ok(api, "usage", "--key", "ci", "--model", "llama", "--since", "60d", "--by-day")
    assert api.calls[-1][1] == "/api/usage?key=ci&model=llama&since=60d"
    assert out == (
        "DAY         KEY  MODEL  REQUESTS  PROMPT  COMPLETION  CACHED  ERRORS\n"
        f"{used['old']}  ci   llama  100       100     100         0       0\n"
        f"{used['yesterday']}  ci   llama  1         1,000   2,000       500     0\n"
        f"{used['today']}  ci   llama  2         3,000   4,000       0       1\n"
        "TOTAL                   103       4,100   6,100       500     1\n"
    )


def test_usage_as_json_is_the_rows(api: FakeAPI, admin: Admin, used: dict[str, str]) -> None:
    for args in (("usage", "--json", "--until", "1d"), ("--json", "usage", "--until", "1d")):
        rows = json.loads(ok(api, *args))
        assert rows == [
            {
                "day": used["yesterday"],
                "key_id": used["ci"],
                "key": "ci",
                "model": "llama",
                "requests": 1,
                "prompt_tokens": 1000,
                "completion_tokens": 2000,
                "cached_tokens": 500,
                "errors": 0,
            }
        ]


def test_usage_tells_keys_of_one_name_apart(
    api: FakeAPI, admin: Admin, store: Store, clock: Clock
) -> None:
    ok(api, "keys", "create", "ci")
    old = store.get_api_key("ci").id
    ok(api, "keys", "revoke", "ci")
    ok(api, "keys", "create", "ci")
    new = store.get_api_key("ci").id
    today = usage_day(clock.t)
    store.add_usage([UsageRow(today, old, "m", 1, 1, 1), UsageRow(today, new, "m", 2, 2, 2)])
    lines = ok(api, "usage").splitlines()
    assert sorted(line.split("  ")[0] for line in lines[1:3]) == sorted(
        [f"ci ({old})", f"ci ({new})"]
    )


def test_usage_of_an_empty_window_says_so(api: FakeAPI, admin: Admin, used: dict[str, str]) -> None:
    assert ok(api, "usage", "--model", "mistral") == "no usage since 7d\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--since", "last week"),
            "error: since must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d or 12h; got 'last week'\n",
        ),
        (
            ("--key", "nope"),
            "error: no API key with id, prefix or name nope; 'llmgw ctl keys list --all' lists them\n",
        ),
    ],
)
def test_a_bad_usage_option_is_refused_naming_the_forms(
    api: FakeAPI, admin: Admin, used: dict[str, str], args: tuple[str, ...], message: str
) -> None:
    out = api.ctl("usage", *args)
    assert (out.exit_code, out.output) == (1, message)
