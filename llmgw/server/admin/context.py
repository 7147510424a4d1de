"""What every admin route shares: the collaborators it is given (:class:`AdminContext`),
the admin-token check and the translation of errors into JSON answers (:func:`guarded`),
and reading a request's JSON body under the admin API's limit (:func:`read_json`)."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from llmgw.bodies import (
    BodiesBusy,
    BodyBudget,
    BodyIncomplete,
    BodyTimeout,
    BodyTooLarge,
    read_body,
)
from llmgw.contracts.keypolicy import UsageRow
from llmgw.errors import (
    ConfigError,
    Conflict,
    Fenced,
    LlmgwError,
    NotFound,
    PasswordError,
    StoreUnavailable,
)
from llmgw.log import kv
from llmgw.pki import Authority
from llmgw.server.accounts.logins import Logins, LoginThrottled
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import AdminPassword
from llmgw.server.accounts.principals import PRINCIPAL, VIA_CLI, Principal
from llmgw.server.common.config import TLSConfig
from llmgw.server.common.httpapi import bearer_token
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.installs import EngineInstalls
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.planner import Planner
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.fleet.updates import Updates
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServingCache
from llmgw.server.joining.bundles import BundleStore
from llmgw.server.store import Store

__all__ = [
    "ADMIN_MAX_BODY",
    "AdminContext",
    "BadRequest",
    "Handler",
    "Listening",
    "answered",
    "authenticate",
    "error_response",
    "guarded",
    "login_token",
    "read_flag",
    "read_json",
]

ADMIN_MAX_BODY = 1024 * 1024
"""The largest admin API request body: orders, keys and a whole catalog fit many times."""

log = logging.getLogger("llmgw.server.admin")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Listening(Protocol):
    """Where the control plane listens (known once its listeners are bound)."""

    @property
    def http_addr(self) -> str: ...

    @property
    def http_port(self) -> int: ...

    @property
    def grpc_port(self) -> int: ...

    @property
    def enroll_port(self) -> int: ...


@dataclass(frozen=True)
class AdminContext:
    """The collaborators of the admin routes."""

    store: Store
    scheduler: Scheduler
    router: Router
    membership: Membership
    updates: Updates
    password: AdminPassword
    operators: OperatorAccounts
    logins: Logins
    installs: EngineInstalls
    serving: ServingCache
    bodies: BodyBudget
    sessions: Mapping[str, NodeSession]
    lost: Set[str]
    listening: Listening
    ca: Authority
    bundles: BundleStore | None
    cluster_id: str
    epoch: int
    admin_token: str
    admin_token_file: Path
    control_plane_names: frozenset[str]
    tls: TLSConfig | None
    http_scheme: str
    advertise: tuple[str, ...]
    # Seconds an instance must have been silent before it may be retired (on PostgreSQL).
    instance_stale_after: float
    # Whether the enrolment listener is on loopback only: no other machine can join.
    enroll_loopback_only: bool = False
    # This instance's usage counts not flushed to the store yet (the gateway's usage
    # book): what the key and usage routes add to the stored rows.
    pending_usage: Callable[[], list[UsageRow]] = field(default=lambda: [])
    # Each model's last hour of requests and TTFT, as this instance's gateway saw them.
    history: RequestHistory = field(default_factory=RequestHistory)
    # This instance's gateway metrics (each model's prefix cache hit rate).
    metrics: Metrics = field(default_factory=Metrics)
    # The planner: what it thinks of each model that scales by demand (None: tests
    # without one).
    planner: Planner | None = None
    # Why a model routed on its prompt's tokens has no tokenizer loaded (None: it has one,
    # or needs none).
    tokenizer_problem: Callable[[str], str | None] = field(default=lambda _model: None)


def error_response(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


class BadRequest(Exception):
    """The request itself is malformed (400)."""


_ANSWERS: tuple[tuple[type[LlmgwError], int, str], ...] = (
    (BodiesBusy, 503, "overloaded"),
    (BodyIncomplete, 400, "incomplete_body"),
    (BodyTimeout, 408, "body_timeout"),
    (PasswordError, 403, "wrong_password"),
    (LoginThrottled, 429, "too_many_attempts"),
    (StoreUnavailable, 503, "database_unreachable"),
    (Fenced, 503, "no_leader"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (LlmgwError, 500, "server_error"),
)
"""The status and code an admin handler's error is answered with: the first kind it is."""


def authenticate(ctx: AdminContext, request: web.Request) -> Principal | None:
    """Who the request's bearer credential names: the shared admin token, an account's
    token from ``llmgw ctl login`` (its role as the account has it now), or None."""
    token = bearer_token(request)
    if token is None:
        return None
    if hmac.compare_digest(token, ctx.admin_token.encode()):
        return Principal.shared_token()
    session = ctx.logins.resolve(login_token(token), VIA_CLI)
    return None if session is None else session.principal


def login_token(raw: bytes) -> str:
    """A bearer credential as a login token: the text of one, or '' (which resolves to
    nothing) for bytes no token has."""
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return ""


_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def guarded(ctx: AdminContext, handler: Handler) -> Handler:
    """``handler`` behind the admin API's credentials (a viewer only reads), its errors
    answered as JSON; the caller goes on the request as its :class:`Principal`."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        peer = request.remote or ""
        principal = authenticate(ctx, request)
        if principal is None:
            log.info(
                "refused an admin request without the admin token",
                extra=kv(method=request.method[:16], path=request.path[:100], peer=peer),
            )
            return error_response(
                401,
                "missing or wrong admin token; pass --token or set LLMGW_TOKEN (the control "
                f"plane keeps it in {ctx.admin_token_file}), or sign in with 'llmgw ctl login'",
                "unauthorized",
            )
        if request.method not in _READS and not principal.is_admin:
            log.info(
                "refused a viewer's change",
                extra=kv(method=request.method[:16], path=request.path[:100], actor=principal.name),
            )
            return error_response(
                403,
                f"the account {principal.name!r} is a {principal.role}: it reads the cluster "
                "but changes nothing; ask an admin to make the change or to give it the admin "
                "role ('llmgw ctl users role NAME admin')",
                "forbidden",
            )
        request[PRINCIPAL] = principal
        return await answer(request)

    answer = answered(handler)
    return wrapped


def answered(handler: Handler) -> Handler:
    """``handler`` with its errors answered as the admin API's JSON errors (``guarded``'s
    half without the credential check, for the sign-in route)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        peer = request.remote or ""
        try:
            return await handler(request)
        except (BadRequest, ConfigError) as exc:  # ConfigError: a value that cannot be used
            log.info(
                "refused an admin request",
                extra=kv(path=request.path[:100], peer=peer, reason=str(exc)[:200]),
            )
            return error_response(400, str(exc), "bad_request")
        except BodyTooLarge as exc:
            return error_response(
                413,
                f"{exc} for the admin API; split the change (a catalog can be applied "
                "model by model)",
                "request_too_large",
            )
        except LlmgwError as exc:
            status, code = next((st, c) for kind, st, c in _ANSWERS if isinstance(exc, kind))
            answer = error_response(status, str(exc), code)
            if isinstance(exc, LoginThrottled):
                answer.headers["Retry-After"] = str(exc.retry_after)
            return answer

    return wrapped


async def read_json(ctx: AdminContext, request: web.Request) -> dict[str, Any]:
    """The request's body: a JSON object (BadRequest otherwise)."""
    raw = await read_body(request, ADMIN_MAX_BODY, ctx.bodies)
    try:
        body = json.loads(raw)
        # A lone surrogate ("\ud800") parses but cannot be stored or sent on.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise BadRequest("the request body is nested too deep; send a flat JSON object") from None
    except UnicodeEncodeError:
        raise BadRequest(
            "the request body holds a lone UTF-16 surrogate (such as \\ud800); send valid Unicode"
        ) from None
    except ValueError:  # UnicodeDecodeError too
        raise BadRequest("the request body is not valid JSON (UTF-8)") from None
    finally:
        ctx.bodies.give(len(raw))
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def read_flag(body: Mapping[str, Any], name: str) -> bool:
    """A boolean field of a request body, false when absent. Only JSON true and false are
    read: ``"false"``, ``0`` and ``null`` are refused, since Python's truth of ``"false"``
    would turn on what it names (a rekey, an update of every node)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(
            f"'{name}' must be true or false (a JSON boolean), not {json.dumps(value)[:40]}; "
            f"leave it out for false"
        )
    return value
