"""The routing policies (:class:`~llmgw.contracts.catalog.Routing`, a profile's ``routing``):
what the gateway reads of a request for each (its :class:`RouteHint`) and how each chooses
among a model's replicas with a free place, in one table (:data:`POLICIES`).

- ``least-outstanding`` (the default): no hint; the router's fewest in flight
  (:meth:`llmgw.server.gateway.routing.Router.pick_free`);
- ``round-robin``: each replica in turn;
- ``session``: a conversation (the request's ``user``, or its ``x-session-id`` header) goes
  to its replica by rendezvous (highest-random-weight) hashing of the session over the
  model's replicas with a free place (:func:`rendezvous`), while that one is not much busier
  than the least busy (:data:`SESSION_SLACK` requests more); else to the next in the
  session's order that is not. Nothing is remembered: every instance (leader or standby)
  makes the same choice for the same replicas and loads, and a replica that goes away moves
  only its own sessions;
- ``prefix-approx`` and ``kv-events``: the replica with the least estimated work before the
  first token, by what each holds of the prompt's prefix (:mod:`llmgw.server.gateway.prefixes`);
  ties go to the request's rendezvous replica: by its session, else by its prompt's key at
  about :data:`AFFINITY_TOKENS` tokens (:func:`affinity_of`), so that instances that never
  saw a conversation send it where the others did. An instance that has heard no KV events
  for the model yet routes it as ``session`` would (a standby hears them relayed by the
  leader, :mod:`llmgw.server.ha.kvrelay`).

A choice charges the chosen replica the request's uncached prompt tokens
(:attr:`llmgw.server.gateway.routing.Endpoint.pending`) until its first token; the hint says what was
charged where, and :meth:`RouteHint.settle` gives it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from llmgw.contracts.catalog import Routing
from llmgw.contracts.kvblocks import BLOCK_SIZE, block_keys
from llmgw.server.gateway.prefixes import (
    APPROX_CHUNK,
    Endpoint,
    PrefixRouting,
    Replica,
    text_keys,
    text_of,
)

if TYPE_CHECKING:
    from llmgw.server.common.metrics import Metrics
    from llmgw.server.gateway.serving import ServedModel

__all__ = [
    "AFFINITY_TOKENS",
    "POLICIES",
    "SESSION_SLACK",
    "TOKEN_ROUTINGS",
    "Prompt",
    "RouteHint",
    "RoutingPolicies",
    "TokenIds",
    "affinity_of",
    "rendezvous",
    "session_of",
]


class TokenIds(Protocol):
    """What the policies read of a model's tokenizer (tokenizing.PromptTokenizer is one): the
    prompt's token ids, or None when it cannot say. An interface here, so that tokenizing may
    read the policies' table without the two importing each other."""

    def token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None: ...


SESSION_SLACK = 2
"""How many more requests in flight than the least busy replica a session's replica may
have and still keep the session."""
MAX_SESSION_ID = 256
AFFINITY_TOKENS = 1024
"""Without a session, a prefix policy's request is affine to its prompt's key at about this
many tokens (the system prompt and the start of the conversation): the turns of one
conversation share it, and conversations that share only a system prompt longer than it
share a replica while its load allows."""


class RouteHint:
    """What the router may know of one request: its routing, its prompt's block keys, its
    session, and (once a replica is chosen) what was charged to that replica until the first
    token."""

    __slots__ = (
        "charged",
        "charged_to",
        "keys",
        "matched",
        "reason",
        "routing",
        "session",
        "tokens",
        "unit",
    )

    def __init__(
        self,
        routing: Routing,
        keys: Sequence[int] | None = None,
        *,
        unit: int = BLOCK_SIZE,
        tokens: int = 0,
        session: str | None = None,
    ) -> None:
        self.routing = Routing(routing)
        self.keys: Sequence[int] = keys or ()
        self.unit = unit  # tokens per key
        self.tokens = max(tokens, len(self.keys) * unit)
        self.session = session
        self.charged = 0
        self.charged_to: Replica | None = None
        self.matched = 0  # leading blocks the chosen replica holds
        self.reason = ""

    def charge(self, ep: Replica) -> None:
        """``ep`` takes the request: its uncached prompt tokens are queued there."""
        uncached = max(0, self.tokens - self.matched * self.unit)
        ep.pending += uncached
        self.charged, self.charged_to = uncached, ep

    def settle(self) -> None:
        """The request has its first token (or ended): its prefill is no longer queued.
        Idempotent: the first call gives the charge back."""
        ep = self.charged_to
        if ep is not None:
            ep.pending -= self.charged
            self.charged_to = None


class Prompt:
    """What the gateway made of a request's prompt: its tokens by the model's tokenizer
    (None: it has none, or the shape is not one it counts), the block keys its routing looks
    up, their unit, the approximate index's token count, and the time it took."""

    __slots__ = ("keys", "seconds", "text_tokens", "tokens", "unit")

    def __init__(self) -> None:
        self.tokens: int | None = None
        self.keys: list[int] = []
        self.unit = BLOCK_SIZE
        self.text_tokens = 0
        self.seconds = 0.0


def session_of(payload: Mapping[str, Any], header: str | None) -> str | None:
    """A request's conversation: its ``x-session-id`` header, else its ``user`` field (each
    at most :data:`MAX_SESSION_ID` characters; longer ones are not sessions)."""
    for value in (header, payload.get("user")):
        if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID:
            return value
    return None


def _weight(affinity: bytes, shard_id: str) -> int:
    digest = hashlib.blake2b(affinity, digest_size=8, key=shard_id.encode()[:64])
    return int.from_bytes(digest.digest(), "big")


def rendezvous(affinity: str, eps: Sequence[Endpoint]) -> list[Endpoint]:
    """``eps`` in ``affinity``'s order of preference: highest random weight first, each
    replica's weight a hash of the affinity and its shard id (the same on every instance;
    removing a replica moves only the affinities it was first for, adding one takes only
    those it now comes first for)."""
    key = affinity.encode()
    return sorted(eps, key=lambda ep: (_weight(key, ep.shard_id), ep.shard_id), reverse=True)


def affinity_of(hint: RouteHint) -> str | None:
    """What ``hint``'s request is affine to: its session, else (a prefix policy's request)
    its prompt's key at about :data:`AFFINITY_TOKENS` tokens, or the last when shorter;
    None: neither."""
    if hint.session:
        return hint.session
    if not hint.keys:
        return None
    depth = min(len(hint.keys), max(1, AFFINITY_TOKENS // max(1, hint.unit)))
    return f"prefix:{hint.keys[depth - 1]:x}"


class _Choice(NamedTuple):
    """What a chooser is given: the model, its replicas with a free place (not empty), all
    its ready replicas (to tell a prefix hit from a spread), the hint, and the candidates in
    the request's rendezvous order (None: it has no affinity, :func:`affinity_of`)."""

    model: str
    candidates: list[Any]
    every: list[Any]
    hint: RouteHint
    order: list[Any] | None

    @property
    def session(self) -> Any:
        """The request's rendezvous replica among the candidates (None: no affinity)."""
        return self.order[0] if self.order else None


Chooser = Callable[["RoutingPolicies", _Choice], tuple[Any, str]]
HintMaker = Callable[["RoutingPolicies", "ServedModel", Prompt, "str | None"], "RouteHint | None"]


class _Policy(NamedTuple):
    """One routing policy: what it reads of the prompt (``tokens``: block keys of the token
    ids; ``text``: chunk keys of the text; None: nothing), how it makes the hint, and how it
    chooses (None: no hint, the router's least outstanding)."""

    reads: str | None
    hint: HintMaker
    choose: Chooser | None


def _no_hint(_p: RoutingPolicies, _s: ServedModel, _pr: Prompt, _se: str | None) -> None:
    return None


def _session_hint(
    _p: RoutingPolicies, served: ServedModel, _prompt: Prompt, session: str | None
) -> RouteHint:
    return RouteHint(served.routing, session=session)


def _approx_hint(
    p: RoutingPolicies, served: ServedModel, prompt: Prompt, session: str | None
) -> RouteHint:
    p.prefixes.set_capacity(served.name, served.approx_capacity)
    p.observe_keys(served.name, prompt)
    unit = APPROX_CHUNK // 4
    return RouteHint(
        served.routing, prompt.keys, unit=unit, tokens=prompt.text_tokens, session=session
    )


def _tokens_hint(
    p: RoutingPolicies, served: ServedModel, prompt: Prompt, session: str | None
) -> RouteHint:
    if prompt.tokens is None:
        if p.metrics is not None:
            p.metrics.routing.inc((served.name, served.routing, "no_tokenizer"))
        return RouteHint(served.routing, session=session)
    p.observe_keys(served.name, prompt)
    return RouteHint(
        served.routing, prompt.keys, unit=prompt.unit, tokens=prompt.tokens, session=session
    )


def _in_turn(p: RoutingPolicies, c: _Choice) -> tuple[Any, str]:
    return p.in_turn(c.model, c.candidates), "round_robin"


def _by_session(p: RoutingPolicies, c: _Choice) -> tuple[Any, str]:
    least = min(ep.inflight for ep in c.candidates)
    if c.order:
        # The first in the session's order not much busier than the least busy (the least
        # busy itself is one): moved by load alone, the same way on every instance.
        for rank, ep in enumerate(c.order):
            if ep.inflight <= least + SESSION_SLACK:
                return ep, "session" if rank == 0 else "session_moved"
    tied = [ep for ep in c.candidates if ep.inflight == least]
    chosen = tied[0] if len(tied) == 1 else p.in_turn(c.model, tied)
    return chosen, "least_outstanding"


def _by_approx(p: RoutingPolicies, c: _Choice) -> tuple[Any, str]:
    approx = p.prefixes.approx_index(c.model, [ep.shard_id for ep in c.every])
    chosen, reason = p.prefixes.by_prefix(
        approx.index, c.candidates, c.every, c.hint, c.session, _ties(p, c.model)
    )
    if c.hint.keys:
        approx.record(chosen.shard_id, c.hint.keys)
    return chosen, reason


def _by_events(p: RoutingPolicies, c: _Choice) -> tuple[Any, str]:
    if not p.prefixes.has_events(c.model):
        return _by_session(p, c)
    index = p.prefixes.events.get(c.model)
    return p.prefixes.by_prefix(index, c.candidates, c.every, c.hint, c.session, _ties(p, c.model))


def _ties(p: RoutingPolicies, model: str) -> Callable[[list[Any]], Any]:
    """Ties broken in the model's turn (shared with round-robin)."""
    return lambda eps: p.in_turn(model, eps)


POLICIES: dict[Routing, _Policy] = {
    Routing.LEAST_OUTSTANDING: _Policy(None, _no_hint, None),
    Routing.ROUND_ROBIN: _Policy(None, _session_hint, _in_turn),
    Routing.SESSION: _Policy(None, _session_hint, _by_session),
    Routing.PREFIX_APPROX: _Policy("text", _approx_hint, _by_approx),
    Routing.KV_EVENTS: _Policy("tokens", _tokens_hint, _by_events),
}
"""Each routing policy: what it reads, the hint it makes, the choice it makes."""

TOKEN_ROUTINGS = frozenset(r for r, policy in POLICIES.items() if policy.reads == "tokens")
"""The routing policies that key a prompt by its token ids: a model with another one loads no
tokenizer (a sim model's costs nothing and is always there)."""


class RoutingPolicies:
    """The state the policies keep (the prefix indexes, the sessions, the turns) and the
    two steps each request takes through :data:`POLICIES`: its hint, then the choice."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        *,
        prefixes: PrefixRouting | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.prefixes = prefixes if prefixes is not None else PrefixRouting(clock=clock)
        self._turn: dict[str, int] = {}

    def reads_text(self, routing: Routing) -> bool:
        return POLICIES[routing].reads == "text"

    def prompt_of(
        self,
        served: ServedModel,
        tokenizer: TokenIds | None,
        path: str,
        payload: dict[str, Any],
    ) -> Prompt:
        """The prompt's token ids (where the model has a tokenizer) and the keys its
        routing policy looks up: work for a thread when the prompt is long."""
        began = time.perf_counter()
        prompt = Prompt()
        reads = POLICIES[served.routing].reads
        if tokenizer is not None:
            ids = tokenizer.token_ids(path, payload)
            if ids is not None:
                prompt.tokens = len(ids)
                if reads == "tokens":
                    size = self.prefixes.block_size.get(served.name, BLOCK_SIZE)
                    with contextlib.suppress(ValueError):
                        prompt.keys = block_keys(ids, size)
                    prompt.unit = size
        if reads == "text":
            text = text_of(path, payload)
            prompt.keys = text_keys(text) if text else []
            prompt.text_tokens = len(text) // 4 if text else 0
        prompt.seconds = time.perf_counter() - began
        return prompt

    def hint(self, served: ServedModel, prompt: Prompt, session: str | None) -> RouteHint | None:
        """What the model's routing policy needs of the request (None: least outstanding):
        its session, and for the prefix policies its prompt's block keys."""
        return POLICIES[served.routing].hint(self, served, prompt, session)

    def observe_keys(self, model: str, prompt: Prompt) -> None:
        if self.metrics is not None:
            self.metrics.decision.observe((model, "keys"), prompt.seconds)

    def choose(
        self, model: str, candidates: list[Endpoint], every: list[Endpoint], hint: RouteHint
    ) -> Endpoint:
        """The replica among ``candidates`` (not empty: each below its limit and not
        excluded) for the request of ``hint``; ``every`` is all the model's ready replicas.
        Charges the choice to the replica (:meth:`RouteHint.charge`)."""
        began = time.perf_counter()
        routing = hint.routing
        # A least-outstanding hint (none is made) would choose as a session without one.
        chooser = POLICIES[routing].choose or _by_session
        affinity = affinity_of(hint) if routing is not Routing.ROUND_ROBIN else None
        order = rendezvous(affinity, candidates) if affinity is not None else None
        chosen, reason = chooser(self, _Choice(model, candidates, every, hint, order))
        hint.charge(chosen)
        hint.reason = reason
        if self.metrics is not None:
            self.metrics.routing.inc((model, routing, reason))
            self.metrics.decision.observe((model, "choose"), time.perf_counter() - began)
        chosen_ep: Endpoint = chosen
        return chosen_ep

    def in_turn(self, model: str, eps: list[Endpoint]) -> Endpoint:
        turn = self._turn.get(model, 0)
        self._turn[model] = turn + 1
        return eps[turn % len(eps)]
