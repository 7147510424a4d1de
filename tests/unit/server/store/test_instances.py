"""Tests for the leader's lease and the instances' registry, on both engines: the lease is
taken once, lapses by the database's clock, and its epoch fences a replaced leader's
writes; an instance id is one process's at a time."""

from __future__ import annotations

import os
import re
import time

import pytest

from llmgw.errors import ConfigError, Conflict, Fenced
from llmgw.server.store import Store
from llmgw.server.store.instances import process_gone
from tests.unit.clock import Clock

DATE = r"\d{4}-\d\d-\d\d \d\d:\d\d UTC"  # when an instance was retired, as messages say it


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
        "cp2",
        stream="10.0.0.2:7443",
        http="http://10.0.0.2:8080",
        enroll="",
        ca_hash="sha256:x",
        client_serial="c2",
        server_serial="5e2",
    )
    assert [(i.id, i.stream_addr, i.serials) for i in store.list_instances()] == [
        ("cp1", "", ()),
        ("cp2", "10.0.0.2:7443", ("5e2", "c2")),
    ]
    assert store.touch_instance("cp1", "host/1/a")
    assert not store.touch_instance("cp1", "host/9/z")


def test_the_names_instances_answer_to_are_kept_until_retired(store: Store, clock: Clock) -> None:
    """What a node id may not be: every name of every instance not retired, with its id."""
    for instance, names in (("cp1", ["cp-1", "CP-1.example."]), ("cp2", ["cp-2", "api.example"])):
        store.register_instance(instance, f"host/{instance}", stale_after=30, version="1.0.0")
        store.set_instance_addresses(
            instance,
            stream="",
            http="",
            enroll="",
            ca_hash="",
            client_serial="",
            server_serial="",
            names=names,
        )
    assert store.get_instance("cp2").names == ("api.example", "cp-2")  # type: ignore[union-attr]
    assert store.instance_names() == {
        "cp-1": "cp1",
        "cp-1.example": "cp1",
        "cp-2": "cp2",
        "api.example": "cp2",
    }
    _lapse(store, clock, 0.2)
    store.retire_instance("cp2", silent_for=0.1)
    assert store.instance_names() == {"cp-1": "cp1", "cp-1.example": "cp1"}


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


def _silent_instance(
    store: Store, clock: Clock, instance_id: str, serials: tuple[str, str]
) -> None:
    """*instance_id* registered with its certificates' serials (server, client), then silent
    past 0.3 s (stopped)."""
    store.register_instance(instance_id, f"host/{instance_id}/a", stale_after=0.3, version="1")
    store.set_instance_addresses(
        instance_id,
        stream=f"{instance_id}:7443",
        http=f"http://{instance_id}:8080",
        enroll="",
        ca_hash="sha256:x",
        server_serial=serials[0],
        client_serial=serials[1],
    )


def test_a_stopped_instance_is_retired_and_its_serials_kept(store: Store, clock: Clock) -> None:
    _silent_instance(store, clock, "cp2", ("a2", "b2"))
    _silent_instance(store, clock, "cp3", ("a3", "b3"))
    _lapse(store, clock, 0.5)
    retired = store.retire_instance("cp2", silent_for=0.3)
    assert retired.id == "cp2" and retired.retired_at is not None
    assert retired.serials == ("a2", "b2")
    _lapse(store, clock, 0.05)
    store.retire_instance("cp3", silent_for=0.3)
    assert store.list_instances() == []
    assert [i.id for i in store.list_instances(retired=True)] == ["cp2", "cp3"]
    # The newest retired first, server then client; bounded.
    assert store.retired_serials(10) == ("a3", "b3", "a2", "b2")
    assert store.retired_serials(3) == ("a3", "b3", "a2")


def test_retiring_refuses_what_must_not_be_retired(store: Store, clock: Clock) -> None:
    lease = store.take_lease("cp1", 60)
    assert lease is not None
    _silent_instance(store, clock, "cp1", ("a1", "b1"))
    _silent_instance(store, clock, "cp2", ("a2", "b2"))
    with pytest.raises(Conflict, match=r"no instance 'cp9' is registered; 'llmgw ctl instances'"):
        store.retire_instance("cp9", silent_for=0.3)
    with pytest.raises(Conflict) as running:
        store.retire_instance("cp2", silent_for=0.3)
    assert str(running.value).startswith("instance cp2 was seen 0 s ago: it is running; stop it")
    assert "systemctl stop llmgw-server on that machine" in str(running.value)
    _lapse(store, clock, 0.5)
    with pytest.raises(Conflict, match="instance cp1 is the leader; stop it first: systemctl stop"):
        store.retire_instance("cp1", silent_for=0.3)
    store.retire_instance("cp2", silent_for=0.3)
    with pytest.raises(
        Conflict, match=rf"instance cp2 was retired already, on {DATE}; nothing to do"
    ):
        store.retire_instance("cp2", silent_for=0.3)
    assert store.retired_serials(10) == ("a2", "b2")  # the refusals changed nothing


def test_a_retired_instance_never_starts_again_and_its_certificates_neither(
    store: Store, clock: Clock
) -> None:
    _silent_instance(store, clock, "cp3", ("a3", "b3"))
    _lapse(store, clock, 0.5)
    store.retire_instance("cp3", silent_for=0.3)
    # Its id, whatever the machine holds.
    with pytest.raises(ConfigError) as same_id:
        store.register_instance(
            "cp3", "host/3/b", stale_after=0.3, version="1", pki_dir="/var/lib/llmgw/pki"
        )
    assert re.fullmatch(
        rf"instance_id: instance cp3 was retired on {DATE}; give this machine another "
        r"instance_id and move its /var/lib/llmgw/pki/server\.\* and "
        r"/var/lib/llmgw/pki/client\.\* aside so that it makes new certificates",
        str(same_id.value),
    ), str(same_id.value)
    # Another id on a machine that kept cp3's certificates.
    with pytest.raises(ConfigError) as same_certs:
        store.register_instance(
            "cp4", "host/3/b", stale_after=0.3, version="1", serials=("ff", "b3"), pki_dir="P"
        )
    assert "this machine's certificates (serial b3) are those of instance cp3, retired on" in (
        str(same_certs.value)
    )
    assert "which the agents refuse; move its P/server.* and P/client.* aside" in (
        str(same_certs.value)
    )
    assert [i.id for i in store.list_instances(retired=True)] == ["cp3"]  # nothing registered
    # Another id with new certificates joins.
    joined = store.register_instance(
        "cp4", "host/3/b", stale_after=0.3, version="1", serials=("c4", "d4"), pki_dir="P"
    )
    assert joined.id == "cp4" and joined.retired_at is None
    assert [i.id for i in store.list_instances()] == ["cp4"]


def test_only_the_current_leader_retires(store: Store, clock: Clock) -> None:
    old = store.take_lease("cp1", 0.3)
    assert old is not None
    _silent_instance(store, clock, "cp3", ("a3", "b3"))
    _lapse(store, clock, 0.5)
    assert store.take_lease("cp2", 60) is not None
    store.database.fence = lambda _db: store.check_epoch(old.epoch)  # cp1, replaced
    with pytest.raises(Fenced):
        store.retire_instance("cp3", silent_for=0.3)
    store.database.fence = None
    assert store.retired_serials(10) == ()
