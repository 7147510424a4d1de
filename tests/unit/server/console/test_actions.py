"""The node page's actions (llmgw.server.console.actions): drain, uncordon, revoke through the
admin API's own code, each needing the node's id in ``confirm``, answered 303 back to the
node page with a one-shot flash message; refusals (not draining, already revoked, unknown
node) said the same way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw.server.console.site import Flash
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import HOSTILE, Browser, ConsoleRig


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    rig.add_node("gpu-1")
    return rig


def _flash(page: str) -> str:
    found = re.search(r'<p class="flash flash-(\w+)" role="status" id="flash">([^<]*)</p>', page)
    return f"{found.group(1)}: {found.group(2)}" if found else ""


async def act(b: Browser, node: str, action: str, confirm: str | None = None) -> tuple[int, str]:
    """POST the action; the status and the flash of the page it goes back to."""
    from urllib.parse import quote

    path = f"/ui/nodes/{quote(node, safe='')}"
    status, body, resp = await b.post(
        f"{path}/{action}", {"csrf": b.csrf, "confirm": node if confirm is None else confirm}
    )
    if status != 303:
        return status, body
    assert resp.headers["Location"] == path
    _, page, _ = await b.get(path)
    return status, _flash(page)


def test_drain_then_uncordon(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = [await act(b, "gpu-1", "drain")]
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        assert 'id="action-uncordon"' in page and 'id="action-drain"' not in page
        assert 'id="drain-progress"' in page
        assert _flash(page) == ""  # one-shot: gone on the next page
        out.append(await act(b, "gpu-1", "uncordon"))
        out.append(await act(b, "gpu-1", "uncordon"))
        return out

    drained, uncordoned, again = rig.run(scenario)
    assert drained == (303, "info: node gpu-1 is draining: no replica left on it")
    assert uncordoned == (303, "info: node gpu-1 takes new replicas again")
    assert again == (303, "error: node gpu-1 is not draining; nothing to undo")
    kinds = [(e.kind, e.actor) for e in reversed(store.list_events()) if e.subject == "gpu-1"]
    assert kinds == [("node_drain", "admin"), ("node_uncordon", "admin")]


def test_revoke(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[tuple[int, str], tuple[int, str], str]:
        await b.login()
        first = await act(b, "gpu-1", "revoke")
        second = await act(b, "gpu-1", "revoke")
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        return first, second, page

    first, second, page = rig.run(scenario)
    assert first[0] == 303 and first[1].startswith("info: node gpu-1 is revoked")
    assert second == (303, "error: node gpu-1 is already revoked")
    assert store.get_node("gpu-1").state == "revoked"
    assert 'id="action-revoke"' not in page
    # Nothing is offered that a revoked node could do; the page says how it comes back.
    assert 'id="action-drain"' not in page and 'id="action-uncordon"' not in page
    assert "Revoked: it comes back only by joining again" in page
    # Its stream was cut: the session's queue ends with the close marker.
    queue = rig.sessions["gpu-1"].queue
    assert [queue.get_nowait() for _ in range(queue.qsize())][-1] is None


def test_an_action_needs_the_node_id_as_confirmation(rig: ConsoleRig, store: Store) -> None:
    rig.add_node("gpu-2")

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        return [
            await act(b, "gpu-1", "revoke", confirm=""),
            await act(b, "gpu-1", "revoke", confirm="gpu-2"),  # another node's form
            await act(b, "gpu-1", "drain", confirm="yes"),
        ]

    for status, flash in rig.run(scenario):
        assert status == 303
        assert flash.startswith("error: nothing done: to ") and "confirm with its id" in flash
    assert store.get_node("gpu-1").state == "approved" and not store.get_node("gpu-1").draining
    assert store.get_node("gpu-2").state == "approved"


def test_an_unknown_node(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        return await act(b, "nobody", "drain")

    status, page = rig.run(scenario)
    assert status == 404 and "nobody" in page and "<h1" in page


def test_a_hostile_node_id_in_the_flash_is_escaped(rig: ConsoleRig) -> None:
    rig.add_node(HOSTILE)

    async def scenario(b: Browser) -> str:
        await b.login()
        await act(b, HOSTILE, "drain")
        from urllib.parse import quote

        _, page, _ = await b.get("/ui/nodes/" + quote(HOSTILE, safe=""))
        return page

    page = rig.run(scenario)
    assert "<script>" not in page
    assert "node &lt;script&gt;" in page


def test_flash_messages_are_one_shot_and_bounded() -> None:
    flash = Flash(limit=2)
    flash.put("a", "one")
    flash.put("a", "two")  # the newest replaces
    assert flash.take("a") == ("info", "two")
    assert flash.take("a") is None
    for token in ("x", "y", "z"):
        flash.put(token, token, level="error")
    assert flash.take("x") is None  # the oldest went
    assert flash.take("z") == ("error", "z")
