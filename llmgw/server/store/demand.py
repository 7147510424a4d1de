"""Each gateway instance's demand per model, as it last said it: what the standbys' gateways
see reaches the leader's planner through here (the leader's own is read in memory). Written
by every instance without a fence (a standby holds no lease), each instance's rows replaced
whole at each write; a reader takes only rows written since a moment it names, so that an
instance that stopped writing stops counting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.server.store.database import Database

__all__ = ["DemandRow", "DemandTable"]


@dataclass(frozen=True)
class DemandRow:
    instance: str
    model: str
    inflight: int
    queued: int
    waiting: int
    ttft_p90: float | None
    at: float


class DemandTable:
    def __init__(self, db: Database) -> None:
        self._db = db

    def put_demand(
        self,
        instance: str,
        demand: Mapping[str, tuple[int, int, int, float | None]],
        at: float,
    ) -> None:
        """``instance``'s demand now: model -> (in flight, queued, waiting, TTFT p90),
        replacing what it said before."""
        rows = [
            (instance, model, max(0, a), max(0, b), max(0, c), ttft, at)
            for model, (a, b, c, ttft) in sorted(demand.items())
        ]
        with self._db.unfenced(), self._db.write():
            self._db.execute("DELETE FROM demand WHERE instance = ?", (instance,))
            if rows:
                self._db.executemany(
                    "INSERT INTO demand(instance, model, inflight, queued, waiting, ttft_p90, "
                    "at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )

    def list_demand(self, *, since: float, excluding: str = "") -> list[DemandRow]:
        """The rows written at or after ``since`` by instances other than ``excluding``."""
        return [
            DemandRow(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), r[5], float(r[6]))
            for r in self._db.all(
                "SELECT instance, model, inflight, queued, waiting, ttft_p90, at FROM demand "
                "WHERE at >= ? AND instance != ? ORDER BY instance, model",
                (since, excluding),
            )
        ]
