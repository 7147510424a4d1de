"""Tests for server.yaml's database: the URL forms, and the refusals that say what to write."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.errors import ConfigError
from llmgw.server.store.location import parse_location


def test_sqlite_url_and_plain_path() -> None:
    loc = parse_location("sqlite:///var/lib/llmgw/llmgw.db")
    assert (loc.engine, loc.path, loc.display) == (
        "sqlite",
        "/var/lib/llmgw/llmgw.db",
        "/var/lib/llmgw/llmgw.db",
    )
    assert parse_location("/srv/state.db").path == "/srv/state.db"
    assert parse_location("sqlite://:memory:").path == ":memory:"


def test_postgresql_url_with_several_hosts() -> None:
    loc = parse_location(
        "postgresql://llmgw@db1,db2:5433/llmgw?target_session_attrs=read-write"
        "&sslmode=verify-full&sslrootcert=/etc/llmgw/db-ca.crt",
        password_file=Path("/etc/llmgw/db-password"),
    )
    assert loc.engine == "postgresql"
    assert loc.conninfo["dbname"] == "llmgw"
    assert loc.conninfo["target_session_attrs"] == "read-write"
    assert loc.hosts() == ["db1:5432", "db2:5433"]
    assert loc.display == "postgresql://llmgw@db1,db2:5433/llmgw"
    assert loc.password_file == Path("/etc/llmgw/db-password")
    assert parse_location("postgres://u@h/d?sslmode=verify-full").engine == "postgresql"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "is empty; give sqlite:///PATH or a postgresql:// URL"),
        ("sqlite://relative.db", "names no absolute path; write sqlite:///ABSOLUTE/PATH"),
        ("mysql://u@h/d", "unknown database scheme 'mysql'"),
        ("postgresql://u:secret@h/d", "holds a password; take it out of the URL"),
        ("postgresql://u@h", "names no database; add it after the host"),
        ("postgresql://u@h/d?nonsense=1", "is not a valid PostgreSQL URL"),
    ],
)
def test_refusals_name_the_key_and_the_fix(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_location(value)
    assert str(info.value).startswith("database: ")
    assert message in str(info.value)
    assert "secret" not in str(info.value)


def test_a_password_file_for_sqlite_is_refused() -> None:
    with pytest.raises(ConfigError, match="password_file is for a postgresql:// database"):
        parse_location("sqlite:///x.db", password_file=Path("/p"))


def test_the_password_file_is_read_and_checked(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    loc = parse_location("postgresql://u@localhost/d", password_file=pw)
    assert loc.read_password() == "s3cret"
    pw.write_text("\n")
    with pytest.raises(ConfigError, match="must hold the database password alone, on one line"):
        loc.read_password()
    with pytest.raises(ConfigError, match="cannot read the database password file"):
        parse_location("postgresql://u@/d", password_file=tmp_path / "none").read_password()


def test_a_postgresql_url_without_the_driver_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg raises ImportError
    with pytest.raises(ConfigError, match=r"no PostgreSQL driver .*pip install 'psycopg\[binary"):
        parse_location("postgresql://u@h/d")
    assert parse_location("sqlite:///x.db").engine == "sqlite"  # SQLite needs none


REFUSAL = (
    "database: reaches {hosts} over the network without checking that the server is the one "
    "meant (libpq's default sslmode=prefer takes any certificate, or none), and whoever "
    "answers there owns the cluster; add sslmode=verify-full&sslrootcert=/etc/llmgw/db-ca.crt "
    "to the URL (the CA that signed the database server's certificate, readable by the "
    "control plane's user; sslrootcert=system: the system's trust store), or state another "
    "sslmode= to accept less (the README's 'The database connection' says what each means)"
)


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("postgresql://llmgw@db1.example.net/llmgw", "db1.example.net"),
        ("postgresql://llmgw@127.0.0.1,db2:5433/llmgw", "db2"),  # one remote host is enough
        ("postgresql://llmgw@10.0.0.5/llmgw", "10.0.0.5"),
        ("postgresql://llmgw@[fd00::5]/llmgw", "fd00::5"),
        ("postgresql://llmgw@localhost/llmgw?hostaddr=10.0.0.5", "10.0.0.5"),
        ("postgresql:///llmgw?host=db1", "db1"),
    ],
)
def test_a_network_host_without_sslmode_is_refused(url: str, hosts: str) -> None:
    """libpq's default sslmode=prefer was used and never checked: whoever answers on the
    network path owns the cluster."""
    with pytest.raises(ConfigError) as info:
        parse_location(url)
    assert str(info.value) == REFUSAL.format(hosts=hosts)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://llmgw@127.0.0.1:5432/llmgw",
        "postgresql://llmgw@127.8.9.1/llmgw",
        "postgresql://llmgw@[::1]/llmgw",
        "postgresql://llmgw@localhost/llmgw",
        "postgresql://llmgw@/llmgw",  # the default Unix socket
        "postgresql:///llmgw?host=/var/run/postgresql",
        "postgresql://llmgw@%2Fvar%2Frun%2Fpostgresql/llmgw",
    ],
)
def test_loopback_and_unix_sockets_stay_as_they_were(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGHOST", raising=False)
    monkeypatch.delenv("PGHOSTADDR", raising=False)
    loc = parse_location(url)
    assert "sslmode" not in loc.conninfo
    assert loc.unverified_network_hosts == []


def test_an_explicit_sslmode_is_the_operators_choice() -> None:
    """verify-full checks; another sslmode stated in the URL is accepted, and the start
    warns of the hosts it leaves unverified."""
    full = parse_location(
        "postgresql://llmgw@db1/llmgw?sslmode=verify-full&sslrootcert=/etc/llmgw/db-ca.crt"
    )
    assert full.conninfo["sslrootcert"] == "/etc/llmgw/db-ca.crt"
    assert full.unverified_network_hosts == []
    for mode in ("require", "verify-ca", "disable"):
        loc = parse_location(f"postgresql://llmgw@db1,127.0.0.1/llmgw?sslmode={mode}")
        assert loc.unverified_network_hosts == ["db1"]


def test_pghost_counts_when_the_url_names_no_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHOST", "db9.example.net")
    with pytest.raises(ConfigError, match=r"reaches db9\.example\.net over the network"):
        parse_location("postgresql://llmgw@/llmgw")
