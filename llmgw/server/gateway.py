"""The OpenAI-compatible gateway on :8080: authenticate, apply the key's policy, take a place
on a replica (or wait for one), relay through its agent, account the usage.

The request path touches no database: API keys with their policy, the deployed models with
what each serves, the ready replicas, the limits (:mod:`llmgw.server.limits`), the queues
(:mod:`llmgw.server.queueing`) and the usage (:mod:`llmgw.server.usage`, flushed once a
second) are in memory. Every OpenAI endpoint an engine may serve
(:mod:`llmgw.contracts.endpoints`) is routed by the body's ``model`` to that model's
replicas when its deployed profile serves it. Bodies are forwarded unchanged; event streams
are relayed chunk by chunk; a client that disconnects cancels the handler, which closes the
upstream request (or takes it out of the queue).

Request bodies are read under limits (:mod:`llmgw.bodies`): server.yaml's
``max_request_body`` or the deployed profile's own, passed on to the data plane, and
``max_inflight_body_bytes`` for all requests together (over it: 503); a request carries at
most ``max_messages`` messages. Answers from agents are bounded too: ``max_response_body``
for one read whole, ``upstream_idle_timeout`` for silence, and
:data:`llmgw.server.usage.MAX_SSE_EVENT` for one event of a stream. What a request is
charged, and how a stream is made to report its usage, is :mod:`llmgw.server.metering`'s;
/healthz and /metrics are :mod:`llmgw.server.probes`'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from cryptography import x509

from llmgw.bodies import (
    MAX_BODY_HEADER,
    BodiesBusy,
    BodyBudget,
    BodyIncomplete,
    BodyTimeout,
    BodyTooLarge,
    read_body,
)
from llmgw.configfile import format_size
from llmgw.contracts.endpoints import ALIASES, PATHS, endpoint_refusal
from llmgw.errors import ChatTemplateRefused, ConfigError
from llmgw.http.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from llmgw.http.pool import UpstreamPool
from llmgw.http.relay import NOT_PROCESSED, STREAM_ERROR, relay
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.server.config import DEFAULT_MAX_MESSAGES, ServerConfig
from llmgw.server.history import RequestHistory
from llmgw.server.httpapi import bearer_token
from llmgw.server.limits import Grant, KeyLimits, Refusal
from llmgw.server.metering import NOTHING, Outcome, estimate, with_usage
from llmgw.server.metrics import Metrics
from llmgw.server.policies import RouteHint, session_of
from llmgw.server.probes import Probes
from llmgw.server.queueing import Admission, QueueTimeout
from llmgw.server.routing import Endpoint, Router
from llmgw.server.serving import ServingCache
from llmgw.server.store.rows import ApiKey
from llmgw.server.tokenizing import (
    LONG_PROMPT_BYTES,
    TOKEN_ROUTINGS,
    Tokenizers,
)
from llmgw.server.usage import StreamTokenCounter, UsageBook, body_usage, usage_numbers

__all__ = ["Gateway", "GatewaySettings", "openai_error"]

log = logging.getLogger("llmgw.server.gateway")

_JSON_HEADERS = (("Content-Type", "application/json"),)


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@dataclass(frozen=True)
class GatewaySettings:
    """The settings of server.yaml the request path applies (a key's own limits are
    :class:`~llmgw.server.limits.KeyLimits`')."""

    max_request_body: int
    max_inflight_body_bytes: int
    max_response_body: int
    upstream_idle_timeout: float
    replica_wait: float
    queue_timeout: float = 30.0
    fair_queueing: bool = True
    max_messages: int = DEFAULT_MAX_MESSAGES
    # How an operator runs ctl here, in the fixes the gateway's refusals name.
    ctl: str = "llmgw ctl"

    @classmethod
    def of(cls, cfg: ServerConfig) -> GatewaySettings:
        return cls(
            max_request_body=cfg.max_request_body,
            max_inflight_body_bytes=cfg.max_inflight_body_bytes,
            max_response_body=cfg.max_response_body,
            upstream_idle_timeout=cfg.upstream_idle_timeout,
            replica_wait=cfg.replica_wait,
            queue_timeout=cfg.queue_timeout,
            fair_queueing=cfg.fair_queueing,
            max_messages=cfg.max_messages,
            ctl=cfg.ctl_command,
        )


class Gateway:
    def __init__(
        self,
        router: Router,
        metrics: Metrics,
        serving: ServingCache,
        bodies: BodyBudget,
        settings: GatewaySettings,
        *,
        revoked: Callable[[], Set[str]],
        client_ssl: Callable[[], ssl.SSLContext | None],
        nodes_connected: Callable[[], int],
        epoch: int,
        started_at: float,
        health: Callable[[], Mapping[str, object]] | None = None,
        key_limits: KeyLimits | None = None,
        usage: UsageBook | None = None,
        history: RequestHistory | None = None,
        tokenizers: Tokenizers | None = None,
        readers: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router = router
        # What /healthz adds (several instances: this one's role, the leader, the database).
        self.health = health
        self.metrics = metrics
        # /healthz and /metrics; ``readers``: the tokens that read /metrics and /healthz's
        # details (the metrics token, the admin token).
        self.probes = Probes(
            metrics, self._health_details, readers, index_sizes=router.prefixes.index_sizes
        )
        self.serving = serving
        # The body bytes the process holds at once (the admin API's bodies too).
        self.bodies = bodies
        self.settings = settings
        # The certificate serials the control plane denies (llmgw.server.nodes).
        self.revoked = revoked
        # The TLS the gateway presents to agents' data planes (None: plain, in tests).
        self.client_ssl = client_ssl
        self.nodes_connected = nodes_connected
        self.epoch = epoch
        self.started_at = started_at
        self._session: UpstreamPool | None = None
        self._hostports: dict[str, tuple[str, int]] = {}
        # Each key's limits, the usage to store, and the places on replicas with their queues.
        self.key_limits = key_limits or KeyLimits()
        self.usage = usage
        # Each model's last hour for the console's charts (None: not kept).
        self.history = history
        # Each model's prompt tokenizer, for cache-aware routing (none: no model has one).
        self.tokenizers = tokenizers if tokenizers is not None else Tokenizers(None)
        self.clock = clock
        self.admission = Admission(
            router,
            lambda model: self.serving.max_concurrency(model),
            metrics,
            fair=settings.fair_queueing,
        )

    def retrust(self, client_ssl: ssl.SSLContext) -> None:
        """The TLS towards agents changed (a CA rotation or the drop of the old CA): new
        connections use ``client_ssl``; those open now are closed once free."""
        if self._session is not None:
            self._session.retrust(client_ssl)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        for path in (*PATHS, *ALIASES):
            app.router.add_post(path, self.completions)
        self.probes.add_routes(app)

    @property
    def session(self) -> UpstreamPool:
        """Keep-alive mTLS connections to the agents' data planes (made on first use)."""
        if self._session is None:
            self._session = UpstreamPool(
                ssl=self.client_ssl(),
                peer_check=self._agent_certificate_problem,
                connect_timeout=5.0,
                # Shorter than the data plane keeps idle connections (300 s), so we close first.
                idle_timeout=290.0,
                read_timeout=self.settings.upstream_idle_timeout,
                max_body=self.settings.max_response_body,
            )
        return self._session

    def _agent_certificate_problem(self, der: bytes, node_id: str | None) -> str | None:
        """The data plane's certificate must not be one the control plane revoked (an old
        identity after a rekey, or a revoked node's): the CA alone still trusts those."""
        serial = format(x509.load_der_x509_certificate(der).serial_number, "x")
        if serial in self.revoked():
            return (
                f"the data plane of node {node_id} presented certificate {serial}, which was "
                f"revoked; refusing it (the node must join again: llmgw ctl join-command "
                f"--node {node_id})"
            )
        return None

    def forget_node(self, node_id: str) -> None:
        """Drop pooled connections to a node whose certificates were just revoked."""
        if self._session is not None:
            self._session.forget(node_id)

    def _hostport(self, addr: str) -> tuple[str, int]:
        hostport = self._hostports.get(addr)
        if hostport is None:
            try:
                hostport = self._hostports[addr] = parse_hostport(addr)
            except ConfigError as exc:
                raise UpstreamConnectError(f"data plane address {addr!r}: {exc}") from exc
        return hostport

    async def close(self) -> None:
        self.admission.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- auth ----------------------------------------------------------------------------------

    def _key(self, request: web.Request) -> ApiKey | web.Response:
        """The request's active key, or the 401 to answer."""
        token = bearer_token(request)
        key = None
        if token is not None:
            key = self.serving.keys.get(hashlib.sha256(token).hexdigest())
        if key is None:
            return self._unauthorized(request)
        expires = key.policy.expires_at
        if expires is not None and self.clock() >= expires:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
            return openai_error(
                401,
                f"The API key '{key.name}' expired on {when}. Ask the operator for a new key "
                f"('{self.settings.ctl} keys create NAME') or to extend this one "
                f"('{self.settings.ctl} keys update {key.name} --expires 90d').",
                code="expired_api_key",
            )
        return key

    def _unauthorized(self, request: web.Request) -> web.Response:
        log.info(
            "refused a request without a valid API key",
            extra=kv(path=request.path[:100], peer=request.remote or ""),
        )
        return openai_error(
            401,
            "Incorrect or missing API key. Pass 'Authorization: Bearer <key>'; an operator "
            f"creates keys with '{self.settings.ctl} keys create NAME'.",
            code="invalid_api_key",
        )

    # -- handlers ------------------------------------------------------------------------------

    def _health_details(self) -> dict[str, object]:
        """What /healthz says to a reader (its role to anyone)."""
        body: dict[str, object] = {
            "role": "leader",
            "epoch": self.epoch,
            "nodes": self.nodes_connected(),
            "models": self.router.models(),
        }
        if self.health is not None:
            body.update(self.health())
        return body

    def _model_entry(self, name: str) -> dict[str, object]:
        entry: dict[str, object] = {
            "id": name,
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "llmgw",
        }
        served = self.serving.models.get(name)
        if served is not None:
            entry["llmgw"] = {
                "engine": served.engine,
                "tasks": list(served.tasks),
                "endpoints": sorted(served.paths),
                "max_concurrency": served.max_concurrency,
            }
        return entry

    async def models(self, request: web.Request) -> web.Response:
        key = self._key(request)
        if isinstance(key, web.Response):
            return key
        policy = key.policy
        data = [self._model_entry(name) for name in self.router.models() if policy.allows(name)]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        key = self._key(request)
        if isinstance(key, web.Response):
            return key
        name = request.match_info["model"]
        if name not in self.serving.models or not key.policy.allows(name):
            return self._no_such_model(name, key)
        return web.json_response(self._model_entry(name))

    def _no_such_model(self, model: str, key: ApiKey) -> web.Response:
        names = sorted(n for n in self.serving.models if key.policy.allows(n))
        return openai_error(
            404,
            f"The model '{model}' does not exist. Models on this gateway: "
            f"{', '.join(names) or 'none'}.",
            param="model",
            code="model_not_found",
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Every POST endpoint: the body's model chooses the replicas."""
        started = time.perf_counter()
        key = self._key(request)
        if isinstance(key, web.Response):
            return key
        # The model is in the body: read up to the largest limit any model has, then hold
        # the body to its own model's.
        limit = min(self.serving.largest_body_limit, self.settings.max_inflight_body_bytes)
        budget = self.bodies
        try:
            body = await read_body(request, limit, budget)
        except BodyTooLarge as exc:
            return self._too_large(exc.size, limit, None)
        except BodiesBusy:
            return openai_error(
                503,
                f"The gateway is holding as many request bodies as it may at once "
                f"({format_size(budget.capacity)}, max_inflight_body_bytes in server.yaml); "
                "retry in a moment.",
                type_="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        except BodyIncomplete as exc:
            return openai_error(400, _sentence(exc), code="incomplete_body")
        except BodyTimeout as exc:
            return openai_error(408, _sentence(exc), code="body_timeout")
        try:
            return await self._complete(request, key, body, started)
        finally:
            budget.give(len(body))

    def _too_large(self, size: int | None, limit: int, model: str | None) -> web.Response:
        what = f"{size} bytes" if size is not None else f"more than {format_size(limit)}"
        cfg = self.settings
        if model is not None and model in self.serving.body_limits:
            taken = f"model '{model}' takes at most {format_size(limit)}"
            fix = f"its catalog profile's max_request_body sets it ('{cfg.ctl} models apply')"
        elif limit == cfg.max_inflight_body_bytes and limit < self.serving.largest_body_limit:
            taken = f"this gateway holds at most {format_size(limit)} of bodies at once"
            fix = "raise max_inflight_body_bytes in server.yaml"
        elif model is None and limit > cfg.max_request_body:
            taken = f"no model on this gateway takes more than {format_size(limit)}"
            fix = "a model's catalog profile sets its own with max_request_body"
        else:
            whose = f"model '{model}'" if model is not None else "this gateway"
            taken = f"{whose} takes at most {format_size(limit)}"
            fix = (
                "max_request_body in server.yaml sets it; for long contexts a model's catalog "
                "profile may raise it with its own max_request_body"
            )
        return openai_error(
            413,
            f"The request body is {what}; {taken} ({fix}).",
            code="request_too_large",
        )

    async def _complete(
        self, request: web.Request, key: ApiKey, body: bytes, started: float
    ) -> web.StreamResponse:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            why = "nested too deep" if isinstance(exc, RecursionError) else "not valid JSON"
            log.info(
                "refused a request body",
                extra=kv(path=request.path[:100], peer=request.remote or "", reason=why),
            )
            return openai_error(
                400,
                f"The request body is {why}; send a JSON object such as "
                '{"model": "...", "messages": [...]}.',
                code="invalid_json",
            )
        if not isinstance(payload, dict):
            return openai_error(
                400,
                "The request body must be a JSON object such as "
                '{"model": "...", "messages": [...]}.',
                code="invalid_json",
            )
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(
                400, "The request needs a 'model' (a string).", param="model", code="missing_model"
            )
        stream = payload.get("stream") is True
        limit = self.serving.body_limits.get(model, self.settings.max_request_body)
        if len(body) > limit:
            return self._too_large(len(body), limit, model)
        served = self.serving.models.get(model)
        policy = key.policy
        if served is None:
            return self._no_such_model(model, key)
        if not policy.allows(model):
            self._account(key, model, 403)
            return openai_error(
                403,
                f"The API key '{key.name}' may not use the model '{model}'; it may use "
                f"{', '.join(policy.models)}. The operator changes that with "
                f"'{self.settings.ctl} keys update {key.name} --models ...'.",
                type_="permission_error",
                param="model",
                code="model_not_allowed",
            )
        path = request.path
        path = ALIASES.get(path, path)
        if path not in served.paths:
            self._account(key, model, 400)
            return openai_error(
                400,
                endpoint_refusal(model, path, served.engine, served.tasks) + ".",
                code="unsupported_endpoint",
            )
        refusal = self._shape_refusal(path, payload)
        if refusal is not None:
            self._account(key, model, 400)
            return refusal
        tokenizer = self.tokenizers.for_model(model)
        if served.routing not in TOKEN_ROUTINGS and policy.tpm is None and policy.budget is None:
            tokenizer = None  # no limit reads this key's estimate: bytes / 4 costs nothing
        policies = self.router.policies
        work = partial(policies.prompt_of, served, tokenizer, path, payload)
        try:
            if len(body) < LONG_PROMPT_BYTES or (
                tokenizer is None and not policies.reads_text(served.routing)
            ):
                prompt = work()
            else:
                prompt = await self.tokenizers.off_loop(work)
        except ChatTemplateRefused as exc:  # the engine's own rendering would refuse it too
            self._account(key, model, 400)
            return openai_error(400, f"{exc}.", code="chat_template_refused")
        cost = estimate(path, payload, len(body), prompt.tokens, served.output_cap)
        grant = self.key_limits.admit(key, cost.total)
        if isinstance(grant, Refusal):
            self._account(key, model, grant.status)
            log.info(
                "refused a request over its key's limit",
                extra=kv(key=key.name, model=model, code=grant.code),
            )
            return openai_error(
                grant.status,
                grant.message,
                type_=grant.type,
                code=grant.code,
                headers=grant.headers,
            )
        hint = policies.hint(
            served, prompt, session_of(payload, request.headers.get("x-session-id"))
        )
        # Every stream reports its usage (what the key is charged); the client that did not
        # ask for it does not see it.
        asked = with_usage(path, body, payload) if stream else None
        del payload  # a parsed body can take many times its size: hold it no longer
        outcome = Outcome()
        try:
            return await self._route(
                request,
                key,
                grant,
                model,
                path,
                body if asked is None else asked,
                started,
                stream,
                limit,
                outcome,
                hint,
                drop_usage=asked is not None,
            )
        finally:
            grant.settle(outcome.charge(cost), self.key_limits.clock())
            self._account(key, model, outcome.status or 499, outcome)

    def _shape_refusal(self, path: str, payload: dict[str, Any]) -> web.Response | None:
        """The 400 for a body whose ``stream`` is not a boolean, or that carries more
        messages (a chat's, a response's input items) than ``max_messages``; None when
        neither."""
        stream = payload.get("stream")
        if stream is not None and not isinstance(stream, bool):
            return openai_error(
                400,
                f"'stream' must be true or false, got {json.dumps(stream)[:40]}.",
                param="stream",
                code="invalid_type",
            )
        cap = self.settings.max_messages
        for name in ("messages", "input") if path == RESPONSES else ("messages",):
            items = payload.get(name)
            if isinstance(items, list) and len(items) > cap:
                return openai_error(
                    400,
                    f"The request has {len(items)} {name}; this gateway takes at most {cap} "
                    "in one request (max_messages in server.yaml).",
                    param=name,
                    code="too_many_messages",
                )
        return None

    def _account(self, key: ApiKey, model: str, status: int, outcome: Outcome = NOTHING) -> None:
        """One request of ``key`` to ``model`` ended with ``status`` (without an outcome: a
        refusal, no tokens): its usage and metrics."""
        self.metrics.key_requests.inc((key.name, model, str(status)))
        if outcome.prompt or outcome.completion:
            tokens = self.metrics.key_tokens
            tokens.inc((key.name, model, "prompt"), outcome.prompt)
            tokens.inc((key.name, model, "completion"), outcome.completion)
            if outcome.cached:
                tokens.inc((key.name, model, "cached"), outcome.cached)
        if self.usage is not None:
            self.usage.record(
                key.id,
                key.name,
                model,
                prompt=outcome.prompt,
                completion=outcome.completion,
                cached=outcome.cached,
                error=not 200 <= status < 300,
            )

    async def _route(
        self,
        request: web.Request,
        key: ApiKey,
        grant: Grant,
        model: str,
        path: str,
        body: bytes,
        started: float,
        stream: bool,
        limit: int,
        outcome: Outcome,
        hint: RouteHint | None = None,
        *,
        drop_usage: bool = False,
    ) -> web.StreamResponse:
        """Take a place on a replica of ``model`` (waiting in the key's queue when all are
        full; the one ``hint``'s policy chooses) and forward; another replica when one cannot
        be reached. ``drop_usage``: the usage chunk of the stream is the gateway's, not the
        client's."""
        tried: set[str] = set()
        busy = 0  # replicas whose agent had no room for the body
        admission = self.admission
        while True:
            exclude = frozenset(tried)
            ep = admission.try_acquire(model, exclude, hint)
            if ep is None:
                if not self.router.has_ready(model, exclude):
                    if not tried:
                        # No ready replica now (its agent may be restarting, a drain may be
                        # moving it): wait a while for one rather than failing at once.
                        await self.router.wait_ready(model, self.settings.replica_wait)
                    if not self.router.has_ready(model, exclude):
                        outcome.status = 503 if not tried or busy == len(tried) else 502
                        return self._no_replica(model, tried, busy)
                try:
                    ep = await admission.acquire(
                        model,
                        key.id,
                        key.policy.weight,
                        exclude,
                        self.settings.queue_timeout,
                        hint,
                    )
                except QueueTimeout as exc:
                    outcome.status = 503
                    log.info(
                        "a request waited its whole queue_timeout",
                        extra=kv(key=key.name, model=model, waited=round(exc.waited, 3)),
                    )
                    return openai_error(
                        503,
                        f"Every replica of '{model}' is busy (max_concurrency "
                        f"{self.serving.max_concurrency(model)} each) and this request waited "
                        f"{exc.waited:.1f} s (queue_timeout in server.yaml) with "
                        f"{exc.depth} others; retry in a moment, or the operator adds replicas "
                        f"('{self.settings.ctl} deploy {model} --replicas N').",
                        type_="server_error",
                        code="model_overloaded",
                        headers={"Retry-After": "1"},
                    )
            tried.add(ep.shard_id)
            try:
                headers = (
                    grant.state.headers()
                    if grant.state.requests is not None or grant.state.tokens is not None
                    else None
                )
                return await self._forward(
                    request,
                    ep,
                    path,
                    body,
                    started,
                    stream=stream,
                    limit=limit,
                    outcome=outcome,
                    headers=headers,
                    hint=hint,
                    drop_usage=drop_usage,
                )
            except _ConnectFailed as exc:
                busy += exc.busy
                log.warning(
                    "replica unreachable; trying another",
                    extra=kv(model=model, shard=ep.shard_id, error=str(exc)),
                )
                continue
            finally:
                if hint is not None:
                    hint.settle()
                admission.release(ep)

    def _no_replica(self, model: str, tried: set[str], busy: int) -> web.Response:
        if tried and busy == len(tried):
            return openai_error(
                503,
                f"Every replica of '{model}' is holding as many request bodies as it "
                "may (max_inflight_body_bytes in agent.yaml); retry in a moment.",
                type_="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        if tried:
            return openai_error(
                502,
                f"No replica of '{model}' answered ({len(tried)} tried); try again shortly.",
                type_="server_error",
                code="upstream_unavailable",
            )
        return openai_error(
            503,
            f"The model '{model}' has no ready replica right now; retry after a few seconds "
            f"('{self.settings.ctl} replicas {model}' shows why).",
            type_="server_error",
            code="model_not_ready",
            headers={"Retry-After": "5"},
        )

    async def _forward(
        self,
        request: web.Request,
        ep: Endpoint,
        path: str,
        body: bytes,
        started: float,
        *,
        stream: bool,
        limit: int,
        outcome: Outcome,
        headers: dict[str, str] | None = None,
        hint: RouteHint | None = None,
        drop_usage: bool = False,
    ) -> web.StreamResponse:
        labels = (ep.model, ep.replica_id)
        metrics = self.metrics
        metrics.inflight.inc(labels)
        status = 0
        ttft: float | None = None
        counter = StreamTokenCounter() if stream else None
        try:
            try:
                host, port = self._hostport(ep.addr)
                # From here the engine may be working on it (a client that leaves still
                # pays for its prompt), unless the agent says it never passed it on.
                outcome.handed = True
                upstream = await self.session.request(
                    "POST",
                    host,
                    port,
                    f"/s/{ep.shard_id}{path}",
                    body=body,
                    # The body asking for usage may be a few bytes over the model's limit.
                    headers=(*_JSON_HEADERS, (MAX_BODY_HEADER, str(max(limit, len(body))))),
                    server_hostname=ep.node_id,
                )
            except UpstreamError as exc:
                if exc.retryable:  # not a byte of answer: another replica may take it
                    outcome.handed = False
                    raise _ConnectFailed(str(exc)) from exc
                raise
            if upstream.status in (502, 503) and upstream.header(NOT_PROCESSED):
                # The agent did not hand it to an engine (it is draining, has no room for the
                # body, or its engine refused the connection: stopping): another replica may
                # take it, as if the connection had been refused.
                busy = upstream.header("Retry-After") is not None
                upstream.release()
                why = (
                    "its engine is not accepting"
                    if upstream.status == 502
                    else "no room for the body"
                    if busy
                    else "draining"
                )
                outcome.handed = False
                raise _ConnectFailed(f"{ep.node_id} did not process the request ({why})", busy)
            try:
                status = outcome.engine_status = upstream.status
                if counter is not None and upstream.content_type == "text/event-stream":
                    outcome.streamed = True
                    feed = counter.feed
                    if hint is not None and hint.charged_to is not None:
                        # The prefill queued on the replica ends with the first token.
                        def feed(chunk: bytes, counter: StreamTokenCounter = counter) -> None:
                            counter.feed(chunk)
                            if counter.first_at is not None:
                                hint.settle()

                    try:
                        resp = await relay(
                            request,
                            upstream,
                            on_chunk=feed,
                            extra_headers=headers,
                            drop_usage=drop_usage,
                        )
                    finally:
                        # Counted also when the client left mid-stream (the handler cancelled).
                        self._count_stream_tokens(ep, counter, outcome)
                    failed = resp.get(STREAM_ERROR)
                    if failed is not None:
                        status = 502
                        log.warning(
                            "a stream ended early",
                            extra=kv(model=ep.model, shard=ep.shard_id, error=str(failed)),
                        )
                    if counter.first_at is not None:
                        ttft = counter.first_at - started
                        metrics.ttft.observe(labels, ttft)
                else:
                    resp = await relay(
                        request,
                        upstream,
                        on_chunk=lambda b: self._count_body_tokens(ep, b, outcome),
                        extra_headers=headers,
                    )
            finally:
                # Back to the pool when read to the end, else closed: a cancelled handler
                # (the client went away) closes the connection, and the agent sees it.
                upstream.release()
            return resp
        except UpstreamError as exc:
            status = 502
            return openai_error(
                502,
                f"The replica {ep.replica_id} failed mid-request: {exc}",
                type_="server_error",
                code="upstream_timeout" if isinstance(exc, UpstreamTimeout) else "upstream_error",
            )
        finally:
            metrics.inflight.dec(labels)
            if status:
                outcome.status = status
                metrics.requests.inc((ep.model, ep.replica_id, str(status)))
                metrics.latency.observe(labels, time.perf_counter() - started)
                if self.history is not None:
                    self.history.record(ep.model, ttft=ttft, error=status >= 500)

    def _count_body_tokens(self, ep: Endpoint, body: bytes, outcome: Outcome) -> None:
        usage = body_usage(body)
        if usage is not None:
            self._add_usage(ep, usage, outcome)

    def _count_stream_tokens(
        self, ep: Endpoint, counter: StreamTokenCounter, outcome: Outcome
    ) -> None:
        if counter.usage is not None:
            self._add_usage(ep, counter.usage, outcome)
        else:
            # No usage in the stream (cut short, or an engine that does not report it):
            # each content event is a token; the prompt is charged its estimate.
            outcome.completion = counter.events
            self.metrics.tokens.inc((ep.model, "completion"), counter.events)

    def _add_usage(self, ep: Endpoint, usage: dict[str, Any], outcome: Outcome) -> None:
        prompt, completion, cached = usage_numbers(usage)
        outcome.prompt, outcome.completion, outcome.cached = prompt, completion, cached
        outcome.reported = True
        model = ep.model
        tokens = self.metrics.tokens
        tokens.inc((model, "prompt"), prompt)
        tokens.inc((model, "completion"), completion)
        if cached:
            tokens.inc((model, "cached"), cached)
        if prompt:
            by_replica = self.metrics.replica_tokens
            by_replica.inc((model, ep.replica_id, "prompt"), prompt)
            by_replica.inc((model, ep.replica_id, "cached"), min(cached, prompt))


RESPONSES = "/v1/responses"


def _sentence(exc: Exception) -> str:
    """An error's message as a sentence (capital first, full stop), like the gateway's own."""
    text = str(exc)
    return f"{text[:1].upper()}{text[1:]}."


class _ConnectFailed(Exception):
    """The replica could not be reached, or went away before answering, or its agent had no
    room for the body (``busy``); another may be tried."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
