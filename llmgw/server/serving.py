"""What the gateway's request path reads instead of the store: the hashes of active API
keys, the deployed model names and the request-body limits their profiles raise. The admin
API refreshes them after every change it makes to keys or models."""

from __future__ import annotations

from llmgw.contracts.catalog import profile_body_limit
from llmgw.server.store import Store

__all__ = ["ServingCache"]


class ServingCache:
    """In-memory copies of what the request path needs, refreshed from ``store``."""

    def __init__(self, store: Store, *, max_request_body: int) -> None:
        self.store = store
        self.max_request_body = max_request_body
        self.key_hashes: set[str] = set()
        self.model_names: set[str] = set()
        # Request body limits raised by a deployed profile (model -> bytes), and the
        # largest limit of any model.
        self.body_limits: dict[str, int] = {}
        self.largest_body_limit = max_request_body

    def refresh_keys(self) -> None:
        self.key_hashes = self.store.active_key_hashes()

    def refresh_models(self) -> None:
        models = self.store.list_models()
        self.model_names = {m.name for m in models}
        limits: dict[str, int] = {}
        for m in models:
            limit = profile_body_limit(m.profiles.get(m.profile))
            if limit is not None:
                limits[m.name] = limit
        self.body_limits = limits
        self.largest_body_limit = max([self.max_request_body, *limits.values()])
