"""Fakes that several server tests share: the usage store and an API key row."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable

from llmgw.contracts.keypolicy import KeyPolicy, UsageRow
from llmgw.errors import StoreUnavailable
from llmgw.server.store.rows import ApiKey


class FakeStore:
    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], UsageRow] = {}
        self.writes = 0
        self.fail = False

    def add_usage(self, rows: Iterable[UsageRow]) -> None:
        if self.fail:
            raise StoreUnavailable("the database is away")
        self.writes += 1
        for r in rows:
            old = self.rows.get((r.day, r.key_id, r.model))
            if old is None:
                self.rows[(r.day, r.key_id, r.model)] = UsageRow(r.day, r.key_id, r.model)
                old = self.rows[(r.day, r.key_id, r.model)]
            old.requests += r.requests
            old.prompt_tokens += r.prompt_tokens
            old.completion_tokens += r.completion_tokens
            old.cached_tokens += r.cached_tokens
            old.errors += r.errors

    def tokens_since(
        self, since_day: str, key_ids: Collection[str] | None = None
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows.values():
            if r.day >= since_day and (key_ids is None or r.key_id in key_ids):
                out[r.key_id] = out.get(r.key_id, 0) + r.prompt_tokens + r.completion_tokens
        return out


def api_key(name: str, policy: KeyPolicy) -> tuple[ApiKey, str]:
    secret = f"sk-{name}"
    return ApiKey(
        name, name, secret, hashlib.sha256(secret.encode()).hexdigest(), 0.0, None, policy=policy
    ), secret
