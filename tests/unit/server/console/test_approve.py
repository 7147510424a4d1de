"""The console's Approve page (llmgw.server.console.approval): the pending nodes with their
fingerprints and degraded reasons, live; approval compares the fingerprint the operator
pasted (Membership.approve: a mismatch approves nothing, the typed value is kept); reject
needs the node's id as confirmation. A viewer sees no form and its POSTs are refused; a POST
without the CSRF token is refused."""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import quote

import pytest

from llmgw import pki
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.fleet_rig import FINGERPRINT, FleetRig
from tests.unit.server.console.rig import HOSTILE, VIEWER_PW, Browser

OTHER = "sha256:" + "cd" * 32


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority) -> FleetRig:
    rig = FleetRig(store, clock, tmp_path, ca)
    rig.add_node("gpu-1")  # approved: not on the page
    rig.enrol("gpu-2", degraded="vllm is not installed at /opt/vllm/bin/vllm")
    return rig


def problem(page: str) -> str:
    found = re.search(r'<p class="flash flash-error" role="alert" id="problem">([^<]*)</p>', page)
    return "" if found is None else html.unescape(found.group(1))


def flash(page: str) -> str:
    found = re.search(r'<p class="flash flash-(\w+)" role="status" id="flash">([^<]*)</p>', page)
    return "" if found is None else f"{found.group(1)}: {html.unescape(found.group(2))}"


def pending_ids(page: str) -> list[str]:
    return [
        html.unescape(n)
        for n in re.findall(r'<li class="pending-node[^"]*" id="[^"]*" data-node="([^"]*)"', page)
    ]


async def approve(b: Browser, node: str, fingerprint: str) -> tuple[int, str, str]:
    """POST the approval; its status, its page (the one it redirects to, followed) and the
    redirect's target."""
    status, page, resp = await b.post(
        f"/ui/nodes/{quote(node, safe='')}/approve", {"csrf": b.csrf, "fingerprint": fingerprint}
    )
    if status != 303:
        return status, page, ""
    target = resp.headers["Location"]
    _, page, _ = await b.get(target)
    return status, page, target


def test_the_pending_nodes_with_their_fingerprints_and_reasons(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/approve")
        return page

    page = rig.run(scenario)
    assert pending_ids(page) == ["gpu-2"]
    assert f'<code class="fingerprint">{FINGERPRINT}</code>' in page
    assert "<li>vllm is not installed at /opt/vllm/bin/vllm</li>" in page
    assert 'action="/ui/nodes/gpu-2/approve"' in page and 'action="/ui/nodes/gpu-2/reject"' in page
    assert 'data-confirm="Reject node gpu-2?' in page
    assert (
        'id="pending-live" data-live="pending" data-live-url="/ui/approve?fragment=pending"' in page
    )


def test_none_pending_says_how_to_add_one(
    store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority
) -> None:
    rig = FleetRig(store, clock, tmp_path, ca)

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/approve")
        return page

    page = rig.run(scenario)
    assert 'id="no-pending"' in page and 'href="/ui/add-node"' in page


def test_a_new_pending_node_appears_in_the_live_part(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        _, before, _ = await b.get("/ui/approve?fragment=pending")
        rig.enrol("gpu-3", fingerprint=OTHER)
        _, after, _ = await b.get("/ui/approve?fragment=pending")
        return before, after

    before, after = rig.run(scenario)
    assert pending_ids(before) == ["gpu-2"] and pending_ids(after) == ["gpu-2", "gpu-3"]
    assert "<html" not in after and f'<code class="fingerprint">{OTHER}</code>' in after
    # The fragment's forms carry the session's CSRF token, as the page's do.
    assert 'name="csrf" value=""' not in after


def test_a_wrong_fingerprint_approves_nothing_and_is_kept(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await approve(b, "gpu-2", OTHER)
        return status, page

    status, page = rig.run(scenario)
    assert status == 409
    assert problem(page) == (
        f"fingerprint {OTHER} does not match node gpu-2's key {FINGERPRINT}; do not approve: "
        "compare with what 'llmgw agent join' printed on the node"
    )
    assert f'value="{OTHER}"' in page  # what was pasted, kept to compare
    assert store.get_node("gpu-2").state == "pending"
    assert not [e for e in store.list_events() if e.kind == "node_approved"]


def test_no_fingerprint_approves_nothing(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await approve(b, "gpu-2", "  ")
        return status, page

    status, page = rig.run(scenario)
    assert status == 400 and "paste the fingerprint node gpu-2 printed" in problem(page)
    assert store.get_node("gpu-2").state == "pending"


def test_the_right_fingerprint_approves_and_goes_to_the_node(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str, str, str]:
        await b.login()
        status, page, target = await approve(b, "gpu-2", FINGERPRINT.upper().replace("SHA", "sha"))
        _, listing, _ = await b.get("/ui/approve")
        return status, page, target, listing

    status, page, target, listing = rig.run(scenario)
    assert (status, target) == (303, "/ui/nodes/gpu-2")
    assert flash(page) == f"info: node gpu-2 is approved (key {FINGERPRINT}): it takes work now"
    assert store.get_node("gpu-2").state == "approved"
    [event] = [e for e in store.list_events() if e.kind == "node_approved"]
    assert (event.subject, event.actor, event.message) == ("gpu-2", "admin", f"key {FINGERPRINT}")
    assert pending_ids(listing) == [] and 'id="no-pending"' in listing
    # Its held inventory was stored: its GPU is on its page.
    assert "NVIDIA L4" in page


def test_approving_an_approved_node_is_refused_on_the_page(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await approve(b, "gpu-1", FINGERPRINT)
        return status, page

    status, page = rig.run(scenario)
    assert status == 409 and problem(page) == "node gpu-1 is already approved"


def test_reject_needs_the_node_id_then_removes_it(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str]]:
        await b.login()
        out = []
        for confirm in ("", "gpu-1", "gpu-2"):
            status, _body, resp = await b.post(
                "/ui/nodes/gpu-2/reject", {"csrf": b.csrf, "confirm": confirm}
            )
            assert resp.headers["Location"] == "/ui/approve"
            _, page, _ = await b.get("/ui/approve")
            out.append((status, flash(page)))
        return out

    unconfirmed, other, rejected = rig.run(scenario)
    for status, said in (unconfirmed, other):
        assert status == 303 and said.startswith("error: nothing done: to reject node gpu-2")
    assert rejected[0] == 303 and rejected[1].startswith("info: node gpu-2 is rejected")
    assert [n.id for n in store.list_nodes()] == ["gpu-1"]
    [event] = [e for e in store.list_events() if e.kind == "node_rejected"]
    assert (event.subject, event.actor) == ("gpu-2", "admin")


def test_rejecting_an_approved_node_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await b.post(
            "/ui/nodes/gpu-1/reject", {"csrf": b.csrf, "confirm": "gpu-1"}
        )
        return status, page

    status, page = rig.run(scenario)
    assert status == 409 and "nothing rejected: node gpu-1 is approved, not pending" in problem(
        page
    )
    assert store.get_node("gpu-1").state == "approved"


def test_a_viewer_sees_no_form_and_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[str, list[int]]:
        await b.login("vera", VIEWER_PW)
        _, page, _ = await b.get("/ui/approve")
        statuses = []
        for path, data in (
            ("/ui/nodes/gpu-2/approve", {"fingerprint": FINGERPRINT}),
            ("/ui/nodes/gpu-2/reject", {"confirm": "gpu-2"}),
        ):
            status, _body, _ = await b.post(path, {"csrf": b.csrf, **data})
            statuses.append(status)
        return page, statuses

    page, statuses = rig.run(scenario)
    assert pending_ids(page) == ["gpu-2"] and '<form method="post" action="/ui/nodes' not in page
    assert statuses == [403, 403]
    assert store.get_node("gpu-2").state == "pending"


def test_a_post_without_the_csrf_token_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> int:
        await b.login()
        status, _page, _ = await b.post("/ui/nodes/gpu-2/approve", {"fingerprint": FINGERPRINT})
        return status

    assert rig.run(scenario) == 403
    assert store.get_node("gpu-2").state == "pending"


def test_a_hostile_node_id_is_escaped(rig: FleetRig) -> None:
    rig.add_node(HOSTILE, state="pending")

    async def scenario(b: Browser) -> list[str]:
        await b.login()
        _, page, _ = await b.get("/ui/approve")
        _, refused, _ = await approve(b, HOSTILE, OTHER)
        return [page, refused]

    page, refused = rig.run(scenario)
    assert HOSTILE in pending_ids(page)
    for body in (page, refused):
        assert HOSTILE not in body and "&lt;script&gt;" in body


def test_a_pending_nodes_page_links_to_its_approval(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/nodes/gpu-2")
        return page

    page = rig.run(scenario)
    assert 'id="node-approve" href="/ui/approve?node=gpu-2#pending-gpu-2"' in page
