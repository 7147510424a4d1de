"""The API keys pages: the keys with their policy and usage (today's, and their budget
period's), a key's page (its policy and the last 7 days per model), creating a key and
revoking one.

A new key's secret is on the create POST's own answer and nowhere else: not behind a
redirect a reload would show again, not in the flash, the events or the log, and its page
is ``Cache-Control: no-store`` like every console page. The control plane keeps only its
hash, so no later page could show it. What is shown and done is the admin API's own code
(:mod:`llmgw.server.admin.access`, the policy parsed by
:func:`llmgw.contracts.keypolicy.policy_from_json`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from llmgw.contracts.keypolicy import (
    POLICY_FIELDS,
    PRIORITIES,
    UsageRow,
    period_start,
    usage_day,
)
from llmgw.errors import ConfigError, Conflict, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.access import create_key, key_detail, key_json, revoke_key, usage_rows
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.console.auth import form_of
from llmgw.server.console.pages import Pages
from llmgw.server.console.site import SESSION, Site
from llmgw.server.store import ApiKey

__all__ = ["KEY_FORM_FIELDS", "KeyPages"]

log = logging.getLogger("llmgw.server.console")

KEY_FORM_FIELDS: Final = ("name", *POLICY_FIELDS)
"""The create form's fields: the key's name and every field of its policy."""


def key_path(key_id: str) -> str:
    return "/ui/keys/" + quote(key_id, safe="")


def _tokens(row: UsageRow) -> int:
    return row.prompt_tokens + row.completion_tokens


def _usage_of(key: ApiKey, rows: Iterable[UsageRow], now: float) -> dict[str, Any]:
    """A key's requests and tokens today, and its tokens in its budget's period."""
    today = usage_day(now)
    mine = [r for r in rows if r.key_id == key.id]
    out: dict[str, Any] = {
        "requests_today": sum(r.requests for r in mine if r.day == today),
        "tokens_today": sum(_tokens(r) for r in mine if r.day == today),
        "budget": None,
    }
    budget = key.policy.budget
    if budget is not None:
        start = period_start(budget.period, now)
        out["budget"] = {
            "budget": str(budget),
            "since": start,
            "spent": sum(_tokens(r) for r in mine if r.day >= start),
        }
    return out


class KeyPages:
    """``/ui/keys``, ``/ui/keys/{key}`` and their actions."""

    def __init__(self, site: Site, pages: Pages) -> None:
        self.site = site
        self.pages = pages

    @property
    def ctx(self) -> AdminContext:
        return self.site.ctx

    def _now(self) -> float:
        return self.ctx.store.database.clock()

    # -- reading ------------------------------------------------------------------------------

    def _table(self, include_revoked: bool) -> dict[str, Any]:
        ctx = self.ctx
        now = self._now()
        found = ctx.store.list_api_keys(include_revoked=include_revoked)
        # One read for every key: a budget's period starts at the latest on the month's first.
        rows = usage_rows(ctx, since_day=period_start("month", now)) if found else []
        keys = [
            {**key_json(k, now), "usage": _usage_of(k, rows, now), "url": key_path(k.id)}
            for k in found
        ]
        return {"keys": keys, "today": usage_day(now)}

    def _keys_page(
        self,
        request: web.Request,
        *,
        status: int = 200,
        problem: str = "",
        form: Mapping[str, str] | None = None,
    ) -> web.Response:
        include_revoked = request.query.get("all") == "1"
        given = form or {}
        return self.pages.answer(
            request,
            "keys.html",
            {"table": "_keys_table.html"},
            lambda: self._table(include_revoked),
            status=status,
            page="keys",
            is_admin=principal_of(request).is_admin,
            include_revoked=include_revoked,
            problem=problem,
            priorities=PRIORITIES,
            given={name: given.get(name, "") for name in KEY_FORM_FIELDS},
        )

    async def keys(self, request: web.Request) -> web.Response:
        return self._keys_page(request)

    def _key_page(
        self, request: web.Request, key_ref: str, *, status: int = 200, problem: str = ""
    ) -> web.Response:
        ctx = self.ctx
        key = ctx.store.get_api_key(key_ref, prefer_active=True)  # NotFound: the 404 page
        return self.pages.answer(
            request,
            "key.html",
            {"detail": "_key_detail.html"},
            lambda: {"key": key_detail(ctx, key)},
            status=status,
            page="keys",
            is_admin=principal_of(request).is_admin,
            problem=problem,
            key_url=key_path(key.id),
            key_id=key.id,
            key_name=key.name,
        )

    async def key(self, request: web.Request) -> web.Response:
        return self._key_page(request, request.match_info["key"])

    # -- acting -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /ui/keys``: the new key's secret on this answer, once."""
        form = form_of(request)
        actor = principal_of(request).actor
        # A field left empty is a limit not set: unlimited, never expires, normal priority.
        body: dict[str, Any] = {"name": form.get("name", "")}
        body.update({f: form[f].strip() for f in POLICY_FIELDS if form.get(f, "").strip()})
        try:
            key, secret = create_key(self.ctx, body, actor=actor)
        except (BadRequest, ConfigError, Conflict) as exc:
            status = 409 if isinstance(exc, Conflict) else 400
            return self._keys_page(
                request, status=status, problem=f"no key created: {exc}", form=form
            )
        log.info("a console action", extra=kv(action="create_key", key=key.id, actor=actor))
        return self.site.page(
            request,
            "key_created.html",
            page="keys",
            key=key_json(key, self._now()),
            key_url=key_path(key.id),
            secret=secret,
        )

    async def revoke(self, request: web.Request) -> web.StreamResponse:
        """``POST /ui/keys/{key}/revoke``, confirmed with the key's id."""
        key = self.ctx.store.get_api_key(request.match_info["key"], prefer_active=True)
        form = form_of(request)
        actor = principal_of(request).actor
        if form.get("confirm", "").strip() != key.id:
            return self._key_page(
                request,
                key.id,
                status=400,
                problem=f"nothing done: to revoke API key {key.name}, confirm with its id "
                f"({key.id!r}) in the form's confirmation field",
            )
        try:
            revoked = revoke_key(self.ctx, key.id, actor=actor)
        except (Conflict, NotFound) as exc:
            status = 404 if isinstance(exc, NotFound) else 409
            return self._key_page(request, key.id, status=status, problem=f"nothing done: {exc}")
        log.info("a console action", extra=kv(action="revoke_key", key=key.id, actor=actor))
        token, _session = request[SESSION]
        self.site.flash.put(
            token,
            f"API key {revoked.name} ({revoked.prefix}) is revoked: the gateway refuses it "
            "from now on",
        )
        return web.Response(status=303, headers={"Location": key_path(revoked.id)})
