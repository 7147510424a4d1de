"""install without join options (Debian 12): everything is put in place, the service user
does not join the docker group that exists (root on the host; --docker is the way), and
nothing starts: the unit is skipped, by its
condition, until an identity exists. Then purge."""

from __future__ import annotations

import pytest

from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab

NODE = "dry-bare"

# Two installer runs, each bounded by Node.sh's 270 s with its own message (see test_bullseye).
pytestmark = pytest.mark.timeout(600)


def test_install_without_join_options_installs_but_starts_nothing(lab: Lab) -> None:
    node = lab.boot(systemd_image_of("bookworm"), NODE)
    folder = lab.unpack(lab.bundle_n, "bare-unpacked")
    node.sh("groupadd --system docker")
    result = node.sh(f"sh {folder}/install-agent.sh install --models-root /data/models")
    said = result.stdout + result.stderr
    # It says why it did not start and how to join later.
    assert "not started: this node has no identity yet" in said, said
    assert "--node-id, --enroll-url and --ca-hash" in said
    assert "docker" not in node.out("id -nG llmgw-agent").split()
    assert "docker:     no access" in node.out(f"sh {folder}/install-agent.sh status")
    assert node.out("/usr/local/lib/llmgw-agent/llmgw --version").startswith("llmgw ")
    assert node.out("systemctl is-enabled llmgw-agent.service") == "enabled"
    assert node.out("systemctl is-active llmgw-agent.service || true") == "inactive"
    assert not node.listening()
    dropin = node.out("cat /etc/systemd/system/llmgw-agent.service.d/10-install.conf")
    assert "-/data/models" in dropin
    assert node.out("stat -c '%U' /data/models") == "llmgw-agent"
    # A start (a boot would do the same) is skipped by ConditionPathExists, not failed.
    node.sh("systemctl start llmgw-agent.service")
    assert node.unit("ConditionResult") == "no"
    assert node.out("systemctl is-failed llmgw-agent.service || true") != "failed"
    assert not node.listening()
    status = node.out(f"sh {folder}/install-agent.sh status")
    assert "identity" in status
    node.sh(f"sh {folder}/install-agent.sh uninstall --purge")
    assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
    left = node.out("find /etc /var/lib /usr/local -name '*llmgw*' 2>/dev/null || true")
    assert left == "", left
    assert node.sh("test -d /data/models", check=False).returncode == 0  # models are never removed
