"""server.yaml's sections that take several keys together: the listening addresses, a
node's timing, queueing, the leadership's timing and the drain's, each parsed into the
:class:`~llmgw.server.common.config.ServerConfig` fields it fills, with the defaults they
fall back to (re-exported by :mod:`llmgw.server.common.config`, where the other modules
read them)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, TypedDict

from llmgw.configfile import Checker
from llmgw.contracts.ports import DEFAULT_ENROLL_PORT, DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from llmgw.netaddr import format_hostport, is_ip_address

DEFAULT_HEARTBEAT_INTERVAL = 5.0
# A killed node is lost this long after its stream closed, a hung one within a second past
# this after its last heartbeat (llmgw.server.fleet.sessions); with the sim engine its replicas serve
# on other nodes a second or two later (tests/integration/test_node_loss.py): lost within 15 s
# of the kill, serving again within 20 s.
DEFAULT_LOSS_TIMEOUT = 12.0
# After a control plane starts leading (a restart, a take-over), a node that holds shards
# has this long to reattach before it is lost: a fleet of thousands reconnects over tens of
# seconds (each agent's jittered backoff), and a node lost in that window would have its
# replicas rebuilt while they still run.
DEFAULT_REATTACH_GRACE = 60.0
DEFAULT_QUEUE_TIMEOUT = 30.0
MIN_HEARTBEAT_INTERVAL = 0.2
MAX_HEARTBEAT_INTERVAL = 60.0
# Leadership on PostgreSQL: a lapsed lease is taken within lease + a standby's poll (one
# lease_renew), which the defaults keep under 15 s; a released one (a clean stop) at once.
DEFAULT_LEASE = 8.0
DEFAULT_LEASE_RENEW = 2.0
DEFAULT_RESYNC_INTERVAL = 5.0
# A stop (SIGTERM): /healthz answers 503 this long so that load balancers take the instance
# out, then the requests in flight have this long to end (llmgw.server.ha.drain); the
# systemd unit's TimeoutStopSec exceeds their sum.
DEFAULT_DRAIN_GRACE = 10.0
DEFAULT_DRAIN_TIMEOUT = 120.0
# The most messages (a chat's, a response's input items) one request may carry: OpenAI's own
# limit, so that no client written for it is refused, while a body of hundreds of thousands
# of tiny messages never reaches a chat template.
DEFAULT_MAX_MESSAGES = 2048
MAX_MAX_MESSAGES = 1_000_000


class _Addresses(TypedDict):
    http_listen: str
    grpc_listen: str
    enroll_listen: str


class _NodeTiming(TypedDict):
    heartbeat_interval: float
    loss_timeout: float
    reattach_grace: float


class _Queueing(TypedDict):
    queue_timeout: float
    fair_queueing: bool


class _Draining(TypedDict):
    drain_grace: float
    drain_timeout: float


class _LeadershipTiming(TypedDict):
    lease: float
    lease_renew: float
    resync_interval: float


def bounded_duration(
    check: Checker,
    top: Mapping[str, Any],
    key: str,
    default: float,
    bounds: tuple[float, float],
    why: str,
) -> float:
    """The duration at ``key`` (``default`` when not given); ``why`` when it is out of
    ``bounds`` (both included)."""
    if top.get(key) is None:
        return default
    value = check.duration(top[key], key)
    if not bounds[0] <= value <= bounds[1]:
        check.fail(key, why)
    return value


def listen_addresses(check: Checker, top: Mapping[str, Any]) -> _Addresses:
    """The three listening addresses (the gateway's, the agents' stream's, enrolment's),
    each on a port of its own."""

    def listen(name: str, default_port: int) -> tuple[str, int]:
        value = top.get(name)
        if value is None:
            return "0.0.0.0", default_port
        return check.hostport_pair(value, name, default_port=default_port, allow_zero=True)

    http_host, http_port = listen("http_listen", DEFAULT_HTTP_PORT)
    grpc_host, grpc_port = listen("grpc_listen", DEFAULT_GRPC_PORT)
    if (
        http_port == grpc_port
        and http_port != 0
        and (http_host == grpc_host or _is_wildcard(http_host) or _is_wildcard(grpc_host))
    ):
        check.fail(
            "grpc_listen",
            f"port {grpc_port} is also http_listen's; the gateway (8080) and the agents' "
            "stream (7443) need ports of their own",
        )
    enroll_host, enroll_port = listen("enroll_listen", DEFAULT_ENROLL_PORT)
    if enroll_port != 0 and enroll_port in (http_port, grpc_port):
        check.fail(
            "enroll_listen",
            f"port {enroll_port} is already used by http_listen or grpc_listen; enrolment "
            "(8443) needs a port of its own",
        )
    return {
        "http_listen": format_hostport(http_host, http_port),
        "grpc_listen": format_hostport(grpc_host, grpc_port),
        "enroll_listen": format_hostport(enroll_host, enroll_port),
    }


def node_timing(check: Checker, top: Mapping[str, Any]) -> _NodeTiming:
    """How often a node beats, how long before it counts as lost, and how long the nodes
    have to reattach after a restart."""
    heartbeat = DEFAULT_HEARTBEAT_INTERVAL
    if top.get("heartbeat_interval") is not None:
        heartbeat = check.number(
            top["heartbeat_interval"],
            "heartbeat_interval",
            minimum=MIN_HEARTBEAT_INTERVAL,
            maximum=MAX_HEARTBEAT_INTERVAL,
        )
    # Not given: 12 s, or three heartbeat intervals where 12 s is not more than two (a
    # server.yaml that slows the heartbeat to 6 s or more keeps a loss timeout it can meet).
    loss_timeout = DEFAULT_LOSS_TIMEOUT if DEFAULT_LOSS_TIMEOUT > 2 * heartbeat else 3 * heartbeat
    if top.get("loss_timeout") is not None:
        loss_timeout = check.number(top["loss_timeout"], "loss_timeout", minimum=0)
    if not loss_timeout > 2 * heartbeat:
        check.fail(
            "loss_timeout",
            f"is {loss_timeout:g} s but must be more than twice heartbeat_interval "
            f"({heartbeat:g} s), so one late heartbeat does not lose a node; "
            f"set it to {3 * heartbeat:g} or more",
        )
    reattach_grace = bounded_duration(
        check,
        top,
        "reattach_grace",
        DEFAULT_REATTACH_GRACE,
        (0, 3600),
        "must be between 0 s (the loss timeout only) and 1 hour; a fleet of thousands "
        "needs about a minute to reattach after a restart",
    )
    return {
        "heartbeat_interval": heartbeat,
        "loss_timeout": loss_timeout,
        "reattach_grace": reattach_grace,
    }


def queueing(check: Checker, top: Mapping[str, Any]) -> _Queueing:
    """How long a request waits for a free replica, and whether keys take turns."""
    queue_timeout = bounded_duration(
        check,
        top,
        "queue_timeout",
        DEFAULT_QUEUE_TIMEOUT,
        (0, 600),
        "must be between 0 s (no waiting: 503 at once when every replica is full) and 10 minutes",
    )
    fair_queueing = True
    if top.get("fair_queueing") is not None:
        fair_queueing = check.boolean(top["fair_queueing"], "fair_queueing")
    return {"queue_timeout": queue_timeout, "fair_queueing": fair_queueing}


def leadership_timing(check: Checker, top: Mapping[str, Any]) -> _LeadershipTiming:
    """The leader's lease and its renewal, and how often a standby reads the store again."""
    lease = bounded_duration(
        check, top, "lease", DEFAULT_LEASE, (2, 300), "must be between 2 s and 5 minutes"
    )
    lease_renew = min(DEFAULT_LEASE_RENEW, lease / 3)
    if top.get("lease_renew") is not None:
        lease_renew = check.duration(top["lease_renew"], "lease_renew")
        if not 0 < lease_renew <= lease / 2:
            check.fail(
                "lease_renew",
                f"must be more than 0 and at most half the lease ({lease / 2:g} s), so that "
                "one late renewal does not lose the leadership",
            )
    resync = bounded_duration(
        check,
        top,
        "resync_interval",
        DEFAULT_RESYNC_INTERVAL,
        (0.5, 300),
        "must be between 0.5 s and 5 minutes",
    )
    return {"lease": lease, "lease_renew": lease_renew, "resync_interval": resync}


def draining(check: Checker, top: Mapping[str, Any]) -> _Draining:
    """A stop's two waits: the load balancers' (/healthz 503) and the requests' in flight."""
    grace = bounded_duration(
        check,
        top,
        "drain_grace",
        DEFAULT_DRAIN_GRACE,
        (0, 300),
        "must be between 0 s (no load balancer checks /healthz) and 5 minutes; give it a few "
        "of the load balancer's health-check intervals",
    )
    timeout = bounded_duration(
        check,
        top,
        "drain_timeout",
        DEFAULT_DRAIN_TIMEOUT,
        (0, 3600),
        "must be between 0 s (cut what is in flight) and 1 hour; the systemd unit's "
        "TimeoutStopSec must exceed drain_grace + drain_timeout (systemctl edit llmgw-server)",
    )
    return {"drain_grace": grace, "drain_timeout": timeout}


def max_messages(check: Checker, top: Mapping[str, Any]) -> int:
    if top.get("max_messages") is None:
        return DEFAULT_MAX_MESSAGES
    value = int(
        check.number(top["max_messages"], "max_messages", minimum=1, maximum=MAX_MAX_MESSAGES)
    )
    if not isinstance(top["max_messages"], int):
        check.fail("max_messages", f"must be a whole number, got {top['max_messages']!r}")
    return value


def _is_wildcard(host: str) -> bool:
    return is_ip_address(host) and ipaddress.ip_address(host).is_unspecified


__all__ = [
    "DEFAULT_DRAIN_GRACE",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_LEASE",
    "DEFAULT_LEASE_RENEW",
    "DEFAULT_LOSS_TIMEOUT",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_QUEUE_TIMEOUT",
    "DEFAULT_REATTACH_GRACE",
    "DEFAULT_RESYNC_INTERVAL",
    "MAX_HEARTBEAT_INTERVAL",
    "MAX_MAX_MESSAGES",
    "MIN_HEARTBEAT_INTERVAL",
    "bounded_duration",
    "draining",
    "leadership_timing",
    "listen_addresses",
    "max_messages",
    "node_timing",
    "queueing",
]
