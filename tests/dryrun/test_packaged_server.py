"""A control plane installed from packages gives a working Add node: on a Debian 12 machine
under systemd, 'apt-get install llmgw-server' from the signed repository (scripts/repo.sh)
brings the llmgw-agent-bundles package it recommends; the control plane serves the packaged
bundle at /agent/bundles with that file's SHA-256; 'llmgw ctl join-command' (the API behind
the console's Add node) prints the one-liner, and on a second machine the one-liner downloads,
checks and installs the bundle and joins the node to that control plane.
"""

from __future__ import annotations

import json
import re

import pytest

from llmgw.contracts.paths import PACKAGED_BUNDLE_DIR
from tests.integration.harness import wait_for
from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab, Node

CP = "dry-pkg-cp"
NODE = "dry-pkg-node"

# About 45 s: two containers, the packages' install, the one-liner's.
pytestmark = pytest.mark.timeout(600)


def install_server(lab: Lab, cp: Node) -> None:
    """The signed repository as an operator adds it, then the control plane's package alone:
    apt brings llmgw-agent (a dependency) and llmgw-agent-bundles (recommended)."""
    _url, key = lab.serve_repo(cp)
    cp.sh(
        f"cp {key} /usr/share/keyrings/llmgw.gpg && "
        f"cp {key.removesuffix('llmgw.gpg')}llmgw.list /etc/apt/sources.list.d/llmgw.list"
    )
    cp.sh("apt-get update -q >/dev/null && apt-get install -y -q llmgw-server >/dev/null")
    for package in ("llmgw-server", "llmgw-agent", "llmgw-agent-bundles"):
        assert cp.out(f"dpkg-query -W -f '${{Status}}' {package}") == "install ok installed"
    cp.sh("systemctl enable --now llmgw-server.service")
    cp.container.wait_for(
        "curl -fsS http://127.0.0.1:8080/healthz >/dev/null", "llmgw-server /healthz", 60
    )


def test_apt_install_llmgw_server_serves_the_packaged_bundle_and_its_one_liner_joins(
    lab: Lab,
) -> None:
    image = systemd_image_of("bookworm")
    cp = lab.boot(image, CP)
    install_server(lab, cp)

    # The packaged bundle, served with its own SHA-256; nothing was copied into bundle_dir.
    name = f"llmgw-agent-{lab.version}-linux-x64.tar.gz"
    packaged = f"{PACKAGED_BUNDLE_DIR}/{name}"
    sha256 = cp.out(f"sha256sum {packaged}").split()[0]
    assert cp.sh("ls /var/lib/llmgw/bundles 2>/dev/null", check=False).stdout.strip() == ""
    listing = json.loads(cp.out("curl -fsS http://127.0.0.1:8080/agent/bundles"))
    assert [(b["rid"], b["version"], b["sha256"]) for b in listing] == [
        ("linux-x64", lab.version, sha256)
    ]
    served = cp.out(
        "curl -fsS http://127.0.0.1:8080/agent/bundles/linux-x64.tar.gz | sha256sum"
    ).split()[0]
    assert served == sha256

    # Add node's one-liner, for an address the new machine reaches the control plane at.
    join = json.loads(cp.out(f"llmgw ctl --json join-command --node {NODE} --address {cp.ip}"))
    command = join["command"]
    assert f"http://{cp.ip}:8080/agent/bundles/" in command, command
    assert sha256 in command and "install-agent.sh install" in command, command

    # Pasted on a new machine: it downloads and checks the bundle, installs and joins.
    node = lab.boot(image, NODE)
    ran = node.sh(command)
    assert re.search(r"agent\.tar\.gz: OK", ran.stdout + ran.stderr), ran.stdout + ran.stderr
    assert node.listening(), node.journal()

    def joined() -> dict[str, object] | None:
        nodes = json.loads(cp.out("llmgw ctl --json nodes"))
        return next((n for n in nodes if n["id"] == NODE and n["connected"]), None)

    seen = wait_for(
        joined, what=f"{NODE} connected to the packaged control plane", timeout=60, interval=1
    )
    assert seen["state"] == "pending", seen
