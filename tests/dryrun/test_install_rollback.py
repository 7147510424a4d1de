"""A failed fresh install leaves the host as it found it (Debian 12, one container for the
module): the one-liner with its bundle URL unreachable changes nothing; a join the control
plane refuses, after the user, folders, units and binary were put in place, takes them all
back; so does an agent that does not come up after a good join (its identity too). A failed
re-run over a working install removes only what that run added, never the install. The same
for 'package' from the signed apt repository: a refused join after the package went in
purges the package with the rest; a failed re-run over a package install keeps it."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator

import pytest

from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab, Node

NODE = "dry-rollback"
PACKAGE_NODE = "dry-rollback-pkg"
INSTALLER = "install-agent.sh"
# What an install makes, and what the host has of llmgw before one: nothing.
LLMGW_PATHS = (
    "find /etc /var/lib /usr/local /srv /run -xdev \\( -name '*llmgw*' -o -path /srv/data \\)"
    " -print 2>/dev/null | sort"
)


@pytest.fixture(scope="module")
def node(lab: Lab) -> Iterator[Node]:
    booted = lab.boot(systemd_image_of("bookworm"), NODE)
    yield booted


@pytest.fixture(scope="module")
def folder(lab: Lab) -> str:
    return lab.unpack(lab.bundle_n, "rollback-unpacked")


def host_state(node: Node) -> dict[str, str]:
    """What a llmgw install would change here, as text to compare before and after."""
    return {
        "paths": node.out(LLMGW_PATHS),
        "passwd": node.out("getent passwd llmgw-agent || true"),
        "group": node.out("getent group llmgw-agent || true"),
        "units": node.out(
            "systemctl list-unit-files --no-legend 'llmgw*' | awk '{print $1, $2}' || true"
        ),
        "wants": node.out("find /etc/systemd/system -name '*llmgw*' | sort"),
        "linger": node.out("ls /var/lib/systemd/linger 2>/dev/null || true"),
        "link": node.out("ls -l /usr/local/bin/llmgw 2>/dev/null || true"),
        "running": node.out("pgrep -u llmgw-agent -a 2>/dev/null || true"),
        # What the package and its repository add outside the folders above.
        "package": node.out(
            "dpkg-query -W -f '${db:Status-Status}' llmgw-agent 2>/dev/null || true"
        ),
        "packaged": node.out(
            "ls -d /usr/bin/llmgw /usr/lib/llmgw /usr/lib/sysusers.d/llmgw-agent.conf "
            "/usr/share/keyrings/llmgw.* /lib/systemd/system/llmgw* 2>/dev/null || true"
        ),
    }


def join_args(join: dict[str, str], node_id: str = NODE) -> str:
    return shlex.join(
        ["--node-id", node_id, "--enroll-url", join["enroll_url"], "--ca-hash", join["ca_hash"]]
    )


def test_a_clean_host_has_nothing_of_llmgw(node: Node) -> None:
    state = host_state(node)
    assert state["paths"] == "" and state["passwd"] == "" and state["units"] == "", state


def test_the_one_liner_with_its_bundle_unreachable_changes_nothing(lab: Lab, node: Node) -> None:
    before = host_state(node)
    tmp_before = node.out("ls -A /tmp")
    join = lab.join_command(NODE)
    # The same one-liner, pointed at a port of the control plane's host where nothing listens.
    command = re.sub(
        r"https?://[^/']+/agent/bundles/", f"http://{lab.gateway}:9/agent/bundles/", join["command"]
    )
    assert command != join["command"]
    result = node.sh(command, check=False)
    assert result.returncode != 0
    assert host_state(node) == before
    assert node.out("ls -A /tmp") == tmp_before, "the one-liner's download folder was left behind"


def test_a_refused_join_takes_back_the_user_folders_units_and_binary(
    lab: Lab, node: Node, folder: str
) -> None:
    before = host_state(node)
    join = lab.join_command(NODE)
    result = node.sh(
        f"LLMGW_JOIN_TOKEN=not-a-token sh {folder}/{INSTALLER} install {join_args(join)}"
        " --models-root /srv/data/models",
        check=False,
    )
    said = result.stderr
    assert result.returncode == 1, said
    # The install got as far as the join: its steps before it ran.
    assert "user: creating system user llmgw-agent" in said, said
    assert "binary: llmgw" in said and "units: /etc/systemd/system/llmgw-agent.service" in said
    assert "'llmgw agent join' failed" in said, said
    assert "==> rollback: the install failed; removing what it created" in said
    last = said.strip().splitlines()[-1]
    assert last.startswith("error: rolled back (removed ") and last.endswith(
        ": nothing was left installed"
    ), said
    for made in ("user llmgw-agent", "/usr/local/lib/llmgw-agent", "/srv/data", "/etc/llmgw"):
        assert made in last, last
    assert host_state(node) == before


def test_an_agent_that_does_not_come_up_after_its_join_is_taken_back_too(
    lab: Lab, node: Node, folder: str
) -> None:
    """A good token, the join done, and the unit not up in time (a health timeout of 0 s): the
    identity goes with the rest, and the operator is told the enrolment stays on the control
    plane."""
    before = host_state(node)
    join = lab.join_command(NODE)
    result = node.sh(
        f"LLMGW_AGENT_HEALTH_TIMEOUT=0 LLMGW_JOIN_TOKEN={shlex.quote(join['token'])} "
        f"sh {folder}/{INSTALLER} install {join_args(join)}",
        check=False,
    )
    said = result.stderr
    assert result.returncode == 1, said
    assert f"node {NODE} joined" in result.stdout + said, said
    assert "did not come up listening on :9443 within 0 s" in said, said
    assert f"warning: this node had joined as {NODE} before the failure" in said, said
    assert said.strip().splitlines()[-1].endswith(": nothing was left installed"), said
    assert host_state(node) == before
    assert not node.listening()


def test_a_failed_rerun_never_removes_the_install_that_was_there(
    lab: Lab, node: Node, folder: str
) -> None:
    join = lab.join_command(NODE)
    good = node.sh(
        f"LLMGW_JOIN_TOKEN={shlex.quote(join['token'])} sh {folder}/{INSTALLER} install "
        f"{join_args(join)}",
        check=False,
    )
    assert good.returncode == 0, good.stderr
    assert node.listening()
    installed = host_state(node)
    identity = node.out("sha256sum /var/lib/llmgw-agent/node.crt /etc/llmgw/agent.yaml")
    # A re-run that moves the model root (a restart) and then does not see the agent up.
    rerun = node.sh(
        f"LLMGW_AGENT_HEALTH_TIMEOUT=0 sh {folder}/{INSTALLER} install --models-root /srv/data/m2",
        check=False,
    )
    said = rerun.stderr
    assert rerun.returncode == 1, said
    assert said.strip().splitlines()[-1] == (
        "error: rolled back what this run added (removed /srv/data); "
        "the install that was here before is kept"
    ), said
    after = host_state(node)
    assert after["passwd"] == installed["passwd"] and after["units"] == installed["units"]
    assert after["link"] == installed["link"] and after["wants"] == installed["wants"]
    assert node.out("test -x /usr/local/lib/llmgw-agent/llmgw && echo kept") == "kept"
    assert node.out("test -d /srv/data || echo gone") == "gone"
    # The identity is the one it joined with: the agent comes back on it with the old root.
    assert node.out("sha256sum /var/lib/llmgw-agent/node.crt /etc/llmgw/agent.yaml") != ""
    assert identity.split()[0] == node.out("sha256sum /var/lib/llmgw-agent/node.crt").split()[0]
    back = node.sh(f"sh {folder}/{INSTALLER} install --models-root /srv/llmgw/models", check=False)
    assert back.returncode == 0, back.stderr
    assert node.listening()
    node.sh(f"sh {folder}/{INSTALLER} uninstall --purge")


def package_args(lab: Lab, node: Node) -> str:
    url, key = lab.serve_repo(node)
    return shlex.join(["--repo-url", url, "--repo-key", key])


def test_a_refused_join_after_the_package_went_in_purges_the_package_too(
    lab: Lab, node: Node, folder: str
) -> None:
    source = package_args(lab, node)
    before = host_state(node)
    assert before["package"] in ("", "not-installed") and before["passwd"] == "", before
    join = lab.join_command(PACKAGE_NODE)
    result = node.sh(
        f"LLMGW_JOIN_TOKEN=not-a-token sh {folder}/{INSTALLER} package {source} "
        f"{join_args(join, PACKAGE_NODE)} --models-root /srv/data/models",
        check=False,
    )
    said = result.stderr
    assert result.returncode == 1, said
    # The package went in (its preinst made the user) and the join ran.
    assert "package: apt-get update && apt-get install llmgw-agent" in said, said
    assert "'llmgw agent join' failed" in said, said
    assert "==> rollback: the install failed; removing what it created" in said
    last = said.strip().splitlines()[-1]
    assert last.startswith("error: rolled back (removed ") and last.endswith(
        ": nothing was left installed"
    ), said
    for made in (
        "package llmgw-agent",
        "user llmgw-agent",
        "/srv/data",
        "/etc/apt/sources.list.d/llmgw.list",
    ):
        assert made in last, last
    assert host_state(node) == before


def test_a_failed_package_rerun_keeps_the_package_install(
    lab: Lab, node: Node, folder: str
) -> None:
    source = package_args(lab, node)
    join = lab.join_command(PACKAGE_NODE)
    good = node.sh(
        f"LLMGW_JOIN_TOKEN={shlex.quote(join['token'])} sh {folder}/{INSTALLER} package {source} "
        f"{join_args(join, PACKAGE_NODE)}",
        check=False,
    )
    assert good.returncode == 0, good.stderr
    assert node.listening()
    installed = host_state(node)
    assert installed["package"] == "installed", installed
    identity = node.out("sha256sum /var/lib/llmgw-agent/node.crt").split()[0]
    # A re-run that moves the model root (a restart) and then does not see the agent up.
    rerun = node.sh(
        f"LLMGW_AGENT_HEALTH_TIMEOUT=0 sh {folder}/{INSTALLER} package {source} "
        "--models-root /srv/data/m2",
        check=False,
    )
    said = rerun.stderr
    assert rerun.returncode == 1, said
    assert said.strip().splitlines()[-1] == (
        "error: rolled back what this run added (removed /srv/data); "
        "the install that was here before is kept"
    ), said
    after = host_state(node)
    for kept in ("package", "packaged", "passwd", "units", "wants", "linger"):
        assert after[kept] == installed[kept], (kept, after[kept], installed[kept])
    assert node.out("test -d /srv/data || echo gone") == "gone"
    assert node.out("sha256sum /var/lib/llmgw-agent/node.crt").split()[0] == identity
    back = node.sh(
        f"sh {folder}/{INSTALLER} package {source} --models-root /srv/llmgw/models", check=False
    )
    assert back.returncode == 0, back.stderr
    assert node.listening()
    node.sh(f"sh {folder}/{INSTALLER} uninstall --purge")
