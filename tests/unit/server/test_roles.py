"""The role machine (llmgw.server.ha.roles): lead when the leadership is free, else stand by;
step down when it is lost, take over when it is free again; one Role read throughout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from llmgw.errors import StoreUnavailable
from llmgw.server.ha import Role, Roles
from llmgw.server.ha.lease import LeaseKeeper
from llmgw.server.store import Store
from llmgw.server.store.location import parse_location

# A database that answers, with two nodes connected to the leader.
_STORE: Any = SimpleNamespace(database=SimpleNamespace(), count_connected_nodes=lambda: 2)


class _Leadership:
    shared = True

    def __init__(self, *, free: bool) -> None:
        self.epoch = 0
        self.free = free
        self.lost = asyncio.Event()
        self.taken = asyncio.Event()
        self.ended = 0

    def try_take(self) -> bool:
        return self.free

    async def take(self) -> None:
        await self.taken.wait()
        self.epoch += 1

    def begin(self, _store: object) -> int:
        return self.epoch

    async def keep(self) -> str:
        await self.lost.wait()
        self.lost.clear()
        return "the lease was taken by cp2 (epoch 9) since"

    def end(self) -> None:
        self.ended += 1

    def release(self) -> None: ...

    def leader_addresses(self) -> tuple[str, str]:
        return "10.0.0.2:7443", "https://10.0.0.2:8080"

    def cluster_epoch(self) -> int:
        return 9


class _Parts:
    def __init__(self, roles: list[Roles]) -> None:
        self.calls: list[tuple[str, Role]] = []
        self.roles = roles

    def _saw(self, what: str) -> None:
        self.calls.append((what, self.roles[0].role))

    async def lead(self) -> None:
        self._saw("lead")

    async def stop_leading(self) -> None:
        self._saw("stop_leading")

    async def stand_by(self) -> None:
        self._saw("stand_by")

    async def stop_standing_by(self) -> None:
        self._saw("stop_standing_by")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_leader_steps_down_then_takes_over_again() -> None:
    async def main() -> None:
        leadership = _Leadership(free=True)
        box: list[Roles] = []
        parts = _Parts(box)
        roles = Roles(cast(Any, leadership), parts, instance="cp1")
        box.append(roles)
        assert roles.role is Role.STARTING
        await roles.start()
        assert roles.role is Role.LEADER
        leadership.lost.set()  # another instance took the lease
        await _settle()
        assert roles.role is Role.STANDBY and leadership.ended == 1
        assert roles.health(_STORE)["leader"] == "https://10.0.0.2:8080"
        leadership.taken.set()  # the lease is free again
        await _settle()
        assert roles.role is Role.LEADER
        await roles.stop()
        assert parts.calls == [
            ("lead", Role.LEADER),
            ("stop_leading", Role.LEADER),
            ("stand_by", Role.STANDBY),
            ("stop_standing_by", Role.STANDBY),
            ("lead", Role.LEADER),
            ("stop_leading", Role.LEADER),
        ]

    asyncio.run(main())


def test_a_standby_stops_what_it_served() -> None:
    async def main() -> None:
        box: list[Roles] = []
        parts = _Parts(box)
        roles = Roles(cast(Any, _Leadership(free=False)), parts, instance="cp2")
        box.append(roles)
        await roles.start()
        assert roles.role is Role.STANDBY
        health = roles.health(_STORE)
        assert (health["role"], health["instance"]) == ("standby", "cp2")
        await roles.stop()
        assert [what for what, _ in parts.calls] == ["stand_by", "stop_standing_by"]

    asyncio.run(main())


class _LeaseStore:
    """The lease and the nodes as the database holds them (cp1 leads at epoch 7, two nodes
    on it), or StoreUnavailable for every read while ``away``."""

    def __init__(self) -> None:
        self.away = False
        self.database = SimpleNamespace(server_time=lambda: 100.0, unreachable_since=None)

    def _read(self) -> None:
        if self.away:
            raise StoreUnavailable("database unreachable since 12:00:00")

    def lease(self) -> Any:
        self._read()
        return SimpleNamespace(holder="cp1", epoch=7, expires_at=105.0)

    def get_instance(self, _id: str) -> Any:
        self._read()
        return SimpleNamespace(stream_addr="10.0.0.1:7443", http_addr="https://10.0.0.1:8080")

    def count_connected_nodes(self) -> int:
        self._read()
        return 2


def test_a_standbys_health_says_the_clusters_epoch_and_nodes_the_database_away_included() -> None:
    """A standby's /healthz said epoch 0 (its own, never having led) and the gateway's 0
    nodes: it says the lease's epoch and the nodes on the leader; while the database is away
    it says what it read last, the leader included (it leads on: nobody can take the lease)."""
    store = _LeaseStore()
    keeper = LeaseKeeper(cast(Any, store), "cp2", duration=8.0, renew=2.0)
    roles = Roles(keeper, _Parts([]), instance="cp2")
    roles.role = Role.STANDBY
    health = roles.health(cast(Any, store))
    assert (health["epoch"], health["nodes"], health["leader"]) == (7, 2, "https://10.0.0.1:8080")
    assert "database" not in health

    store.away = True
    store.database.unreachable_since = time.time()
    health = roles.health(cast(Any, store))
    assert (health["epoch"], health["nodes"], health["leader"]) == (7, 2, "https://10.0.0.1:8080")
    assert str(health["database"]).startswith("unreachable since ")
    assert keeper.leader_addresses() == ("10.0.0.1:7443", "https://10.0.0.1:8080")


def test_a_draining_standby_takes_no_leadership() -> None:
    """Roles.stay(): a standby that drains before its stop must not become the leader when
    the leadership frees up meanwhile (it would take the agents for the seconds it has left)."""

    async def main() -> None:
        leadership = _Leadership(free=False)
        box: list[Roles] = []
        parts = _Parts(box)
        roles = Roles(cast(Any, leadership), parts, instance="cp2")
        box.append(roles)
        await roles.start()
        assert roles.role is Role.STANDBY
        await roles.stay()
        leadership.taken.set()  # the leader stopped: the leadership is free
        await _settle()
        assert roles.role is Role.STANDBY and leadership.epoch == 0  # never taken
        await roles.stop()
        assert [what for what, _ in parts.calls] == ["stand_by", "stop_standing_by"]

    asyncio.run(main())


def test_a_draining_leader_that_loses_the_leadership_does_not_wait_for_it_again() -> None:
    async def main() -> None:
        leadership = _Leadership(free=True)
        box: list[Roles] = []
        parts = _Parts(box)
        roles = Roles(cast(Any, leadership), parts, instance="cp1")
        box.append(roles)
        await roles.start()
        await roles.stay()
        assert roles.role is Role.LEADER  # a leader goes on leading while it drains
        leadership.lost.set()  # another instance took the lease meanwhile
        await _settle()
        assert roles.role is Role.STANDBY
        leadership.taken.set()
        await _settle()
        assert roles.role is Role.STANDBY and leadership.epoch == 0
        await roles.stop()
        assert [what for what, _ in parts.calls] == [
            "lead",
            "stop_leading",
            "stand_by",
            "stop_standing_by",
        ]

    asyncio.run(main())


def test_a_take_over_under_way_when_the_drain_begins_ends_as_leader() -> None:
    """The leadership already taken: cut halfway, nobody would lead until the lease lapsed;
    it ends as a leader, whose stop releases it."""

    async def main() -> None:
        leadership = _Leadership(free=False)
        box: list[Roles] = []
        gate = asyncio.Event()

        class _SlowParts(_Parts):
            async def stop_standing_by(self) -> None:
                self._saw("stop_standing_by")
                await gate.wait()

        parts = _SlowParts(box)
        roles = Roles(cast(Any, leadership), parts, instance="cp2")
        box.append(roles)
        await roles.start()
        leadership.taken.set()
        await _settle()
        assert [what for what, _ in parts.calls] == ["stand_by", "stop_standing_by"]
        await roles.stay()
        gate.set()
        await _settle()
        assert roles.role is Role.LEADER and leadership.epoch == 1
        await roles.stop()
        assert [what for what, _ in parts.calls][-2:] == ["lead", "stop_leading"]

    asyncio.run(main())


def test_a_standby_takes_a_released_lease_at_once_on_postgresql(
    pg_cluster: Any, tmp_path: Path
) -> None:
    """The leader's release (a clean stop) is announced: a standby polling every 30 s takes
    the lease within seconds; a standby that was not listening would wait for its poll."""
    name = pg_cluster.fresh_database()
    where = parse_location(
        pg_cluster.url(name, password=False), password_file=pg_cluster.password_file(tmp_path)
    )

    async def main() -> float:
        with Store.open(where) as one, Store.open(where) as two:
            leader = LeaseKeeper(one, "cp1", duration=60.0, renew=30.0)
            standby = LeaseKeeper(two, "cp2", duration=60.0, renew=30.0)
            assert leader.try_take()
            taking = asyncio.create_task(standby.take())
            await asyncio.wait_for(standby.listening.wait(), timeout=10)
            await asyncio.sleep(0.2)
            assert not taking.done()  # held: the standby waits
            began = time.monotonic()
            leader.release()
            await asyncio.wait_for(taking, timeout=10)  # the poll would take 30 s
            took = time.monotonic() - began
            assert standby.epoch == leader.epoch + 1
            return took

    took = asyncio.run(main())
    print(f"a released lease taken by the standby in {took * 1000:.0f} ms")
