"""The user-data 'llmgw ctl join-command --cloud-init' prints, booted for real: a Debian 12
systemd container with Debian's cloud-init, its NoCloud seed holding that user-data, first
boot after 'cloud-init clean'. With --auto-approve the node installs, joins and comes online
by itself, approved by its token (the event names it); without, it installs, joins and waits
pending until an operator approves it by fingerprint. Afterwards the token file is gone and
the token is in no process's command line, only in cloud-init's own root-only copy of the
user-data."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.harness import wait_for

from .lab import MOUNT, Lab, Node, cloud_init_image, run

TOKEN_FILE = "/run/llmgw-join-token"


def first_boot(lab: Lab, node_id: str, user_data: str) -> Node:
    """A machine booting into the fleet: the seed in place, cloud-init cleaned, restarted;
    returns once cloud-init has finished (its status printed on failure)."""
    node = lab.boot(cloud_init_image(), node_id)
    seed = lab.dir / f"seed-{node_id}"
    seed.mkdir()
    (seed / "user-data").write_text(user_data)
    (seed / "meta-data").write_text(f"instance-id: {node_id}-1\nlocal-hostname: {node_id}\n")
    node.sh(
        # The seed as root-only as cloud-init's own copies (a real one is an ISO or a URL).
        "mkdir -p -m 0700 /var/lib/cloud/seed/nocloud && "
        f"install -m 0600 {MOUNT}/seed-{node_id}/user-data {MOUNT}/seed-{node_id}/meta-data "
        "/var/lib/cloud/seed/nocloud/ && cloud-init clean --logs"
    )
    run("docker", "restart", "-t", "5", node.container.name)
    assert node.container.wait_booted(120), node.container.journal()
    waited = node.sh("timeout 600 cloud-init status --wait --long", check=False, timeout=660)
    status = waited.stdout + waited.stderr
    assert "status: done" in status, (
        status + "\n" + node.sh("tail -n 60 /var/log/cloud-init-output.log", check=False).stdout
    )
    return node


def user_data(lab: Lab, node_id: str, *extra: str) -> str:
    printed = lab.ctl("join-command", "--node", node_id, "--cloud-init", *extra).stdout
    assert printed.startswith("#cloud-config\n"), printed
    return printed


def token_of(lab: Lab, node_id: str) -> dict[str, Any]:
    assert lab.server is not None
    [token] = [t for t in lab.server.api("GET", "/api/join-tokens?all=1") if t["node"] == node_id]
    return token  # type: ignore[no-any-return]


def check_token_gone(node: Node, data: str) -> None:
    secret = next(line.strip() for line in data.splitlines() if "llmgwjt_" in line)
    assert node.sh(f"test -e {TOKEN_FILE}", check=False).returncode != 0, "token file left"
    # In no process's command line, and on disk only in cloud-init's copies (root only).
    cmdlines = node.sh("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", check=False)
    assert secret not in cmdlines.stdout
    holders = node.out(
        f"grep -rlF -D skip {secret} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
        "--exclude-dir=lab "
        "2>/dev/null || true"
    ).split()
    assert holders and all(path.startswith("/var/lib/cloud/") for path in holders), holders
    for path in holders:
        assert node.out(f"stat -c '%a %U' {path}") in ("600 root", "400 root"), path


def test_auto_approve_user_data_brings_the_machine_online_on_first_boot(lab: Lab) -> None:
    node_id = "dry-ci-auto"
    data = user_data(lab, node_id, "--auto-approve")
    node = first_boot(lab, node_id, data)
    online = wait_for(
        lambda: (
            (n := lab.node_state(node_id)) and n["connected"] and n["state"] == "approved" and n
        ),
        what=f"{node_id} online and approved",
        timeout=120,
    )
    assert node.listening()
    token = token_of(lab, node_id)
    assert token["auto_approve"] and token["used_at"]
    assert token["approved_fingerprint"] == online["fingerprint"]
    assert lab.server is not None
    events = lab.server.api("GET", f"/api/events?subject={node_id}")
    [approved] = [e for e in events if e["kind"] == "node_approved"]
    assert approved["actor"] == f"auto-approve:{token['id']}"
    assert online["fingerprint"] in approved["message"]
    check_token_gone(node, data)


def test_without_auto_approve_the_machine_waits_for_the_normal_approval(lab: Lab) -> None:
    node_id = "dry-ci-pending"
    data = user_data(lab, node_id, "--ttl", "2h")
    node = first_boot(lab, node_id, data)
    pending = wait_for(
        lambda: (n := lab.node_state(node_id)) and n["connected"] and n,
        what=f"{node_id} connected",
        timeout=120,
    )
    assert pending["state"] == "pending", pending
    assert node.sh("test -x /usr/local/lib/llmgw-agent/llmgw").returncode == 0
    check_token_gone(node, data)
    lab.approve(node_id)
    wait_for(
        lambda: (n := lab.node_state(node_id)) and n["state"] == "approved" and n["connected"],
        what=f"{node_id} approved",
        timeout=60,
    )
    log = node.out("cat /var/log/cloud-init-output.log")
    assert "agent.tar.gz: OK" in log, log[-2000:]
    assert json.loads(node.out("cloud-init status --format json"))["status"] == "done"
