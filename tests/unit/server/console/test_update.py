"""The console's Update now page (llmgw.server.console.updating): the versions of the bundles
served, one node or all, the signed-in account's own password asked again; the real
Updates signs the order with the cluster CA and sends it; each node's state is shown live
as the node reports it (sent, spooled, done, refused with its reason). A wrong password, an
unknown version, a node not approved, a viewer and a POST without its CSRF token sign
nothing."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from llmgw import pki
from llmgw.proto import control_pb2 as pb
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.fleet_rig import FleetRig
from tests.unit.server.console.rig import HOSTILE, VIEWER_PW, Browser

VERSION = "0.9.2"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority) -> FleetRig:
    rig = FleetRig(store, clock, tmp_path, ca)
    rig.bundle("0.9.1", "linux-arm64")
    rig.bundle(VERSION, "linux-x64")
    rig.add_x64_node("gpu-1")
    rig.add_x64_node("gpu-2", connected=False)
    rig.enrol("gpu-3")  # pending: not offered
    return rig


def problem(page: str) -> str:
    found = re.search(r'<p class="flash flash-error" role="alert" id="problem">([^<]*)</p>', page)
    return "" if found is None else html.unescape(found.group(1))


def flash(page: str) -> str:
    found = re.search(r'<p class="flash flash-(\w+)" role="status" id="flash">([^<]*)</p>', page)
    return "" if found is None else f"{found.group(1)}: {html.unescape(found.group(2))}"


def states(part: str) -> dict[str, str]:
    return dict(re.findall(r'<tr data-node="([^"]*)" data-state="([^"]*)">', part))


def options(page: str, select: str) -> list[tuple[str, bool]]:
    block = re.search(rf'<select id="{select}" name="[^"]*">(.*?)</select>', page, re.S)
    assert block is not None, f"no select {select}"
    return [
        (html.unescape(value), bool(selected))
        for value, selected in re.findall(r'<option value="([^"]*)"( selected)?>', block.group(1))
    ]


def test_the_form_offers_the_versions_served_and_the_approved_nodes(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await b.get("/ui/update?node=gpu-2")
        return page

    page = rig.run(scenario)
    assert options(page, "update-version") == [(VERSION, True), ("0.9.1", False)]
    assert f">{VERSION} (linux-x64)</option>" in page and ">0.9.1 (linux-arm64)</option>" in page
    assert options(page, "update-node") == [("", False), ("gpu-1", False), ("gpu-2", True)]
    assert 'type="password" autocomplete="current-password" required' in page
    assert 'id="no-updates"' in page and 'data-live="status"' in page


def test_an_order_is_signed_sent_and_followed_live(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str, str, list[str]]:
        await b.login()
        status, _body, resp = await b.post(
            "/ui/update",
            {
                "csrf": b.csrf,
                "target": "node",
                "node": "gpu-1",
                "version": VERSION,
                "password": rig.admin_pw,
            },
        )
        _, page, _ = await b.get(resp.headers["Location"])
        parts = []
        update = store.get_update("gpu-1")
        assert update is not None
        session = rig.sessions["gpu-1"]
        for state, message in (
            ("", ""),
            ("spooled", "waiting for the root helper"),
            ("refused", "the order's signature does not verify"),
        ):
            if state:
                rig.updates.on_status(
                    session,
                    pb.UpdateStatus(counter=update.counter, state=state, message=message),
                )
            _, part, _ = await b.get("/ui/update?fragment=status")
            parts.append(part)
        return status, resp.headers["Location"], page, parts

    status, location, page, (sent, spooled, refused) = rig.run(scenario)
    assert (status, location) == (303, "/ui/update?node=gpu-1")
    assert flash(page).startswith(
        f"info: update to {VERSION} signed and ordered for 1 node (gpu-1)"
    )
    assert states(sent) == {"gpu-1": "sent"} and "<html" not in sent
    assert states(spooled) == {"gpu-1": "spooled"} and "waiting for the root helper" in spooled
    assert states(refused) == {"gpu-1": "refused"}
    assert "the order&#39;s signature does not verify" in refused
    # Signed by the cluster CA, sent on the node's stream, recorded as admin's.
    queue = rig.sessions["gpu-1"].queue
    sent_orders = [m for m in (queue.get_nowait() for _ in range(queue.qsize())) if m is not None]
    assert [m.WhichOneof("msg") for m in sent_orders][-1:] == ["update_order"]
    [event] = [e for e in store.list_events() if e.kind == "update_ordered"]
    assert (event.subject, event.actor) == ("gpu-1", "admin")


def test_all_approved_nodes(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, _body, _ = await b.post(
            "/ui/update",
            {"csrf": b.csrf, "target": "all", "version": VERSION, "password": rig.admin_pw},
        )
        _, part, _ = await b.get("/ui/update?fragment=status")
        return status, part

    status, part = rig.run(scenario)
    assert status == 303
    # gpu-2 is not connected: its order waits for it.
    assert states(part) == {"gpu-1": "sent", "gpu-2": "queued"}
    assert store.get_update("gpu-3") is None


@pytest.mark.parametrize(
    ("fields", "status", "says"),
    [
        (
            {"node": "gpu-1", "version": VERSION, "password": "not it"},
            403,
            "wrong password for the account 'admin'; nothing was signed",
        ),
        (
            {"node": "gpu-1", "version": "9.9.9"},
            400,
            f"nothing ordered: this control plane serves no bundle of version 9.9.9; it serves "
            f"{VERSION}, 0.9.1",
        ),
        (
            {"node": "gpu-1", "version": "0.9.1"},
            409,
            "nothing ordered: this control plane does not serve version 0.9.1 for linux-x64",
        ),
        ({"node": "", "version": VERSION}, 400, "nothing ordered: choose a node"),
        ({"node": "gpu-3", "version": VERSION}, 409, "nothing ordered: node gpu-3 is pending"),
        ({"node": "nobody", "version": VERSION}, 404, "nothing ordered: "),
        (
            {"node": "gpu-1", "version": VERSION, "password": ""},
            400,
            "nothing signed: give your own account's password",
        ),
    ],
)
def test_refusals_sign_nothing(
    rig: FleetRig, store: Store, fields: dict[str, str], status: int, says: str
) -> None:
    password = fields.pop("password", None)

    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        got, page, _ = await b.post(
            "/ui/update",
            {
                "csrf": b.csrf,
                "target": "node",
                "password": rig.admin_pw if password is None else password,
                **fields,
            },
        )
        return got, page

    got, page = rig.run(scenario)
    assert got == status, page
    assert problem(page).startswith(says), problem(page)
    assert store.list_updates() == []
    assert not [e for e in store.list_events() if e.kind == "update_ordered"]
    assert rig.admin_pw not in page  # the password never comes back
    if fields["node"] in ("gpu-1",):
        assert ("gpu-1", True) in options(page, "update-node")


def test_a_viewer_sees_the_states_but_no_form_and_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[str, int]:
        await b.login("vera", VIEWER_PW)
        _, page, _ = await b.get("/ui/update")
        status, _body, _ = await b.post(
            "/ui/update",
            {"csrf": b.csrf, "target": "all", "version": VERSION, "password": VIEWER_PW},
        )
        return page, status

    page, status = rig.run(scenario)
    assert 'id="update-form"' not in page and 'id="viewer-note"' in page
    assert 'data-live="status"' in page
    assert status == 403 and store.list_updates() == []


def test_a_post_without_the_csrf_token_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> int:
        await b.login()
        status, _body, _ = await b.post(
            "/ui/update", {"target": "all", "version": VERSION, "password": rig.admin_pw}
        )
        return status

    assert rig.run(scenario) == 403
    assert store.list_updates() == []


def test_without_bundles_it_says_where_to_put_them(
    store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority
) -> None:
    rig = FleetRig(store, clock, tmp_path, ca)
    rig.add_x64_node("gpu-1")

    async def scenario(b: Browser) -> tuple[str, int, str]:
        await b.login()
        _, page, _ = await b.get("/ui/update")
        status, refused, _ = await b.post(
            "/ui/update",
            {"csrf": b.csrf, "target": "all", "version": VERSION, "password": rig.admin_pw},
        )
        return page, status, refused

    page, status, refused = rig.run(scenario)
    assert 'id="no-versions"' in page and str(rig.bundle_dir) in page
    assert (
        status == 400
        and "it serves none: its bundle directory holds no agent bundle" in problem(refused)
    )


def test_an_approved_nodes_page_links_to_update_it(rig: FleetRig) -> None:
    rig.add_x64_node(HOSTILE)

    async def scenario(b: Browser) -> tuple[str, str]:
        await b.login()
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        _, hostile, _ = await b.get("/ui/update")
        return page, hostile

    page, hostile = rig.run(scenario)
    assert 'id="node-update-link" href="/ui/update?node=gpu-1"' in page
    assert HOSTILE not in hostile and "&lt;script&gt;" in hostile
