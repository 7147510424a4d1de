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
    tokens: int = 0  # its requests' tokens (a prefill pool's prompts, others' outputs)


class DemandTable:
    def __init__(self, db: Database) -> None:
        self._db = db

    def put_demand(
        self,
        instance: str,
        demand: Mapping[
            str, tuple[int, int, int, float | None] | tuple[int, int, int, float | None, int]
        ],
        at: float,
    ) -> None:
        """``instance``'s demand now: model -> (in flight, queued, waiting, TTFT p90[,
        tokens]), replacing what it said before (tokens left out: 0)."""
        rows = [
            (instance, model, max(0, f[0]), max(0, f[1]), max(0, f[2]), f[3], at, _tokens(f))
            for model, f in sorted(demand.items())
        ]
        with self._db.unfenced(), self._db.write():
            self._db.execute("DELETE FROM demand WHERE instance = ?", (instance,))
            if rows:
                self._db.executemany(
                    "INSERT INTO demand(instance, model, inflight, queued, waiting, ttft_p90, "
                    "at, tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )

    def list_demand(self, *, since: float, excluding: str = "") -> list[DemandRow]:
        """The rows written at or after ``since`` by instances other than ``excluding``."""
        return [
            DemandRow(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), r[5], float(r[6]), int(r[7]))
            for r in self._db.all(
                "SELECT instance, model, inflight, queued, waiting, ttft_p90, at, tokens "
                "FROM demand WHERE at >= ? AND instance != ? ORDER BY instance, model",
                (since, excluding),
            )
        ]


def _tokens(figures: tuple[int | float | None, ...]) -> int:
    """The tokens of a demand tuple (its fifth figure; 0 for one without), never below 0."""
    value = figures[4] if len(figures) > 4 else 0
    return max(0, int(value or 0))
