"""The nodes table: each node's identity (id, uid, key fingerprint), approval state, and
what its agent last reported; enrolment writes a joining node into it."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from llmgw.errors import Conflict, NotFound
from llmgw.netaddr import validate_node_id
from llmgw.server.store import tokens
from llmgw.server.store.credentials import Certificates
from llmgw.server.store.database import Database
from llmgw.server.store.rows import Node, check_state, dump_json
from llmgw.server.store.states import NodeState

__all__ = ["Nodes", "no_node"]


class Nodes:
    """The nodes known, by id; a fresh join revokes the node's older certificates."""

    def __init__(self, db: Database, certificates: Certificates) -> None:
        self._db = db
        self._certificates = certificates
        # node id -> its stored inventory's text and that text parsed. A fleet's reconcile
        # reads every node each pass and an inventory changes rarely: parsing thousands of
        # them each time was most of its cost. Readers share the dict: never change it.
        self._parsed: dict[str, tuple[str, dict[str, Any]]] = {}

    def _node(self, row: Any) -> Node:
        text = row["inventory"]
        known = self._parsed.get(row["id"])
        if known is not None and known[0] == text:
            return Node.from_row(row, known[1])
        node = Node.from_row(row)
        self._parsed[node.id] = (text, node.inventory)
        return node

    def upsert_node(
        self,
        node_id: str,
        *,
        dataplane_addr: str | None,
        agent_version: str | None,
        inventory: dict[str, Any],
        connected: bool,
    ) -> Node:
        """Record a node's latest report; new nodes get a fresh uid, known ones keep theirs."""
        inv = dump_json(inventory, "node inventory")
        now = self._db.clock()
        uid = uuid.uuid4().hex
        values = (node_id, uid, int(connected), dataplane_addr, agent_version, inv, now, now)
        with self._db.write():
            self._db.execute(
                "INSERT INTO nodes(id, uid, connected, dataplane_addr, agent_version, inventory, "
                "last_seen, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET connected = excluded.connected, "
                "dataplane_addr = excluded.dataplane_addr, "
                "agent_version = excluded.agent_version, inventory = excluded.inventory, "
                "last_seen = excluded.last_seen",
                values,
            )
            return self.get_node(node_id)

    def _update_node(self, node_id: str, sql: str, params: tuple[Any, ...]) -> None:
        with self._db.write():
            cur = self._db.execute(f"UPDATE nodes SET {sql} WHERE id = ?", (*params, node_id))
            if cur.rowcount == 0:
                raise no_node(node_id)

    def set_node_connected(self, node_id: str, connected: bool) -> None:
        self._update_node(node_id, "connected = ?", (int(connected),))

    def touch_nodes(self, seen: Mapping[str, float]) -> int:
        """Record when each node was last heard from (node id -> the store's clock then), in
        one transaction: the liveness the control plane keeps in memory, flushed in a batch.
        A time older than the one stored is not written back; unknown ids are skipped. The
        number of nodes updated."""
        if not seen:
            return 0
        rows = [(at, node_id, at) for node_id, at in seen.items()]
        with self._db.write():
            cur = self._db.executemany(
                "UPDATE nodes SET last_seen = ? WHERE id = ? "
                "AND (last_seen IS NULL OR last_seen < ?)",
                rows,
            )
        return max(cur.rowcount, 0)

    def set_node_state(self, node_id: str, state: str) -> None:
        """Set pending / approved / revoked; any other value is a ValueError."""
        self._update_node(node_id, "state = ?", (check_state(state, NodeState, "node"),))

    def set_node_draining(self, node_id: str, draining: bool) -> None:
        self._update_node(node_id, "draining = ?", (int(draining),))

    def set_node_fingerprint(self, node_id: str, fingerprint: str | None) -> None:
        self._update_node(node_id, "fingerprint = ?", (fingerprint,))

    def set_node_lost(self, node_id: str, lost: bool) -> None:
        """Mark a node lost (``lost_at`` keeps when it was first found lost) or found again."""
        if lost:
            self._update_node(
                node_id, "lost = 1, lost_at = COALESCE(lost_at, ?)", (self._db.clock(),)
            )
        else:
            self._update_node(node_id, "lost = 0, lost_at = NULL", ())

    def count_connected_nodes(self) -> int:
        """How many nodes have a stream to the leader, as it recorded them (what a standby's
        /healthz says of the cluster)."""
        row = self._db.one("SELECT COUNT(*) AS n FROM nodes WHERE connected != 0")
        return 0 if row is None else int(row["n"])

    def set_all_disconnected(self) -> None:
        """Mark every node disconnected (at server start, before any stream exists)."""
        with self._db.write():
            self._db.execute("UPDATE nodes SET connected = 0 WHERE connected != 0")

    def get_node(self, node_id: str) -> Node:
        row = self._db.one("SELECT * FROM nodes WHERE id = ?", (node_id,))
        if row is None:
            raise no_node(node_id)
        return self._node(row)

    def list_nodes(self) -> list[Node]:
        nodes = [self._node(r) for r in self._db.all("SELECT * FROM nodes ORDER BY id")]
        if len(self._parsed) > len(nodes):  # forget the nodes deleted meanwhile
            ids = {n.id for n in nodes}
            self._parsed = {k: v for k, v in self._parsed.items() if k in ids}
        return nodes

    def count_nodes(self) -> int:
        row = self._db.one("SELECT count(*) FROM nodes")
        assert row is not None
        return int(row[0])

    def list_draining_nodes(self) -> list[Node]:
        """The nodes being drained, by id. Found through their partial index (an ORDER BY
        in SQL would have the planner walk every node in id order instead)."""
        rows = self._db.all("SELECT * FROM nodes WHERE draining != 0")
        return sorted((self._node(r) for r in rows), key=lambda n: n.id)

    def delete_node(self, node_id: str) -> None:
        """Forget a node; refused while shards are placed on it."""
        with self._db.write():
            self.get_node(node_id)
            row = self._db.one("SELECT count(*) FROM shards WHERE node_id = ?", (node_id,))
            assert row is not None
            if row[0]:
                raise Conflict(
                    f"node {node_id} still hosts {row[0]} shard(s); drain it and wait for its "
                    "replicas to move, or delete those models, then retry"
                )
            self._db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))

    def enrol_node(
        self,
        node_id: str,
        *,
        fingerprint: str,
        rekey: bool,
        node_uid: str | None,
        require_approval: bool,
    ) -> Node:
        """Record a node that joined (or rekeyed) with the key *fingerprint*.

        A join makes the node, or gives an existing one (reinstalled, or revoked and coming
        back) a fresh uid, state pending and revokes its older certificates. A rekey keeps
        the uid, which must be *node_uid*, and the state (pending with *require_approval*);
        :func:`llmgw.server.store.tokens.check_rekey` says when it is refused.
        """
        validate_node_id(node_id)
        now = self._db.clock()
        with self._db.write():
            row = self._db.one("SELECT * FROM nodes WHERE id = ?", (node_id,))
            if not rekey:
                uid = uuid.uuid4().hex
                if row is None:
                    self._db.execute(
                        "INSERT INTO nodes(id, uid, state, fingerprint, created_at) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (node_id, uid, NodeState.PENDING, fingerprint, now),
                    )
                else:
                    self._db.execute(
                        "UPDATE nodes SET uid = ?, state = ?, fingerprint = ? WHERE id = ?",
                        (uid, NodeState.PENDING, fingerprint, node_id),
                    )
                    self._certificates.revoke_certificates(
                        node_id, reason="replaced by a fresh join"
                    )
                return self.get_node(node_id)
            node = None if row is None else Node.from_row(row)
            tokens.check_rekey(
                node_id,
                state=None if node is None else node.state,
                uid=None if node is None else node.uid,
                node_uid=node_uid,
            )
            assert node is not None
            state = NodeState.PENDING if require_approval else node.state
            self._db.execute(
                "UPDATE nodes SET state = ?, fingerprint = ? WHERE id = ?",
                (state, fingerprint, node_id),
            )
            return self.get_node(node_id)


def no_node(node_id: str) -> NotFound:
    return NotFound(f"no node named {node_id}; 'llmgw ctl nodes' lists them")
