"""server.yaml -> ServerConfig: defaults without a file, refusals naming key and file."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from llmgw.errors import ConfigError
from llmgw.server.accounts.logins import LoginPolicy
from llmgw.server.common.config import (
    ServerConfig,
    load_server_config,
    parse_server_config,
)

DEFAULTS = ServerConfig(
    state_dir=Path("/var/lib/llmgw"),
    http_listen="0.0.0.0:8080",
    grpc_listen="0.0.0.0:7443",
    advertise=(),
    heartbeat_interval=5.0,
    loss_timeout=12.0,
    admin_token_file=Path("/var/lib/llmgw/admin.token"),
    source=None,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


INVALID = [
    ("http_listn: ':8080'\n", "http_listn", "did you mean 'http_listen'?"),
    ("state_dir: 5\n", "state_dir", "must be a path (a string), got int"),
    ("http_listen: '0.0.0.0:80800'\n", "http_listen", "must be a number from 0 to 65535"),
    ("grpc_listen: '::1:7443'\n", "grpc_listen", "needs brackets"),
    ("grpc_listen: 7443\n", "grpc_listen", "must be a string host:port, got int"),
    ("grpc_listen: '0.0.0.0:8080'\n", "grpc_listen", "port 8080 is also http_listen's"),
    ("http_listen: 10.0.0.1:7443\n", "grpc_listen", "port 7443 is also http_listen's"),
    ("advertise: cp.example.com\n", "advertise", "must be a list of host names or IPs"),
    ("advertise: [cp.example.com, 5]\n", "advertise[1]", "got int"),
    ("advertise: ['cp:8080']\n", "advertise[0]", "is not a host name or IP address"),
    ("advertise: ['*.example.com']\n", "advertise[0]", "no wildcards"),
    ("advertise: [cp1, CP1]\n", "advertise[1]", "listed twice"),
    ("heartbeat_interval: 0.1\n", "heartbeat_interval", "must be from 0.2 to 60"),
    ("heartbeat_interval: 61\n", "heartbeat_interval", "must be from 0.2 to 60"),
    ("heartbeat_interval: fast\n", "heartbeat_interval", "must be a number, got string"),
    ("heartbeat_interval: true\n", "heartbeat_interval", "must be a number, got bool"),
    ("heartbeat_interval: .nan\n", "heartbeat_interval", "finite"),
    ("loss_timeout: 10\n", "loss_timeout", "more than twice heartbeat_interval (5 s)"),
    ("heartbeat_interval: 6\nloss_timeout: 12\n", "loss_timeout", "set it to 18 or more"),
    ("loss_timeout: -1\n", "loss_timeout", "must be at least 0"),
    ("admin_token_file: ''\n", "admin_token_file", "must not be an empty path"),
    ("max_request_body: 8M\n", "max_request_body", "ambiguous; use binary units, e.g. 8MiB"),
    ("max_request_body: 2TiB\n", "max_request_body", "unknown unit 'TiB'"),
    ("max_request_body: true\n", "max_request_body", "a size like 8MiB"),
    ("max_request_body: 512MiB\n", "max_inflight_body_bytes", "less than max_request_body"),
    ("max_response_body: 0\n", "max_response_body", "at least 1 KiB"),
    ("upstream_idle_timeout: 0s\n", "upstream_idle_timeout", "from 1 s to 1 d"),
    ("upstream_idle_timeout: soon\n", "upstream_idle_timeout", "a duration like 500ms, 30s"),
    ("database: mysql://x@y/z\n", "database", "unknown database scheme 'mysql'"),
    ("database: postgresql://u:pw@h/d\n", "database", "holds a password; take it out"),
    ("database: {password_file: /p}\n", "database.url", "is required"),
    ("database: {url: 'postgresql://u@h/d', pw: x}\n", "database.pw", "unknown key 'pw'"),
    ("database: 5\n", "database", "must be sqlite:///PATH or a postgresql:// URL"),
    ("instance_id: CP_1\n", "instance_id", "is not an instance name"),
    ("lease: 1s\n", "lease", "must be between 2 s and 5 minutes"),
    ("lease_renew: 6s\n", "lease_renew", "at most half the lease (4 s)"),
    ("resync_interval: 0.1s\n", "resync_interval", "between 0.5 s and 5 minutes"),
    ("reattach_grace: 2h\n", "reattach_grace", "between 0 s (the loss timeout only) and 1 hour"),
    ("reattach_grace: soon\n", "reattach_grace", "a duration like 500ms, 30s"),
]


def test_the_default_loss_timeout_follows_a_slower_heartbeat(tmp_path: Path) -> None:
    assert load_server_config(None).loss_timeout == 12.0
    slow = load_server_config(write(tmp_path, "heartbeat_interval: 10\n"))
    assert (slow.heartbeat_interval, slow.loss_timeout) == (10.0, 30.0)
    fast = load_server_config(write(tmp_path, "heartbeat_interval: 1\n"))
    assert fast.loss_timeout == 12.0


def test_reattach_grace_defaults_to_a_minute_and_takes_a_duration(tmp_path: Path) -> None:
    assert load_server_config(None).reattach_grace == 60.0
    assert load_server_config(write(tmp_path, "reattach_grace: 2m\n")).reattach_grace == 120.0
    assert load_server_config(write(tmp_path, "reattach_grace: 0\n")).reattach_grace == 0.0


def test_drain_grace_and_timeout_default_to_10s_and_2m_and_take_durations(
    tmp_path: Path,
) -> None:
    default = load_server_config(None)
    assert (default.drain_grace, default.drain_timeout) == (10.0, 120.0)
    cfg = load_server_config(write(tmp_path, "drain_grace: 2s\ndrain_timeout: 5m\n"))
    assert (cfg.drain_grace, cfg.drain_timeout) == (2.0, 300.0)
    none = load_server_config(write(tmp_path, "drain_grace: 0\ndrain_timeout: 0s\n"))
    assert (none.drain_grace, none.drain_timeout) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("drain_grace: 6m\n", "drain_grace", "between 0 s"),
        ("drain_grace: -1\n", "drain_grace", ""),
        ("drain_grace: soon\n", "drain_grace", ""),
        ("drain_timeout: 2h\n", "drain_timeout", "TimeoutStopSec"),
        ("drain_timeout: [1]\n", "drain_timeout", ""),
    ],
)
def test_drain_refusals_name_the_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_server_config(path)
    assert err.value.key == key
    assert words in str(err.value)
    assert str(path) in str(err.value)


def test_database_forms(tmp_path: Path) -> None:
    default = load_server_config(None)
    assert default.database_location.path == "/var/lib/llmgw/llmgw.db"
    assert not default.shared_database
    assert default.instance  # the host name
    cfg = load_server_config(
        write(
            tmp_path,
            """\
            database:
              url: postgresql://llmgw@db1,db2/llmgw?target_session_attrs=read-write&sslmode=verify-full
              password_file: db-password
            instance_id: cp2
            lease: 6s
            """,
        )
    )
    assert cfg.shared_database and cfg.instance == "cp2"
    assert cfg.database_location.password_file == tmp_path / "db-password"
    assert (cfg.lease, cfg.lease_renew) == (6.0, 2.0)
    plain = load_server_config(write(tmp_path, "database: sqlite:///srv/x.db\n"))
    assert plain.database_location.path == "/srv/x.db" and not plain.shared_database


@pytest.mark.parametrize(("text", "key", "fragment"), INVALID)
def test_invalid_server_yaml_is_refused_naming_key_and_file(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert fragment in message
    assert info.value.key == key
    assert info.value.file == str(path)


def test_no_file_means_every_default() -> None:
    assert load_server_config(None) == DEFAULTS


def test_empty_file_means_every_default(tmp_path: Path) -> None:
    path = write(tmp_path, "# all defaults\n")
    assert load_server_config(path) == dataclasses.replace(DEFAULTS, source=path)


def test_full_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        state_dir: /srv/llmgw-cp
        http_listen: 10.0.0.1
        grpc_listen: "[::]:7444"
        advertise: [cp.example.com, 10.0.0.1, "FD00::1"]
        heartbeat_interval: 2
        loss_timeout: 4.5
        admin_token_file: /etc/llmgw/admin.token
        """,
    )
    assert load_server_config(str(path)) == ServerConfig(
        state_dir=Path("/srv/llmgw-cp"),
        http_listen="10.0.0.1:8080",
        grpc_listen="[::]:7444",
        advertise=("cp.example.com", "10.0.0.1", "fd00::1"),
        heartbeat_interval=2.0,
        loss_timeout=4.5,
        admin_token_file=Path("/etc/llmgw/admin.token"),
        bundle_dir=Path("/srv/llmgw-cp/bundles"),
        source=path,
    )


def test_relative_paths_and_token_default(tmp_path: Path) -> None:
    path = write(tmp_path, "state_dir: state\n")
    config = load_server_config(path)
    assert config.state_dir == tmp_path / "state"
    assert config.admin_token_file == tmp_path / "state" / "admin.token"
    config = load_server_config(write(tmp_path, "admin_token_file: secrets/token\n"))
    assert config.admin_token_file == tmp_path / "secrets/token"


def test_bundle_dir_defaults_under_state_dir_and_resolves_relative(tmp_path: Path) -> None:
    assert DEFAULTS.bundle_dir == Path("/var/lib/llmgw/bundles")
    assert load_server_config(None).bundle_dir == Path("/var/lib/llmgw/bundles")
    config = load_server_config(write(tmp_path, "state_dir: state\n"))
    assert config.bundle_dir == tmp_path / "state" / "bundles"
    config = load_server_config(write(tmp_path, "bundle_dir: dist\n"))
    assert config.bundle_dir == tmp_path / "dist"
    assert config.state_dir == Path("/var/lib/llmgw")
    with pytest.raises(ConfigError) as info:
        load_server_config(write(tmp_path, "bundle_dir: [a]\n"))
    assert info.value.key == "bundle_dir"
    assert "must be a path" in str(info.value)


def test_overrides(tmp_path: Path) -> None:
    config = load_server_config(
        None, overrides={"state_dir": "/tmp/cp", "http_listen": "127.0.0.1:18080"}
    )
    assert config.state_dir == Path("/tmp/cp")
    assert config.admin_token_file == Path("/tmp/cp/admin.token")
    assert config.http_listen == "127.0.0.1:18080"
    path = write(tmp_path, "heartbeat_interval: 1\n")
    config = load_server_config(path, overrides={"loss_timeout": 3})
    assert (config.heartbeat_interval, config.loss_timeout) == (1.0, 3.0)


def test_overrides_without_file_are_validated() -> None:
    with pytest.raises(ConfigError) as info:
        load_server_config(None, overrides={"heartbeat_interval": 10, "loss_timeout": 15})
    assert info.value.key == "loss_timeout"
    assert "set it to 30 or more" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'grpc_listen'"):
        load_server_config(None, overrides={"grpc_listn": ":1"})


def test_file_level_refusals(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_server_config(missing)
    assert str(info.value) == (
        f"{missing}: no such file; create it from server.example.yaml or pass --config"
    )
    with pytest.raises(ConfigError, match="must be a mapping of keys"):
        load_server_config(write(tmp_path, "- state_dir: /x\n"))
    path = write(tmp_path, "state_dir: /x\nhttp_listen: [\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value).startswith(f"{path}: line ")
    assert "invalid YAML" in str(info.value)


def test_parse_server_config() -> None:
    assert parse_server_config(None) == DEFAULTS
    assert parse_server_config({"heartbeat_interval": 1}).heartbeat_interval == 1.0
    with pytest.raises(ConfigError, match=r"^<server\.yaml>: loss_timeout: "):
        parse_server_config({"loss_timeout": 1})


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.loss_timeout = 1.0  # type: ignore[misc]


def test_body_limits_default_and_accept_sizes(tmp_path: Path) -> None:
    assert DEFAULTS.max_request_body == 8 * 1024 * 1024
    assert DEFAULTS.max_inflight_body_bytes == 256 * 1024 * 1024
    assert DEFAULTS.max_response_body == 64 * 1024 * 1024
    assert DEFAULTS.upstream_idle_timeout == 300.0
    path = write(
        tmp_path,
        """\
        max_request_body: 512KiB
        max_inflight_body_bytes: 1GiB
        max_response_body: 1048576
        upstream_idle_timeout: 10m
        """,
    )
    cfg = load_server_config(path)
    assert cfg.max_request_body == 512 * 1024
    assert cfg.max_inflight_body_bytes == 1024**3
    assert cfg.max_response_body == 1024 * 1024
    assert cfg.upstream_idle_timeout == 600.0


def test_replica_wait_accepts_durations_and_refuses_out_of_range(tmp_path: Path) -> None:
    from llmgw.errors import ConfigError
    from llmgw.server.common.config import load_server_config

    cfg = tmp_path / "server.yaml"
    cfg.write_text("replica_wait: 30s\n")
    assert load_server_config(cfg).replica_wait == 30.0
    cfg.write_text("replica_wait: 2h\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(cfg)
    assert f"{cfg}: replica_wait: must be between 0 and 600 seconds" in str(info.value)


def test_queue_timeout_and_fair_queueing(tmp_path: Path) -> None:
    from llmgw.errors import ConfigError
    from llmgw.server.common.config import load_server_config

    cfg = tmp_path / "server.yaml"
    cfg.write_text("{}\n")
    default = load_server_config(cfg)
    assert (default.queue_timeout, default.fair_queueing) == (30.0, True)
    cfg.write_text("queue_timeout: 0\nfair_queueing: false\n")
    zero = load_server_config(cfg)
    assert (zero.queue_timeout, zero.fair_queueing) == (0.0, False)
    cfg.write_text("queue_timeout: 1h\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(cfg)
    assert f"{cfg}: queue_timeout: must be between 0 s" in str(info.value)
    cfg.write_text("fair_queueing: sometimes\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(cfg)
    assert "fair_queueing" in str(info.value)


def test_durations_take_the_one_syntax_of_llmgw_durations(tmp_path: Path) -> None:
    """New with issue 12: server.yaml reads durations as catalog.yaml and ctl do, so
    milliseconds and a quoted number of seconds are accepted, a negative one refused."""
    from llmgw.errors import ConfigError
    from llmgw.server.common.config import load_server_config

    cfg = tmp_path / "server.yaml"
    cfg.write_text('replica_wait: 500ms\nupstream_idle_timeout: "90"\ncert_lifetime: 30d\n')
    loaded = load_server_config(cfg)
    assert loaded.replica_wait == 0.5
    assert loaded.upstream_idle_timeout == 90.0
    assert loaded.cert_lifetime == 30 * 86400.0
    cfg.write_text("replica_wait: -1\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(cfg)
    assert f"{cfg}: replica_wait: must be a duration of 0 s or more" in str(info.value)


def test_tls_is_off_by_default_cluster_or_the_operators_files(tmp_path: Path) -> None:
    from llmgw.server.common.config import TLSConfig

    assert load_server_config(write(tmp_path, "{}\n")).tls is None
    assert load_server_config(write(tmp_path, "{}\n")).http_scheme == "http"
    cfg = load_server_config(write(tmp_path, "tls: cluster\n"))
    assert cfg.tls == TLSConfig() and cfg.tls.cluster and cfg.http_scheme == "https"
    cfg = load_server_config(write(tmp_path, "tls: {cert: live/fullchain.pem, key: /k.pem}\n"))
    assert cfg.tls == TLSConfig(cert=tmp_path / "live/fullchain.pem", key=Path("/k.pem"))
    assert cfg.tls is not None and not cfg.tls.cluster and cfg.http_scheme == "https"


def test_listener_limits_default_and_configured(tmp_path: Path) -> None:
    from llmgw.listener import ListenerLimits

    defaults = load_server_config(None)
    assert defaults.listeners == ListenerLimits(header_timeout=15.0, handshake_timeout=10.0)
    assert defaults.enroll_connections_per_source == 64
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "listeners:\n  header_timeout: 2\n  handshake_timeout: 1\n"
        "  enroll_connections_per_source: 5000\n"
    )
    loaded = load_server_config(cfg)
    assert loaded.listeners == ListenerLimits(header_timeout=2.0, handshake_timeout=1.0)
    assert loaded.enroll_connections_per_source == 5000
    cfg.write_text("listeners:\n  enroll_connections_per_source: 0\n")
    assert load_server_config(cfg).enroll_connections_per_source == 0  # no cap


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        (
            "tls: true\n",
            "tls",
            "must be 'cluster' (a certificate from the cluster CA) or a mapping",
        ),
        ("tls: clustr\n", "tls", "got 'clustr'"),
        ("tls: {cert: c.pem}\n", "tls.key", "is required: give both cert"),
        ("tls: {key: k.pem}\n", "tls.cert", "is required: give both cert"),
        ("tls: {cert: c.pem, key: k.pem, ca: x}\n", "tls.ca", "unknown key"),
        ("tls: {cert: '', key: k.pem}\n", "tls.cert", "must not be an empty path"),
    ],
)
def test_tls_refusals_name_the_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value).startswith(f"{path}: {key}: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("listeners: 15\n", "listeners", "must be a mapping"),
        ("listeners: {header_timeout: 0}\n", "listeners.header_timeout", "from 0.1 to 600"),
        ("listeners: {handshake_timeout: 601}\n", "listeners.handshake_timeout", "to 600"),
        (
            "listeners: {enroll_connections_per_source: -1}\n",
            "listeners.enroll_connections_per_source",
            "whole number of connections",
        ),
        ("listeners: {header_timeot: 3}\n", "listeners.header_timeot", "'header_timeout'?"),
    ],
)
def test_listener_limits_refused_naming_the_key(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_server_config(cfg)
    assert info.value.key == key
    assert str(info.value).startswith(f"{cfg}: {key}: ") and fragment in str(info.value)


# ------------------------------------------------------------------ console:

ROOT = Path(__file__).resolve().parents[3]


def test_console_defaults_and_values(tmp_path: Path) -> None:
    assert load_server_config(None).console == LoginPolicy()
    path = write(
        tmp_path,
        """\
        console:
          session_idle: 30m
          session_lifetime: 8h
          cli_idle: 1d
          cli_lifetime: 2d
          login_failures_per_address: 50
          login_failures_per_account: 3
          login_failure_window: 10m
          login_lockout: 1h
        """,
    )
    assert load_server_config(path).console == LoginPolicy(
        session_idle=1800.0,
        session_lifetime=8 * 3600.0,
        cli_idle=86400.0,
        cli_lifetime=2 * 86400.0,
        failures_per_address=50,
        failures_per_account=3,
        failure_window=600.0,
        lockout=3600.0,
    )


def test_the_documented_console_block_is_the_defaults(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```yaml\nconsole:\n", 1)[1].split("```", 1)[0]
    path = write(tmp_path, "console:\n" + block)
    assert load_server_config(path).console == LoginPolicy()
    shipped = (ROOT / "packaging" / "config" / "server.yaml").read_text()
    lines = shipped.split("# console:\n", 1)[1].splitlines()
    kept = [line.removeprefix("# ") for line in lines if line.startswith("#   ")]
    assert len(kept) == 8
    path = write(tmp_path, "console:\n" + "\n".join(kept) + "\n")
    assert load_server_config(path).console == LoginPolicy()


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("console: 1h\n", "console", "must be a mapping"),
        ("console: {session_idel: 1h}\n", "console.session_idel", "'session_idle'?"),
        ("console: {session_idle: 0}\n", "console.session_idle", "must be more than 0 seconds"),
        ("console: {cli_idle: -5}\n", "console.cli_idle", "must be a duration of 0 s or more"),
        ("console: {login_lockout: -1h}\n", "console.login_lockout", "a duration like"),
        ("console: {login_failure_window: 0s}\n", "console.login_failure_window", "more than 0"),
        (
            "console: {session_idle: 13h}\n",
            "console.session_idle",
            "longer than console.session_lifetime (43200 s)",
        ),
        (
            "console: {cli_idle: 2d, cli_lifetime: 1d}\n",
            "console.cli_idle",
            "make cli_idle at most cli_lifetime",
        ),
        (
            "console: {login_failures_per_account: 0}\n",
            "console.login_failures_per_account",
            "whole number of failed logins, 1 or more, got 0",
        ),
        (
            "console: {login_failures_per_address: 2.5}\n",
            "console.login_failures_per_address",
            "got 2.5",
        ),
        (
            "console: {login_failures_per_address: true}\n",
            "console.login_failures_per_address",
            "got True",
        ),
    ],
)
def test_console_refusals_name_the_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert info.value.key == key
    assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value)


# ------------------------------------------------------- trusted_proxies, plain HTTP


def test_trusted_proxies_default_to_none_and_take_addresses_and_cidrs(tmp_path: Path) -> None:
    assert load_server_config(None).trusted_proxies == ()
    path = write(tmp_path, "trusted_proxies: [10.0.0.0/8, 192.0.2.7, '2001:db8::/48']\n")
    assert [str(n) for n in load_server_config(path).trusted_proxies] == [
        "10.0.0.0/8",
        "192.0.2.7/32",
        "2001:db8::/48",
    ]


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("trusted_proxies: 10.0.0.0/8\n", "trusted_proxies", "must be a list"),
        ("trusted_proxies: [10.0.0.1/8]\n", "trusted_proxies[0]", "no host bits set"),
        ("trusted_proxies: [10.0.0.0/8, proxy.local]\n", "trusted_proxies[1]", "'proxy.local'"),
        ("trusted_proxies: [7]\n", "trusted_proxies[0]", "must be a list of strings"),
    ],
)
def test_trusted_proxies_refusals_name_the_key(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert info.value.key == key
    assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value)


@pytest.mark.parametrize(
    ("listen", "tls", "exposed"),
    [
        ("0.0.0.0:8080", None, True),
        ("[::]:8080", None, True),
        ("192.0.2.10:8080", None, True),
        ("cp.example.net:8080", None, True),
        ("127.0.0.1:8080", None, False),
        ("127.0.0.2:8080", None, False),
        ("[::1]:8080", None, False),
        ("[::ffff:127.0.0.1]:8080", None, False),
        ("localhost:8080", None, False),
        ("0.0.0.0:8080", "cluster", False),
    ],
)
def test_plain_http_beyond_loopback_is_known(listen: str, tls: str | None, exposed: bool) -> None:
    cfg = load_server_config(None, overrides={"http_listen": listen, "tls": tls})
    assert cfg.cleartext_exposed is exposed


def test_gateway_settings_default_parse_and_name_their_key(tmp_path: Path) -> None:
    """max_messages, metrics_token_file and tokenizer_sources (issue 36): the shipped
    server.yaml's commented lines are the defaults (and an example source)."""
    defaults = load_server_config(None)
    assert defaults.max_messages == 2048 and defaults.tokenizer_sources == ()
    assert defaults.metrics_token_path == Path("/var/lib/llmgw/metrics.token")
    shipped = (ROOT / "packaging" / "config" / "server.yaml").read_text()
    for key in ("max_messages", "metrics_token_file", "tokenizer_sources"):
        line = next(x for x in shipped.splitlines() if x.startswith(f"# {key}: "))
        cfg = load_server_config(write(tmp_path, line.removeprefix("# ") + "\n"))
        if key != "tokenizer_sources":
            assert getattr(cfg, key) in (getattr(defaults, key), defaults.metrics_token_path)
    assert [p.text for p in cfg.tokenizer_sources] == ["http://10.0.0.2:8000/tokenizers/"]
    for text, key, fragment in (
        ("max_messages: 0\n", "max_messages", "must be from 1 to"),
        ("max_messages: 2.5\n", "max_messages", "must be a whole number"),
        ("tokenizer_sources: [ftp://x/]\n", "tokenizer_sources[0]", "is not a URL prefix"),
        ("tokenizer_sources: [file:///srv/t/]\n", "tokenizer_sources[0]", "https:// or http://"),
        ("tokenizer_sources: http://x/\n", "tokenizer_sources", "list"),
    ):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            load_server_config(path)
        assert info.value.key == key, text
        assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value)


def test_what_no_tokenizer_path_may_name(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        state_dir: /srv/llmgw
        admin_token_file: /etc/llmgw/admin.token
        metrics_token_file: /etc/llmgw/metrics.token
        database: {url: "postgresql://llmgw@db/llmgw?sslmode=verify-full&sslrootcert=/etc/llmgw/db-ca.crt", password_file: /etc/llmgw/db-password}
        tls: {cert: /etc/llmgw/tls.crt, key: /etc/llmgw/tls.key}
        """,
    )
    assert load_server_config(path).private_paths == (
        Path("/srv/llmgw"),
        Path("/etc/llmgw/admin.token"),
        Path("/etc/llmgw/metrics.token"),
        Path("/etc/llmgw/db-password"),
        Path("/etc/llmgw/tls.key"),
        path,
    )
