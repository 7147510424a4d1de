"""The Events page's live feed (llmgw.server.console.stream): server-sent events whose id is
the event's, resumed after Last-Event-ID (or the page's ``after``), filtered like the page,
a heartbeat comment, and the end of the stream when the session ends."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.server.console import Console
from llmgw.server.console.security import CSP
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import Browser, ConsoleRig, sse_messages


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    return ConsoleRig(store, clock, tmp_path)


def _fast(console: Console) -> None:
    console.stream.poll_s = 0.02
    console.stream.session_check_s = 0.05
    console.stream.heartbeat_s = 0.1


def test_the_stream_yields_new_events_and_honours_last_event_id(
    rig: ConsoleRig, store: Store
) -> None:
    added = []

    async def scenario(b: Browser) -> tuple[list[dict[str, str]], list[dict[str, str]], Any]:
        await b.login()  # an event of its own, before these
        first = store.add_event("node_drain", "gpu-1", "drain started", "admin")
        added.append(store.add_event("node_uncordon", "gpu-1", "takes new again", "admin"))
        # Resumed after the first: the second comes at once, then what happens next.
        resp = await b.client.get("/ui/events/stream", headers={"Last-Event-ID": str(first.id)})
        assert resp.status == 200
        resumed = await sse_messages(resp, 2)
        store.add_event("node_drain", "gpu-2", "drain started", "carol")
        live = await sse_messages(resp, 1)
        resp.close()
        return resumed, live, resp

    resumed, live, resp = rig.run(scenario, _fast)
    (second,) = added
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Content-Security-Policy"] == CSP
    assert resumed[0] == {"retry": "3000"}
    assert resumed[1]["id"] == str(second.id)
    assert json.loads(resumed[1]["data"])["kind"] == "node_uncordon"
    data = json.loads(live[0]["data"])
    assert (data["subject"], data["actor"], data["message"]) == ("gpu-2", "carol", "drain started")
    assert int(live[0]["id"]) > second.id


def test_without_a_resume_point_the_stream_starts_from_now(rig: ConsoleRig, store: Store) -> None:
    store.add_event("node_drain", "gpu-1", "old news", "admin")

    async def scenario(b: Browser) -> list[dict[str, str]]:
        await b.login()
        resp = await b.client.get("/ui/events/stream")
        await sse_messages(resp, 1)  # retry
        store.add_event("node_drain", "gpu-1", "new", "admin")
        got = await sse_messages(resp, 1)
        resp.close()
        return got

    (message,) = rig.run(scenario, _fast)
    assert json.loads(message["data"])["message"] == "new"


def test_the_stream_filters_like_the_page(rig: ConsoleRig, store: Store) -> None:
    after = store.add_event("x", "y", "z").id

    async def scenario(b: Browser) -> list[dict[str, str]]:
        await b.login()
        resp = await b.client.get(f"/ui/events/stream?after={after}&kind=node_drain&actor=carol")
        store.add_event("node_drain", "gpu-1", "by admin", "admin")
        store.add_event("node_revoked", "gpu-1", "by carol, another kind", "carol")
        store.add_event("node_drain", "gpu-2", "by carol", "carol")
        got = await sse_messages(resp, 2)
        resp.close()
        return got

    _retry, message = rig.run(scenario, _fast)
    assert json.loads(message["data"])["message"] == "by carol"


def test_a_heartbeat_keeps_an_idle_stream_open(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> list[dict[str, str]]:
        await b.login()
        resp = await b.client.get("/ui/events/stream")
        got = await sse_messages(resp, 2)
        resp.close()
        return got

    _retry, beat = rig.run(scenario, _fast)
    assert beat["comment"].startswith("heartbeat")


def test_the_stream_ends_with_the_session(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> tuple[list[dict[str, str]], bytes]:
        await b.login()
        resp = await b.client.get("/ui/events/stream")
        await sse_messages(resp, 1)
        (token,) = [c.value for c in b.client.session.cookie_jar if c.key == "llmgw_session"]
        rig.logins.logout(token)
        got = [m for m in await sse_messages(resp, 3) if "comment" not in m][:1]
        rest = await asyncio.wait_for(resp.content.read(), 5)  # the server closed it
        return got, rest

    (ended,), rest = rig.run(scenario, _fast)
    assert ended["event"] == "session-ended"
    assert b"data:" not in rest


def test_the_stream_needs_a_session(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> int:
        status, _, _ = await b.get("/ui/events/stream")
        return status

    assert rig.run(scenario) == 303
