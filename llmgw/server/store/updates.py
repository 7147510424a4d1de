"""The node_updates table: each node's latest signed update order and what the node
reported about it. Its counter only ever grows, and the row outlives the node, so a node
joined again under the same id is never sent a counter its update helper already
accepted."""

from __future__ import annotations

from llmgw.errors import Conflict
from llmgw.server.store.database import Database
from llmgw.server.store.rows import NodeUpdate

__all__ = ["NodeUpdates"]


class NodeUpdates:
    """Each node's update counter and latest order."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def next_update_counter(self, node_id: str) -> int:
        """Reserve the next update counter of *node_id* (one above the last ever given, also
        when the order is then not sent): call inside :meth:`Store.transaction` with the
        :meth:`put_update` that uses it."""
        now = self._db.clock()
        with self._db.write():
            self._db.execute(
                "INSERT INTO node_updates(node_id, counter, updated_at) VALUES (?, 1, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET counter = node_updates.counter + 1",
                (node_id, now),
            )
            row = self._db.one("SELECT counter FROM node_updates WHERE node_id = ?", (node_id,))
        assert row is not None
        return int(row["counter"])

    def put_update(
        self,
        node_id: str,
        *,
        counter: int,
        version: str,
        state: str,
        message: str,
        op_id: str,
        order: bytes,
        signature: bytes,
        expires: float,
    ) -> NodeUpdate:
        """Record the order with *counter* (from :meth:`next_update_counter`) as the node's
        latest; Conflict if a later counter was given out meanwhile."""
        now = self._db.clock()
        with self._db.write():
            cur = self._db.execute(
                "UPDATE node_updates SET version = ?, state = ?, message = ?, op_id = ?, "
                "order_json = ?, signature = ?, expires = ?, ordered_at = ?, updated_at = ? "
                "WHERE node_id = ? AND counter = ?",
                (
                    version,
                    state,
                    message,
                    op_id,
                    order,
                    signature,
                    expires,
                    now,
                    now,
                    node_id,
                    counter,
                ),
            )
            if cur.rowcount != 1:
                raise Conflict(
                    f"update counter {counter} of node {node_id} is no longer the latest; "
                    "order the update again"
                )
        update = self.get_update(node_id)
        assert update is not None
        return update

    def get_update(self, node_id: str) -> NodeUpdate | None:
        """The node's latest update order, or None (never ordered, or nothing but a
        reserved counter)."""
        row = self._db.one(
            "SELECT * FROM node_updates WHERE node_id = ? AND ordered_at IS NOT NULL", (node_id,)
        )
        return None if row is None else NodeUpdate.from_row(row)

    def list_updates(self) -> list[NodeUpdate]:
        rows = self._db.all(
            "SELECT * FROM node_updates WHERE ordered_at IS NOT NULL ORDER BY node_id"
        )
        return [NodeUpdate.from_row(r) for r in rows]

    def set_update_state(self, node_id: str, counter: int, state: str, message: str) -> bool:
        """Set the state of the node's update order *counter*; False when that is not its
        latest order (a late report about an older one)."""
        with self._db.write():
            cur = self._db.execute(
                "UPDATE node_updates SET state = ?, message = ?, updated_at = ? "
                "WHERE node_id = ? AND counter = ? AND ordered_at IS NOT NULL",
                (state, message[:2000], self._db.clock(), node_id, counter),
            )
        return cur.rowcount == 1
