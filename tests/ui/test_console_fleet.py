"""The console's Add node, Approve and Update now pages in Debian's Chromium, against a real
control plane serving an agent bundle, with real agent processes: an operator makes a join
command on Add node (copied with its button), runs it as ``llmgw agent join`` for a real
agent whose GPUs are the fake nvidia-smi's, watches it enrol live, approves it on Approve (a
wrong fingerprint refused, the right one taking it online with its GPUs), then orders it a
signed update on Update now (a wrong password signing nothing) and follows its state live
to the root helper's verdict. A second node appears on the Approve page without a reload
and is rejected through the dialog that names it; a viewer sees none of the forms and its
POSTs are refused. Each page passes axe-core's check, fits a phone's width and is
photographed at both sizes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest
import yaml

from llmgw.contracts.update_order import REQUEST
from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)
from tests.tarballs import make_bundle
from tests.ui.browser import expect
from tests.ui.console_rig import (
    ADMIN,
    FIXTURES,
    LIVE,
    VIEWER,
    Shots,
    add_accounts,
    checked,
    csrf_of,
    mark,
    not_reloaded,
    sign_in,
)

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page

pytestmark = pytest.mark.integration

VERSION = "0.0.2"  # the bundle's: older than the agents, which the control plane allows
WAIT = 60.0


@dataclass
class Plane:
    """The module's control plane, the agents the tests started and the bundle it serves."""

    server: Server
    tmp: Path
    bundle: Path
    marker: Path
    agents: list[Agent] = field(default_factory=list)

    def url(self, path: str) -> str:
        return self.server.url + path

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.server.nodes() if n["id"] == node_id), None)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("console-fleet")
    marker = tmp / "installer-ran"
    bundle = make_bundle(tmp / "bundles", VERSION, marker)
    server = start_server_with(tmp, bundle_dir=str(tmp / "bundles"))
    plane = Plane(server, tmp, bundle, marker)
    try:
        add_accounts(server, tmp, ADMIN, VIEWER)
        yield plane
    finally:
        for agent in plane.agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def signed_in(new_context: Callable[..., BrowserContext], plane: Plane, path: str) -> Page:
    page = new_context(permissions=["clipboard-read", "clipboard-write"]).new_page()
    sign_in(page, plane.server.url, ADMIN, path)
    return page


def join_on(command: str, d: Path) -> str:
    """The ``llmgw agent join`` command a page showed, run as the operator would on the node
    whose config and state are in ``d`` (``llmgw`` being this checkout's); the fingerprint
    it printed."""
    words = shlex.split(command)
    assert words[0].startswith("LLMGW_JOIN_TOKEN=") and words[1:3] == ["llmgw", "agent"], words
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["LLMGW_JOIN_TOKEN"] = words[0].split("=", 1)[1]
    argv = [*LLMGW, *words[2:], "--config", str(d / "agent.yaml"), "--state-dir", str(d / "state")]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=WAIT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"^fingerprint: (sha256:[0-9a-f]{64})$", out.stdout, re.M)
    assert found, out.stdout
    return found.group(1)


def run_join(plane: Plane, command: str, node_id: str) -> tuple[Agent, str]:
    """The join command the page showed, run on a new node (:func:`join_on`, in the test's
    directory); the agent it configured, started; and the fingerprint the join printed."""
    d = plane.tmp / f"agent-{node_id}"
    config = d / "agent.yaml"
    fingerprint = join_on(command, d)
    data = yaml.safe_load(config.read_text())
    data["listen"] = "127.0.0.1:0"
    data["stop_shards_on_exit"] = True
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    agent = start_agent(Agent(node_id, d, config, 0))
    plane.agents.append(agent)
    return agent, fingerprint


def make_command(page: Page, node_id: str, **facts: str) -> str:
    """Fill the Add node form for ``node_id`` and submit it; the join command shown."""
    page.fill("#join-node", node_id)
    page.fill("#join-ttl", "30m")
    if facts:
        page.click("details summary")
        for name, value in facts.items():
            page.fill(f"#fact-{name}", value)
    page.click("#join-submit")
    expect(page.locator("#shown-once")).to_be_visible()
    return page.locator("#join-command-text").input_value()


def pending_item(page: Page, node_id: str) -> Any:
    return page.locator(f"li.pending-node[data-node='{node_id}']")


def helper(plane: Plane, agent: Agent, node_id: str) -> subprocess.CompletedProcess[str]:
    """The root helper (``llmgw agent update-apply``) on temporary directories, as the
    path unit would start it on the node once the agent has spooled the order."""
    trust = plane.tmp / f"trust-{node_id}"
    trust.mkdir(exist_ok=True)
    (trust / "ca.pem").write_bytes((plane.server.pki_dir / "ca.crt").read_bytes())
    (trust / "node-id").write_text(node_id + "\n")
    installed = plane.tmp / f"installed-{node_id}" / "llmgw"
    installed.parent.mkdir(exist_ok=True)
    installed.write_text("#!/bin/sh\necho 'llmgw 0.0.1'\n")
    installed.chmod(0o755)
    return subprocess.run(
        [
            *LLMGW,
            "agent",
            "update-apply",
            "--spool",
            str(agent.dir / "state" / "update"),
            "--trust",
            str(trust),
            "--state",
            str(plane.tmp / f"helper-state-{node_id}"),
            "--installed-binary",
            str(installed),
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )


# --------------------------------------------------------------------------- the operator path


def test_add_a_node_approve_it_by_fingerprint_and_update_it(
    new_context: Callable[..., BrowserContext], plane: Plane, screenshot: Shots
) -> None:
    node_id = "gpu-new"
    page = signed_in(new_context, plane, "/ui/add-node")
    expect(page.locator("#nav-add-node")).to_have_attribute("aria-current", "page")
    checked(page, screenshot, "fleet-add-node", "the Add node form")

    # Add node: the command and the one-liner, shown once, each with its copy button.
    command = make_command(page, node_id, nvidia_smi=str(FIXTURES / "one-gpu"))
    liner = page.locator("#one-liner-text").input_value()
    assert "sha256sum -c" in liner and "/agent/bundles/" in liner
    secret = shlex.split(command)[0].split("=", 1)[1]
    assert secret in liner
    assert f"--nvidia-smi {FIXTURES / 'one-gpu'}" in command
    page.click("#join-command-copy")
    expect(page.locator("#join-command-copy")).to_have_text("Copied")
    expect(page.locator("#join-command-copied")).to_have_text("copied to the clipboard")
    assert page.evaluate("() => navigator.clipboard.readText()") == command
    expect(page.locator("#enrol-state")).to_have_attribute("data-stage", "waiting")
    checked(page, screenshot, "fleet-add-node-command", "the join command shown once")
    # Shown once: the page that follows the enrolment does not carry it.
    followed = page.context.request.get(plane.url(f"/ui/add-node?node={node_id}"))
    assert followed.ok and secret not in followed.text()

    # The node runs it; the page sees it enrol, live, with the fingerprint the join printed.
    mark(page)
    agent, fingerprint = run_join(plane, command, node_id)
    expect(page.locator("#enrol-state")).to_have_attribute("data-stage", "pending", timeout=LIVE)
    expect(page.locator("#enrol-fingerprint")).to_have_text(fingerprint)
    assert not_reloaded(page)
    checked(page, screenshot, "fleet-add-node-pending", "Add node with the node enrolled")

    # Approve: a wrong fingerprint is refused and kept; the right one approves.
    page.click("#enrol-approve")
    expect(page).to_have_url(plane.url(f"/ui/approve?node={node_id}#pending-{node_id}"))
    item = pending_item(page, node_id)
    expect(item.locator("code.fingerprint")).to_have_text(fingerprint)
    checked(page, screenshot, "fleet-approve", "the Approve page")
    wrong = "sha256:" + "0" * 64
    item.locator("input[name=fingerprint]").fill(wrong)
    item.locator("button.approve").click()
    expect(page.locator("#problem")).to_contain_text(f"fingerprint {wrong} does not match")
    expect(pending_item(page, node_id).locator("input[name=fingerprint]")).to_have_value(wrong)
    assert (plane.node(node_id) or {})["state"] == "pending"
    checked(page, screenshot, "fleet-approve-refused", "a wrong fingerprint refused")
    field_ = pending_item(page, node_id).locator("input[name=fingerprint]")
    field_.fill(fingerprint)
    pending_item(page, node_id).locator("button.approve").click()
    expect(page).to_have_url(plane.url(f"/ui/nodes/{node_id}"))
    expect(page.locator("#flash")).to_contain_text(f"node {node_id} is approved")
    expect(page.locator("#node-state")).to_have_text("approved")
    expect(page.locator("#node-gpus tbody tr")).to_have_count(1, timeout=LIVE)
    expect(page.locator("#node-gpus")).to_contain_text("NVIDIA GeForce RTX 4090")
    events = plane.server.api("GET", f"/api/events?subject={node_id}")
    approved = [e for e in events if e["kind"] == "node_approved"]
    assert [(e["actor"], e["message"]) for e in approved] == [(ADMIN.name, f"key {fingerprint}")]

    # Update now, from the node's page: a wrong password signs nothing.
    page.click("#node-update-link")
    expect(page).to_have_url(plane.url(f"/ui/update?node={node_id}"))
    expect(page.locator("#update-node")).to_have_value(node_id)
    expect(page.locator("#update-version")).to_have_value(VERSION)
    checked(page, screenshot, "fleet-update", "the Update now page")
    page.fill("#update-password", "not my password")
    page.click("#update-submit")
    expect(page.locator("#problem")).to_contain_text(
        f"wrong password for the account {ADMIN.name!r}; nothing was signed"
    )
    expect(page.locator("#update-node")).to_have_value(node_id)  # the choice kept
    expect(page.locator("#update-password")).to_have_value("")  # the password never
    assert (plane.node(node_id) or {})["update"] is None

    page.fill("#update-password", ADMIN.password)
    page.click("#update-submit")
    expect(page.locator("#flash")).to_contain_text(f"update to {VERSION} signed and ordered")
    row = page.locator(f"#updates tr[data-node='{node_id}']")
    mark(page)
    expect(row).to_have_attribute("data-state", "spooled", timeout=LIVE + WAIT * 1000)
    assert (agent.dir / "state" / "update" / REQUEST / "order.sig").exists()
    checked(page, screenshot, "fleet-update-spooled", "an update spooled on the node")
    done = helper(plane, agent, node_id)
    assert done.returncode == 0, done.stdout + done.stderr
    expect(row).to_have_attribute("data-state", "done", timeout=LIVE + WAIT * 1000)
    expect(row).to_contain_text(f"upgraded to {VERSION}")
    assert not_reloaded(page)
    assert plane.marker.exists()
    checked(page, screenshot, "fleet-update-done", "an update done")
    ordered = [
        e
        for e in plane.server.api("GET", f"/api/events?subject={node_id}")
        if e["kind"] == "update_ordered"
    ]
    assert [e["actor"] for e in ordered] == [ADMIN.name]


def test_a_new_node_appears_on_approve_live_and_is_rejected_through_the_dialog(
    new_context: Callable[..., BrowserContext], plane: Plane, screenshot: Shots
) -> None:
    node_id = "gpu-late"
    page = signed_in(new_context, plane, "/ui/approve")
    mark(page)
    maker = signed_in(new_context, plane, "/ui/add-node")
    command = make_command(maker, node_id, nvidia_smi=str(FIXTURES / "one-gpu"))
    _agent, fingerprint = run_join(plane, command, node_id)

    item = pending_item(page, node_id)
    expect(item.locator("code.fingerprint")).to_have_text(fingerprint, timeout=LIVE)
    assert not_reloaded(page)
    # A half-typed fingerprint survives the next refresh of the list.
    item.locator("input[name=fingerprint]").fill("sha256:12")
    page.locator("h1").click()  # out of the field: the refresh may run
    item.evaluate("el => { el.llmgwOld = true }")
    page.wait_for_function(
        f"() => !document.querySelector(\"li[data-node='{node_id}']\").llmgwOld",
        timeout=LIVE,
    )  # the list was replaced by a refresh
    expect(item.locator("input[name=fingerprint]")).to_have_value("sha256:12")

    asked: list[str] = []

    def dismiss(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    item.locator("button.reject").click()
    assert asked == [
        f"Reject node {node_id}? Its certificate is denied and its record removed; it can "
        "join again only with a new token."
    ]
    assert (plane.node(node_id) or {})["state"] == "pending"
    page.once("dialog", lambda dialog: dialog.accept())
    pending_item(page, node_id).locator("button.reject").click()
    expect(page.locator("#flash")).to_contain_text(f"node {node_id} is rejected")
    expect(pending_item(page, node_id)).to_have_count(0)
    assert plane.node(node_id) is None
    checked(page, screenshot, "fleet-approve-empty", "the Approve page with nothing pending")


def test_rekey_and_repair_a_node_from_its_page(
    new_context: Callable[..., BrowserContext], plane: Plane, screenshot: Shots
) -> None:
    node_id = "gpu-keys"
    maker = signed_in(new_context, plane, "/ui/add-node")
    agent, first = run_join(
        plane, make_command(maker, node_id, nvidia_smi=str(FIXTURES / "one-gpu")), node_id
    )
    plane.server.approve(node_id)
    page = signed_in(new_context, plane, f"/ui/nodes/{node_id}")
    expect(page.locator("#node-fingerprint")).to_have_text(first)

    # Rekey, behind the dialog that names the node: dismissed, nothing is made.
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("#button-rekey")
    assert asked == [
        f"Rekey node {node_id}? A one-time token and the command to run on the node are "
        "shown next; the node keeps its uid, history and replicas with a new key."
    ]
    assert rekey_tokens(plane, node_id) == []
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#button-rekey")
    expect(page.locator("#made-heading")).to_have_text(f"Rekey node {node_id}")
    expect(page.locator("#shown-once")).to_be_visible()
    liner = page.locator("#one-liner-text").input_value()
    command = page.locator("#join-command-text").input_value()
    assert f"install-agent.sh rekey --node-id {node_id} " in liner
    assert command.endswith(" --rekey")
    secret = shlex.split(command)[0].split("=", 1)[1]
    assert secret in liner
    assert [(t["kind"], t["lost_state"]) for t in rekey_tokens(plane, node_id)] == [
        ("rekey", False)
    ]
    checked(page, screenshot, "fleet-node-rekey", "a node's rekey command, shown once")
    followed = page.context.request.get(plane.url(f"/ui/nodes/{node_id}"))
    assert followed.ok and secret not in followed.text()  # shown once

    # The node runs it and restarts with its new key: approved still, online, live.
    mark(page)
    second = join_on(command, agent.dir)
    assert second != first
    assert agent.proc is not None
    stop_process(agent.proc)
    start_agent(agent)
    expect(page.locator("#node-fingerprint")).to_have_text(second, timeout=LIVE)
    expect(page.locator("#node-state")).to_have_text("approved")
    wait_for(
        lambda: (plane.node(node_id) or {}).get("connected") is True,
        timeout=WAIT,
        what=f"{node_id} connected with its new key",
    )
    assert not_reloaded(page)

    # Re-pair: its state directory is lost. The command names the uid it keeps; the node
    # waits for approval again, which the page shows live, and is approved by fingerprint.
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#button-repair")
    assert asked[-1] == (
        f"Re-pair node {node_id}? Only for a node whose state directory is lost: it gets a "
        "new key, keeps its record and must be approved again; its old certificates are "
        "revoked."
    )
    expect(page.locator("#made-heading")).to_have_text(f"Re-pair node {node_id}")
    command = page.locator("#join-command-text").input_value()
    uid = (plane.node(node_id) or {})["uid"]
    assert command.endswith(f" --node-uid {uid}")
    checked(page, screenshot, "fleet-node-repair", "a node's re-pair command, shown once")
    stop_process(agent.proc)
    shutil.rmtree(agent.dir)
    mark(page)
    agent, third = run_join(plane, command, node_id)
    expect(page.locator("#node-state")).to_have_text("pending", timeout=LIVE)
    expect(page.locator("#node-fingerprint")).to_have_text(third)
    assert not_reloaded(page)
    page.click("#node-approve")
    item = pending_item(page, node_id)
    item.locator("input[name=fingerprint]").fill(third)
    item.locator("button.approve").click()
    expect(page).to_have_url(plane.url(f"/ui/nodes/{node_id}"))
    expect(page.locator("#node-state")).to_have_text("approved")
    assert (plane.node(node_id) or {})["uid"] == uid
    kinds = [
        (e["kind"], e["actor"])
        for e in plane.server.api("GET", f"/api/events?subject={node_id}")
        if e["kind"] in ("join_token_created", "node_rekeyed", "node_repaired")
    ]
    assert kinds == [
        ("node_repaired", ""),
        ("join_token_created", ADMIN.name),
        ("node_rekeyed", ""),
        ("join_token_created", ADMIN.name),
        ("join_token_created", ADMIN.name),
    ]


def rekey_tokens(plane: Plane, node_id: str) -> list[dict[str, Any]]:
    tokens = plane.server.api("GET", "/api/join-tokens?all=1")
    return [t for t in tokens if t["node"] == node_id and t["kind"] == "rekey"]


def test_a_viewer_sees_no_form_and_its_posts_are_refused(
    new_context: Callable[..., BrowserContext], plane: Plane
) -> None:
    page = new_context().new_page()
    sign_in(page, plane.server.url, VIEWER, "/ui/add-node")
    expect(page.locator("#viewer-note")).to_be_visible()
    expect(page.locator("#join-form")).to_have_count(0)
    page.goto(plane.url("/ui/update"))
    expect(page.locator("#viewer-note")).to_be_visible()
    expect(page.locator("#update-form")).to_have_count(0)
    page.goto(plane.url("/ui/approve"))
    expect(page.locator("form[action$='/approve']")).to_have_count(0)
    csrf = csrf_of(page)
    for path, form in (
        ("/ui/add-node", {"node": "gpu-viewer", "ttl": "1h"}),
        ("/ui/update", {"target": "all", "version": VERSION, "password": VIEWER.password}),
        (f"/ui/nodes/{quote('gpu-new')}/approve", {"fingerprint": "sha256:" + "0" * 64}),
        (f"/ui/nodes/{quote('gpu-new')}/rekey", {"confirm": "gpu-new"}),
        (f"/ui/nodes/{quote('gpu-new')}/repair", {"confirm": "gpu-new"}),
    ):
        answer = page.context.request.post(
            plane.url(path), form={"csrf": csrf, **form}, headers={"Origin": plane.server.url}
        )
        assert answer.status == 403, (path, answer.status)
        assert "is a viewer and may only read" in answer.text()
    # Without the CSRF token, an admin's session is refused too.
    admin = signed_in(new_context, plane, "/ui/add-node")
    answer = admin.context.request.post(
        plane.url("/ui/add-node"),
        form={"node": "gpu-forged", "ttl": "1h"},
        headers={"Origin": plane.server.url},
    )
    assert answer.status == 403 and "security token is missing" in answer.text()
    tokens = plane.server.api("GET", "/api/join-tokens?all=1")
    assert not [t for t in tokens if t["node"] in ("gpu-viewer", "gpu-forged")]
