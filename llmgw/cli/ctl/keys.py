"""``llmgw ctl keys``: the API keys of the gateway, each with its policy (the models it may
call, its rate limits, its token budget, its priority, its expiry) and its usage."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, count, echo_json, table, until
from llmgw.contracts.keypolicy import PRIORITIES, USAGE_COUNTS, describe_changes

__all__ = ["keys"]

_JSON_HELP = "Print JSON for scripts instead of text (as 'llmgw ctl --json')."
_CLEARS = "'none' clears it"


@click.group(cls=ReportingGroup)
def keys() -> None:
    """API keys for the gateway (/v1), with their limits and usage.

    \b
    A key's policy (every limit off unless given):
      --models     the models the key may call (default: all)
      --rpm        requests per minute, --tpm tokens (prompt + completion) per minute:
                   token buckets that refill continuously (rpm 60: one request a
                   second, bursts of up to 60)
      --max-concurrent  requests in flight at once; a stream counts until its last chunk
      --budget     tokens per calendar period in UTC: 10M/day (from 00:00 UTC) or
                   100M/month (from the 1st); once spent, requests get 429 until the
                   next period
      --priority   high, normal or low: the key's share when requests wait for a full model
      --expires    when the key stops working: a duration from now (90d) or never
      --no-resume  a stream of the key that breaks mid-answer ends with an error event,
                   and a failed answer is not retried on another replica (--resume: as
                   the model's profile says, the default)
    'llmgw ctl usage' shows what the keys used.
    """


def _policy_options(update: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of a key's policy (on update, 'none' clears a limit)."""
    clears = f"; {_CLEARS}" if update else ""
    options = [
        click.option(
            "--models",
            metavar="A,B",
            help="Models the key may call, comma-separated"
            + ("; 'all' lifts the restriction." if update else " (default: all)."),
        ),
        click.option(
            "--rpm",
            metavar="N",
            help=f"Requests per minute (a token bucket: bursts up to N), e.g. 60{clears}.",
        ),
        click.option(
            "--tpm",
            metavar="N",
            help=f"Tokens (prompt + completion) per minute, as a token bucket, e.g. 100k{clears}.",
        ),
        click.option(
            "--max-concurrent",
            metavar="N",
            help=f"Requests in flight at once; a stream counts until its last chunk{clears}.",
        ),
        click.option(
            "--budget",
            metavar="TOKENS/PERIOD",
            help="Tokens per calendar period in UTC: 10M/day or 100M/month; spent, the key "
            f"gets 429 until the next period{clears}.",
        ),
        click.option(
            "--priority",
            type=click.Choice(PRIORITIES),
            help="The key's share when requests wait for a model that is full"
            + ("." if update else " (default: normal)."),
        ),
        click.option(
            "--expires",
            metavar="DURATION",
            help="When the key stops working, from now: 90d, 12h; or never"
            + ("." if update else " (the default)."),
        ),
        click.option(
            "--resume/--no-resume",
            default=None,
            help="Whether the key's streams that break mid-answer go on on another replica, "
            "and its failed answers are retried there, as the model's profile says "
            "(--resume, the default) or never (--no-resume).",
        ),
    ]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _policy_body(given: dict[str, str | bool | None]) -> dict[str, Any]:
    """The admin API's policy fields from the options given ('none' -> null)."""
    body: dict[str, Any] = {}
    for name, value in given.items():
        if value is None:
            continue
        if isinstance(value, bool):  # --resume/--no-resume
            body[name] = value
            continue
        word = value.strip().lower()
        if name == "models":
            body[name] = None if word in ("all", "none") else value
        elif name == "expires":
            body[name] = "never" if word in ("never", "none") else value
        elif name == "priority":
            body[name] = value
        else:
            body[name] = None if word == "none" else value
    return body


def _resume_cell(resume: bool) -> str:
    if resume:
        return "as the model's profile says"
    return "off: a broken stream ends with an error event, a failed answer is not retried"


@keys.command("create")
@click.argument("name")
@_policy_options(update=False)
@pass_ctl
def keys_create(c: Ctl, name: str, **policy: str | bool | None) -> None:
    """Create a key for NAME (who or what uses it); the key is shown once.

    A name is unique among the active keys, and names the key in the other commands.
    """
    data = c.call("POST", "/api/keys", {"name": name, **_policy_body(policy)})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"created key {data['id']} for {data['name']}:")
    click.echo(data["key"])
    click.echo("store it now: it is not shown again (only its hash is kept)")
    click.echo(f"policy: {_policy_line(data)}")


@keys.command("update")
@click.argument("key")
@_policy_options(update=True)
@pass_ctl
def keys_update(c: Ctl, key: str, **policy: str | bool | None) -> None:
    """Change the policy of KEY (its id, prefix or name); what is not given stays.

    The gateway applies it at once (a standby within its next sync).
    """
    body = _policy_body(policy)
    if not body:
        raise click.UsageError(
            "nothing to change; give one or more of --models, --rpm, --tpm, "
            "--max-concurrent, --budget, --priority, --expires, --resume/--no-resume"
        )
    data = c.call("PATCH", _path(key), body)
    if c.as_json:
        echo_json(data)
        return
    changed = {k: (v["from"], v["to"]) for k, v in data["changed"].items()}
    if changed:
        click.echo(f"updated key {data['id']} ({data['name']}): {describe_changes(changed)}")
    else:
        click.echo(f"key {data['id']} ({data['name']}) already has that policy; nothing changed")
    click.echo(f"policy: {_policy_line(data)}")


@keys.command("list")
@click.option("--all", "include_all", is_flag=True, help="Include revoked keys.")
@pass_ctl
def keys_list(c: Ctl, include_all: bool) -> None:
    """List API keys (prefixes only) with their limits."""
    data = c.call("GET", "/api/keys" + ("?all=1" if include_all else ""))
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            k["id"],
            k["name"],
            k["prefix"] + "…",
            k["policy_summary"],
            until(k["policy"]["expires_at"]) if k["policy"]["expires_at"] else "never",
            ago(k["created_at"]),
            k["state"],
        ]
        for k in data
    ]
    click.echo(table(["ID", "NAME", "PREFIX", "POLICY", "EXPIRES", "CREATED", "STATE"], rows))


@keys.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@pass_ctl
def keys_show(c: Ctl, key: str, as_json: bool) -> None:
    """KEY's policy and usage: today, its budget's period, the last 7 days by model."""
    data = c.call("GET", _path(key))
    if as_json or c.as_json:
        echo_json(data)
        return
    click.echo("\n".join(_shown(data)))


@keys.command("revoke")
@click.argument("key")
@pass_ctl
def keys_revoke(c: Ctl, key: str) -> None:
    """Revoke KEY (its id, prefix or name); requests with it get 401 at once."""
    data = c.call("DELETE", _path(key))
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"revoked key {data['id']} ({data['name']})")


def _path(key: str) -> str:
    return f"/api/keys/{quote(key, safe='')}"


def _policy_line(data: dict[str, Any]) -> str:
    expires = data["policy"]["expires_at"]
    return data["policy_summary"] + (f" (expires {until(expires)})" if expires else "")


def _shown(data: dict[str, Any]) -> list[str]:
    """``keys show``: the key and each limit, then its usage."""
    policy, usage = data["policy"], data["usage"]
    state = f"{data['state']}, created {ago(data['created_at'])}"
    if data["updated_at"] and data["updated_at"] != data["created_at"]:
        state += f", changed {ago(data['updated_at'])}"
    if data["revoked_at"]:
        state += f", revoked {ago(data['revoked_at'])}"
    budget = usage["budget"]
    if budget is None:
        budget_cell = "none"
    else:
        budget_cell = (
            f"{budget['budget']}: {count(budget['spent'])} spent since {budget['since']} "
            f"(UTC), {count(budget['remaining'])} left"
        )
    expires = policy["expires_at"]
    lines = table(
        ["key", f"{data['name']} ({data['id']}, {data['prefix']}…)"],
        [
            ["state", state],
            ["models", ", ".join(policy["models"]) or "all"],
            ["rpm", _limit(policy["rpm"], "requests a minute")],
            ["tpm", _limit(policy["tpm"], "tokens a minute")],
            ["max concurrent", _limit(policy["max_concurrent"], "requests at once")],
            ["budget", budget_cell],
            ["priority", policy["priority"]],
            ["resume", _resume_cell(policy.get("resume", True))],
            [
                "expires",
                "never"
                if expires is None
                else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
                + f" ({until(expires)})",
            ],
        ],
    ).splitlines()
    today = usage["today"]
    lines += ["", f"today ({today['day']}, UTC): {_counts_line(today)}"]
    week = usage["last_7_days"]
    lines.append(f"last 7 days ({week['since']} to {week['until']}):")
    if not week["models"]:
        lines.append("  no requests")
    else:
        rows = [[m["model"], *(count(m[c]) for c in USAGE_COUNTS)] for m in week["models"]]
        lines += table(["MODEL", *USAGE_HEADERS], rows).splitlines()
    return lines


USAGE_HEADERS = ["REQUESTS", "PROMPT", "COMPLETION", "CACHED", "ERRORS"]
"""The columns of :data:`~llmgw.contracts.keypolicy.USAGE_COUNTS` in a table."""


def _limit(value: int | None, unit: str) -> str:
    return "unlimited" if value is None else f"{count(value)} {unit}"


def _counts_line(totals: dict[str, int]) -> str:
    errors = totals["errors"]
    return (
        f"{count(totals['requests'])} requests, {count(totals['prompt_tokens'])} prompt + "
        f"{count(totals['completion_tokens'])} completion tokens "
        f"({count(totals['cached_tokens'])} cached), {count(errors)} "
        + ("error" if errors == 1 else "errors")
    )
