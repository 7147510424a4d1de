"""The scaling_state table: what the leader's planner learnt of each model and a new leader
continues from rather than learns again (issue 39: a take-over keeps scaling state). A
model's scale-down window (since when its demand stayed below its count, UNIX seconds) and
the host memory one of its replicas held asleep at level 1, as its engines said. Written by
the leader only when a value changes; the row goes with its model."""

from __future__ import annotations

from llmgw.server.store.database import Database

__all__ = ["ScalingState"]

# Upserts that write nothing for a model that is gone (deleted between the planner's read of
# the models and its write): its row would have no model to belong to.
_UPSERT = (
    "INSERT INTO scaling_state(model, {column}) SELECT ?, ? "
    "WHERE EXISTS (SELECT 1 FROM models WHERE name = ?) "
    "ON CONFLICT(model) DO UPDATE SET {column} = excluded.{column}"
)


class ScalingState:
    def __init__(self, db: Database) -> None:
        self._db = db

    def scale_down_windows(self) -> dict[str, float]:
        """model -> since when its demand stayed below its count (UNIX seconds), for every
        model whose window runs."""
        return {
            str(r["model"]): float(r["low_since"])
            for r in self._db.all(
                "SELECT model, low_since FROM scaling_state WHERE low_since IS NOT NULL"
            )
        }

    def set_scale_down_window(self, model: str, since: float | None) -> None:
        """``model``'s window runs since ``since`` (UNIX seconds); None: none runs."""
        with self._db.write():
            if since is None:
                self._db.execute(
                    "UPDATE scaling_state SET low_since = NULL WHERE model = ?", (model,)
                )
            else:
                self._db.execute(_UPSERT.format(column="low_since"), (model, since, model))

    def learnt_host_memory(self) -> dict[str, int]:
        """model -> the host memory (MiB) a replica of it held asleep at level 1, for every
        model whose engines said so."""
        return {
            str(r["model"]): int(r["sleep_host_mib"])
            for r in self._db.all(
                "SELECT model, sleep_host_mib FROM scaling_state WHERE sleep_host_mib > 0"
            )
        }

    def set_learnt_host_memory(self, model: str, mib: int) -> None:
        """A replica of ``model`` holds ``mib`` MiB of host memory asleep at level 1."""
        with self._db.write():
            self._db.execute(_UPSERT.format(column="sleep_host_mib"), (model, max(0, mib), model))
