"""The console in Debian's Chromium against a real control plane with real agents (the fake
nvidia-smi's GPUs): an operator signs in, sees the fleet on the Overview, the Nodes page and
a node's page, drains, uncordons and revokes a node through its confirmation dialog, and
watches the events arrive live; a viewer reads only; forged and token-less POSTs, an expired
session and a guessed password are refused. Every page passes axe-core's check, breaks no
rule of its Content Security Policy (the ``new_context`` fixture fails a test whose pages
reported a violation) and is photographed at a laptop's and a phone's size.

One control plane and its agents serve the whole module (the expired-session test starts a
second, with a two-second idle expiry); each test signs in a browser context of its own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest

from tests.integration.harness import (
    Agent,
    Server,
    start_server_with,
    stop_process,
    wait_for,
)
from tests.ui.browser import (
    CspViolations,
    expect,
)
from tests.ui.console_rig import (
    ADMIN,
    LIVE,
    VIEWER,
    Account,
    Shots,
    add_accounts,
    checked,
    csrf_of,
    gpu_agent,
    mark,
    not_reloaded,
    sign_in,
    text_of,
)

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page

pytestmark = pytest.mark.integration

CSP = (
    "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)


# Only ever given wrong passwords until the lock, so the other accounts stay usable.
GUESSED = Account("target", "target-console-password-1", "viewer")
MODEL = "chat"


@dataclass
class Fleet:
    """The module's control plane, its agents and their directory."""

    server: Server
    agents: list[Agent]
    tmp: Path

    def url(self, path: str) -> str:
        return self.server.url + path

    def node(self, node_id: str) -> dict[str, Any]:
        return self.server.api("GET", f"/api/nodes/{quote(node_id, safe='')}")  # type: ignore[no-any-return]

    def replica_node(self) -> str:
        replicas = [r for r in self.server.replicas(MODEL) if r["state"] == "ready"]
        assert len(replicas) == 1, replicas
        return str(replicas[0]["node"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = time.monotonic()
    tmp = tmp_path_factory.mktemp("console")
    server = start_server_with(tmp)
    agents: list[Agent] = []

    def stop_all() -> None:
        for agent in agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)

    try:
        agents.append(gpu_agent(tmp, server, "gpu-a", "one-gpu"))
        agents.append(gpu_agent(tmp, server, "gpu-b", "eight-h100"))
        assert sorted(server.approve_pending(2)) == ["gpu-a", "gpu-b"]
        add_accounts(server, tmp, ADMIN, VIEWER, GUESSED)
        server.api("POST", "/api/models", {"name": MODEL, "engine": "sim", "replicas": 1})
        wait_for(
            lambda: [r["state"] for r in server.replicas(MODEL)] == ["ready"],
            what=f"{MODEL}'s replica ready",
        )
        print(f"the console's fleet started in {time.monotonic() - started:.1f} s")
    except Exception:
        # Shown with the failure: why the fleet did not come up.
        print(f"the control plane's log:\n{server.log()[-6000:]}")
        for agent in agents:
            print(f"{agent.node_id}'s log:\n{agent.log()[-3000:]}")
        stop_all()
        raise
    try:
        yield Fleet(server, agents, tmp)
    finally:
        stop_all()


# --------------------------------------------------------------------------- helpers


def signed_in(
    new_context: Callable[..., BrowserContext], fleet: Fleet, account: Account, path: str
) -> Page:
    page = new_context().new_page()
    sign_in(page, fleet.server.url, account, path)
    return page


def act(page: Page, action: str) -> None:
    """Press a node page's ``action`` button and accept its dialog; the page it lands on
    says what was done."""
    page.once("dialog", lambda dialog: dialog.accept())
    page.click(f"#button-{action}")
    expect(page.locator("#flash")).to_be_visible()


# --------------------------------------------------------------------------- the operator path


def test_sign_in_and_the_overview_shows_the_fleet_and_a_new_model_live(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = new_context().new_page()
    page.goto(fleet.url("/ui/"))
    expect(page).to_have_url(fleet.url("/ui/login?next=%2Fui%2F"))
    checked(page, screenshot, "login", "the login page")
    sign_in(page, fleet.server.url, ADMIN)

    expect(page.locator("#nodes-approved")).to_have_text(re.compile(r"^[23]$"))
    expect(page.locator("#gpus")).to_have_text(re.compile(r"^\d+ / 9$"))
    chat = page.locator("#models tbody tr", has_text=MODEL)
    expect(chat.locator("td").nth(2)).to_have_text("1 / 1")
    checked(page, screenshot, "overview", "the Overview")

    mark(page)
    fleet.server.api("POST", "/api/models", {"name": "extra", "engine": "sim", "replicas": 1})
    try:
        extra = page.locator("#models tbody tr", has_text="extra")
        expect(extra.locator("td").nth(2)).to_have_text("1 / 1", timeout=LIVE)
        assert not_reloaded(page)
        recent = page.locator("#recent-events tbody tr", has_text="extra")
        expect(recent.first).to_be_visible(timeout=LIVE)
    finally:
        fleet.server.api("DELETE", "/api/models/extra")


def test_the_first_admin_account_is_the_admin_password(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    password = (fleet.server.state_dir / "admin.password").read_text().strip()
    page = new_context().new_page()
    sign_in(page, fleet.server.url, Account("admin", password, "admin"), "/ui/events")
    expect(page.locator("#nav-events")).to_have_attribute("aria-current", "page")


def test_the_nodes_page_lists_each_node_with_its_gpus_and_filters_by_url(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/nodes")
    a = page.locator("#nodes tr[data-node='gpu-a']")
    b = page.locator("#nodes tr[data-node='gpu-b']")
    expect(a).to_contain_text("approved")
    expect(a).to_contain_text("connected")
    expect(a).to_contain_text("NVIDIA GeForce RTX 4090")
    # One line per GPU model: eight H100s are one line, not eight.
    expect(b.locator("ul.gpus li")).to_have_count(1)
    expect(b.locator("ul.gpus li")).to_contain_text("8 \u00d7 NVIDIA H100 80GB HBM3")
    checked(page, screenshot, "nodes", "the Nodes page")

    page.select_option("#filter-state", "approved")
    page.fill("#filter-q", "H100")
    page.click("#filter-apply")
    expect(page).to_have_url(fleet.url("/ui/nodes?state=approved&q=H100"))
    expect(page.locator("#nodes tbody tr")).to_have_count(1)
    expect(b).to_be_visible()
    page.reload()  # bookmarkable: the same filters after a reload
    expect(page.locator("#filter-q")).to_have_value("H100")
    expect(page.locator("#nodes tbody tr")).to_have_count(1)

    page.goto(fleet.url("/ui/nodes?q=no-such-node"))
    expect(page.locator("#no-match")).to_contain_text("clear them")
    checked(page, screenshot, "nodes-no-match", "the Nodes page matching nothing")


def test_a_nodes_page_shows_its_inventory_and_shards(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    host = fleet.replica_node()
    page = signed_in(new_context, fleet, ADMIN, f"/ui/nodes/{host}")
    api = fleet.node(host)
    expect(page.locator("#node-id")).to_have_text(host)
    expect(page.locator("#node-state")).to_have_text("approved")
    expect(page.locator("#node-fingerprint")).to_have_text(api["fingerprint"])
    expect(page.locator("#node-gpus tbody tr")).to_have_count(len(api["gpus"]))
    expect(page.locator("#node-shards tbody tr", has_text=MODEL)).to_have_count(1)
    expect(page.locator("#node-events tbody tr", has_text="node_approved")).to_have_count(1)
    checked(page, screenshot, "node", "a node's page")

    page.goto(fleet.url("/ui/nodes/no-such-node"))
    expect(page.locator("#error-title")).to_have_text("Not found")
    expect(page.locator("#error-message")).to_contain_text("no-such-node")
    checked(page, screenshot, "node-missing", "the page of a node that does not exist")


def test_drain_and_uncordon_through_the_dialog_and_a_viewer_sees_it_live(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    host = fleet.replica_node()
    page = signed_in(new_context, fleet, ADMIN, f"/ui/nodes/{host}")
    watcher = signed_in(new_context, fleet, VIEWER, f"/ui/nodes/{host}")
    mark(watcher)

    # Dismissed, the dialog changes nothing.
    asked: list[str] = []

    def dismiss(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    page.click("#button-drain")
    assert asked == [
        f"Drain node {host}? Its replicas move to other nodes and it takes no new ones."
    ]
    assert fleet.node(host)["draining"] is False

    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-drain")
    expect(page.locator("#flash")).to_contain_text(f"node {host} is draining")
    expect(page.locator("#node-state")).to_have_text("approved (draining)")
    assert fleet.node(host)["draining"] is True
    expect(page.locator("#button-uncordon")).to_be_visible()
    checked(page, screenshot, "node-draining", "a draining node's page")

    expect(watcher.locator("#node-state")).to_have_text("approved (draining)", timeout=LIVE)
    assert not_reloaded(watcher)
    # Its replica moves to the other node.
    other = {"gpu-a": "gpu-b", "gpu-b": "gpu-a"}[host]
    wait_for(
        lambda: [r["node"] for r in fleet.server.replicas(MODEL)] == [other],
        timeout=30,
        what=f"{MODEL}'s replica moved from {host} to {other}",
    )

    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-uncordon")
    assert asked[-1] == f"Uncordon node {host}? It takes new replicas again."
    expect(page.locator("#flash")).to_contain_text(f"node {host} takes new replicas again")
    expect(page.locator("#node-state")).to_have_text("approved")
    assert fleet.node(host)["draining"] is False
    expect(watcher.locator("#node-state")).to_have_text("approved", timeout=LIVE)
    assert not_reloaded(watcher)


def test_revoke_asks_naming_the_node_and_cuts_it(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    agent = gpu_agent(fleet.tmp, fleet.server, "gpu-c", "zero-gpus")
    fleet.agents.append(agent)
    fleet.server.approve("gpu-c")
    page = signed_in(new_context, fleet, ADMIN, "/ui/nodes/gpu-c")
    expect(page.locator("#node-state")).to_have_text("approved")
    # No GPU, no driver: its card says so on a phone as on a desktop, never an empty box.
    page.set_viewport_size({"width": 390, "height": 844})
    expect(page.locator("#node-driver")).to_have_text("none found")
    expect(page.locator("#node-driver")).to_be_in_viewport()
    checked(page, screenshot, "node-no-gpu", "the page of a node without GPUs")

    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("#button-revoke")
    assert fleet.node("gpu-c")["state"] == "approved"

    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-revoke")
    expected = (
        "Revoke node gpu-c? Its certificates are refused from now on; it must join again to "
        "come back."
    )
    assert asked == [expected, expected]
    expect(page.locator("#flash")).to_contain_text("node gpu-c is revoked")
    expect(page.locator("#node-state")).to_have_text("revoked")
    expect(page.locator("#button-revoke")).to_have_count(0)
    assert fleet.node("gpu-c")["state"] == "revoked"
    checked(page, screenshot, "node-revoked", "a revoked node's page")
    assert agent.proc is not None
    stop_process(agent.proc)  # refused from now on, it would only retry


def test_the_events_page_receives_new_events_live(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/events")
    expect(page.locator("#events tbody tr").first).to_be_visible()
    checked(page, screenshot, "events", "the Events page")
    # On a phone the messages are off to the right: the box says so, and scrolls to them.
    page.set_viewport_size({"width": 390, "height": 844})
    box = page.locator(".scroll", has=page.locator("#events"))
    expect(box).to_have_attribute("data-more", "right")
    message = page.locator("#events tbody tr").first.locator("td").nth(4)
    expect(message).not_to_be_in_viewport()
    box.evaluate("b => { b.scrollLeft = b.scrollWidth }")
    expect(box).to_have_attribute("data-more", "left")
    expect(message).to_be_in_viewport()
    page.set_viewport_size({"width": 1366, "height": 900})
    expect(box).not_to_have_attribute("data-more", re.compile(".*"))
    mark(page)

    # Another operator signs in, and an admin drains a node from its page and uncordons it:
    # each row names the account that acted (the audit trail), as it happens.
    signed_in(new_context, fleet, VIEWER, "/ui/")
    # Rows the page's script added (class "new"), not rows of a reload.
    login = page.locator("#event-rows tr.new", has_text="operator_login").filter(
        has_text=VIEWER.name
    )
    expect(login.first).to_be_visible(timeout=LIVE)
    admin = signed_in(new_context, fleet, ADMIN, "/ui/nodes/gpu-b")
    act(admin, "drain")
    drain = page.locator("#event-rows tr.new", has_text="node_drain").filter(has_text="gpu-b")
    expect(drain.first).to_be_visible(timeout=LIVE)
    expect(drain.first.locator("td").nth(3)).to_have_text(ADMIN.name)
    act(admin, "uncordon")
    uncordon = page.locator("#event-rows tr.new", has_text="node_uncordon").filter(has_text="gpu-b")
    expect(uncordon).to_have_count(1, timeout=LIVE)
    expect(uncordon.locator("td").nth(3)).to_have_text(ADMIN.name)
    assert not_reloaded(page)

    # Filtered by URL, the live rows are those of the filter only.
    page.goto(fleet.url("/ui/events?kind=node_drain"))
    expect(page.locator("#filter-kind")).to_have_value("node_drain")
    rows = page.locator("#event-rows tr")
    expect(rows.first).to_contain_text("node_drain")
    count = rows.count()
    fleet.server.api("POST", "/api/nodes/gpu-b/drain")
    fleet.server.api("POST", "/api/nodes/gpu-b/uncordon")
    expect(rows).to_have_count(count + 1, timeout=LIVE)
    # A script's action under the shared admin token is recorded as the token's.
    expect(page.locator("#event-rows tr.new td").nth(3)).to_have_text("token")
    expect(page.locator("#event-rows tr", has_text="node_uncordon")).to_have_count(0)
    checked(page, screenshot, "events-filtered", "the Events page, filtered")


# --------------------------------------------------------------------------- security


def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = signed_in(new_context, fleet, VIEWER, "/ui/nodes/gpu-a")
    expect(page.locator("#node-state")).to_have_text(re.compile("^approved"))
    expect(page.locator("#node-actions")).to_have_count(0)
    expect(page.locator("form[action^='/ui/nodes/']")).to_have_count(0)
    checked(page, screenshot, "node-as-viewer", "a node's page as a viewer")

    # The viewer's own session and CSRF token, the form an admin's page would send.
    answer = page.request.post(
        fleet.url("/ui/nodes/gpu-a/drain"),
        form={"csrf": csrf_of(page), "confirm": "gpu-a"},
        max_redirects=0,
    )
    assert answer.status == 403
    assert f"the account {VIEWER.name} is a viewer and may only read" in text_of(answer)
    assert fleet.node("gpu-a")["draining"] is False


# Every state-changing route of the console (the routes' table, with a node, a model and a
# key of this fleet), each refused before its handler reads what it was sent.
ACTIONS = (
    "/ui/nodes/gpu-a/drain",
    "/ui/nodes/gpu-a/uncordon",
    "/ui/nodes/gpu-a/revoke",
    "/ui/nodes/gpu-a/rekey",
    "/ui/nodes/gpu-a/repair",
    "/ui/nodes/gpu-a/gpus/cordon",
    "/ui/nodes/gpu-a/gpus/uncordon",
    "/ui/nodes/gpu-a/approve",
    "/ui/nodes/gpu-a/reject",
    "/ui/add-node",
    "/ui/update",
    "/ui/models",
    f"/ui/models/{MODEL}/scale",
    f"/ui/models/{MODEL}/undeploy",
    "/ui/keys",
    "/ui/keys/no-such-key/revoke",
)


def nav_paths(page: Page) -> list[str]:
    """Every page the nav lists (it lists every page of the console)."""
    hrefs = page.locator("#nav a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert "/ui/nodes" in hrefs and "/ui/events" in hrefs, hrefs
    return [str(h) for h in hrefs]


def fleet_state(fleet: Fleet) -> Any:
    """What a refused action must leave as it was."""
    api = fleet.server.api
    return (
        [(n["id"], n["state"], n["draining"]) for n in fleet.server.nodes()],
        [(m["name"], m["replicas"]) for m in api("GET", "/api/models")],
        sorted(k["name"] for k in api("GET", "/api/keys")),
        len(api("GET", "/api/join-tokens")),
        len(api("GET", "/api/updates")),
        [[g["state"] for g in n["gpus"]] for n in api("GET", "/api/gpus")],
    )


def test_a_viewers_pages_hold_no_form_that_changes_anything_and_each_action_is_refused(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    page = signed_in(new_context, fleet, VIEWER, "/ui/")
    paths = [*nav_paths(page), "/ui/nodes/gpu-a", f"/ui/models/{MODEL}"]
    for path in paths:
        response = page.goto(fleet.url(path))
        assert response is not None and response.status == 200, path
        posts = page.locator("form[method=post]").evaluate_all(
            "forms => forms.map(f => f.getAttribute('action'))"
        )
        assert posts == ["/ui/logout"], f"{path} offers a viewer {posts}"
    before = fleet_state(fleet)
    csrf = csrf_of(page)
    for path in ACTIONS:
        answer = page.request.post(
            fleet.url(path), form={"csrf": csrf, "confirm": "gpu-a"}, max_redirects=0
        )
        assert answer.status == 403, path
        assert f"the account {VIEWER.name} is a viewer and may only read" in text_of(answer)
    assert fleet_state(fleet) == before


def test_every_action_without_the_sessions_csrf_token_is_refused(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/")
    before = fleet_state(fleet)
    for path in ACTIONS:
        for form in ({"confirm": "gpu-a"}, {"confirm": "gpu-a", "csrf": "not-the-token"}):
            answer = page.request.post(fleet.url(path), form=form, max_redirects=0)
            assert answer.status == 403, (path, form)
            assert "security token is missing or out of date" in text_of(answer), path
    assert fleet_state(fleet) == before


def test_a_post_without_its_csrf_token_or_from_another_site_is_refused(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    page = signed_in(new_context, fleet, ADMIN, "/ui/nodes/gpu-a")
    url = fleet.url("/ui/nodes/gpu-a/drain")
    for form in ({"confirm": "gpu-a"}, {"confirm": "gpu-a", "csrf": "not-the-token"}):
        answer = page.request.post(url, form=form, max_redirects=0)
        assert answer.status == 403, form
        assert "security token is missing or out of date" in text_of(answer)
    foreign = page.request.post(
        url,
        form={"confirm": "gpu-a", "csrf": csrf_of(page)},
        headers={"Origin": "http://attacker.example"},
        max_redirects=0,
    )
    assert foreign.status == 403
    assert "came from another site's page" in text_of(foreign)
    # The right token without the node's id in the confirmation field: nothing done either.
    unconfirmed = page.request.post(url, form={"csrf": csrf_of(page)}, max_redirects=0)
    assert unconfirmed.status == 303
    assert fleet.node("gpu-a")["draining"] is False
    page.reload()
    expect(page.locator("#flash")).to_contain_text("nothing done: to drain node gpu-a")
    assert fleet.node("gpu-a")["draining"] is False


def test_signing_out_ends_the_session_and_its_cookie_opens_nothing_again(
    new_context: Callable[..., BrowserContext], fleet: Fleet
) -> None:
    context = new_context()
    page = context.new_page()
    sign_in(page, fleet.server.url, VIEWER, "/ui/nodes")
    cookie = next(c for c in context.cookies() if c["name"] == "llmgw_session")
    page.click("#logout")
    expect(page).to_have_url(fleet.url("/ui/login?signed_out=1"))
    expect(page.locator("#login-notice")).to_have_text("signed out")
    assert [c for c in context.cookies() if c["name"] == "llmgw_session"] == []
    # The old cookie, put back as a thief would, is no session any more.
    context.add_cookies(
        [{"name": cookie["name"], "value": cookie["value"], "url": fleet.url("/ui/")}]
    )
    page.goto(fleet.url("/ui/nodes"))
    expect(page).to_have_url(fleet.url("/ui/login?next=%2Fui%2Fnodes&expired=1"))
    expect(page.locator("#account")).to_have_count(0)


def test_every_page_has_the_security_headers_and_cookie_flags(
    new_context: Callable[..., BrowserContext], fleet: Fleet, csp: CspViolations
) -> None:
    context = new_context()
    page = context.new_page()
    sign_in(page, fleet.server.url, ADMIN)
    cookie = next(c for c in context.cookies() if c["name"] == "llmgw_session")
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/ui/")
    paths = [*nav_paths(page), "/ui/nodes/gpu-a", f"/ui/models/{MODEL}", "/ui/no-such-page"]
    for path in paths:
        response = page.goto(fleet.url(path))
        assert response is not None
        headers = response.headers
        assert headers["content-security-policy"] == CSP, path
        assert headers["x-frame-options"] == "DENY", path
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["cache-control"] == "no-store", path
        page.wait_for_load_state("load")
        assert page.evaluate("() => document.querySelectorAll('script:not([src])').length") == 0
        assert page.evaluate("() => document.querySelectorAll('[style]').length") == 0
        # Laid out for the device's width on a phone, not for a desktop's shrunk.
        expect(page.locator("meta[name=viewport]")).to_have_attribute(
            "content", "width=device-width, initial-scale=1"
        )
    csp.assert_none()


def test_the_login_is_locked_after_repeated_wrong_passwords_and_says_when_to_retry(
    new_context: Callable[..., BrowserContext], fleet: Fleet, screenshot: Shots
) -> None:
    page = new_context().new_page()
    page.goto(fleet.url("/ui/login"))
    for attempt in range(5):
        page.fill("#login-name", GUESSED.name)
        page.fill("#login-password", f"wrong-{attempt}")
        page.click("#login-submit")
        expect(page.locator("#login-problem")).to_have_text("wrong name or password")
        expect(page.locator("#login-name")).to_have_value(GUESSED.name)
    checked(page, screenshot, "login-wrong-password", "the login page after a wrong password")
    # Locked now: the right password too is refused, and the page says for how long.
    page.fill("#login-password", GUESSED.password)
    with page.expect_response(fleet.url("/ui/login")) as answer:
        page.click("#login-submit")
    assert answer.value.status == 429
    problem = page.locator("#login-problem")
    expect(problem).to_have_text(
        re.compile(r"^too many failed sign-ins; try again in \d+ (s|min)$")
    )
    shown = int(re.findall(r"\d+", problem.inner_text())[0])
    wait = int(answer.value.headers["retry-after"])
    assert 0 < wait <= 900
    # The page says it as a person reads it: seconds under two minutes, else minutes.
    assert problem.inner_text().endswith(f"{wait} s" if wait < 120 else f"{-(-wait // 60)} min")
    assert shown == (wait if wait < 120 else -(-wait // 60))
    expect(page.locator("#account")).to_have_count(0)
    checked(page, screenshot, "login-locked", "the login page of a locked account")


def test_an_expired_session_goes_back_to_the_login_page(
    new_context: Callable[..., BrowserContext],
    tmp_path: Path,
    screenshot: Shots,
) -> None:
    server = start_server_with(tmp_path, console={"session_idle": 2, "session_lifetime": 3600})
    try:
        add_accounts(server, tmp_path, ADMIN)
        page = new_context().new_page()
        sign_in(page, server.url, ADMIN, "/ui/nodes")
        time.sleep(2.5)
        page.goto(server.url + "/ui/events")
        expect(page).to_have_url(server.url + "/ui/login?next=%2Fui%2Fevents&expired=1")
        expect(page.locator("#login-notice")).to_have_text("your session expired, sign in again")
        checked(page, screenshot, "login-expired", "the login page after a session expired")
        # Signed in again, back where it was going. Left open, the Events page's live feed
        # ends with the session and says so; a page with live parts goes to the login page
        # by itself (its next refresh finds the session ended).
        page.fill("#login-name", ADMIN.name)
        page.fill("#login-password", ADMIN.password)
        page.click("#login-submit")
        expect(page).to_have_url(server.url + "/ui/events")
        expect(page.locator("#live-status")).to_have_text(
            "Your session ended; reload the page to sign in again.", timeout=LIVE
        )
        sign_in(page, server.url, ADMIN, "/ui/nodes")
        expect(page).to_have_url(re.compile(r"/ui/login\?next=%2Fui%2Fnodes"), timeout=LIVE)
    finally:
        stop_process(server.proc)
