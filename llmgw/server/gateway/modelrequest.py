"""One request to a model as it goes down the gateway's chain (admit, route, forward): what
was read of it, frozen once admitted (:class:`ModelRequest`), and what it is charged
(:class:`Charge`).

A request is charged in one place and settled in one: its key's grant of the estimate is
taken by :meth:`llmgw.server.gateway.limits.KeyLimits.admit` and given back, on the tokens its
outcome comes to, by :meth:`Charge.settle` when the request ends; the prefill a routing
policy charges its replica (:meth:`llmgw.server.gateway.policies.RouteHint.charge`) is given back by
:meth:`llmgw.server.gateway.queueing.Admission.release` with the replica's place (or at a stream's
first token, when the prefill is done).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from llmgw.http.response import UpstreamResponse
from llmgw.server.gateway.limits import Grant
from llmgw.server.gateway.metering import Estimate, Outcome
from llmgw.server.gateway.policies import RouteHint
from llmgw.server.gateway.resume import StreamSplice
from llmgw.server.store.rows import ApiKey

__all__ = ["Charge", "ModelRequest"]


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """An admitted request to a model."""

    http: web.Request  # the client's: the answer is relayed to it
    key: ApiKey
    model: str
    path: str  # the endpoint, aliases resolved (/v1/chat/completions, ...)
    # The body forwarded: a stream's asks the engine for its usage (with_usage).
    body: bytes
    body_limit: int  # the model's max_request_body, passed on to the data plane
    started: float  # time.perf_counter() at arrival
    stream: bool
    # The stream's usage chunk is the gateway's, not the client's: dropped from the answer.
    drop_usage: bool
    hint: RouteHint | None  # what the model's routing policy reads (None: least outstanding)
    # A stream that may go on on another replica when its own breaks (llmgw.server.gateway.
    # resume): what was sent of it; None for other requests.
    splice: StreamSplice | None = None
    # How many times the request may be sent again, whole, to another replica when its
    # replica failed before a byte of the answer reached the client (0: the key's or the
    # profile's resume is off).
    retries: int = 0
    # A disaggregated model's decode (llmgw.server.gateway.disagg): the body to send instead
    # when the request is sent again whole or resumed (the client's own, without the
    # hand-over's fields; None: ``body``), what is awaited once a replica's status line is in
    # and before a byte is relayed (the watch for the first token, which may give the
    # replica up by raising), and the output tokens charged to its replica while it runs
    # (Endpoint.decoding).
    whole: bytes | None = None
    on_head: Callable[[UpstreamResponse], Awaitable[None]] | None = None
    decoding: int = 0
    # What it weighs on its model's replicas for the planner while it holds a place or waits
    # for one (Endpoint.tokens, Admission.queued_tokens): a prefill's prompt estimate, any
    # other request's output estimate.
    tokens: int = 0
    # The prompt tokens the client's usage says were cached (a disaggregated model's: its
    # prefill's prefix cache); None: what the engine says.
    cached: int | None = None


class Charge:
    """What an admitted request holds against its key until it ends (``grant``, of the
    ``estimate``), and what it came to (``outcome``, filled in as it is forwarded)."""

    __slots__ = ("estimate", "grant", "outcome")

    def __init__(self, grant: Grant, estimate: Estimate) -> None:
        self.grant = grant
        self.estimate = estimate
        self.outcome = Outcome()

    def rate_headers(self) -> dict[str, str] | None:
        """The key's rate-limit headers for the answer (None: the key has no rate limit)."""
        state = self.grant.state
        if state.requests is None and state.tokens is None:
            return None
        return state.headers()

    def settle(self, now: float) -> Outcome:
        """The request ended: the key's grant settled on what the outcome is charged
        (:meth:`Outcome.charge`); once."""
        self.grant.settle(self.outcome.charge(self.estimate), now)
        return self.outcome
