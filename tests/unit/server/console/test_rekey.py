"""A node page's Rekey and Re-pair (llmgw.server.console.joining.RekeyNode): each mints a
rekey token through the admin API's own function (as ``llmgw ctl join-command --rekey NODE
[--re-pair]`` does), behind the node's id as confirmation like revoke, and shows its
command once, in the POST's own answer (the node's page, never cached); the page that
follows shows no secret. Refusals (no confirmation, a revoked node, an unknown node, a node
id no command may carry, a viewer, no CSRF token) mint nothing."""

from __future__ import annotations

import html
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from llmgw import pki
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.fleet_rig import FleetRig
from tests.unit.server.console.rig import HOSTILE, VIEWER_PW, Browser, box


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority) -> FleetRig:
    rig = FleetRig(store, clock, tmp_path, ca)
    rig.add_node("gpu-1")
    return rig


def flash(page: str) -> str:
    found = re.search(r'<p class="flash flash-(\w+)" role="status" id="flash">([^<]*)</p>', page)
    return f"{found.group(1)}: {html.unescape(found.group(2))}" if found else ""


async def rekey(
    b: Browser, node: str, action: str = "rekey", confirm: str | None = None
) -> tuple[int, str, Any]:
    """POST the node page's ``action``; a refusal's redirect is followed to its page."""
    path = f"/ui/nodes/{quote(node, safe='')}"
    status, page, resp = await b.post(
        f"{path}/{action}", {"csrf": b.csrf, "confirm": node if confirm is None else confirm}
    )
    if status == 303:
        assert resp.headers["Location"] == path
        _, page, _ = await b.get(path)
    return status, page, resp


def test_rekey_shows_the_command_once_on_the_nodes_page(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[Any, ...]:
        await b.login()
        _, before, _ = await b.get("/ui/nodes/gpu-1")
        status, page, resp = await rekey(b, "gpu-1")
        _, after, _ = await b.get("/ui/nodes/gpu-1")
        _, live, _ = await b.get("/ui/nodes/gpu-1?fragment=detail")
        return before, status, page, resp.headers, after, live

    before, status, page, headers, after, live = rig.run(scenario)
    # Offered behind the same confirmation as revoke: the node's id, or the dialog naming it.
    for action, verb in (("rekey", "rekey"), ("repair", "re-pair")):
        form = re.search(rf'<form [^>]*id="action-{action}"[^>]*>', before)
        assert form is not None, action
        assert 'action="/ui/nodes/gpu-1/' + action + '"' in form.group(0)
        assert f'data-confirm="{verb.capitalize()} node gpu-1? ' in form.group(0)
        assert f"Type the node's id to {verb} it" in before
    assert ">Re-pair: its state is lost</button>" in before

    assert status == 201 and headers["Cache-Control"] == "no-store"
    assert '<h2 id="made-heading">Rekey node gpu-1</h2>' in page
    assert 'id="shown-once"' in page and "the rekey token appears" in page
    command = box(page, "join-command")
    assert command is not None
    words = shlex.split(command)
    secret = words[0].removeprefix("LLMGW_JOIN_TOKEN=")
    assert words[1:6] == ["llmgw", "agent", "join", "--node-id", "gpu-1"]
    assert words[-1] == "--rekey" and "--node-uid" not in words
    assert box(page, "one-liner") is None and 'id="no-bundles"' in page
    # The node's own page around it, its live part fetched from the node's URL (this
    # answer's is .../rekey).
    assert 'id="node-state">approved<' in page
    assert 'data-live-url="/ui/nodes/gpu-1?fragment=detail"' in page
    [token] = store.list_join_tokens()
    assert (token.node_id, str(token.kind), token.lost_state) == ("gpu-1", "rekey", False)
    assert token.node_uid == store.get_node("gpu-1").uid
    assert token.expires_at - token.created_at == 3600
    assert secret.startswith(token.prefix)
    [event] = [e for e in store.list_events() if e.kind == "join_token_created"]
    assert (event.subject, event.actor) == ("gpu-1", "admin")
    assert event.message.startswith(f"rekey token {token.id}")
    for later in (after, live):  # shown once
        assert secret not in later and "LLMGW_JOIN_TOKEN" not in later
        assert 'id="join-made"' not in later


def test_repair_names_the_uid_it_keeps_and_with_bundles_gives_the_one_liner(
    rig: FleetRig, store: Store
) -> None:
    rig.bundle("0.9.1")
    uid = store.get_node("gpu-1").uid

    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await rekey(b, "gpu-1", "repair")
        return status, page

    status, page = rig.run(scenario)
    assert status == 201
    assert '<h2 id="made-heading">Re-pair node gpu-1</h2>' in page
    command, liner = box(page, "join-command"), box(page, "one-liner")
    assert command is not None and liner is not None
    words = shlex.split(command)
    assert words[words.index("--node-uid") + 1] == uid and "--rekey" not in words
    secret = words[0].removeprefix("LLMGW_JOIN_TOKEN=")
    assert f"LLMGW_JOIN_TOKEN={secret}" in liner and "sha256sum -c" in liner
    # The installer joins it again, by its uid.
    assert "install-agent.sh install --node-id gpu-1 " in liner
    assert liner.endswith(f" --node-uid {uid})")
    assert f"uid <code>{uid}</code>" in page and "waits for approval again" in page
    [token] = store.list_join_tokens()
    assert (str(token.kind), token.lost_state, token.require_approval) == ("rekey", True, True)
    assert token.node_uid == uid


def test_with_bundles_a_rekeys_one_liner_runs_the_installers_rekey(rig: FleetRig) -> None:
    rig.bundle("0.9.1")

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await rekey(b, "gpu-1")
        return page

    liner = box(rig.run(scenario), "one-liner")
    assert liner is not None and "install-agent.sh rekey --node-id gpu-1 " in liner


@pytest.mark.parametrize(
    ("confirm", "action"),
    [("", "rekey"), ("gpu-2", "rekey"), ("yes", "repair")],
)
def test_without_the_node_id_as_confirmation_nothing_is_made(
    rig: FleetRig, store: Store, confirm: str, action: str
) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await rekey(b, "gpu-1", action, confirm=confirm)
        return status, page

    status, page = rig.run(scenario)
    verb = {"rekey": "rekey", "repair": "re-pair"}[action]
    assert status == 303
    assert flash(page).startswith(f"error: nothing done: to {verb} node gpu-1, confirm with")
    assert store.list_join_tokens(include_inactive=True) == []


def test_a_revoked_an_unknown_or_an_unusable_node_gets_no_token(
    rig: FleetRig, store: Store
) -> None:
    rig.add_node("old-1", state="revoked", connected=False)
    rig.add_node(HOSTILE)

    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for node, action in (("old-1", "rekey"), ("old-1", "repair"), ("nobody", "rekey")):
            status, page, _ = await rekey(b, node, action)
            out.append((status, page))
        status, page, _ = await rekey(b, HOSTILE)
        out.append((status, page))
        return out

    (revoked, revoked_too, unknown, hostile) = rig.run(scenario)
    for status, page in (revoked, revoked_too):
        assert status == 303
        assert flash(page).startswith("error: nothing made: node old-1 is revoked;")
        assert "'llmgw ctl join-command --node old-1'" in flash(page)
        assert 'id="action-rekey"' not in page and 'id="action-repair"' not in page
    status, page = unknown
    assert status == 404 and "nobody" in page and "<h1" in page
    status, page = hostile
    assert status == 303 and flash(page).startswith("error: nothing made: ")
    assert HOSTILE not in page and "&lt;script&gt;" in page
    assert store.list_join_tokens(include_inactive=True) == []


def test_a_viewer_sees_no_rekey_and_its_post_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[str, list[tuple[int, str]]]:
        await b.login("vera", VIEWER_PW)
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        refused = []
        for action in ("rekey", "repair"):
            status, body, _ = await b.post(
                f"/ui/nodes/gpu-1/{action}", {"csrf": b.csrf, "confirm": "gpu-1"}
            )
            refused.append((status, body))
        return page, refused

    page, refused = rig.run(scenario)
    assert 'id="action-rekey"' not in page and 'id="action-repair"' not in page
    for status, body in refused:
        assert status == 403 and "is a viewer and may only read" in body
    assert store.list_join_tokens(include_inactive=True) == []


def test_a_post_without_the_csrf_token_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for action in ("rekey", "repair"):
            status, body, _ = await b.post(f"/ui/nodes/gpu-1/{action}", {"confirm": "gpu-1"})
            out.append((status, body))
        return out

    for status, body in rig.run(scenario):
        assert status == 403 and "security token is missing" in body
    assert store.list_join_tokens(include_inactive=True) == []
