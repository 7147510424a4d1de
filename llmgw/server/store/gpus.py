"""The gpu_cordons table: the GPUs an operator took out of placement, each with who did it,
when and why. Its node keeps its other GPUs; the row goes with its node."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.server.store.database import Database

__all__ = ["GpuCordon", "GpuCordons"]


@dataclass(frozen=True)
class GpuCordon:
    node_id: str
    gpu_uuid: str
    reason: str
    actor: str
    at: float


class GpuCordons:
    """Cordoned GPUs by node and uuid (a GPU's uuid outlives its index across reboots)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def cordon_gpus(
        self, node_id: str, uuids: Iterable[str], *, reason: str, actor: str
    ) -> list[GpuCordon]:
        """Cordon these GPUs of ``node_id``; those already cordoned keep their row (who and
        why). The cordons added, in the order given."""
        added = []
        now = self._db.clock()
        with self._db.write():
            for uuid in uuids:
                if self._db.one(
                    "SELECT 1 FROM gpu_cordons WHERE node_id = ? AND gpu_uuid = ?",
                    (node_id, uuid),
                ):
                    continue
                self._db.execute(
                    "INSERT INTO gpu_cordons(node_id, gpu_uuid, reason, actor, at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (node_id, uuid, reason, actor, now),
                )
                added.append(GpuCordon(node_id, uuid, reason, actor, now))
        return added

    def uncordon_gpus(self, node_id: str, uuids: Iterable[str]) -> list[str]:
        """Lift the cordons of these GPUs of ``node_id``; the uuids that had one."""
        lifted = []
        with self._db.write():
            for uuid in uuids:
                cursor = self._db.execute(
                    "DELETE FROM gpu_cordons WHERE node_id = ? AND gpu_uuid = ?", (node_id, uuid)
                )
                if cursor.rowcount:
                    lifted.append(uuid)
        return lifted

    def list_gpu_cordons(self, node_id: str | None = None) -> list[GpuCordon]:
        """Every cordon (or ``node_id``'s), by node and uuid."""
        if node_id is None:
            rows = self._db.all("SELECT * FROM gpu_cordons ORDER BY node_id, gpu_uuid")
        else:
            rows = self._db.all(
                "SELECT * FROM gpu_cordons WHERE node_id = ? ORDER BY gpu_uuid", (node_id,)
            )
        return [
            GpuCordon(
                node_id=str(r["node_id"]),
                gpu_uuid=str(r["gpu_uuid"]),
                reason=str(r["reason"]),
                actor=str(r["actor"]),
                at=float(r["at"]),
            )
            for r in rows
        ]
