"""The OpenAI-compatible gateway on :8080: authenticate, apply the key's policy, take a place
on a replica (or wait for one), relay through its agent, account the usage.

The request path touches no database: API keys with their policy, the deployed models with
what each serves, the ready replicas, the limits (:mod:`llmgw.server.gateway.limits`), the queues
(:mod:`llmgw.server.gateway.queueing`) and the usage (:mod:`llmgw.server.gateway.usage`, flushed once a
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
:data:`llmgw.server.gateway.usage.MAX_SSE_EVENT` for one event of a stream. What a request is
charged, and how a stream is made to report its usage, is :mod:`llmgw.server.gateway.metering`'s;
/healthz and /metrics are :mod:`llmgw.server.gateway.probes`'.

A request goes down the chain as one object: read and checked (:meth:`Gateway._complete`),
it is admitted as a frozen :class:`~llmgw.server.gateway.modelrequest.ModelRequest` with its
:class:`~llmgw.server.gateway.modelrequest.Charge`, given a place on a replica by the model's routing
policy (:mod:`llmgw.server.gateway.policies`) and forwarded, retried and resumed
(:mod:`llmgw.server.gateway.dispatch`, :mod:`llmgw.server.gateway.forwarding`); the charge is
settled once, when it ends.
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

from llmgw.bodies import (
    BodiesBusy,
    BodyBudget,
    BodyIncomplete,
    BodyTimeout,
    BodyTooLarge,
    read_body,
)
from llmgw.contracts.disagg import split_pool
from llmgw.contracts.endpoints import ALIASES, PATHS, endpoint_refusal
from llmgw.errors import ChatTemplateRefused
from llmgw.log import kv
from llmgw.server.common.config import DEFAULT_MAX_MESSAGES, ServerConfig
from llmgw.server.common.httpapi import bearer_token
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway import refusals
from llmgw.server.gateway.capacity import Capacity
from llmgw.server.gateway.disagg import Disagg
from llmgw.server.gateway.dispatch import Dispatch
from llmgw.server.gateway.forwarding import Forwarder
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.limits import KeyLimits, Refusal
from llmgw.server.gateway.metering import NOTHING, Outcome, estimate, with_usage
from llmgw.server.gateway.modelrequest import Charge, ModelRequest
from llmgw.server.gateway.policies import TOKEN_ROUTINGS, Prompt, session_of
from llmgw.server.gateway.probes import Probes
from llmgw.server.gateway.queueing import Admission
from llmgw.server.gateway.refusals import openai_error, sentence
from llmgw.server.gateway.resume import (
    DEFAULT_MAX_RESUMES,
    splice_for,
)
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServedModel, ServingCache
from llmgw.server.gateway.tokenizing import LONG_PROMPT_BYTES, Tokenizers
from llmgw.server.gateway.usage import UsageBook
from llmgw.server.store.rows import ApiKey

__all__ = ["Gateway", "GatewaySettings"]

log = logging.getLogger("llmgw.server.gateway")

RESPONSES = "/v1/responses"


@dataclass(frozen=True)
class GatewaySettings:
    """The settings of server.yaml the request path applies (a key's own limits are
    :class:`~llmgw.server.gateway.limits.KeyLimits`')."""

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
        draining: Callable[[], Mapping[str, object] | None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router = router
        # What /healthz adds (several instances: this one's role, the leader, the database).
        self.health = health
        self.metrics = metrics
        # /healthz and /metrics; ``readers``: the tokens that read /metrics and /healthz's
        # details (the metrics token, the admin token); ``draining``: what it says while a
        # stop drains the instance (503).
        self.probes = Probes(
            metrics,
            self._health_details,
            readers,
            index_sizes=router.prefixes.index_sizes,
            draining=draining,
        )
        self.serving = serving
        # The body bytes the process holds at once (the admin API's bodies too).
        self.bodies = bodies
        self.settings = settings
        self.nodes_connected = nodes_connected
        self.epoch = epoch
        self.started_at = started_at
        # Each key's limits, the usage to store, and the places on replicas with their queues.
        self.key_limits = key_limits or KeyLimits()
        self.usage = usage
        # Each model's prompt tokenizer, for cache-aware routing (none: no model has one).
        self.tokenizers = tokenizers if tokenizers is not None else Tokenizers(None)
        self.clock = clock
        self.admission = Admission(
            router,
            lambda model: self.serving.max_concurrency(model),
            metrics,
            fair=settings.fair_queueing,
        )
        # The requests waiting for a replica to exist, counted as demand for the planner.
        self.capacity = Capacity(
            router,
            history if history is not None else RequestHistory(),
            queued=self.admission.depth,
            queued_tokens=self.admission.queued_tokens,
        )
        # The last hop, to the agents' data planes; ``history``: each model's last hour for
        # the console's charts (None: not kept).
        self.forwarder = Forwarder(
            metrics,
            read_timeout=settings.upstream_idle_timeout,
            max_body=settings.max_response_body,
            revoked=revoked,
            client_ssl=client_ssl,
            history=history,
        )
        # Each request's way to a replica: placed, forwarded, retried, resumed.
        self.dispatch = Dispatch(
            router,
            self.admission,
            self.forwarder,
            self.capacity,
            serving,
            metrics,
            queue_timeout=settings.queue_timeout,
            replica_wait=settings.replica_wait,
            ctl=settings.ctl,
        )
        # A disaggregated model's requests: the hand-over between its pools.
        self.disagg = Disagg(self)

    def retrust(self, client_ssl: ssl.SSLContext) -> None:
        """The TLS towards agents changed (a CA rotation or the drop of the old CA): new
        connections use ``client_ssl``; those open now are closed once free."""
        self.forwarder.retrust(client_ssl)

    def forget_node(self, node_id: str) -> None:
        """Drop pooled connections to a node whose certificates were just revoked."""
        self.forwarder.forget_node(node_id)

    async def close(self) -> None:
        self.disagg.close()
        self.admission.close()
        self.capacity.close()
        await self.forwarder.close()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        for path in (*PATHS, *ALIASES):
            app.router.add_post(path, self.completions)
        self.probes.add_routes(app)

    # -- auth ----------------------------------------------------------------------------------

    def _key(self, request: web.Request) -> ApiKey | web.Response:
        """The request's active key, or the 401 to answer."""
        token = bearer_token(request)
        key = None
        if token is not None:
            key = self.serving.keys.get(hashlib.sha256(token).hexdigest())
        if key is None:
            log.info(
                "refused a request without a valid API key",
                extra=kv(path=request.path[:100], peer=request.remote or ""),
            )
            return refusals.unauthorized(self.settings.ctl)
        expires = key.policy.expires_at
        if expires is not None and self.clock() >= expires:
            return refusals.expired_key(key.name, expires, self.settings.ctl)
        return key

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
        # Those with a ready replica, and those that scale by demand (at zero now, started
        # by the first request); a disaggregated model by its pools', never a pool itself.
        ready = self.router.models()
        demand = [m for m, s in self.serving.models.items() if s.cold_start_timeout]
        names = {pool[0] if (pool := split_pool(m)) else m for m in (*ready, *demand)}
        data = [self._model_entry(name) for name in sorted(names) if policy.allows(name)]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        key = self._key(request)
        if isinstance(key, web.Response):
            return key
        name = request.match_info["model"]
        if self.serving.for_client(name) is None or not key.policy.allows(name):
            return self._no_such_model(name, key)
        return web.json_response(self._model_entry(name))

    def _no_such_model(self, model: str, key: ApiKey) -> web.Response:
        names = sorted(
            n for n, s in self.serving.models.items() if not s.is_pool and key.policy.allows(n)
        )
        return refusals.no_such_model(model, names)

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
            return refusals.bodies_busy(budget.capacity)
        except BodyIncomplete as exc:
            return openai_error(400, sentence(exc), code="incomplete_body")
        except BodyTimeout as exc:
            return openai_error(408, sentence(exc), code="body_timeout")
        try:
            return await self._complete(request, key, body, started)
        finally:
            budget.give(len(body))

    def _too_large(self, size: int | None, limit: int, model: str | None) -> web.Response:
        cfg = self.settings
        return refusals.too_large(
            size,
            limit,
            model,
            own_limit=model in self.serving.body_limits,
            inflight_cap=cfg.max_inflight_body_bytes,
            largest=self.serving.largest_body_limit,
            default=cfg.max_request_body,
            ctl=cfg.ctl,
        )

    # -- one request down the chain: read, admit, route, forward --------------------------------

    async def _complete(
        self, request: web.Request, key: ApiKey, body: bytes, started: float
    ) -> web.StreamResponse:
        payload = refusals.payload_of(request, body)
        if isinstance(payload, web.Response):
            return payload
        model: str = payload["model"]
        limit = self.serving.body_limits.get(model, self.settings.max_request_body)
        if len(body) > limit:
            return self._too_large(len(body), limit, model)
        served = self.serving.for_client(model)
        if served is None:
            return self._no_such_model(model, key)
        path = ALIASES.get(request.path, request.path)
        refusal = self._refusal(key, served, path, payload)
        if refusal is not None:
            return refusal
        # A disaggregated model's prompt is keyed and routed as its prefill pool's (whose
        # replicas' KV events are indexed under the pool's name).
        routed = served
        if served.handover is not None:
            routed = self.serving.models.get(served.handover.prefill, served)
        prompt = await self._prompt(key, routed, path, payload, len(body), model)
        if isinstance(prompt, web.Response):
            return prompt
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
        stream = payload.get("stream") is True
        # Every stream reports its usage (what the key is charged); the client that did not
        # ask for it does not see it.
        asked = with_usage(path, body, payload) if stream else None
        session = session_of(payload, request.headers.get("x-session-id"))
        # The key's resume: false wins over the profile's on.
        most = served.max_resumes if key.policy.resume else 0
        splice = splice_for(path, payload, served.engine, most, self.tokenizers.chat_prompt(model))
        del payload  # a parsed body can take many times its size: hold it no longer
        req = ModelRequest(
            http=request,
            key=key,
            model=model,
            path=path,
            body=body if asked is None else asked,
            body_limit=limit,
            started=started,
            stream=stream,
            drop_usage=asked is not None,
            hint=self.router.policies.hint(routed, prompt, session),
            splice=splice,
            retries=DEFAULT_MAX_RESUMES if most is None else most,
            tokens=cost.output,
        )
        charge = Charge(grant, cost)
        try:
            if served.handover is not None:
                return await self.disagg.serve(req, charge, served.handover)
            return await self._route(req, charge)
        finally:
            outcome = charge.settle(self.key_limits.clock())
            self._account(key, model, outcome.status or 499, outcome)

    def _refusal(
        self, key: ApiKey, served: ServedModel, path: str, payload: dict[str, Any]
    ) -> web.Response | None:
        """The answer to a request ``key`` may not make, or that ``served`` does not take;
        None when it may go on."""
        model = served.name
        if not key.policy.allows(model):
            self._account(key, model, 403)
            return refusals.model_not_allowed(key.name, model, key.policy.models, self.settings.ctl)
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

    async def _prompt(
        self,
        key: ApiKey,
        served: ServedModel,
        path: str,
        payload: dict[str, Any],
        size: int,
        model: str,
    ) -> Prompt | web.Response:
        """What the routing policy and the estimate read of the prompt (tokenized off the
        event loop when long); the 400 when the chat template refuses it (``model``: the
        one the client named, accounted; ``served`` may be its prefill pool)."""
        policy = key.policy
        tokenizer = self.tokenizers.for_model(served.name)
        if served.routing not in TOKEN_ROUTINGS and policy.tpm is None and policy.budget is None:
            tokenizer = None  # no limit reads this key's estimate: bytes / 4 costs nothing
        policies = self.router.policies
        work = partial(policies.prompt_of, served, tokenizer, path, payload)
        try:
            if size < LONG_PROMPT_BYTES or (
                tokenizer is None and not policies.reads_text(served.routing)
            ):
                return work()
            return await self.tokenizers.off_loop(work)
        except ChatTemplateRefused as exc:  # the engine's own rendering would refuse it too
            self._account(key, model, 400)
            return openai_error(400, f"{exc}.", code="chat_template_refused")

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

    async def _route(self, req: ModelRequest, charge: Charge) -> web.StreamResponse:
        """``req`` placed on a replica of its model and forwarded, retried and resumed
        (:class:`~llmgw.server.gateway.dispatch.Dispatch`); the hand-over's decode goes this
        way too."""
        return await self.dispatch.route(req, charge)
