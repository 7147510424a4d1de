"""Leadership among instances sharing a PostgreSQL database (DESIGN §8): a lease in the
database (its SQL in :mod:`llmgw.server.store.instances`), whose epoch fences every write of
the leader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmgw.errors import Fenced, StoreError, StoreUnavailable
from llmgw.log import kv
from llmgw.server.store import Store
from llmgw.server.store.instances import LEASE_CHANNEL

__all__ = ["LeaseKeeper"]

log = logging.getLogger("llmgw.server.ha")


class LeaseKeeper:
    """The :class:`~llmgw.server.ha.leadership.Leadership` of PostgreSQL: the lease in the
    store, taken by polling while a standby, renewed while the leader, and its epoch the
    fence of every write this process makes while it leads.

    The leader keeps leading while the database is away (nobody can take the lease then,
    and its writes fail anyway); it steps down when a renewal finds another holder or a
    write is fenced (:attr:`lost`).
    """

    # A standby serves the gateway itself (routes followed from the database).
    shared = True

    def __init__(self, store: Store, holder: str, *, duration: float, renew: float) -> None:
        self.store = store
        self.holder = holder
        self.duration = duration
        self.renew = renew
        self.epoch = 0
        self.lost = asyncio.Event()
        self.reason = ""
        self._renewed = 0.0  # time.monotonic() of the last renewal that succeeded
        # The leader's addresses and the lease's epoch as last read: what a standby says
        # while the database is away (nobody can take the lease then, so they still hold).
        self._known_leader = ("", "")
        self._known_epoch = 0
        # Set while a standby listens for the leader's release (:meth:`take`).
        self.listening = asyncio.Event()

    def try_take(self) -> bool:
        """Take the lease if it is free or lapsed; True when this process now leads.

        Right after the database was away, a lapsed lease is left to its holder for two
        renewals: it lapsed because nobody could write, not because the leader is gone, and a
        change of leader would only move every agent for nothing."""
        recovered = getattr(self.store.database, "recovered_at", None)
        if recovered is not None and time.monotonic() - recovered < 2 * self.renew + 1:
            return False
        try:
            lease = self.store.take_lease(self.holder, self.duration)
        except StoreUnavailable:
            return False
        if lease is None:
            return False
        self.epoch = lease.epoch
        self._renewed = time.monotonic()
        self.lost.clear()
        self.reason = ""
        return True

    async def take(self) -> None:
        """Wait until this process holds the lease: tried every ``lease_renew`` (a lapsed
        lease, a leader gone without a word), and at once when the leader releases it (its
        NOTIFY on :data:`~llmgw.server.store.instances.LEASE_CHANNEL`, listened for from
        before the first try, so that a release between a try and the LISTEN is not missed)."""
        released = asyncio.Event()
        self.listening.clear()
        listener = asyncio.create_task(self._listen(released), name="lease-listen")
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.listening.wait(), timeout=self.renew)
            while True:
                released.clear()
                if self.try_take():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), timeout=self.renew)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _listen(self, released: asyncio.Event) -> None:
        """Set *released* at each release the leader announces, listening again when the
        connection drops (a release may have been missed meanwhile: *released* is set then
        too). Not on SQLite (a test's store): the poll alone."""
        from llmgw.server.store.postgres import PostgresDatabase, listen_async

        if not isinstance(self.store.database, PostgresDatabase):
            return
        while True:
            try:
                async for holder in listen_async(
                    self.store.database, LEASE_CHANNEL, listening=self.listening
                ):
                    log.info("the leader released its lease", extra=kv(leader=holder))
                    released.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("lease notifications stopped", extra=kv(error=str(exc)))
            self.listening.clear()
            released.set()
            await asyncio.sleep(min(self.renew, 2.0))

    def begin(self, store: Store) -> int:
        """Lead on *store* (the one the lease is in): its writes fenced by the lease's epoch,
        which this returns."""
        store.database.fence = self.fence
        return self.epoch

    def end(self) -> None:
        """Stop leading: no fence on the store's writes (a standby writes its own rows)."""
        self.store.database.fence = None

    def fence(self, _db: object) -> None:
        """The database's fence while leading: refuse a write once another epoch leads."""
        try:
            self.store.check_epoch(self.epoch)
        except Fenced as exc:
            self._lose(str(exc))
            raise

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()

    async def keep(self) -> str:
        """Renew the lease until it is lost; why it was."""
        while not self.lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lost.wait(), timeout=self.renew)
            if self.lost.is_set():
                break
            try:
                lease = self.store.renew_lease(self.holder, self.epoch, self.duration)
            except StoreUnavailable as exc:
                if time.monotonic() - self._renewed > self.duration:
                    log.warning(
                        "cannot renew the leader's lease: the database is away; leading on "
                        "without writes until it answers",
                        extra=kv(epoch=self.epoch, error=str(exc)),
                    )
                continue
            if lease is None:
                current = self._current()
                self._lose(f"the lease was taken by {current} since")
                break
            self._renewed = time.monotonic()
        return self.reason

    def _current(self) -> str:
        try:
            lease = self.store.lease()
        except StoreUnavailable:
            return "another instance"
        return f"{lease.holder} (epoch {lease.epoch})"

    def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes it at once (PostgreSQL's
        NOTIFY, sent with the release)."""
        with contextlib.suppress(StoreUnavailable, Fenced):
            self.store.release_lease(self.holder, self.epoch)

    def leader_addresses(self) -> tuple[str, str]:
        """The current leader's stream and HTTP addresses ("" when none holds a live lease);
        while the database is away, the last ones read (it leads on: nobody can take the
        lease meanwhile)."""
        try:
            lease = self.store.lease()
            self._known_epoch = lease.epoch
            if lease.expires_at <= self.store.database.server_time():
                self._known_leader = ("", "")
                return "", ""  # lapsed: whoever takes it next leads; naming it would mislead
            instance = self.store.get_instance(lease.holder) if lease.holder else None
        except StoreUnavailable:
            return self._known_leader
        except StoreError:
            return "", ""
        known = ("", "") if instance is None else (instance.stream_addr, instance.http_addr)
        self._known_leader = known
        return known

    def cluster_epoch(self) -> int:
        """The epoch the cluster is led under (the lease's; the last read while the
        database is away)."""
        with contextlib.suppress(StoreError):
            self._known_epoch = self.store.lease().epoch
        return self._known_epoch
