"""Tests for the leader's lease and the instances' registry, on both engines: the lease is
taken once, lapses by the database's clock, and its epoch fences a replaced leader's
writes; an instance id is one process's at a time."""

from __future__ import annotations

import os
import time

import pytest

from llmgw.errors import ConfigError, Fenced
from llmgw.server.store import Store
from llmgw.server.store.instances import process_gone
from tests.unit.clock import Clock


def _lapse(store: Store, clock: Clock, seconds: float) -> None:
    """Let *seconds* pass by the database's clock (SQLite: the test's; PostgreSQL: real)."""
    if store.engine == "sqlite":
        clock.advance(seconds)
    else:
        time.sleep(seconds)


def test_the_lease_is_taken_once_and_bumps_the_epoch(store: Store, clock: Clock) -> None:
    before = store.epoch()
    first = store.take_lease("cp1", 0.5)
    assert first is not None and first.holder == "cp1" and first.epoch == before + 1
    assert store.take_lease("cp2", 0.5) is None  # held, not lapsed
    assert store.epoch() == before + 1
    _lapse(store, clock, 0.7)
    second = store.take_lease("cp2", 0.5)
    assert second is not None and (second.holder, second.epoch) == ("cp2", before + 2)
    # The old holder cannot renew: another took over.
    assert store.renew_lease("cp1", first.epoch, 0.5) is None
    renewed = store.renew_lease("cp2", second.epoch, 0.5)
    assert renewed is not None and renewed.expires_at >= second.expires_at


def test_a_restarted_holder_takes_its_own_lease_at_once(store: Store) -> None:
    first = store.take_lease("cp1", 60)
    assert first is not None
    again = store.take_lease("cp1", 60)
    assert again is not None and again.epoch == first.epoch + 1


def test_a_lapsed_lease_nobody_took_is_renewed(store: Store, clock: Clock) -> None:
    lease = store.take_lease("cp1", 0.3)
    assert lease is not None
    _lapse(store, clock, 0.5)
    assert store.renew_lease("cp1", lease.epoch, 0.3) is not None


def test_release_lets_another_take_it_without_waiting(store: Store) -> None:
    lease = store.take_lease("cp1", 60)
    assert lease is not None
    assert store.release_lease("cp1", lease.epoch)
    taken = store.take_lease("cp2", 60)
    assert taken is not None and taken.epoch == lease.epoch + 1
    assert not store.release_lease("cp1", lease.epoch)


def test_the_epoch_fences_a_replaced_leaders_writes(store: Store, clock: Clock) -> None:
    lease = store.take_lease("cp1", 0.3)
    assert lease is not None
    store.database.fence = lambda _db: store.check_epoch(lease.epoch)
    store.put_model("m", engine="sim", params={}, replicas=1)  # still the leader: written
    _lapse(store, clock, 0.5)
    with store.database.unfenced():
        successor = store.take_lease("cp2", 60)
    assert successor is not None
    with pytest.raises(Fenced, match=f"led at epoch {lease.epoch}, but cp2 has led since"):
        store.put_model("m2", engine="sim", params={}, replicas=1)
    store.database.fence = None
    assert [m.name for m in store.list_models()] == ["m"]


def test_an_instance_id_is_one_process_at_a_time(store: Store, clock: Clock) -> None:
    first = store.register_instance("cp1", "host/1/a", stale_after=30, version="1.0.0")
    assert (first.id, first.process) == ("cp1", "host/1/a")
    with pytest.raises(ConfigError, match="instance id 'cp1' is already used by a running"):
        store.register_instance("cp1", "host/2/b", stale_after=30, version="1.0.0")
    store.register_instance("cp2", "host/2/b", stale_after=30, version="1.0.0")
    store.set_instance_addresses(
        "cp2", stream="10.0.0.2:7443", http="http://10.0.0.2:8080", enroll="", ca_hash="sha256:x"
    )
    assert [(i.id, i.stream_addr) for i in store.list_instances()] == [
        ("cp1", ""),
        ("cp2", "10.0.0.2:7443"),
    ]
    assert store.touch_instance("cp1", "host/1/a")
    assert not store.touch_instance("cp1", "host/9/z")
    store.retire_instance("cp1")
    assert [i.id for i in store.list_instances()] == ["cp2"]


def test_a_silent_instance_id_may_be_taken_over(store: Store, clock: Clock) -> None:
    store.register_instance("cp1", "host/1/a", stale_after=0.3, version="1.0.0")
    _lapse(store, clock, 0.5)
    again = store.register_instance("cp1", "host/3/c", stale_after=0.3, version="1.0.1")
    assert (again.process, again.version) == ("host/3/c", "1.0.1")
    assert not store.touch_instance("cp1", "host/1/a")


def test_a_restarted_process_of_this_machine_takes_its_id_at_once(store: Store) -> None:
    import socket

    dead = f"{socket.gethostname()}/999999999/ab"
    store.register_instance("cp1", dead, stale_after=60, version="1")
    got = store.register_instance("cp1", "me/1/x", stale_after=60, version="1", gone=process_gone)
    assert got.process == "me/1/x"
    alive = f"{socket.gethostname()}/{os.getpid()}/cd"
    store.register_instance("cp2", alive, stale_after=60, version="1")
    with pytest.raises(ConfigError, match="already used"):
        store.register_instance("cp2", "me/2/y", stale_after=60, version="1", gone=process_gone)
