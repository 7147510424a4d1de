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
        "postgresql://llmgw@db1,db2:5433/llmgw?target_session_attrs=read-write",
        password_file=Path("/etc/llmgw/db-password"),
    )
    assert loc.engine == "postgresql"
    assert loc.conninfo["dbname"] == "llmgw"
    assert loc.conninfo["target_session_attrs"] == "read-write"
    assert loc.hosts() == ["db1:5432", "db2:5433"]
    assert loc.display == "postgresql://llmgw@db1,db2:5433/llmgw"
    assert loc.password_file == Path("/etc/llmgw/db-password")
    assert parse_location("postgres://u@h/d").engine == "postgresql"


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
    loc = parse_location("postgresql://u@h/d", password_file=pw)
    assert loc.read_password() == "s3cret"
    pw.write_text("\n")
    with pytest.raises(ConfigError, match="must hold the database password alone, on one line"):
        loc.read_password()
    with pytest.raises(ConfigError, match="cannot read the database password file"):
        parse_location("postgresql://u@h/d", password_file=tmp_path / "none").read_password()


def test_a_postgresql_url_without_the_driver_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg raises ImportError
    with pytest.raises(ConfigError, match=r"no PostgreSQL driver .*pip install 'psycopg\[binary"):
        parse_location("postgresql://u@h/d")
    assert parse_location("sqlite:///x.db").engine == "sqlite"  # SQLite needs none
