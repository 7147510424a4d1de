"""Nothing the agent user controls reaches root (issue 11, point 2), on Debian 12 with the real
units: code running as ``llmgw-agent`` plants links, swaps its CA and floods its update spool,
and root's installer and update helper are shown to do nothing with any of it. Then the settle
period: an upgraded agent that comes up and crashes 20 s later is rolled back.

The steps share one node and run in file order; after a failed step the later ones fail at
once, naming it.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw import pki
from tests.integration.harness import wait_for
from tests.packaging.pkgcheck import systemd_image_of

from .lab import MOUNT, SPOOL, Lab, Node, OrderedSteps, node_of, run

NODE = "dry-root"
STATE = "/var/lib/llmgw-agent"
AGENT_TMP = "/var/lib/llmgw-agent-tmp"
TRUST = "/etc/llmgw/update"
AS_AGENT = "setpriv --reuid=llmgw-agent --regid=llmgw-agent --init-groups"
# The installer's functions, without its last line (main "$@"), to call them one by one.
FUNCTIONS = "/root/install-agent-functions.sh"


pytestmark = pytest.mark.usefixtures("in_order")


class Steps(OrderedSteps):
    def __init__(self, lab: Lab) -> None:
        super().__init__(lab)
        self.folder = ""  # the N bundle, unpacked, as the container sees it


@pytest.fixture(scope="module")
def steps(lab: Lab) -> Steps:
    return Steps(lab)


def as_agent(node: Node, script: str, check: bool = True) -> str:
    """``script`` run by the agent's user, as code that took over the agent would."""
    quoted = script.replace("'", "'\"'\"'")
    return node.sh(f"{AS_AGENT} sh -c '{quoted}'", check=check).stdout


def install(steps: Steps, *options: str, check: bool = True) -> Any:
    return node_of(steps).sh(
        f"sh {steps.folder}/install-agent.sh install {' '.join(options)}", check=check
    )


def trust_state(node: Node) -> str:
    return node.out(f"ls -la --time-style=+%s {TRUST}; sha256sum {TRUST}/*")


def test_01_install_and_join(steps: Steps, lab: Lab) -> None:
    node = steps.node = lab.boot(systemd_image_of("bookworm"), NODE)
    steps.join = j = lab.join_command(NODE)
    # The N bundle's installer (what the control plane serves may be N+1 by now, when the
    # life-cycle module ran first), joined as the one-liner would.
    steps.folder = lab.unpack(lab.bundle_n, "rootpaths-n")
    node.sh(
        f"LLMGW_JOIN_TOKEN={shlex.quote(j['token'])} sh {steps.folder}/install-agent.sh install "
        f"--node-id {NODE} --enroll-url {j['enroll_url']} --ca-hash {j['ca_hash']}"
    )
    assert node.listening()
    assert node.version() == f"llmgw {lab.version}"
    node.sh(f"sed '$d' {steps.folder}/install-agent.sh > {FUNCTIONS}")
    # The agent's TMPDIR is a sibling of its state directory, both its own, 0700.
    assert node.out(f"stat -c '%U %a' {STATE} {AGENT_TMP}").split("\n") == [
        "llmgw-agent 700",
        "llmgw-agent 700",
    ]
    assert node.sh(f"test -e {STATE}/tmp", check=False).returncode != 0
    unit = node.out("systemctl show -p Environment --value llmgw-agent.service")
    assert f"TMPDIR={AGENT_TMP}" in unit
    # The pin the install was given is recorded, root's, next to the CA it checked.
    assert node.out(f"cat {TRUST}/ca-hash") == steps.join["ca_hash"]
    assert node.out(f"stat -c '%U %a' {TRUST}/ca-hash") == "root 644"


def test_02_root_never_unpacks_or_loads_from_the_agents_folders(steps: Steps) -> None:
    node = node_of(steps)
    # The attack: the agent points the old nested tmp/ at a root-owned folder it can
    # write (so the old bootloader's ownership check passed) and fills its own TMPDIR.
    as_agent(node, f"rm -rf {STATE}/tmp && ln -s /tmp {STATE}/tmp && mkdir -p {AGENT_TMP}/run")
    # Record, while root-run llmgw processes live, where they mapped libpython from.
    node.sh(
        "rm -f /root/stop-watch; : >/root/libpython.txt; setsid sh -c '"
        "while [ ! -e /root/stop-watch ]; do "
        "for pid in $(pgrep -u 0 -f /usr/local/lib/llmgw-agent/llmgw); do "
        'grep -h libpython /proc/$pid/maps 2>/dev/null | tr -s " " | cut -d" " -f6 '
        ">>/root/libpython.txt; done; sleep 0.02; done' >/dev/null 2>&1 </dev/null &"
    )
    try:
        # 1. The root helper, started by the path unit for a (bogus) request the agent spooled.
        status = spool_junk(node, "junk-1")
        assert status["state"] == "refused", status
        # 2. llmgw run by root with an environment pointing at the agent's folders, as an
        # operator's shell or a careless script might.
        node.sh(
            f"TMPDIR={AGENT_TMP} LLMGW_RUNTIME_DIR={AGENT_TMP}/run HOME={STATE} "
            "timeout 6 /usr/local/lib/llmgw-agent/llmgw engine sim --host 127.0.0.1 "
            "--port 18777 >/dev/null 2>&1 || true"
        )
        # 3. The installer's own root runs (version_of, config_is_valid).
        node.sh(f"TMPDIR={AGENT_TMP} sh {steps.folder}/install-agent.sh status")
    finally:
        node.sh("touch /root/stop-watch; sleep 0.2")
    seen = set(node.out("sort -u /root/libpython.txt").split())
    assert seen, "no root-run llmgw was seen"
    for path in seen:
        assert re.fullmatch(r"/(var/)?tmp/_MEI[0-9a-zA-Z]+/libpython3\.11\.so\.1\.0", path), seen
    # Nothing of root's was left in (or unpacked into and removed from) the agent's folders.
    assert node.out(f"find {STATE} {AGENT_TMP} -xdev -user root -name '_MEI*'") == ""
    as_agent(node, f"rm -f {STATE}/tmp && rm -rf {AGENT_TMP}/run")


def spool_junk(node: Node, name: str) -> dict[str, Any]:
    """A request that is no order at all, spooled as the agent would (one rename); the
    helper's verdict."""
    node.sh(f"rm -f {SPOOL}/status.json")
    as_agent(
        node,
        f"mkdir -p {SPOOL}/.{name} && echo junk >{SPOOL}/.{name}/order.json && "
        f"mv {SPOOL}/.{name} {SPOOL}/request",
    )
    return node.helper_status(interval=0.3)


def test_03_a_link_to_etc_is_never_managed_by_root(steps: Steps) -> None:
    node = node_of(steps)
    before = node.out("stat -c '%n %U:%G %a' /etc /etc/shadow /etc/passwd")
    # The old place of the agent's TMPDIR, inside its own tree: root no longer looks at it.
    as_agent(node, f"ln -s /etc {STATE}/tmp")
    result = install(steps)
    assert "nothing changed; not restarted" in result.stderr, result.stderr
    assert node.out("stat -c '%n %U:%G %a' /etc /etc/shadow /etc/passwd") == before
    as_agent(node, f"rm {STATE}/tmp")
    # The sibling itself a link (only root could plant it there; a leftover, a mistake): the
    # installer refuses to chmod/chown through it, and says what to do.
    node.sh(f"mv {AGENT_TMP} {AGENT_TMP}.real && ln -s /etc {AGENT_TMP}")
    try:
        refused = install(steps, check=False)
        assert refused.returncode != 0
        assert f"{AGENT_TMP} is a symlink (to /etc); root does not follow it" in refused.stderr
        assert node.out("stat -c '%n %U:%G %a' /etc /etc/shadow /etc/passwd") == before
    finally:
        node.sh(f"rm {AGENT_TMP} && mv {AGENT_TMP}.real {AGENT_TMP}")
    assert node.listening()


def test_04_the_helpers_trust_cannot_be_chosen_by_the_agent(
    steps: Steps, lab: Lab, tmp_path: Path
) -> None:
    node = node_of(steps)
    before = trust_state(node)
    j = steps.join
    # A link to /etc/shadow instead of the agent's CA: root copies nothing of it.
    as_agent(node, f"mv {STATE}/ca.crt {STATE}/ca.crt.real && ln -s /etc/shadow {STATE}/ca.crt")
    try:
        result = install(steps)
        assert "update helper: trust not changed" in result.stderr, result.stderr
        assert trust_state(node) == before
        assert node.sh(f"grep -rq '^root:' {TRUST}", check=False).returncode != 0
        # Another CA in its place: refused against the pin recorded at the first install,
        # and against the operator's --ca-hash when given.
        other = pki.init_ca(tmp_path / "other")
        (lab.dir / "other-ca.crt").write_bytes((other.directory / "ca.crt").read_bytes())
        as_agent(node, f"rm {STATE}/ca.crt && cp {MOUNT}/other-ca.crt {STATE}/ca.crt")
        for options in (
            (),
            (f"--node-id {NODE} --enroll-url {j['enroll_url']} --ca-hash {j['ca_hash']}",),
        ):
            result = install(steps, *options)
            assert "the update helper keeps the CA it trusts" in result.stderr, result.stderr
            assert trust_state(node) == before
    finally:
        as_agent(node, f"rm -f {STATE}/ca.crt && mv {STATE}/ca.crt.real {STATE}/ca.crt")
    assert node.listening()


def test_05_programs_of_the_agent_get_no_terminal_and_no_environment(steps: Steps) -> None:
    node = node_of(steps)
    probe = (
        'env | cut -d= -f1 | sort | tr "\\n" " "; echo; '
        "ps -o sid=,tty= -p $$; echo pid=$$; readlink /proc/self/fd/0; "
        'printf "\\033]0;pwned\\007\\033[2Jvisible\\n"'
    )
    script = (
        f". {FUNCTIONS}; make_stage; export LLMGW_JOIN_TOKEN=secret-token ROOT_SECRET=x; "
        f"as_agent sh -c '{probe}'; JOIN_TOKEN=the-token; "
        "as_agent_with_token sh -c 'echo token=$LLMGW_JOIN_TOKEN'; "
        "as_agent sh -c 'echo token=${LLMGW_JOIN_TOKEN:-none}'"
    )
    (steps.lab.dir / "as-agent-probe.sh").write_text(script + "\n")
    # Under a pseudo-terminal, as an operator's shell would be.
    result = node.sh(f"script -qec 'sh {MOUNT}/as-agent-probe.sh' /dev/null")
    said = result.stdout.replace("\r", "")
    lines = said.split("\n")
    names = set(lines[0].split())
    # The installer marks what it runs (llmgw agent join reads it), nothing else of its own.
    assert names <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD", "SHLVL", "_", "LLMGW_BY_INSTALLER"}, (
        lines[0]
    )
    sid, tty = lines[1].split()
    assert tty == "?", said  # no controlling terminal
    assert lines[2] == f"pid={sid}", said  # a session of its own
    assert lines[3] == "/dev/null", said
    assert "\033" not in said and "visible" in said  # control characters never reach root's tty
    assert "token=the-token" in said and "token=none" in said
    assert "secret-token" not in said


def test_06_agent_read_never_copies_what_the_agent_cannot_read(steps: Steps) -> None:
    node = node_of(steps)
    as_agent(node, f"ln -sf /etc/shadow {STATE}/shadow-link")
    try:
        size = node.out(
            f". {FUNCTIONS}; make_stage; agent_read {STATE}/shadow-link /root/copied; "
            "wc -c </root/copied"
        )
        assert size == "0"
        # What the agent may read comes through whole.
        as_agent(node, f"echo agent-data >{STATE}/plain")
        copied = node.out(
            f". {FUNCTIONS}; make_stage; agent_read {STATE}/plain /root/copied; cat /root/copied"
        )
        assert copied == "agent-data"
    finally:
        as_agent(node, f"rm -f {STATE}/shadow-link {STATE}/plain")


def test_07_a_flood_of_bogus_requests_leaves_the_path_unit_active(steps: Steps) -> None:
    node = node_of(steps)
    # 15 requests back to back, each as soon as the helper took the previous one: with the
    # default start limit (5 in 10 s) the helper's start would fail and the path unit with it
    # whenever a refusal takes under 2 s, as it does on an idle node (on a machine so loaded
    # that the one-file helper needs longer, the old default is not reached either).
    flood = (
        (
            "i=0; while [ $i -lt 15 ]; do "
            "n=0; while [ -e REQ ]; do sleep 0.05; n=$((n+1)); [ $n -lt 600 ] || exit 7; done; "
            "mkdir -p SPOOL/.flood$i && echo junk >SPOOL/.flood$i/order.json && "
            "mv SPOOL/.flood$i REQ; i=$((i+1)); done"
        )
        .replace("REQ", f"{SPOOL}/request")
        .replace("SPOOL", SPOOL)
    )
    started = time.monotonic()
    done = node.sh(f"{AS_AGENT} sh -c '{flood}'", check=False)
    assert done.returncode == 0, (
        f"the flood stalled after {time.monotonic() - started:.0f} s: the helper stopped "
        f"taking requests\n{node.journal('llmgw-agent-update.path')}"
    )
    wait_for(
        lambda: node.sh(f"test -e {SPOOL}/request", check=False).returncode != 0,
        what="the last request taken",
        timeout=60,
    )
    assert node.out("systemctl is-active llmgw-agent-update.path") == "active"
    assert node.out("systemctl show -p Result --value llmgw-agent-update.path") == "success"
    journal = node.journal("llmgw-agent-update.service", lines=400)
    assert "start-limit" not in journal and "Start request repeated too quickly" not in journal
    # And it still serves the next request.
    assert spool_junk(node, "after-flood")["state"] == "refused"


def test_08_an_agent_that_crashes_after_it_came_up_is_rolled_back(steps: Steps, lab: Lab) -> None:
    node = node_of(steps)
    # A bundle whose llmgw starts the real agent (the one kept as previous by the upgrade),
    # which comes up (READY, :9443), then crashes 20 s after the start.
    folder = lab.dir / "crash-later"
    run("cp", "-a", str(lab.dir / "rootpaths-n"), str(folder))
    (top,) = list(folder.iterdir())
    program = top / "llmgw"
    program.write_text(
        "#!/bin/sh\n"
        '[ "${1:-}" = --version ] && { echo "llmgw 99.0.0"; exit 0; }\n'
        '/usr/local/lib/llmgw-agent/previous/llmgw "$@" &\n'
        "sleep 20\n"
        # The crash: this script and the agent it started (a one-file build: two processes),
        # its whole process group, killed at once.
        "kill -9 0\n"
    )
    program.chmod(0o755)
    # The default settle period (LLMGW_AGENT_SETTLE_SECONDS, 30 s) catches it.
    result = node.sh(
        f"sh {MOUNT}/crash-later/{top.name}/install-agent.sh upgrade",
        check=False,
        timeout=600,
    )
    assert result.returncode != 0, result.stderr
    assert "came up but did not stay up" in result.stderr, result.stderr
    assert f"rolled back to llmgw {lab.version}, which runs again" in result.stderr, result.stderr
    assert node.version() == f"llmgw {lab.version}"
    wait_for(node.listening, what="the rolled-back agent listening", timeout=60)
    assert node.unit("ActiveState") == "active"
