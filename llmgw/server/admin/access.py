"""Admin routes that hand out access: API keys for the gateway, with their policy (what a
key may do, :mod:`llmgw.contracts.keypolicy`) and their usage (the store's rows and this
instance's counts not flushed yet), and join tokens (with the command that joins a node)
for the enrolment service.

Minting a join token is :func:`llmgw.server.admin.jointokens.create_join_token`, which
``POST /api/join-tokens`` and the console's Add node page both call; what the console shows and does to API keys is the same
code too: :func:`create_key`, :func:`revoke_key`, :func:`key_detail` and :func:`usage_rows`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from llmgw.contracts.joining import OLD_REPAIR_FIELD, REPAIR_FIELD
from llmgw.contracts.keypolicy import (
    POLICY_FIELDS,
    USAGE_COUNTS,
    UsageRow,
    describe_changes,
    period_start,
    policy_changes,
    policy_from_json,
    usage_day,
    usage_day_from,
)
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.admin.jointokens import create_join_token
from llmgw.server.store import ApiKey

__all__ = [
    "DEFAULT_USAGE_SINCE",
    "AccessRoutes",
    "add_usage_rows",
    "create_key",
    "key_detail",
    "key_json",
    "revoke_key",
    "usage_rows",
]

DEFAULT_USAGE_SINCE = "7d"
"""How far back ``GET /api/usage`` reads when not told (the day a week ago, through today)."""
_USAGE_QUERY = ("key", "model", "since", "until")


class AccessRoutes:
    """API keys and join tokens."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    # -- API keys -------------------------------------------------------------------------------

    async def keys(self, request: web.Request) -> web.Response:
        include = request.query.get("all") in ("1", "true")
        now = _now(self.ctx)
        return web.json_response(
            [key_json(k, now) for k in self.ctx.store.list_api_keys(include_revoked=include)]
        )

    async def create_key(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        key, secret = create_key(self.ctx, body, actor=principal_of(request).actor)
        return web.json_response({**key_json(key, _now(self.ctx)), "key": secret}, status=201)

    async def key(self, request: web.Request) -> web.Response:
        key = self.ctx.store.get_api_key(request.match_info["key"], prefer_active=True)
        return web.json_response(key_detail(self.ctx, key))

    async def update_key(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        if "name" in body:
            raise BadRequest(
                "a key's name does not change; to use another, create a key of that name "
                "and revoke this one"
            )
        if not body:
            raise BadRequest(f"nothing to change; give one or more of {', '.join(POLICY_FIELDS)}")
        store = self.ctx.store
        with store.transaction():  # read, change and write the policy as one step
            key = store.get_api_key(request.match_info["key"], prefer_active=True)
            policy = policy_from_json(body, base=key.policy, now=_now(self.ctx))
            changes = policy_changes(key.policy, policy)
            if changes or key.revoked:  # a revoked key is refused, even with no change
                key = store.update_api_key(key.id, policy)
        if changes:
            self.ctx.serving.refresh_keys()
            store.add_event(
                "key_updated",
                key.id,
                f"{key.name}: {describe_changes(changes)}",
                principal_of(request).actor,
            )
        shown = key_detail(self.ctx, key)
        shown["changed"] = {k: {"from": old, "to": new} for k, (old, new) in changes.items()}
        return web.json_response(shown)

    async def revoke_key(self, request: web.Request) -> web.Response:
        key = revoke_key(self.ctx, request.match_info["key"], actor=principal_of(request).actor)
        return web.json_response({"id": key.id, "name": key.name, "revoked_at": key.revoked_at})

    async def usage(self, request: web.Request) -> web.Response:
        query = request.query
        unknown = sorted(set(query) - set(_USAGE_QUERY))
        if unknown:
            raise BadRequest(
                f"unknown parameter(s) {', '.join(unknown)}; /api/usage takes "
                f"{', '.join(_USAGE_QUERY)}"
            )
        now = _now(self.ctx)
        since = usage_day_from(query.get("since", DEFAULT_USAGE_SINCE), now, "since")
        until = None if "until" not in query else usage_day_from(query["until"], now, "until")
        if until is not None and until < since:
            raise BadRequest(f"since ({since}) is after until ({until}); nothing is between")
        key_id = None
        if "key" in query:
            key_id = self.ctx.store.get_api_key(query["key"], prefer_active=True).id
        model = query.get("model")
        rows = usage_rows(self.ctx, key_id=key_id, model=model, since_day=since, until_day=until)
        return web.json_response([r.to_json() for r in rows])

    # -- joining nodes -----------------------------------------------------------------------------

    async def create_join_token(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        made = await create_join_token(
            self.ctx,
            body,
            host_header=request.headers.get("Host", ""),
            actor=principal_of(request).actor,
        )
        return web.json_response(made.as_json(), status=201)

    async def join_tokens(self, request: web.Request) -> web.Response:
        include = request.query.get("all") in ("1", "true")
        return web.json_response(
            [
                {
                    "id": t.id,
                    "prefix": t.prefix,
                    "node": t.node_id,
                    "kind": t.kind,
                    REPAIR_FIELD: t.lost_state,
                    OLD_REPAIR_FIELD: t.lost_state,
                    "auto_approve": t.auto_approve,
                    "approved_fingerprint": t.approved_fingerprint,
                    "created_at": t.created_at,
                    "expires_at": t.expires_at,
                    "used_at": t.used_at,
                    "revoked_at": t.revoked_at,
                    "active": t.active,
                }
                for t in self.ctx.store.list_join_tokens(include_inactive=include)
            ]
        )

    async def revoke_join_token(self, request: web.Request) -> web.Response:
        token = self.ctx.store.revoke_join_token(request.match_info["token"])
        self.ctx.store.add_event(
            "join_token_revoked", token.node_id, f"token {token.id}", principal_of(request).actor
        )
        return web.json_response(
            {"id": token.id, "node": token.node_id, "revoked_at": token.revoked_at}
        )


def create_key(ctx: AdminContext, body: Mapping[str, Any], *, actor: str) -> tuple[ApiKey, str]:
    """A new key named ``body["name"]`` with the policy the rest of ``body`` gives
    (:func:`~llmgw.contracts.keypolicy.policy_from_json`); its row and its secret, which
    nothing keeps (shown once). ``BadRequest`` for a bad name, ``ConfigError`` for a bad
    policy value, ``Conflict`` when an active key has the name."""
    name = body.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 64:
        raise BadRequest("a key needs a name of 1-64 characters (who or what uses it)")
    policy = policy_from_json(body, now=_now(ctx))
    key, secret = ctx.store.create_api_key(name.strip(), policy)
    ctx.serving.refresh_keys()
    ctx.store.add_event(
        "key_created", key.id, f"{key.name}: {key.policy.summary(expiry=True)}", actor
    )
    return key, secret


def revoke_key(ctx: AdminContext, key: str, *, actor: str) -> ApiKey:
    """Revoke the key ``key`` names (id, unique prefix or name); the revoked row
    (``Conflict`` when it is revoked already)."""
    revoked = ctx.store.revoke_api_key(key)
    ctx.serving.refresh_keys()
    ctx.store.add_event("key_revoked", revoked.id, revoked.name, actor)
    return revoked


def _now(ctx: AdminContext) -> float:
    return ctx.store.database.clock()


def usage_rows(
    ctx: AdminContext,
    *,
    key_id: str | None = None,
    model: str | None = None,
    since_day: str | None = None,
    until_day: str | None = None,
) -> list[UsageRow]:
    """The stored rows and this instance's counts not flushed yet, added together."""
    stored = ctx.store.list_usage(
        key_id=key_id, model=model, since_day=since_day, until_day=until_day
    )
    pending = [
        r
        for r in ctx.pending_usage()
        if (key_id is None or r.key_id == key_id)
        and (model is None or r.model == model)
        and (since_day is None or r.day >= since_day)
        and (until_day is None or r.day <= until_day)
    ]
    if not pending:
        return stored
    names: dict[str, str] = {}
    if any(not r.key_name for r in pending):
        names = {k.id: k.name for k in ctx.store.list_api_keys(include_revoked=True)}
    return add_usage_rows(stored, pending, names)


def key_detail(ctx: AdminContext, key: ApiKey) -> dict[str, Any]:
    """A key as ``GET /api/keys/{key}`` answers: the key, its policy and its usage (today,
    its budget's period, the last 7 days per model)."""
    now = _now(ctx)
    today = usage_day(now)
    week = usage_day(now - 6 * 86400)
    budget = key.policy.budget
    start = period_start(budget.period, now) if budget is not None else today
    rows = usage_rows(ctx, key_id=key.id, since_day=min(week, start))
    usage: dict[str, Any] = {
        "today": {"day": today, **_totals(r for r in rows if r.day == today)},
        "budget": None,
        "last_7_days": {
            "since": week,
            "until": today,
            "models": [
                {
                    "model": model,
                    **_totals(r for r in rows if r.model == model and r.day >= week),
                }
                for model in sorted({r.model for r in rows if r.day >= week})
            ],
        },
    }
    if budget is not None:
        spent = sum(r.prompt_tokens + r.completion_tokens for r in rows if r.day >= start)
        usage["budget"] = {
            "budget": str(budget),
            "tokens": budget.tokens,
            "period": budget.period,
            "since": start,
            "spent": spent,
            "remaining": max(0, budget.tokens - spent),
        }
    return {**key_json(key, now), "usage": usage}


def key_json(key: ApiKey, now: float) -> dict[str, Any]:
    """A key as the admin API lists it: never its secret, nor its hash."""
    if key.revoked:
        state = "revoked"
    elif key.policy.expired(now):
        state = "expired"
    else:
        state = "active"
    return {
        "id": key.id,
        "name": key.name,
        "prefix": key.prefix,
        "state": state,
        "created_at": key.created_at,
        "updated_at": key.updated_at,
        "revoked_at": key.revoked_at,
        "policy": key.policy.to_json(),
        "policy_summary": key.policy.summary(),
    }


def add_usage_rows(
    stored: Iterable[UsageRow], pending: Iterable[UsageRow], names: dict[str, str]
) -> list[UsageRow]:
    """*stored* and *pending* rows added together by day, key and model (a pending row's key
    name from *names* when it has none), in the store's order."""
    out: dict[tuple[str, str, str], UsageRow] = {}
    for row in [*stored, *pending]:
        at = (row.day, row.key_id, row.model)
        have = out.get(at)
        if have is None:
            out[at] = replace(row, key_name=row.key_name or names.get(row.key_id, ""))
            continue
        for name in USAGE_COUNTS:
            setattr(have, name, getattr(have, name) + getattr(row, name))
    return sorted(out.values(), key=lambda r: (r.day, r.key_name, r.key_id, r.model))


def _totals(rows: Iterable[UsageRow]) -> dict[str, int]:
    totals = dict.fromkeys(USAGE_COUNTS, 0)
    for row in rows:
        for name in USAGE_COUNTS:
            totals[name] += getattr(row, name)
    return totals
