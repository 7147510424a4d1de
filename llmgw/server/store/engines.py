"""The desired_engines and node_engines tables: the engine builds the operator wants on the
nodes (engine, version, and per architecture a URL and SHA-256; for every node or for one)
and, per node and engine, what became of the install ordered from them.

A desired engine is kept per scope (``""``: every node, now and later; else one node id)
and engine, one row per architecture (``""``: a build that runs on any). One scope's engine
has one version: recording another version replaces its builds, the same version adds or
replaces the architectures given.
"""

from __future__ import annotations

from llmgw.server.store.database import Database
from llmgw.server.store.rows import DesiredBuild, NodeEngine
from llmgw.server.store.states import InstallState

__all__ = ["ALL_NODES", "EngineTables"]

ALL_NODES = ""
"""The scope of an engine desired on every node."""

MAX_ERROR = 2000


class EngineTables:
    """Desired engine builds and each node's install of them."""

    def __init__(self, db: Database) -> None:
        self._db = db

    # -- desired -------------------------------------------------------------------------

    def set_desired_engine(
        self, scope: str, engine: str, version: str, builds: list[tuple[str, str, str]]
    ) -> bool:
        """Record ``builds`` (``(arch, url, sha256)``) of ``engine`` ``version`` for ``scope``.

        Returns True when an entry of another version was replaced (its builds dropped),
        False when the version is new to the scope or the same (builds added or replaced by
        architecture)."""
        now = self._db.clock()
        with self._db.write():
            cur = self._db.execute(
                "DELETE FROM desired_engines WHERE scope = ? AND engine = ? AND version <> ?",
                (scope, engine, version),
            )
            replaced = cur.rowcount > 0
            for arch, url, sha256 in builds:
                self._db.execute(
                    "INSERT INTO desired_engines(scope, engine, version, arch, url, sha256, "
                    "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(scope, engine, arch) DO UPDATE SET url = excluded.url, "
                    "sha256 = excluded.sha256, updated_at = excluded.updated_at",
                    (scope, engine, version, arch, url, sha256, now),
                )
        return replaced

    def list_desired_engines(self, scope: str | None = None) -> list[DesiredBuild]:
        """Every desired build (of ``scope`` only, when given), by scope, engine, arch."""
        where, params = ("WHERE scope = ?", (scope,)) if scope is not None else ("", ())
        rows = self._db.all(
            f"SELECT * FROM desired_engines {where} ORDER BY scope, engine, arch", params
        )
        return [DesiredBuild.from_row(r) for r in rows]

    def forget_desired_engine(self, scope: str, engine: str, arch: str | None = None) -> int:
        """Remove ``engine``'s desired builds for ``scope`` (only ``arch``'s, when given);
        how many were removed."""
        sql = "DELETE FROM desired_engines WHERE scope = ? AND engine = ?"
        params: tuple[str, ...] = (scope, engine)
        if arch is not None:
            sql += " AND arch = ?"
            params += (arch,)
        with self._db.write():
            return int(self._db.execute(sql, params).rowcount)

    # -- per node ------------------------------------------------------------------------

    def put_node_engine(
        self,
        node_id: str,
        engine: str,
        *,
        version: str,
        sha256: str,
        state: InstallState,
        op_id: str,
        error: str = "",
    ) -> NodeEngine:
        """Record the install of ``engine`` last ordered on ``node_id`` (one per engine)."""
        with self._db.write():
            self._db.execute(
                "INSERT INTO node_engines(node_id, engine, version, sha256, state, error, op_id, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id, engine) DO UPDATE SET version = excluded.version, "
                "sha256 = excluded.sha256, state = excluded.state, error = excluded.error, "
                "op_id = excluded.op_id, updated_at = excluded.updated_at",
                (
                    node_id,
                    engine,
                    version,
                    sha256,
                    str(state),
                    error[:MAX_ERROR],
                    op_id,
                    self._db.clock(),
                ),
            )
        found = self.get_node_engine(node_id, engine)
        assert found is not None
        return found

    def finish_node_engine(
        self, node_id: str, op_id: str, state: InstallState, error: str = ""
    ) -> NodeEngine | None:
        """Record the node's answer to install order ``op_id``; None when that is not the
        order last sent for any engine of the node (a late answer to an older one)."""
        with self._db.write():
            cur = self._db.execute(
                "UPDATE node_engines SET state = ?, error = ?, updated_at = ? "
                "WHERE node_id = ? AND op_id = ? AND op_id <> ''",
                (str(state), error[:MAX_ERROR], self._db.clock(), node_id, op_id),
            )
            if cur.rowcount != 1:
                return None
            row = self._db.one(
                "SELECT * FROM node_engines WHERE node_id = ? AND op_id = ?", (node_id, op_id)
            )
        return None if row is None else NodeEngine.from_row(row)

    def get_node_engine(self, node_id: str, engine: str) -> NodeEngine | None:
        row = self._db.one(
            "SELECT * FROM node_engines WHERE node_id = ? AND engine = ?", (node_id, engine)
        )
        return None if row is None else NodeEngine.from_row(row)

    def list_node_engines(self, node_id: str | None = None) -> list[NodeEngine]:
        where, params = ("WHERE node_id = ?", (node_id,)) if node_id is not None else ("", ())
        rows = self._db.all(f"SELECT * FROM node_engines {where} ORDER BY node_id, engine", params)
        return [NodeEngine.from_row(r) for r in rows]

    def node_engines_by_op(self, op_ids: list[str]) -> list[NodeEngine]:
        """The installs last ordered with these op ids (others are left out)."""
        if not op_ids:
            return []
        marks = ", ".join("?" for _ in op_ids)
        rows = self._db.all(
            f"SELECT * FROM node_engines WHERE op_id IN ({marks}) ORDER BY node_id, engine",
            tuple(op_ids),
        )
        return [NodeEngine.from_row(r) for r in rows]
