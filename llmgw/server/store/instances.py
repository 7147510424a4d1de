"""The control-plane instances sharing one database and the leader's lease: who holds it,
its epoch (the fencing token every order carries) and when it lapses.

The lease's times are the database's clock (:meth:`Database.server_time`), never an
instance's, so that instances on machines whose clocks differ agree on when it lapses. Taking
it bumps the epoch in the same transaction; renewing it succeeds only for the holder at the
epoch it took, so a leader replaced while paused learns so on its next renewal, and every
write it makes in between is refused by :meth:`Leases.check_epoch` (installed as the
database's fence).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.errors import ConfigError, Fenced
from llmgw.server.store.database import Database, Row

__all__ = ["Instance", "Lease", "Leases", "process_gone", "process_name"]


@dataclass(frozen=True)
class Lease:
    holder: str
    epoch: int
    expires_at: float
    acquired_at: float
    renewed_at: float

    @classmethod
    def from_row(cls, row: Row) -> Lease:
        return cls(
            holder=str(row["holder"]),
            epoch=int(row["epoch"]),
            expires_at=float(row["expires_at"]),
            acquired_at=float(row["acquired_at"]),
            renewed_at=float(row["renewed_at"]),
        )


@dataclass(frozen=True)
class Instance:
    id: str
    process: str
    stream_addr: str
    http_addr: str
    enroll_addr: str
    version: str
    ca_hash: str
    started_at: float
    seen_at: float
    retired_at: float | None

    @classmethod
    def from_row(cls, row: Row) -> Instance:
        return cls(
            id=str(row["id"]),
            process=str(row["process"]),
            stream_addr=str(row["stream_addr"]),
            http_addr=str(row["http_addr"]),
            enroll_addr=str(row["enroll_addr"]),
            version=str(row["version"]),
            ca_hash=str(row["ca_hash"]),
            started_at=float(row["started_at"]),
            seen_at=float(row["seen_at"]),
            retired_at=None if row["retired_at"] is None else float(row["retired_at"]),
        )


class Leases:
    """The leader's lease and the instances' registry."""

    def __init__(self, db: Database) -> None:
        self._db = db

    # -------------------------------------------------------------------- lease

    def lease(self) -> Lease:
        row = self._db.one("SELECT * FROM leader_lease WHERE id = 1")
        if row is None:  # a database migrated by hand without migration 8's row
            with self._db.unfenced(), self._db.write():
                self._db.execute("INSERT INTO leader_lease(id, epoch) VALUES (1, 0)")
            row = self._db.one("SELECT * FROM leader_lease WHERE id = 1")
        assert row is not None
        return Lease.from_row(row)

    def take_lease(self, holder: str, duration: float) -> Lease | None:
        """Take the lease for *holder* when it is free, lapsed, or already *holder*'s (the
        same instance restarted): the new lease, its epoch one more; else None."""
        with self._db.unfenced(), self._db.write():
            current = self.lease()
            now = self._db.server_time()
            if current.holder and current.holder != holder and current.expires_at > now:
                return None
            self._db.execute(
                "UPDATE leader_lease SET holder = ?, epoch = epoch + 1, expires_at = ?, "
                "acquired_at = ?, renewed_at = ? WHERE id = 1",
                (holder, now + duration, now, now),
            )
            return self.lease()

    def renew_lease(self, holder: str, epoch: int, duration: float) -> Lease | None:
        """Extend the lease of *holder* at *epoch*; None when another instance took it (even
        a lapsed lease is renewed while nobody took it: the epoch is unchanged)."""
        with self._db.unfenced(), self._db.write():
            now = self._db.server_time()
            cur = self._db.execute(
                "UPDATE leader_lease SET expires_at = ?, renewed_at = ? "
                "WHERE id = 1 AND holder = ? AND epoch = ?",
                (now + duration, now, holder, epoch),
            )
            if cur.rowcount != 1:
                return None
            return self.lease()

    def release_lease(self, holder: str, epoch: int) -> bool:
        """Give the lease up at once (a leader stopping cleanly), so a standby need not wait
        for it to lapse; the epoch stays, and the next holder bumps it."""
        with self._db.unfenced(), self._db.write():
            cur = self._db.execute(
                "UPDATE leader_lease SET expires_at = 0 WHERE id = 1 AND holder = ? AND epoch = ?",
                (holder, epoch),
            )
            return cur.rowcount == 1

    def check_epoch(self, epoch: int) -> None:
        """Refuse (:class:`Fenced`) unless *epoch* is the lease's: called inside a write
        transaction, after the writers' lock, so a take-over cannot come between."""
        current = self.lease()
        if current.epoch != epoch:
            raise Fenced(
                f"this control plane led at epoch {epoch}, but {current.holder or 'another'} "
                f"has led since epoch {current.epoch}; it steps down and writes nothing more"
            )

    # ---------------------------------------------------------------- instances

    def register_instance(
        self,
        instance_id: str,
        process: str,
        *,
        stale_after: float,
        version: str,
        gone: Callable[[str], bool] = lambda _process: False,
    ) -> Instance:
        """Record this process as instance *instance_id*; refuse when another process is
        that instance and was seen within *stale_after* seconds (two with one id), unless
        ``gone(process)`` knows that process has ended (one of this machine's, restarted)."""
        with self._db.unfenced(), self._db.write():
            now = self._db.server_time()
            row = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
            if row is not None:
                other = Instance.from_row(row)
                if (
                    other.process != process
                    and now - other.seen_at < stale_after
                    and not gone(other.process)
                ):
                    raise ConfigError(
                        f"instance id {instance_id!r} is already used by a running control "
                        f"plane (process {other.process}, seen {now - other.seen_at:.0f} s ago, "
                        f"stream {other.stream_addr or 'not yet listening'}); give this one "
                        "another instance_id in server.yaml (each instance needs its own)",
                        key="instance_id",
                    )
            self._db.execute(
                "INSERT INTO instances(id, process, version, started_at, seen_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET process = excluded.process, "
                "version = excluded.version, started_at = excluded.started_at, "
                "seen_at = excluded.seen_at, retired_at = NULL",
                (instance_id, process, version, now, now),
            )
            got = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
        assert got is not None
        return Instance.from_row(got)

    def set_instance_addresses(
        self, instance_id: str, *, stream: str, http: str, enroll: str, ca_hash: str
    ) -> None:
        with self._db.unfenced(), self._db.write():
            self._db.execute(
                "UPDATE instances SET stream_addr = ?, http_addr = ?, enroll_addr = ?, "
                "ca_hash = ? WHERE id = ?",
                (stream, http, enroll, ca_hash, instance_id),
            )

    def touch_instance(self, instance_id: str, process: str) -> bool:
        """This instance is alive; False when another process has taken its id since."""
        with self._db.unfenced(), self._db.write():
            cur = self._db.execute(
                "UPDATE instances SET seen_at = ? WHERE id = ? AND process = ?",
                (self._db.server_time(), instance_id, process),
            )
            return cur.rowcount == 1

    def retire_instance(self, instance_id: str) -> None:
        with self._db.unfenced(), self._db.write():
            self._db.execute(
                "UPDATE instances SET retired_at = ? WHERE id = ?",
                (self._db.server_time(), instance_id),
            )

    def get_instance(self, instance_id: str) -> Instance | None:
        row = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
        return None if row is None else Instance.from_row(row)

    def list_instances(self) -> list[Instance]:
        """Every instance not retired, in the order they first registered."""
        rows = self._db.all(
            "SELECT * FROM instances WHERE retired_at IS NULL ORDER BY started_at, id"
        )
        return [Instance.from_row(r) for r in rows]


def process_name() -> str:
    """This process as an instance's registry knows it: host/pid/random, the random part so
    that a reused pid is another process."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


def process_gone(process: str) -> bool:
    """True when *process* (a :func:`process_name`) was one of this machine's and has ended."""
    host, _, rest = process.partition("/")
    pid_text = rest.partition("/")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
