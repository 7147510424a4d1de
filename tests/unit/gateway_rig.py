"""The gateway in-process for the unit tests: a real serving cache holding the keys and models
a test gives (no store behind it), and the Gateway built with stand-ins for what only the
control plane has (plain HTTP to a stand-in data plane, no revoked serials, no nodes)."""

from __future__ import annotations

import time
from typing import Any, cast

from llmgw.bodies import BodyBudget
from llmgw.server.common.config import ServerConfig
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.gateway import Gateway, GatewaySettings
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServedModel, ServingCache
from llmgw.server.gateway.usage import UsageBook
from llmgw.server.store import Store
from llmgw.server.store.rows import ApiKey


def serving_of(cfg: ServerConfig, keys: list[ApiKey], models: list[ServedModel]) -> ServingCache:
    """A serving cache holding ``keys`` and ``models``, as a refresh from a store would."""
    cache = ServingCache(cast(Store, None), max_request_body=cfg.max_request_body)
    cache.set_keys(keys)
    cache.set_models(models)
    return cache


def gateway_of(
    cfg: ServerConfig,
    router: Router,
    cache: ServingCache,
    *,
    metrics: Metrics | None = None,
    key_limits: KeyLimits | None = None,
    usage: UsageBook | None = None,
    **more: Any,
) -> Gateway:
    return Gateway(
        router,
        metrics or Metrics(),
        cache,
        BodyBudget(cfg.max_inflight_body_bytes),
        GatewaySettings.of(cfg),
        revoked=set,
        client_ssl=lambda: None,  # plain HTTP to the stand-in data plane
        nodes_connected=lambda: 0,
        epoch=1,
        started_at=time.time(),
        key_limits=key_limits,
        usage=usage,
        **more,
    )
