"""The control-plane instances sharing one database and the leader's lease: who holds it,
its epoch (the fencing token every order carries) and when it lapses.

The lease's times are the database's clock (:meth:`Database.server_time`), never an
instance's, so that instances on machines whose clocks differ agree on when it lapses. Taking
it bumps the epoch in the same transaction; renewing it succeeds only for the holder at the
epoch it took, so a leader replaced while paused learns so on its next renewal, and every
write it makes in between is refused by :meth:`Leases.check_epoch` (installed as the
database's fence).

An instance retired (``llmgw ctl instances retire``) keeps its row, so that its id is never
taken again and the serials of its certificates stay known: the leader sends them to the
agents, whose data planes refuse them.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmgw.errors import ConfigError, Conflict, Fenced
from llmgw.server.store.database import Database, Row

__all__ = ["LEASE_CHANNEL", "Instance", "Lease", "Leases", "process_gone", "process_name"]

LEASE_CHANNEL = "llmgw_lease"
"""PostgreSQL's channel on which a leader that releases the lease says so (the payload its
instance id): standbys listen for it and take the lease at once rather than at their next
poll (:class:`llmgw.server.ha.lease.LeaseKeeper`)."""


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
    client_serial: str
    server_serial: str
    started_at: float
    seen_at: float
    retired_at: float | None
    names: tuple[str, ...] = ()

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
            client_serial=str(row["client_serial"]),
            server_serial=str(row["server_serial"]),
            started_at=float(row["started_at"]),
            seen_at=float(row["seen_at"]),
            retired_at=None if row["retired_at"] is None else float(row["retired_at"]),
            names=tuple(str(n) for n in json.loads(str(row["names"] or "[]"))),
        )

    @property
    def serials(self) -> tuple[str, ...]:
        """The serials of its certificates the registry knows (server first)."""
        return tuple(s for s in (self.server_serial, self.client_serial) if s)


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
        for it to lapse; the epoch stays, and the next holder bumps it. On PostgreSQL the
        release is announced on :data:`LEASE_CHANNEL` (delivered at the commit, so a standby
        woken by it finds the lease free)."""
        with self._db.unfenced(), self._db.write():
            cur = self._db.execute(
                "UPDATE leader_lease SET expires_at = 0 WHERE id = 1 AND holder = ? AND epoch = ?",
                (holder, epoch),
            )
            released = cur.rowcount == 1
            if released and self._db.location.is_postgresql:
                self._db.execute("SELECT pg_notify(?, ?)", (LEASE_CHANNEL, holder))
            return released

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
        serials: Sequence[str] = (),
        pki_dir: str = "STATE/pki",
    ) -> Instance:
        """Record this process as instance *instance_id*; refuse when another process is
        that instance and was seen within *stale_after* seconds (two with one id), unless
        ``gone(process)`` knows that process has ended (one of this machine's, restarted).
        Refuse a retired id, and *serials* (this machine's certificates, when it has some
        already) that are a retired instance's: the agents refuse those certificates, so
        the machine must make new ones (*pki_dir*, where they are, named in the fix)."""
        with self._db.unfenced(), self._db.write():
            now = self._db.server_time()
            row = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
            fix = (
                f"move its {pki_dir}/server.* and {pki_dir}/client.* aside so that it makes new "
                "certificates"
            )
            if row is not None and row["retired_at"] is not None:
                raise ConfigError(
                    f"instance {instance_id} was retired on {_date(float(row['retired_at']))}; "
                    f"give this machine another instance_id and {fix}",
                    key="instance_id",
                )
            self._refuse_retired_serials(serials, fix)
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
                "seen_at = excluded.seen_at",
                (instance_id, process, version, now, now),
            )
            got = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
        assert got is not None
        return Instance.from_row(got)

    def _refuse_retired_serials(self, serials: Sequence[str], fix: str) -> None:
        wanted = [s for s in serials if s]
        if not wanted:
            return
        marks = ", ".join("?" for _ in wanted)
        row = self._db.one(
            f"SELECT id, retired_at, server_serial, client_serial FROM instances "
            f"WHERE retired_at IS NOT NULL AND (server_serial IN ({marks}) OR "
            f"client_serial IN ({marks})) ORDER BY retired_at LIMIT 1",
            (*wanted, *wanted),
        )
        if row is None:
            return
        taken = ", ".join(
            s for s in wanted if s in (str(row["server_serial"]), str(row["client_serial"]))
        )
        raise ConfigError(
            f"this machine's certificates (serial {taken}) are those of instance {row['id']}, "
            f"retired on {_date(float(row['retired_at']))}, which the agents refuse; {fix}",
            key="instance_id",
        )

    def set_instance_addresses(
        self,
        instance_id: str,
        *,
        stream: str,
        http: str,
        enroll: str,
        ca_hash: str,
        client_serial: str,
        server_serial: str,
        names: Sequence[str] = (),
    ) -> None:
        """Where this instance is reached, the serials of its own certificates, and the
        names it answers to (its server certificate's DNS names), which no node may take."""
        with self._db.unfenced(), self._db.write():
            self._db.execute(
                "UPDATE instances SET stream_addr = ?, http_addr = ?, enroll_addr = ?, "
                "ca_hash = ?, client_serial = ?, server_serial = ?, names = ? WHERE id = ?",
                (
                    stream,
                    http,
                    enroll,
                    ca_hash,
                    client_serial,
                    server_serial,
                    json.dumps(sorted(set(names))),
                    instance_id,
                ),
            )

    def instance_names(self) -> dict[str, str]:
        """Every name a registered instance (not retired) answers to, lower-cased without a
        final dot, and the id of the instance that answers to it: no node may take one."""
        found: dict[str, str] = {}
        for instance in self.list_instances():
            for name in instance.names:
                found.setdefault(name.lower().rstrip("."), instance.id)
        return found

    def touch_instance(self, instance_id: str, process: str) -> bool:
        """This instance is alive; False when another process has taken its id since."""
        with self._db.unfenced(), self._db.write():
            cur = self._db.execute(
                "UPDATE instances SET seen_at = ? WHERE id = ? AND process = ?",
                (self._db.server_time(), instance_id, process),
            )
            return cur.rowcount == 1

    def retire_instance(self, instance_id: str, *, silent_for: float) -> Instance:
        """Retire *instance_id* for good: its id is refused at start from now on, and its
        certificates' serials go to the agents (:meth:`retired_serials`). Refused
        (:class:`Conflict`, with the fix) for an unknown or retired id, the lease's holder,
        and an instance seen within *silent_for* seconds (it is running). A fenced write:
        only the current leader retires."""
        with self._db.write():
            now = self._db.server_time()
            row = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
            if row is None:
                raise Conflict(
                    f"no instance {instance_id!r} is registered; 'llmgw ctl instances' lists them"
                )
            instance = Instance.from_row(row)
            if instance.retired_at is not None:
                raise Conflict(
                    f"instance {instance_id} was retired already, on "
                    f"{_date(instance.retired_at)}; nothing to do"
                )
            if self.lease().holder == instance_id:
                raise Conflict(
                    f"instance {instance_id} is the leader; stop it first: systemctl stop "
                    "llmgw-server on that machine (a standby takes the lease), then retire it "
                    "through any other instance"
                )
            if now - instance.seen_at < silent_for:
                raise Conflict(
                    f"instance {instance_id} was seen {now - instance.seen_at:.0f} s ago: it is "
                    "running; stop it first: systemctl stop llmgw-server on that machine, and "
                    f"retire it once it has been silent for {silent_for:.0f} s"
                )
            self._db.execute("UPDATE instances SET retired_at = ? WHERE id = ?", (now, instance_id))
            got = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
        assert got is not None
        return Instance.from_row(got)

    def retired_serials(self, limit: int) -> tuple[str, ...]:
        """The certificate serials of the retired instances (server, then client, of each),
        the newest retired first, at most *limit*."""
        rows = self._db.all(
            "SELECT server_serial, client_serial FROM instances WHERE retired_at IS NOT NULL "
            "ORDER BY retired_at DESC, id"
        )
        serials: list[str] = []
        for row in rows:
            for serial in (str(row["server_serial"]), str(row["client_serial"])):
                if serial and serial not in serials:
                    serials.append(serial)
        return tuple(serials[:limit])

    def get_instance(self, instance_id: str) -> Instance | None:
        row = self._db.one("SELECT * FROM instances WHERE id = ?", (instance_id,))
        return None if row is None else Instance.from_row(row)

    def list_instances(self, *, retired: bool = False) -> list[Instance]:
        """Every instance not retired (and with *retired*, those too), in the order they
        started."""
        where = "" if retired else "WHERE retired_at IS NULL "
        rows = self._db.all(f"SELECT * FROM instances {where}ORDER BY started_at, id")
        return [Instance.from_row(r) for r in rows]


def _date(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


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
