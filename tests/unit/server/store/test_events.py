"""Tests for the events table: newest first, messages cut, trimmed by count and size."""

from __future__ import annotations

from llmgw.server.store import (
    MAX_EVENT_MESSAGE,
    Event,
    Store,
)
from llmgw.server.store.location import Location
from tests.unit.clock import Clock
from tests.unit.server.store.conftest import database_size


def test_events(store: Store, clock: Clock) -> None:
    e1 = store.add_event("node", "gpu1", "connected")
    clock.advance()
    e2 = store.add_event("model", "llama", "scaled to 2")
    clock.advance()
    e3 = store.add_event("node", "gpu1", "disconnected")
    assert isinstance(e1, Event)
    assert e1.ts == 1000.0 and e1.kind == "node" and e1.subject == "gpu1"
    assert store.list_events() == [e3, e2, e1]
    assert store.list_events(limit=2) == [e3, e2]
    assert store.list_events(subject="gpu1") == [e3, e1]
    assert store.list_events(subject="nobody") == []


def test_events_filtered_by_kind_and_actor(store: Store) -> None:
    e1 = store.add_event("node_drain", "gpu1", "drain started", "alice")
    e2 = store.add_event("node_drain", "gpu2", "drain started", "bob")
    e3 = store.add_event("node_revoked", "gpu1", "denied", "alice")
    store.add_event("node_drain", "gpu1", "drain started", "")
    assert store.list_events(kind="node_drain", actor="alice") == [e1]
    assert store.list_events(actor="alice") == [e3, e1]
    assert store.list_events(kind="node_drain", subject="gpu2") == [e2]
    assert store.list_events(kind="node_drain", limit=1)[0].actor == ""
    assert store.list_events(kind="nothing") == []
    # A value is data, never SQL.
    assert store.list_events(kind="x' OR '1'='1") == []


def test_events_after_an_id_come_oldest_first(store: Store) -> None:
    events = [store.add_event("k", "s", f"m{i}") for i in range(5)]
    assert store.events_after(events[1].id) == events[2:]
    assert store.events_after(events[1].id, limit=2) == events[2:4]
    assert store.events_after(events[-1].id) == []
    assert store.events_after(0) == events


def test_events_trimmed(store: Store) -> None:
    store._events.max_events = 20
    store._events.trim_every = 10
    for i in range(95):
        store.add_event("k", "s", f"m{i}")
    events = store.list_events(limit=1000)
    assert 20 <= len(events) < 20 + 10
    assert events[0].message == "m94"
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)


def test_a_long_event_message_is_cut_not_stored_whole(store: Store, db_location: Location) -> None:
    before = database_size(store, db_location)
    for _ in range(30):
        event = store.add_event("inventory_changed", "n" * 5000, "x" * 3_000_000)
        assert len(event.message) == MAX_EVENT_MESSAGE and event.message.endswith("…")
        assert len(event.subject) == 255
    grown = database_size(store, db_location) - before
    assert grown < 1024 * 1024, f"30 events of 3 MB grew the database by {grown} bytes"
    short = store.add_event("k", "s", "short message")
    assert short.message == "short message"


def test_events_are_trimmed_by_total_size_as_well_as_count(store: Store) -> None:
    store._events.max_bytes = 10_000
    store._events.trim_every = 10
    for i in range(200):
        store.add_event("k", "s", f"{i:04d}" + "y" * 496)
    events = store.list_events(limit=1000)
    total = sum(len(e.kind) + len(e.subject) + len(e.message) for e in events)
    # At most the cap, plus what arrived since the last trim.
    assert total <= 10_000 + 10 * 502, total
    assert len(events) >= 10_000 // 502 - 1
    assert events[0].message.startswith("0199")  # the newest stay
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)
