"""Tests for the PostgreSQL engine's own behaviour (real PostgreSQL, the session's throwaway
cluster): refusals at open that name the servers and never the password, migrations run once
when instances start together, writes serialised across connections, and an outage that
fails calls at once and heals by itself."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psycopg_pool.base
import pytest

from llmgw import pki
from llmgw.errors import ConfigError, StoreError, StoreUnavailable
from llmgw.server.store import MIGRATIONS, Store
from llmgw.server.store.location import Location, parse_location
from tests.pg import PASSWORD, ROLE


def _location(cluster: Any, tmp_path: Path, name: str | None = None, **params: str) -> Location:
    name = name or cluster.fresh_database()
    return parse_location(
        cluster.url(name, password=False, **params), password_file=cluster.password_file(tmp_path)
    )


def test_wrong_password_refused_without_saying_it(pg_cluster: Any, tmp_path: Path) -> None:
    name = pg_cluster.fresh_database()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    where = parse_location(pg_cluster.url(name, password=False), password_file=wrong)
    with pytest.raises(ConfigError) as info:
        Store.open(where)
    text = str(info.value)
    assert f"refused the credentials of role {ROLE}" in text
    assert "check the password in password_file" in text
    assert "not-the-password" not in text and PASSWORD not in text


def test_missing_database_refused_with_the_command_that_makes_it(
    pg_cluster: Any, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"database 'nosuchdb' does not exist on 127\.0\.0\.1:"):
        Store.open(_location(pg_cluster, tmp_path, "nosuchdb"))


def test_a_verified_connection_and_the_refusal_of_a_server_the_ca_did_not_sign(
    pg_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sslmode=verify-full with sslrootcert: the store opens over TLS, the server's certificate
    and name checked; against another CA (or another name) it is refused as a TLS problem
    with what sslrootcert must be, not as an unreachable server."""
    name = pg_cluster.fresh_database()
    store = Store.open(
        _location(
            pg_cluster, tmp_path, name, sslmode="verify-full", sslrootcert=str(pg_cluster.tls_ca)
        )
    )
    try:
        row = store.database.one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", ())
        assert row is not None and row["ssl"] is True
    finally:
        store.close()
    assert not [r for r in caplog.records if "without verifying" in r.getMessage()]
    other = pki.init_ca(tmp_path / "other")
    with pytest.raises(ConfigError) as info:
        Store.open(
            _location(
                pg_cluster,
                tmp_path,
                name,
                sslmode="verify-full",
                sslrootcert=str(other.directory / "ca.crt"),
            )
        )
    assert str(info.value).startswith(
        f"database: database postgresql://{ROLE}@127.0.0.1:{pg_cluster.port}/{name} at "
        f"127.0.0.1:{pg_cluster.port} failed the TLS check the URL asks for "
        "(sslmode=verify-full): "
    )
    assert "certificate verify failed" in str(info.value)
    assert "sslrootcert must name the CA that signed the server's certificate" in str(info.value)


def test_an_explicit_weaker_sslmode_connects_and_is_warned_of(
    pg_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The override the README explains: stated in the URL, accepted, said at start. Loopback
    needs none, so the warning is checked on a location that names a network host too
    (127.0.0.1 answers first)."""
    name = pg_cluster.fresh_database()
    port = pg_cluster.port
    url = pg_cluster.url(name, password=False, sslmode="require").replace(
        f"@127.0.0.1:{port}", f"@127.0.0.1:{port},db.invalid:{port}"
    )
    where = parse_location(url, password_file=pg_cluster.password_file(tmp_path))
    with caplog.at_level(logging.WARNING, logger="llmgw.server.store"):
        store = Store.open(where)
    store.close()
    (line,) = [r for r in caplog.records if "without verifying" in r.getMessage()]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["hosts"], fields["sslmode"]) == ("db.invalid", "require")


def test_unreachable_server_names_host_and_port(pg_cluster: Any, tmp_path: Path) -> None:
    pw = pg_cluster.password_file(tmp_path)
    where = parse_location("postgresql://llmgw@127.0.0.1:1/llmgw", password_file=pw)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        Store.open(where)
    assert time.monotonic() - started < 30
    assert "cannot reach database postgresql://llmgw@127.0.0.1:1/llmgw at 127.0.0.1:1" in str(
        info.value
    )
    assert PASSWORD not in str(info.value)


def test_two_instances_starting_together_migrate_once(pg_cluster: Any, tmp_path: Path) -> None:
    where = _location(pg_cluster, tmp_path)
    barrier = threading.Barrier(3)
    opened: list[Store] = []
    errors: list[BaseException] = []

    def start() -> None:
        barrier.wait()
        try:
            opened.append(Store.open(where))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert [s.schema_version() for s in opened] == [len(MIGRATIONS)] * 3
    name = where.conninfo["dbname"]
    assert pg_cluster.psql("SELECT count(*) FROM llmgw_schema", database=name).strip() == "1"
    for s in opened:
        s.close()


def test_writes_of_two_instances_are_serialised(pg_cluster: Any, tmp_path: Path) -> None:
    # A read-then-write step (the epoch: read, add one) from two instances at once: each
    # sees the other's commit, as SQLite's BEGIN IMMEDIATE gives on one file.
    where = _location(pg_cluster, tmp_path)
    stores = [Store.open(where), Store.open(where)]
    got: list[int] = []
    lock = threading.Lock()

    def bump(s: Store) -> None:
        for _ in range(20):
            with s.transaction():
                value = s.epoch() + 1
                s.database.execute("UPDATE leader_lease SET epoch = ? WHERE id = 1", (value,))
            with lock:
                got.append(value)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(1, 41))
    for s in stores:
        s.close()


def test_an_outage_fails_calls_at_once_and_heals(pg_cluster: Any, tmp_path: Path) -> None:
    store = Store.open(_location(pg_cluster, tmp_path))
    try:
        store.put_model("m", engine="sim", params={}, replicas=1)
        pg_cluster.stop()
        try:
            with pytest.raises(StoreUnavailable) as info:
                store.list_models()
            assert "unreachable since" in str(info.value)
            assert "llmgw retries on its own" in str(info.value)
            # Later calls fail without waiting for a connection.
            started = time.monotonic()
            for _ in range(20):
                with pytest.raises(StoreUnavailable):
                    store.get_meta("x")
            assert time.monotonic() - started < 5
            assert store.database.unreachable_since is not None  # type: ignore[attr-defined]
        finally:
            pg_cluster.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                assert [m.name for m in store.list_models()] == ["m"]
                break
            except StoreUnavailable:
                time.sleep(0.2)
        else:
            pytest.fail("the store did not come back within 30 s of the database")
        store.put_model("m2", engine="sim", params={}, replicas=1)
    finally:
        store.close()


def test_once_the_database_answers_again_calls_succeed_at_once(
    pg_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a long outage the pool's own reconnection has backed off for about as long (1,
    # 2, 4, 8, 16 s ...). Set its first delay to 60 s: what a minute away leaves. Once the
    # store says the database answers again, the next call must not find that pool empty,
    # fail, and report the database away once more.
    monkeypatch.setattr(psycopg_pool.base.AttemptWithBackoff, "INITIAL_DELAY", 60.0)
    store = Store.open(_location(pg_cluster, tmp_path))
    database: Any = store.database
    try:
        store.put_model("m", engine="sim", params={}, replicas=1)
        pg_cluster.stop()
        try:
            with pytest.raises(StoreUnavailable):
                store.list_models()
        finally:
            pg_cluster.start()
        deadline = time.monotonic() + 30
        while database.unreachable_since is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert database.unreachable_since is None, "the probe did not see the database back"
        assert [m.name for m in store.list_models()] == ["m"]
        store.put_model("m2", engine="sim", params={}, replicas=1)
        assert database.unreachable_since is None
    finally:
        store.close()


def test_a_store_closed_during_an_outage_stays_closed(pg_cluster: Any, tmp_path: Path) -> None:
    # Closed mid-outage, the store says it is closed (not that the database is away), its
    # probe ends, and a new pool the probe opens once the database answers (close() coming
    # between the probe's connect and its swap) is closed, not put in place.
    store = Store.open(_location(pg_cluster, tmp_path))
    database: Any = store.database
    pg_cluster.stop()
    try:
        with pytest.raises(StoreUnavailable):
            store.list_models()
        store.close()
    finally:
        pg_cluster.start()
    probe = database._probe
    assert probe is not None, "the outage started no probe"
    probe.join(timeout=10)
    assert not probe.is_alive()
    assert database._renew_pool() is False
    with pytest.raises(StoreError, match="is closed"):
        store.list_models()


def test_a_closed_store_says_so(pg_cluster: Any, tmp_path: Path) -> None:
    store = Store.open(_location(pg_cluster, tmp_path))
    store.close()
    with pytest.raises(StoreError, match="is closed"):
        store.list_models()


def test_a_url_with_several_hosts_finds_the_one_that_answers(
    pg_cluster: Any, tmp_path: Path
) -> None:
    # A Patroni-style fail-over: the URL names every server; libpq tries them in turn and,
    # with target_session_attrs=read-write, takes the primary. Here the first is gone.
    name = pg_cluster.fresh_database()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]  # nothing listens there once closed
    where = parse_location(
        f"postgresql://{ROLE}@127.0.0.1:{dead},127.0.0.1:{pg_cluster.port}/{name}"
        "?target_session_attrs=read-write",
        password_file=pg_cluster.password_file(tmp_path),
    )
    assert where.hosts() == [f"127.0.0.1:{dead}", f"127.0.0.1:{pg_cluster.port}"]
    with Store.open(where) as store:
        store.put_model("m", engine="sim", params={}, replicas=1)
        assert [m.name for m in store.list_models()] == ["m"]


def test_a_keys_new_policy_is_announced_and_usage_is_not(pg_cluster: Any, tmp_path: Path) -> None:
    # A standby refreshes its gateway's keys on the announcement; usage, added by every
    # instance each second, would only wake them all for nothing.
    import psycopg

    from llmgw.contracts.keypolicy import KeyPolicy, UsageRow
    from llmgw.server.store.postgres import _conninfo

    where = _location(pg_cluster, tmp_path)
    with Store.open(where) as s, psycopg.connect(_conninfo(where), autocommit=True) as conn:
        key, _ = s.create_api_key("ci")
        conn.execute("LISTEN llmgw_changes")
        s.add_usage([UsageRow("2026-12-01", key.id, "llama", 1, 2, 3)])
        s.update_api_key(key.id, KeyPolicy(rpm=60))
        s.add_usage([UsageRow("2026-12-01", key.id, "llama", 1, 2, 3)])
        heard = [n.payload for n in conn.notifies(timeout=2)]
    assert heard == ["api_keys"]


def test_a_released_lease_is_announced_and_a_refused_release_is_not(
    pg_cluster: Any, tmp_path: Path
) -> None:
    # Standbys listen on llmgw_lease to take a released lease at once (not at their next
    # poll); a release that released nothing (another epoch leads) must not wake them.
    import psycopg

    from llmgw.server.store.instances import LEASE_CHANNEL
    from llmgw.server.store.postgres import _conninfo

    where = _location(pg_cluster, tmp_path)
    with Store.open(where) as s, psycopg.connect(_conninfo(where), autocommit=True) as conn:
        conn.execute(f"LISTEN {LEASE_CHANNEL}")
        lease = s.take_lease("cp1", 60)
        assert lease is not None
        s.renew_lease("cp1", lease.epoch, 60)
        assert not s.release_lease("cp1", lease.epoch + 1)
        assert s.release_lease("cp1", lease.epoch)
        heard = [n.payload for n in conn.notifies(timeout=2)]
    assert heard == ["cp1"]
