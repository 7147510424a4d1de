"""Signed self-updates end to end (DESIGN §7), up to the installer: a real control plane
serving a bundle, a real agent, ``llmgw ctl update`` as an operator runs it (admin password
in LLMGW_ADMIN_PASSWORD), the agent downloading and spooling, and the root helper
``llmgw agent update-apply`` run on temporary directories with a test bundle whose
install-agent.sh only records that it ran (the real installer is tested by the dry run).
The helper's verdict travels back over the stream into ``llmgw ctl nodes``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llmgw.contracts.update_order import REQUEST, verify_order
from llmgw.updater.apply import read_counter
from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)
from tests.tarballs import ARCH, make_bundle

pytestmark = pytest.mark.integration

NODE = "gpu-upd"
WAIT = 60.0


@dataclass
class Cluster:
    tmp: Path
    server: Server
    agent: Agent
    bundle: Path
    marker: Path

    @property
    def password(self) -> str:
        return (self.server.state_dir / "admin.password").read_text().strip()

    @property
    def spool(self) -> Path:
        return self.agent.dir / "state" / "update"

    def env(self, password: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env["XDG_CONFIG_HOME"] = str(self.tmp / "xdg")
        env["LLMGW_SERVER"] = self.server.url
        env["LLMGW_TOKEN"] = self.server.admin_token
        if password is not None:
            env["LLMGW_ADMIN_PASSWORD"] = password
        return env

    def ctl(self, *args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LLMGW, "ctl", *args],
            env=self.env(password),
            capture_output=True,
            text=True,
            timeout=WAIT,
            stdin=subprocess.DEVNULL,
        )

    def node(self) -> dict[str, Any]:
        return next(n for n in self.server.nodes() if n["id"] == NODE)

    def helper(self, trust: Path, state: Path, installed: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *LLMGW,
                "agent",
                "update-apply",
                "--spool",
                str(self.spool),
                "--trust",
                str(trust),
                "--state",
                str(state),
                "--installed-binary",
                str(installed),
            ],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    marker = tmp_path / "installer-ran"
    bundle = make_bundle(tmp_path / "bundles", "0.0.2", marker)
    server = start_server_with(tmp_path, bundle_dir=str(tmp_path / "bundles"))
    agent = make_agent(tmp_path, server, NODE)
    start_agent(agent)
    c = Cluster(tmp_path, server, agent, bundle, marker)
    try:
        server.approve_pending(1)
        wait_for(lambda: c.node()["connected"] and c.node()["state"] == "approved", WAIT)
        yield c
    finally:
        assert agent.proc is not None
        stop_process(agent.proc)
        stop_process(server.proc)


def trust_dir(c: Cluster, node_id: str = NODE) -> Path:
    """What the installer writes at install time: the cluster CA and the node id."""
    trust = c.tmp / "etc-llmgw-update"
    trust.mkdir(exist_ok=True)
    (trust / "ca.pem").write_bytes((c.server.pki_dir / "ca.crt").read_bytes())
    (trust / "node-id").write_text(node_id + "\n")
    return trust


def installed_binary(c: Cluster, version: str) -> Path:
    path = c.tmp / "installed" / "llmgw"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'llmgw {version}'\n")
    path.chmod(0o755)
    return path


def update_of(c: Cluster) -> dict[str, Any] | None:
    return c.node()["update"]  # type: ignore[no-any-return]


def test_the_admin_password_is_made_at_first_start(cluster: Cluster) -> None:
    path = cluster.server.state_dir / "admin.password"
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(cluster.password) >= 20
    db = (cluster.server.state_dir / "llmgw.db").read_bytes()
    assert cluster.password.encode() not in db


def test_a_wrong_password_or_version_signs_nothing(cluster: Cluster) -> None:
    wrong = cluster.ctl("update", NODE, "--version", "0.0.2", password="not the password")
    assert wrong.returncode == 1, wrong
    assert "wrong admin password; nothing was signed" in wrong.stderr
    # A release newer than the control plane's own: refused, whatever bundles it has.
    newer = cluster.ctl("update", NODE, "--version", "9.9.9", password=cluster.password)
    assert newer.returncode == 1
    assert "version 9.9.9 is newer than this control plane (llmgw " in newer.stderr
    assert "upgrade the control plane to 9.9.9 or later first" in newer.stderr
    missing = cluster.ctl("update", NODE, "--version", "0.0.9", password=cluster.password)
    assert missing.returncode == 1
    assert "does not serve version 0.0.9" in missing.stderr
    assert f"it serves 0.0.2 (linux-{ARCH})" in missing.stderr
    none = cluster.ctl("update", NODE, "--version", "0.0.2")
    assert none.returncode == 2
    assert "set LLMGW_ADMIN_PASSWORD" in none.stderr
    assert update_of(cluster) is None
    assert cluster.server.api("GET", "/api/updates") == []
    assert not os.path.lexists(cluster.spool / REQUEST)
    # The next good order is counter 1: the refusals spent none.
    ok = cluster.ctl("update", NODE, "--version", "0.0.2", "--no-wait", password=cluster.password)
    assert ok.returncode == 0, ok.stderr
    assert wait_for(lambda: update_of(cluster), WAIT)["counter"] == 1


def test_an_update_is_spooled_applied_and_reported(cluster: Cluster) -> None:
    c = cluster
    sent = c.ctl("update", NODE, "--version", "0.0.2", "--no-wait", password=c.password)
    assert sent.returncode == 0, sent.stderr
    assert "0.0.2" in sent.stdout
    wait_for(
        lambda: (update_of(c) or {}).get("state") == "spooled", WAIT, what="the agent to spool"
    )
    request = c.spool / REQUEST
    # The agent's request: the bundle it downloaded (the one served) and the signed order.
    assert (request / "bundle.tar.gz").read_bytes() == c.bundle.read_bytes()
    order = verify_order(
        (c.server.pki_dir / "ca.crt").read_bytes(),
        (request / "order.json").read_bytes(),
        (request / "order.sig").read_bytes(),
    )
    assert order["node_id"] == NODE
    assert order["version"] == "0.0.2"
    assert order["counter"] == 1
    assert order["arch"] == ARCH
    assert order["sha256"] == hashlib.sha256(c.bundle.read_bytes()).hexdigest()
    assert order["url"].endswith(f"/agent/bundles/linux-{ARCH}.tar.gz")
    # The path unit would start the helper now; it runs as root on the node.
    state = c.tmp / "helper-state"
    done = c.helper(trust_dir(c), state, installed_binary(c, "0.0.1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert c.marker.read_text().strip() == "upgrade"
    assert read_counter(state) == 1
    assert not os.path.lexists(request)
    update = wait_for(
        lambda: (u := update_of(c)) and u["state"] == "done" and u, WAIT, what="done reported"
    )
    assert update["message"] == "upgraded to 0.0.2"
    table = c.ctl("nodes")
    assert table.returncode == 0, table.stderr
    assert "UPDATE" in table.stdout.splitlines()[0]
    assert "0.0.2 done" in table.stdout
    listed = json.loads(c.ctl("--json", "nodes").stdout)
    assert listed[0]["update"]["state"] == "done"
    assert listed[0]["update"]["counter"] == 1

    # A second order, waited for by 'ctl update', is refused by the helper: the installed
    # agent is newer than the order (a downgrade).
    c.marker.unlink()
    waiting = subprocess.Popen(
        [*LLMGW, "ctl", "update", NODE, "--version", "0.0.2", "--timeout", "60"],
        env=c.env(c.password),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # ctl's progress, read as it comes: the helper runs only once ctl has said 'spooled'
    # (it polls each second, and a helper run between two polls would hide that state).
    said: list[str] = []
    reader = threading.Thread(
        target=lambda: said.extend(iter(waiting.stderr.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        wait_for(lambda: os.path.isdir(request), WAIT, what="the second request")
        wait_for(
            lambda: any(f"{NODE}: 0.0.2 spooled" in line for line in said),
            WAIT,
            what="ctl update saying the order is spooled",
        )
        refused = c.helper(trust_dir(c), state, installed_binary(c, "0.0.3"))
        assert refused.returncode == 1
        assert "older than the installed 0.0.3" in refused.stderr
        out = waiting.stdout.read()  # type: ignore[union-attr]
        waiting.wait(timeout=WAIT)
        reader.join(timeout=WAIT)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    err = "".join(said)
    assert waiting.returncode == 1, (out, err)
    assert f"{NODE}: 0.0.2 spooled" in err  # its progress while it waited
    assert f"{NODE}: 0.0.2 refused: version 0.0.2 is older than the installed 0.0.3" in err
    assert "refused" in out
    assert not c.marker.exists()
    assert read_counter(state) == 1
    assert "0.0.2 refused" in c.ctl("nodes").stdout
    assert update_of(c)["counter"] == 2  # type: ignore[index]


def test_an_order_for_an_offline_node_is_delivered_when_it_reconnects(cluster: Cluster) -> None:
    c = cluster
    assert c.agent.proc is not None
    stop_process(c.agent.proc)
    wait_for(lambda: not c.node()["connected"], WAIT, what="the node to disconnect")
    sent = c.ctl("update", NODE, "--version", "0.0.2", "--no-wait", password=c.password)
    assert sent.returncode == 0, sent.stderr
    assert update_of(c)["state"] == "queued"  # type: ignore[index]
    assert not os.path.lexists(c.spool / REQUEST)
    start_agent(c.agent)
    wait_for(lambda: (update_of(c) or {}).get("state") == "spooled", WAIT, what="delivery")
    assert (c.spool / REQUEST / "bundle.tar.gz").read_bytes() == c.bundle.read_bytes()


def test_a_spooled_request_makes_the_next_order_busy(cluster: Cluster) -> None:
    c = cluster
    assert (
        c.ctl("update", NODE, "--version", "0.0.2", "--no-wait", password=c.password).returncode
        == 0
    )
    wait_for(lambda: (update_of(c) or {}).get("state") == "spooled", WAIT)
    second = c.ctl("update", "--all", "--version", "0.0.2", password=c.password)
    assert second.returncode == 1
    assert "busy" in second.stdout
    assert "is still waiting for the update helper" in second.stdout
    update = update_of(c)
    assert update is not None and (update["counter"], update["state"]) == (2, "busy")


def test_the_admin_password_is_changed_with_the_old_one(cluster: Cluster) -> None:
    c = cluster
    first = c.password

    def change(old: str, new: str) -> subprocess.CompletedProcess[str]:
        env = c.env(old)
        env["LLMGW_NEW_ADMIN_PASSWORD"] = new
        return subprocess.run(
            [*LLMGW, "ctl", "admin", "password"],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT,
            stdin=subprocess.DEVNULL,
        )

    wrong = change("not the password", "a much better password")
    assert wrong.returncode == 1
    assert "wrong admin password" in wrong.stderr
    short = change(first, "short")
    assert short.returncode == 1
    assert "at least 12 characters" in short.stderr
    assert (c.server.state_dir / "admin.password").exists()
    done = change(first, "a much better password")
    assert done.returncode == 0, done.stderr
    assert "admin password changed" in done.stdout
    assert not (c.server.state_dir / "admin.password").exists()
    old = c.ctl("update", NODE, "--version", "0.0.2", "--no-wait", password=first)
    assert old.returncode == 1
    assert "wrong admin password" in old.stderr
    new = c.ctl(
        "update", NODE, "--version", "0.0.2", "--no-wait", password="a much better password"
    )
    assert new.returncode == 0, new.stderr
