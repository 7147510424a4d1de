"""Debian 11 (systemd 247, glibc 2.31: the oldest target): install with the one-liner, join,
the installer again with a node fact and the firewall (ufw) for the gateway and the
multi-node range, serve through the gateway, upgrade N -> N+1, purge."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab, next_version

NODE = "dry-11"
MODEL = "dry11"

# Each step bounds itself and says what it waited for (Node.sh 270 s, wait_routable 120 s):
# pytest's 300 s for the whole scenario fired first on a loaded machine, inside the second
# install, with a stack trace instead of the step's message (issue 37).
pytestmark = pytest.mark.timeout(1200)


def test_bullseye_install_serve_upgrade_purge(lab: Lab, bundle_next: Path) -> None:
    assert lab.server is not None
    node = lab.boot(systemd_image_of("bullseye"), NODE)
    assert node.out("systemctl --version | head -n 1").startswith("systemd 247")
    # 1. the one-liner: bundle from the control plane, join, start, listen
    join = lab.join_command(NODE)
    node.sh(join["command"])
    assert node.listening(), node.journal()
    assert node.unit_findings() == []
    assert node.out("readlink /usr/local/bin/llmgw") == "/usr/local/lib/llmgw-agent/llmgw"
    # 1b. the installer again on systemd 247, ufw active: a node fact into agent.yaml, :9443
    # from the gateway and the multi-node range from the fabric's network
    installer = lab.unpack(lab.bundle_n, "n-bullseye") + "/install-agent.sh"
    node.sh("ufw --force enable >/dev/null")
    node.sh(
        f"sh {installer} install --ib-root /sys/class/infiniband --firewall-from {lab.gateway} "
        "--fabric-peers 10.99.0.0/16"
    )
    assert "  ib_root: /sys/class/infiniband" in node.out("cat /etc/llmgw/agent.yaml")
    rules = node.out("ufw status")
    assert "29500:29999/tcp" in rules and "10.99.0.0/16" in rules, rules
    status = node.out(f"sh {installer} status")
    assert "ib-root:    /sys/class/infiniband" in status, status
    assert node.listening(), node.journal()
    # 2. approve, a sim shard serving through the gateway
    lab.approve(NODE)
    lab.deploy(MODEL)
    key = lab.server.api_key("dryrun-11")
    lab.wait_routable(MODEL, NODE)
    lab.complete(MODEL, key)
    # 3. upgrade N -> N+1, identity kept
    identity = node.out("sha256sum /var/lib/llmgw-agent/node.key /etc/llmgw/agent.yaml")
    folder = lab.unpack(bundle_next, "next-bullseye")
    node.sh(f"sh {folder}/install-agent.sh upgrade")
    assert node.version() == f"llmgw {next_version(lab.version)}"
    assert node.out("sha256sum /var/lib/llmgw-agent/node.key /etc/llmgw/agent.yaml") == identity
    lab.wait_routable(MODEL, NODE)
    lab.complete(MODEL, key)
    # 4. purge: nothing of llmgw left but the models
    node.sh(f"sh {folder}/install-agent.sh uninstall --purge")
    assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
    left = node.out("find /etc /var/lib /usr/local -name '*llmgw*' 2>/dev/null || true")
    assert left == "", left
    assert node.sh("test -d /srv/llmgw/models", check=False).returncode == 0
