"""``llmgw server migrate`` at the CLI edge (real PostgreSQL: the session's throwaway
cluster): what it prints after a copy, as text and as JSON, and its refusals as one
``error:`` line on stderr with the error's exit code."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from llmgw.cli import main
from llmgw.server.store import MIGRATIONS, Store
from llmgw.server.store.location import parse_location
from tests.pg import PASSWORD, ROLE


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A stopped control plane's SQLite file, with a node and an event."""
    state = tmp_path / "state"
    state.mkdir()
    path = state / "llmgw.db"
    with Store.open(path) as s:
        s.upsert_node(
            "gpu1", dataplane_addr=None, agent_version=None, inventory={}, connected=False
        )
        s.add_event("node", "gpu1", "joined")
    return path


def _migrate(*args: str) -> Result:
    return CliRunner().invoke(main, ["server", "migrate", *args])


def _tables(db: Path) -> list[str]:
    with Store.open(db) as s:
        return sorted(s.database.table_names())


def _nodes(cluster: Any, name: str, tmp_path: Path) -> list[str]:
    where = parse_location(
        cluster.url(name, password=False), password_file=cluster.password_file(tmp_path)
    )
    with Store.open(where) as pg:
        return [n.id for n in pg.list_nodes()]


def test_migrate_prints_the_rows_of_every_table_and_the_next_step(
    db: Path, pg_cluster: Any, tmp_path: Path
) -> None:
    name = pg_cluster.fresh_database()
    url = pg_cluster.url(name, password=False)
    password_file = pg_cluster.password_file(tmp_path)
    out = _migrate("--from", f"sqlite://{db}", "--to", url, "--password-file", str(password_file))
    assert out.exit_code == 0, out.output
    assert out.stderr == ""
    tables = _tables(db)
    counts = {t: 0 for t in tables} | {"nodes": 1, "events": 1, "leader_lease": 1}
    width = max(len(t) for t in tables)
    display = f"postgresql://{ROLE}@127.0.0.1:{pg_cluster.port}/{name}"
    assert out.stdout == (
        f"copied {db} into {display} (schema version {len(MIGRATIONS)}); rows by table:\n"
        f"  {'TABLE'.ljust(width)}  ROWS\n"
        + "".join(f"  {t.ljust(width)}  {counts[t]}\n" for t in tables)
        + f'next: set database: {{url: "{url}", password_file: {password_file}}} in '
        "server.yaml, start the control plane (systemctl start llmgw-server); keep "
        f"{db} as the backup\n"
    )
    assert _nodes(pg_cluster, name, tmp_path) == ["gpu1"]


def test_migrate_json_for_scripts(
    db: Path, pg_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No --password-file: libpq's PGPASSFILE gives the password.
    name = pg_cluster.fresh_database()
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{pg_cluster.port}:{name}:{ROLE}:{PASSWORD}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    url = pg_cluster.url(name, password=False)
    out = _migrate("--from", str(db), "--to", url, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data == {
        "source": str(db),
        "target": f"postgresql://{ROLE}@127.0.0.1:{pg_cluster.port}/{name}",
        "schema_version": len(MIGRATIONS),
        "upgraded_from": len(MIGRATIONS),
        "tables": {t: {"nodes": 1, "events": 1, "leader_lease": 1}.get(t, 0) for t in _tables(db)},
        "next": f'set database: "{url}" in server.yaml (the password in the llmgw user\'s '
        "~/.pgpass), start the control plane (systemctl start llmgw-server); keep "
        f"{db} as the backup",
    }
    assert _nodes(pg_cluster, name, tmp_path) == ["gpu1"]


def test_a_password_in_the_url_is_refused_before_anything_is_done(db: Path) -> None:
    out = _migrate("--from", f"sqlite://{db}", "--to", "postgresql://llmgw:hunter2@db1/llmgw")
    assert (out.exit_code, out.stdout) == (2, "")
    assert out.stderr == (
        "error: --to: holds a password; take it out of the URL and put it in a file named by "
        "password_file (mode 0600), or in the control plane user's ~/.pgpass\n"
    )


def test_a_source_in_use_is_refused_naming_the_fix(
    db: Path, pg_cluster: Any, tmp_path: Path
) -> None:
    name = pg_cluster.fresh_database()
    args = ["--from", f"sqlite://{db}", "--to", pg_cluster.url(name, password=False)]
    args += ["--password-file", str(pg_cluster.password_file(tmp_path))]
    fd = os.open(db.parent / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = _migrate(*args)
    finally:
        os.close(fd)
    assert (out.exit_code, out.stdout) == (1, "")
    assert out.stderr == (
        f"error: a control plane is running on {db.parent} (it holds {db.parent}/leader.lock); "
        "stop the control plane first (systemctl stop llmgw-server), then run migrate again\n"
    )
    assert pg_cluster.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'", name) == (
        "0\n"
    )


def test_a_missing_source_is_a_usage_error(tmp_path: Path) -> None:
    out = _migrate("--from", f"sqlite://{tmp_path}/none.db", "--to", "postgresql://u@/db")
    assert (out.exit_code, out.stdout) == (2, "")
    assert out.stderr == (
        f"error: there is no state database at {tmp_path}/none.db; give the control plane's "
        "SQLite file (by default /var/lib/llmgw/llmgw.db)\n"
    )
