"""What a load balancer and Prometheus read on :8080: ``/healthz`` and ``/metrics``, and how
much each tells whom.

``/healthz`` answers anyone with what a health check needs: ``{"status": "ok", "role":
"leader"|"standby"}`` (200 on every instance that serves), or 503 with ``"status":
"draining"`` while a stop drains it (:mod:`llmgw.server.ha.drain`: load balancers take it
out while it still serves what they send). The details (the leader's epoch,
the nodes connected, the models routed, the leader's address, the database's state) go only
to a caller that presents a reader's token. ``/metrics`` (every key's name and usage) is
served only to such a caller: ``Authorization: Bearer <token>``, what Prometheus sends with
``authorization: {credentials_file: ...}``, where the token is the metrics token
(``metrics_token_file`` in server.yaml, ``STATE/metrics.token`` by default, made at first
start) or the admin token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable, Mapping

from aiohttp import web

from llmgw.log import kv
from llmgw.server.common.httpapi import bearer_token, json_error
from llmgw.server.common.metrics import Metrics

__all__ = ["Probes"]

log = logging.getLogger("llmgw.server.probes")

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="llmgw"'}


class Probes:
    """The two handlers. ``details`` is what /healthz says to a reader (its ``role`` is told
    to anyone); ``readers`` the tokens that may read; ``index_sizes`` the block keys of the
    gateway's prefix indexes, read at each scrape; ``draining`` what /healthz says while a
    stop drains the instance (None while it serves)."""

    def __init__(
        self,
        metrics: Metrics,
        details: Callable[[], Mapping[str, object]],
        readers: Iterable[str],
        index_sizes: Callable[[], Mapping[tuple[str, str], int]] = dict,
        draining: Callable[[], Mapping[str, object] | None] = lambda: None,
    ) -> None:
        self.metrics = metrics
        self.draining = draining
        self.index_sizes = index_sizes
        self.details = details
        self.readers = tuple(r.encode() for r in readers if r)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_page)

    def _reader(self, request: web.Request) -> bool:
        token = bearer_token(request)
        if token is None:
            return False
        # Every token compared, in constant time each: which one matched shows in no timing.
        matched = False
        for reader in self.readers:
            if hmac.compare_digest(token, reader):
                matched = True
        return matched

    async def healthz(self, request: web.Request) -> web.Response:
        details = self.details()
        drain = self.draining()
        status, code = ("ok", 200) if drain is None else ("draining", 503)
        if self._reader(request):
            return web.json_response({"status": status, **details, **(drain or {})}, status=code)
        return web.json_response(
            {"status": status, "role": details.get("role", "leader")}, status=code
        )

    async def metrics_page(self, request: web.Request) -> web.Response:
        if not self._reader(request):
            presented = bearer_token(request) is not None
            log.info(
                "refused /metrics",
                extra=kv(peer=request.remote or "", token="wrong" if presented else "none"),
            )
            response = json_error(
                401,
                "GET /metrics needs 'Authorization: Bearer <token>' with the metrics token "
                "(the file metrics_token_file in server.yaml names) or the admin token; in "
                "Prometheus: authorization: {credentials_file: FILE}",
                "unauthorized",
            )
            response.headers.update(_CHALLENGE)
            return response
        text = self.metrics.render(self.index_sizes())
        return web.Response(text=text, content_type="text/plain", charset="utf-8")
