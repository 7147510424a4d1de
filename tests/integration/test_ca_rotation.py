"""CA rotation end to end: a real control plane, two live agents whose certificates the old CA
issued, ``llmgw ctl cert rotate-ca`` as an operator runs it. Both agents get the new trust
bundle over the stream and renew under the new CA without a restart; a model keeps serving
through the gateway (both mTLS hops cross the rotation); a signed update is applied by the
root helper that still trusts the old CA (the order carries the old CA's cross-certificate,
and the helper moves its trust to the new CA); the old CA is dropped; an update after the
drop is refused by a helper that never moved until the installer's root-run verb gives it
the new pin, and applied after that."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw import pki
from llmgw.contracts.update_order import REQUEST
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

NODES = ("gpu-rot-a", "gpu-rot-b")
WAIT = 60.0
MODEL = "rotated"


@dataclass
class Fleet:
    tmp: Path
    server: Server
    agents: dict[str, Agent]

    @property
    def password(self) -> str:
        return (self.server.state_dir / "admin.password").read_text().strip()

    def env(self, password: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env["XDG_CONFIG_HOME"] = str(self.tmp / "xdg")
        env["LLMGW_SERVER"] = self.server.url
        env["LLMGW_TOKEN"] = self.server.admin_token
        if password is not None:
            env["LLMGW_ADMIN_PASSWORD"] = password
        return env

    def run(self, *args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LLMGW, *args],
            env=self.env(password),
            capture_output=True,
            text=True,
            timeout=WAIT,
            stdin=subprocess.DEVNULL,
        )

    def ctl(self, *args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run("ctl", *args, password=password)

    def node(self, node_id: str) -> dict[str, Any]:
        return next(n for n in self.server.nodes() if n["id"] == node_id)

    def ca_status(self) -> dict[str, Any]:
        out = self.ctl("--json", "cert")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    # -- one node's files ------------------------------------------------------------------

    def node_cert(self, node_id: str) -> Any:
        return pki.load_cert(self.agents[node_id].dir / "pki" / "node.crt")

    def node_trust(self, node_id: str) -> list[str]:
        certs = pki.load_bundle(self.agents[node_id].dir / "pki" / "ca.crt")
        return [pki.fingerprint(c.public_key()) for c in certs]

    def spool(self, node_id: str) -> Path:
        return self.agents[node_id].dir / "state" / "update"

    def helper_dirs(self, node_id: str) -> tuple[Path, Path, Path]:
        """The root helper's trust (as the installer wrote it at install time, under the old
        CA), state and installed binary for ``node_id``."""
        base = self.tmp / f"root-{node_id}"
        trust, state, installed = base / "etc-llmgw-update", base / "state", base / "llmgw"
        if not trust.exists():
            trust.mkdir(parents=True)
            old = self.server.pki_dir / "ca.crt"
            (trust / "ca.pem").write_bytes(old.read_bytes())
            (trust / "ca-hash").write_text(pki.load_ca(self.server.pki_dir).ca_hash() + "\n")
            (trust / "node-id").write_text(node_id + "\n")
            installed.write_text("#!/bin/sh\necho 'llmgw 0.0.1'\n")
            installed.chmod(0o755)
        return trust, state, installed

    def helper(self, node_id: str) -> subprocess.CompletedProcess[str]:
        trust, state, installed = self.helper_dirs(node_id)
        return self.run(
            "agent",
            "update-apply",
            "--spool",
            str(self.spool(node_id)),
            "--trust",
            str(trust),
            "--state",
            str(state),
            "--installed-binary",
            str(installed),
        )

    def helper_pin(self, node_id: str) -> str:
        trust, _, _ = self.helper_dirs(node_id)
        return pki.fingerprint(pki.load_cert(trust / "ca.pem").public_key())

    def update(self, node_id: str) -> dict[str, Any]:
        """Order 0.0.2 (below the control plane's own release: it refuses newer ones) for
        ``node_id`` and wait until its agent spooled it."""
        sent = self.ctl(
            "update", node_id, "--version", "0.0.2", "--no-wait", password=self.password
        )
        assert sent.returncode == 0, sent.stderr
        return wait_for(  # type: ignore[no-any-return]
            lambda: (u := self.node(node_id)["update"]) and u["state"] == "spooled" and u,
            WAIT,
            what=f"{node_id} to spool its update",
        )

    def chat(self, key: str) -> None:
        client = openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert out.choices[0].message.content


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    marker = tmp_path / "installer-ran"
    make_bundle(tmp_path / "bundles", "0.0.2", marker)
    server = start_server_with(tmp_path, bundle_dir=str(tmp_path / "bundles"))
    agents = {n: make_agent(tmp_path, server, n) for n in NODES}
    f = Fleet(tmp_path, server, agents)
    try:
        for agent in agents.values():
            start_agent(agent)
        server.approve_pending(len(NODES))
        wait_for(
            lambda: all(f.node(n)["state"] == "approved" and f.node(n)["connected"] for n in NODES),
            WAIT,
            what="both nodes approved and connected",
        )
        for n in NODES:
            f.helper_dirs(n)  # as installed, under the CA of the day
        yield f
    finally:
        for agent in agents.values():
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def test_rotation_with_live_agents_and_a_signed_update_after_it(fleet: Fleet) -> None:
    f = fleet
    old = pki.load_ca(f.server.pki_dir)
    old_pin = old.ca_hash()
    for n in NODES:
        assert f.node_trust(n) == [old_pin]
    f.server.api("POST", "/api/models", {"name": MODEL, "engine": "sim", "replicas": 2})
    wait_for(
        lambda: sum(r["routable"] for r in f.server.replicas(MODEL)) == 2,
        120,
        what="two routable replicas",
    )
    key = f.server.api_key()
    f.chat(key)

    # -- rotate -------------------------------------------------------------------------------
    rotated = f.ctl("cert", "rotate-ca", "--overlap", "1h")
    assert rotated.returncode == 0, rotated.stderr
    new = pki.load_ca(f.server.pki_dir)
    new_pin = new.ca_hash()
    assert new_pin != old_pin
    assert f"rotated: the new CA is {new_pin}" in rotated.stdout
    assert f"the old CA {old_pin} is dropped" in rotated.stdout
    assert f"install-agent.sh upgrade --ca-hash {new_pin}" in rotated.stdout
    again = f.ctl("cert", "rotate-ca")
    assert again.returncode == 1
    assert "a CA rotation is under way" in again.stderr
    # Joins from now on pin the new CA, and enrolment serves it over a certificate that an
    # agent trusting only the old CA still verifies (through the cross-certificate).
    token = f.server.api("POST", "/api/join-tokens", {"node": "gpu-rot-c", "ttl": 600})
    assert token["ca_hash"] == new_pin
    ctx = ssl.create_default_context(cadata=pki.cert_pem(old.cert).decode())
    ctx.check_hostname = False
    with urllib.request.urlopen(token["enroll_url"] + "/enroll/ca", context=ctx, timeout=10) as r:
        assert r.read() == pki.cert_pem(new.cert)

    # Both live agents take the bundle (new CA first, the old one during the overlap) and
    # renew under the new CA, without a restart.
    for n in NODES:
        wait_for(
            lambda n=n: pki.issued_by(f.node_cert(n), new.cert),
            WAIT,
            what=f"{n} to renew under the new CA",
        )
        assert f.node_trust(n) == [new_pin, old_pin]
        assert f.agents[n].proc is not None and f.agents[n].proc.poll() is None
    status = wait_for(
        lambda: (s := f.ca_status()) and not s["nodes_on_previous"] and s,
        WAIT,
        what="no node left on the old CA",
    )
    assert status["current"]["ca_hash"] == new_pin
    assert status["previous"]["ca_hash"] == old_pin
    shown = f.ctl("cert")
    assert shown.returncode == 0, shown.stderr
    assert f"CA:          {new_pin}" in shown.stdout
    assert f"old CA:      {old_pin}  (trusted too; dropped " in shown.stdout
    assert "'llmgw ctl cert finish-rotation' drops the old one now" in shown.stdout
    # The gateway still reaches both data planes (new certificates on both sides).
    for _ in range(4):
        f.chat(key)
    # A node that reconnects does so with its renewed certificate.
    agent_b = f.agents[NODES[1]]
    assert agent_b.proc is not None
    stop_process(agent_b.proc)
    wait_for(lambda: not f.node(NODES[1])["connected"], WAIT)
    start_agent(agent_b)
    wait_for(lambda: f.node(NODES[1])["connected"], WAIT, what="gpu-rot-b to reconnect")

    # -- a signed update within the overlap: the helper still trusts the old CA -----------------
    a = NODES[0]
    assert f.helper_pin(a) == old_pin
    f.update(a)
    order = json.loads((f.spool(a) / REQUEST / "order.json").read_text())
    assert order["ca_pin"] == new_pin
    done = f.helper(a)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"now trusts CA {new_pin}" in done.stdout
    assert f.helper_pin(a) == new_pin
    wait_for(lambda: f.node(a)["update"]["state"] == "done", WAIT, what="done reported")

    # -- drop the old CA ---------------------------------------------------------------------------
    finished = f.ctl("cert", "finish-rotation")
    assert finished.returncode == 0, finished.stderr
    assert f"only {new_pin} is trusted now" in finished.stdout
    for name in (pki.PREVIOUS_CA_CERT, pki.PREVIOUS_CA_KEY, pki.CROSS_CERT):
        assert not (f.server.pki_dir / name).exists()
    for n in NODES:
        wait_for(lambda n=n: f.node_trust(n) == [new_pin], WAIT, what=f"{n} to drop the old CA")
    assert f.ca_status()["previous"] is None
    assert "old CA:" in f.ctl("cert").stdout and "dropped" in f.ctl("cert").stdout
    f.chat(key)
    # Both nodes reconnect under the new CA alone.
    for n in NODES:
        agent = f.agents[n]
        assert agent.proc is not None
        stop_process(agent.proc)
        start_agent(agent)
    wait_for(
        lambda: all(f.node(n)["connected"] for n in NODES), WAIT, what="both nodes to reconnect"
    )

    # -- signed updates after the rotation ----------------------------------------------------------
    # The helper that moved with the order verifies the new CA's orders directly.
    f.update(a)
    assert "ca_pin" not in json.loads((f.spool(a) / REQUEST / "order.json").read_text())
    done = f.helper(a)
    assert done.returncode == 0, done.stdout + done.stderr
    # The helper that never moved refuses: the old CA's word for the new one has expired...
    b = NODES[1]
    f.update(b)
    refused = f.helper(b)
    assert refused.returncode == 1
    assert "does not verify against the cluster CA" in refused.stderr
    assert f.helper_pin(b) == old_pin
    # ... until the installer's root-run verb gives it the new pin (what 'install-agent.sh
    # upgrade --ca-hash NEW' runs, on the agent's CA file as a candidate only).
    trust, _, _ = f.helper_dirs(b)
    candidate = f.tmp / "candidate-ca.crt"
    candidate.write_bytes((f.agents[b].dir / "pki" / "ca.crt").read_bytes())
    wrong = f.run("agent", "update-trust", "--ca", str(candidate), "--trust", str(trust))
    assert wrong.returncode != 0  # no pin given: the recorded old pin does not match
    assert f.helper_pin(b) == old_pin
    moved = f.run(
        "agent", "update-trust", "--ca", str(candidate), "--ca-hash", new_pin, "--trust", str(trust)
    )
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f.helper_pin(b) == new_pin
    f.update(b)
    done = f.helper(b)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for(lambda: f.node(b)["update"]["state"] == "done", WAIT, what="done reported")
    assert ARCH  # the bundle served is this machine's
