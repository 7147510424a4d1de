"""The control plane's configuration: ``server.yaml`` (+ overrides) -> one frozen
:class:`ServerConfig`. Every key has a default, so the file itself is optional."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.bodies import (
    DEFAULT_MAX_INFLIGHT_BODY_BYTES,
    DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    parse_body_limits,
)
from llmgw.configfile import Checker, apply_overrides, index_key, load_yaml, type_name
from llmgw.contracts.paths import DEFAULT_SERVER_STATE_DIR
from llmgw.contracts.ports import DEFAULT_ENROLL_PORT, DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from llmgw.contracts.sources import SourcePrefix, parse_prefixes
from llmgw.errors import ConfigError
from llmgw.listener import ListenerLimits, parse_listener_limits
from llmgw.netaddr import is_hostname, is_ip_address, is_loopback_host
from llmgw.server.accounts.logins import LoginPolicy
from llmgw.server.common.config_sections import (
    DEFAULT_DRAIN_GRACE,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_LEASE,
    DEFAULT_LEASE_RENEW,
    DEFAULT_LOSS_TIMEOUT,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_REATTACH_GRACE,
    DEFAULT_RESYNC_INTERVAL,
    bounded_duration,
    draining,
    leadership_timing,
    listen_addresses,
    max_messages,
    node_timing,
    queueing,
)
from llmgw.server.store.location import Location, parse_location

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_HTTP_LISTEN = f"0.0.0.0:{DEFAULT_HTTP_PORT}"
DEFAULT_GRPC_LISTEN = f"0.0.0.0:{DEFAULT_GRPC_PORT}"

_KEYS = (
    "state_dir",
    "http_listen",
    "grpc_listen",
    "advertise",
    "heartbeat_interval",
    "loss_timeout",
    "reattach_grace",
    "admin_token_file",
    "enroll_listen",
    "cert_lifetime",
    "bundle_dir",
    "replica_wait",
    "queue_timeout",
    "fair_queueing",
    "tls",
    "listeners",
    "max_request_body",
    "max_inflight_body_bytes",
    "max_response_body",
    "upstream_idle_timeout",
    "database",
    "instance_id",
    "lease",
    "lease_renew",
    "resync_interval",
    "console",
    "trusted_proxies",
    "max_messages",
    "metrics_token_file",
    "tokenizer_sources",
    "drain_grace",
    "drain_timeout",
)
_TLS_KEYS = ("cert", "key")
_DATABASE_KEYS = ("url", "password_file")
_CONSOLE_KEYS = (
    "session_idle",
    "session_lifetime",
    "cli_idle",
    "cli_lifetime",
    "login_failures_per_address",
    "login_failures_per_account",
    "login_failure_window",
    "login_lockout",
)
_INSTANCE_ID = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
DEFAULT_CERT_LIFETIME = 30 * 86400.0
# Concurrent connections one address may hold on the enrolment port; a fleet enrolled at
# once from behind one NAT (or a benchmark on loopback) raises it.
DEFAULT_ENROLL_CONNECTIONS_PER_SOURCE = 64
MIN_CERT_LIFETIME = 10.0


@dataclass(frozen=True)
class TLSConfig:
    """HTTPS on the gateway/admin listener: the operator's certificate and key files
    (``tls: {cert: FILE, key: FILE}``, reloaded when they change) or, with both ``None``,
    a certificate from the cluster CA (``tls: cluster``)."""

    cert: Path | None = None
    key: Path | None = None

    @property
    def cluster(self) -> bool:
        return self.cert is None


def loopback_only(listen: str) -> bool:
    """Whether a host:port listen address is reached from this machine alone."""
    return is_loopback_host(listen.rpartition(":")[0])


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``server.yaml`` says, validated; relative paths already made absolute."""

    state_dir: Path
    http_listen: str
    grpc_listen: str
    advertise: tuple[str, ...]
    heartbeat_interval: float
    loss_timeout: float
    admin_token_file: Path
    enroll_listen: str = f"0.0.0.0:{DEFAULT_ENROLL_PORT}"
    cert_lifetime: float = DEFAULT_CERT_LIFETIME  # seconds a node certificate is valid
    # The agent bundles served at /agent/bundles (llmgw-agent-*-linux-<arch>.tar.gz).
    bundle_dir: Path = DEFAULT_SERVER_STATE_DIR / "bundles"
    # How long the gateway waits for a ready replica (say, while the only one's agent
    # restarts) before answering 503.
    replica_wait: float = 10.0
    # How long a request waits in the gateway for a place on a replica when every replica
    # of its model is full (then 503 with Retry-After), and whether the waiting requests
    # are served in per-key fair turns (weighted by priority) or in arrival order.
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    fair_queueing: bool = True
    # HTTPS on http_listen; None: plain HTTP.
    tls: TLSConfig | None = None
    # Slow clients: header and TLS handshake timeouts of every listener (the gRPC stream
    # takes the handshake timeout), and the enrolment port's cap per source address.
    listeners: ListenerLimits = field(default_factory=ListenerLimits)
    enroll_connections_per_source: int = DEFAULT_ENROLL_CONNECTIONS_PER_SOURCE
    # The largest request body the gateway takes (a catalog profile may raise it for its
    # model), and the body bytes the whole process holds at once (over it: 503).
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES
    # The largest answer read whole from an agent (streams are not capped), and how long an
    # agent may send nothing while an answer is due (-> 502, or an error event in a stream).
    max_response_body: int = DEFAULT_MAX_RESPONSE_BODY
    upstream_idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT
    # The state database (None: STATE/llmgw.db) and, on PostgreSQL, this instance's name
    # among the control planes sharing it, the leader's lease and how often it is renewed,
    # and how often a standby reloads what it routes by in case a notification was missed.
    database: Location | None = None
    instance_id: str = ""
    lease: float = DEFAULT_LEASE
    lease_renew: float = DEFAULT_LEASE_RENEW
    resync_interval: float = DEFAULT_RESYNC_INTERVAL
    # After this instance starts leading: how long a node holding shards has to reattach
    # before it is lost (never less than loss_timeout).
    reattach_grace: float = DEFAULT_REATTACH_GRACE
    # A stop's drain: /healthz 503 for drain_grace, then the requests in flight finish within
    # drain_timeout (the rest are cut).
    drain_grace: float = DEFAULT_DRAIN_GRACE
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    # The console's and ctl login's sessions (idle and absolute expiry) and the failed
    # logins that lock an address or an account.
    console: LoginPolicy = field(default_factory=LoginPolicy)
    # The reverse proxies (CIDRs) whose X-Forwarded-For names the client (llmgw.server.ha.proxies).
    trusted_proxies: tuple[Network, ...] = ()
    source: Path | None = None
    # The gateway: the most messages a request may carry; the token Prometheus presents for
    # /metrics (None: STATE/metrics.token, made at first start); the URL prefixes a
    # tokenizer may be fetched from over http:// or from a private address.
    max_messages: int = DEFAULT_MAX_MESSAGES
    metrics_token_file: Path | None = None
    tokenizer_sources: tuple[SourcePrefix, ...] = ()
    # How an operator runs 'llmgw ctl' on this machine, in the fixes the gateway's refusals
    # name: 'llmgw ctl', or (llmgw up) the llmgw the user started, as they can type it. Not a
    # server.yaml key.
    ctl_command: str = "llmgw ctl"

    @property
    def database_location(self) -> Location:
        """Where the state database is (the state directory's SQLite file by default)."""
        if self.database is not None:
            return self.database
        path = str(self.state_dir / "llmgw.db")
        return Location("sqlite", path, path=path)

    @property
    def instance(self) -> str:
        """This instance's name: instance_id, else the host name."""
        if self.instance_id:
            return self.instance_id
        name = socket.gethostname().split(".")[0].lower()
        return name if _INSTANCE_ID.fullmatch(name) else "llmgw"

    @property
    def shared_database(self) -> bool:
        """True on PostgreSQL: several instances, one leader by lease."""
        return self.database_location.is_postgresql

    @property
    def instance_stale_after(self) -> float:
        """Seconds after which an instance not heard from (its row's seen_at, touched every
        lease_renew) is taken for stopped: its id may be taken over, and it may be retired."""
        return 3 * self.lease_renew + 1

    @property
    def http_scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def cleartext_exposed(self) -> bool:
        """Whether http_listen serves plain HTTP beyond loopback: the console's password and
        cookie, the admin token, the API keys travel in clear."""
        return self.tls is None and not loopback_only(self.http_listen)

    @property
    def enroll_loopback_only(self) -> bool:
        """Whether joining nodes can reach this control plane only from this very machine
        (enroll_listen on loopback: what 'llmgw up' does unless given --host)."""
        return loopback_only(self.enroll_listen)

    @property
    def metrics_token_path(self) -> Path:
        return self.metrics_token_file or self.state_dir / "metrics.token"

    @property
    def private_paths(self) -> tuple[Path, ...]:
        """What a profile's tokenizer path may not name: the state directory, this file, and
        the secrets it names."""
        paths = [self.state_dir, self.admin_token_file, self.metrics_token_path]
        if self.database is not None and self.database.password_file is not None:
            paths.append(self.database.password_file)
        if self.tls is not None and self.tls.key is not None:
            paths.append(self.tls.key)
        if self.source is not None:
            paths.append(self.source)
        return tuple(paths)

    @property
    def pki_dir(self) -> Path:
        """The cluster CA and this instance's own certificates (:mod:`llmgw.pki`)."""
        return self.state_dir / "pki"


def load_server_config(
    path: Path | str | None, *, overrides: Mapping[str, object] | None = None
) -> ServerConfig:
    """Read ``path`` (``None``: no file, all defaults), apply ``overrides`` (dotted keys
    allowed), validate; every problem is a :class:`ConfigError` naming key and file."""
    if path is None:
        return _parse({}, file="<overrides>", base_dir=Path.cwd(), source=None, overrides=overrides)
    source = Path(path).absolute()
    data = load_yaml(source, missing_hint="create it from server.example.yaml or pass --config")
    return _parse(
        data, file=str(source), base_dir=source.parent, source=source, overrides=overrides
    )


def parse_server_config(data: object, *, source: str = "<server.yaml>") -> ServerConfig:
    """Validate already-parsed YAML data (``None``, an empty file, means all defaults);
    relative paths resolve against the current directory."""
    return _parse(data, file=source, base_dir=Path.cwd(), source=None, overrides=None)


def _parse(
    data: object,
    *,
    file: str,
    base_dir: Path,
    source: Path | None,
    overrides: Mapping[str, object] | None,
) -> ServerConfig:
    check = Checker(file=file, base_dir=base_dir)
    if data is None:
        data = {}  # an empty (or all-comment) file: every default
    if not isinstance(data, Mapping):
        check.fail("", f"must be a mapping of keys ({', '.join(_KEYS)}), got {type_name(data)}")
    if overrides:
        data = apply_overrides(data, overrides, file=file)
    top = check.mapping(data, "", accepted=_KEYS)

    def path(name: str, default: Path) -> Path:
        value = top.get(name)
        return default if value is None else check.path(value, name)

    state_dir = path("state_dir", DEFAULT_SERVER_STATE_DIR)
    addresses = listen_addresses(check, top)
    cert_lifetime = DEFAULT_CERT_LIFETIME
    if top.get("cert_lifetime") is not None:
        cert_lifetime = check.duration(top["cert_lifetime"], "cert_lifetime")
        if cert_lifetime < MIN_CERT_LIFETIME:
            check.fail("cert_lifetime", f"must be at least {MIN_CERT_LIFETIME:g}s")
    replica_wait = bounded_duration(
        check, top, "replica_wait", 10.0, (0, 600), "must be between 0 and 600 seconds"
    )
    bodies = parse_body_limits(check, top)
    timing = node_timing(check, top)
    waits = queueing(check, top)
    listeners, caps = parse_listener_limits(
        check,
        top.get("listeners"),
        "listeners",
        extra={"enroll_connections_per_source": DEFAULT_ENROLL_CONNECTIONS_PER_SOURCE},
    )
    return ServerConfig(
        state_dir=state_dir,
        **addresses,
        advertise=_advertise(check, top.get("advertise")),
        **timing,
        admin_token_file=path("admin_token_file", state_dir / "admin.token"),
        cert_lifetime=cert_lifetime,
        bundle_dir=path("bundle_dir", state_dir / "bundles"),
        replica_wait=replica_wait,
        **waits,
        tls=_tls(check, top.get("tls")),
        listeners=listeners,
        enroll_connections_per_source=caps["enroll_connections_per_source"],
        **bodies,
        database=_database(check, top.get("database")),
        instance_id=_instance_id(check, top.get("instance_id")),
        **leadership_timing(check, top),
        **draining(check, top),
        console=_console(check, top.get("console")),
        trusted_proxies=_trusted_proxies(check, top.get("trusted_proxies")),
        source=source,
        max_messages=max_messages(check, top),
        metrics_token_file=(
            check.path(top["metrics_token_file"], "metrics_token_file")
            if top.get("metrics_token_file") is not None
            else None
        ),
        tokenizer_sources=_tokenizer_sources(check, top.get("tokenizer_sources")),
    )


def _tokenizer_sources(check: Checker, value: object) -> tuple[SourcePrefix, ...]:
    """URL prefixes (agent.yaml's install_sources syntax) a tokenizer may come from over
    http:// or from a loopback or private address; a file on the control plane is a
    profile's tokenizer.path, not a source."""
    return parse_prefixes(
        check,
        value,
        "tokenizer_sources",
        example="http://10.0.0.2:8000/tokenizers/",
        schemes=("https", "http"),
    )


def _console(check: Checker, value: object) -> LoginPolicy:
    """``console:`` absent (the defaults), or a mapping of its keys."""
    default = LoginPolicy()
    if value is None:
        return default
    fields = check.mapping(value, "console", accepted=_CONSOLE_KEYS)

    def seconds(name: str, fallback: float) -> float:
        if fields.get(name) is None:
            return fallback
        got = check.duration(fields[name], f"console.{name}")
        if got <= 0:
            check.fail(f"console.{name}", f"must be more than 0 seconds, got {fields[name]!r}")
        return got

    def count(name: str, fallback: int) -> int:
        got = fields.get(name)
        if got is None:
            return fallback
        if isinstance(got, bool) or not isinstance(got, int) or got < 1:
            check.fail(
                f"console.{name}",
                f"must be a whole number of failed logins, 1 or more, got {got!r}",
            )
        return got

    policy = LoginPolicy(
        session_idle=seconds("session_idle", default.session_idle),
        session_lifetime=seconds("session_lifetime", default.session_lifetime),
        cli_idle=seconds("cli_idle", default.cli_idle),
        cli_lifetime=seconds("cli_lifetime", default.cli_lifetime),
        failures_per_address=count("login_failures_per_address", default.failures_per_address),
        failures_per_account=count("login_failures_per_account", default.failures_per_account),
        failure_window=seconds("login_failure_window", default.failure_window),
        lockout=seconds("login_lockout", default.lockout),
    )
    for idle, lifetime in (("session_idle", "session_lifetime"), ("cli_idle", "cli_lifetime")):
        if getattr(policy, idle) > getattr(policy, lifetime):
            check.fail(
                f"console.{idle}",
                f"is {getattr(policy, idle):g} s, longer than console.{lifetime} "
                f"({getattr(policy, lifetime):g} s): a session would lapse at its lifetime "
                f"before it could be idle that long; make {idle} at most {lifetime}",
            )
    return policy


def _trusted_proxies(check: Checker, value: object) -> tuple[Network, ...]:
    """``trusted_proxies:`` absent (none: X-Forwarded-For is ignored), or a list of
    addresses and CIDRs (``10.0.0.0/8``, ``2001:db8::/48``, ``192.0.2.7``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        check.fail("trusted_proxies", f"must be a list of addresses or CIDRs, e.g. [{value}]")
    found: list[Network] = []
    for index, text in enumerate(check.strings(value, "trusted_proxies")):
        try:
            network = ipaddress.ip_network(text.strip(), strict=True)
        except ValueError as exc:
            check.fail(
                index_key("trusted_proxies", index),
                f"{text!r} is not an address or a CIDR ({exc}); write e.g. 10.0.0.0/8 or "
                "2001:db8::/48, with no host bits set past the prefix",
            )
        found.append(network)
    return tuple(found)


def _database(check: Checker, value: object) -> Location | None:
    """``database:`` absent (STATE/llmgw.db), a URL or path, or ``{url, password_file}``."""
    if value is None:
        return None
    password_file: Path | None = None
    if isinstance(value, Mapping):
        fields = check.mapping(value, "database", accepted=_DATABASE_KEYS)
        if fields.get("url") is None:
            check.fail("database.url", "is required: sqlite:///PATH or a postgresql:// URL")
        if fields.get("password_file") is not None:
            password_file = check.path(fields["password_file"], "database.password_file")
        value = fields["url"]
        key = "database.url"
    else:
        key = "database"
    if not isinstance(value, str):
        check.fail(key, f"must be sqlite:///PATH or a postgresql:// URL, got {type_name(value)}")
    try:
        return parse_location(value, password_file=password_file, key=key)
    except ConfigError as exc:
        check.fail(key, str(exc).removeprefix(f"{key}: "))


def _instance_id(check: Checker, value: object) -> str:
    """This instance's name among those sharing a database (default: the host name)."""
    if value is None:
        return ""  # ServerConfig.instance: the host name
    if not isinstance(value, str) or not _INSTANCE_ID.fullmatch(value):
        check.fail(
            "instance_id",
            f"{value!r} is not an instance name: lower-case letters, digits, '.' and '-', "
            "at most 63, e.g. cp1",
        )
    return value


def _tls(check: Checker, value: object) -> TLSConfig | None:
    """``tls:`` absent (plain HTTP), ``cluster``, or ``{cert: FILE, key: FILE}``."""
    if value is None:
        return None
    if value == "cluster":
        return TLSConfig()
    if not isinstance(value, Mapping):
        check.fail(
            "tls",
            f"must be 'cluster' (a certificate from the cluster CA) or a mapping "
            f"{{cert: FILE, key: FILE}} (your own certificate), got {value!r}",
        )
    files = check.mapping(value, "tls", accepted=_TLS_KEYS)
    paths: dict[str, Path] = {}
    for name in _TLS_KEYS:
        if files.get(name) is None:
            check.fail(
                f"tls.{name}",
                "is required: give both cert (the PEM certificate chain) and key (its "
                "private key), or write 'tls: cluster'",
            )
        paths[name] = check.path(files[name], f"tls.{name}")
    return TLSConfig(cert=paths["cert"], key=paths["key"])


def _advertise(check: Checker, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        check.fail("advertise", f"must be a list of host names or IPs, e.g. [{value}]")
    names = check.strings(value, "advertise")
    result: list[str] = []
    for index, name in enumerate(names):
        key = index_key("advertise", index)
        if is_ip_address(name):
            name = str(ipaddress.ip_address(name))
        elif not is_hostname(name):
            check.fail(
                key,
                f"{name!r} is not a host name or IP address (no port, no brackets, no "
                "wildcards); it goes into the server certificate",
            )
        else:
            name = name.lower()  # DNS names compare without case
        if name in result:
            check.fail(key, f"{name} is listed twice")
        result.append(name)
    return tuple(result)


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
    "ServerConfig",
    "TLSConfig",
    "load_server_config",
    "parse_server_config",
]
