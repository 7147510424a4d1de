"""install-agent.sh's verbs run whole, in a sandbox: the installer's text with every path it
manages moved under a temporary directory, the service user ``nobody``, and the commands
that would change the host (systemctl, useradd, loginctl, apt-get, chown ...) replaced by
stand-ins that record their calls. What is checked is the run order (the numbered steps, one
block at the end of the script) and what "changed?" decides: a re-run changes and restarts
nothing, a changed drop-in restarts the agent, an upgrade keeps the previous binary and rolls
back when the new one does not come up. The real thing, in systemd containers, is the dry
run's (tests/dryrun)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ci import require_tools, unavailable

from .pkgcheck import ROOT, UNITS

INSTALLER = ROOT / "installer" / "install-agent.sh"
SERVICE_USER = "nobody"  # a user every Debian machine has; nothing is done as it here

# Sourced in place of the installer's last line (main "$@"): the stand-ins, then main.
RUNNER = r"""
SERVICE_USER=__USER__
log() { printf '%s\n' "$*" >>"$T/calls"; }
check_systemd() { check_systemd_version; }
systemctl() {
    case $1 in --version) echo "systemd $(cat "$T/sc/systemd-version" 2>/dev/null || echo 252) (252.22-1~deb12u1)"; return 0 ;; esac
    log systemctl "$@"
    case $1 in
        is-enabled) [ -e "$T/sc/enabled-$2" ] && echo enabled || echo disabled ;;
        is-active) [ -e "$T/sc/active-$2" ] && echo active || echo inactive ;;
        enable)
            if [ "$2" = --now ]; then touch "$T/sc/enabled-$3" "$T/sc/active-$3"
            else touch "$T/sc/enabled-$2"; fi ;;
        restart)
            unit=$2
            [ "$2" != --no-block ] || unit=$3
            [ -e "$T/sc/fail" ] && return 0
            touch "$T/sc/active-$unit"
            # A new invocation each start, as systemd's InvocationID; with sc/slow-restart
            # the job runs a second later (--no-block), the old one active meanwhile.
            next=$(( $(cat "$T/sc/invocation" 2>/dev/null || echo 0) + 1 ))
            if [ -e "$T/sc/slow-restart" ]; then
                (sleep 1; echo "$next" >"$T/sc/invocation") </dev/null >/dev/null 2>&1 &
            else
                echo "$next" >"$T/sc/invocation"
            fi ;;
        stop) rm -f "$T/sc/active-$2" ;;
        show) echo "invocation-$(cat "$T/sc/invocation" 2>/dev/null || echo 0)" ;;
    esac
    return 0
}
ss() { [ -e "$T/sc/active-llmgw-agent.service" ] && echo "LISTEN 0 128 *:9443 *:*"; return 0; }
loginctl() { log loginctl "$@"; return 1; }
useradd() { log useradd "$@"; }
groupadd() { log groupadd "$@"; }
usermod() { log usermod "$@"; }
gpasswd() { log gpasswd "$@"; }
journalctl() { log journalctl "$@"; }
chown() { log chown "$@"; }
getent() { [ "$1 $2" != "group docker" ] || return 1; command getent "$@"; }
mode_of() { stat -c '%a root:root' "$1" 2>/dev/null || true; }
same_mode() { [ "$(mode_of "$1")" = "${2#0} root:root" ]; }
as_agent_with_token() { LLMGW_JOIN_TOKEN=$JOIN_TOKEN LLMGW_BY_INSTALLER=1 "$@" >&2; }
agent_read() { cp "$1" "$2" 2>/dev/null || : >"$2"; }
main "$@"
"""

# The bundle's llmgw: its version, agent --check (valid when it names a node), join (writes
# an identity and agent.yaml), update-trust.
FAKE_LLMGW = r"""#!/bin/sh
case $1 in
    --version) echo "llmgw __VERSION__"; exit 0 ;;
    agent) shift ;;
    *) exit 3 ;;
esac
case $1 in
    --check)
        grep -q '^node_id:' "$3" || exit 1
        # agent.yaml may name a key once only (the real agent's loader refuses a second).
        [ -z "$(sed -n 's/^\([a-z_]*\):.*/\1/p' "$3" | sort | uniq -d)" ] || exit 1
        if [ "$4" = --print ]; then
            sed -n 's/^multinode_ports: *//p' "$3" | grep . || echo 29500-29999
        fi ;;
    render-facts)
        # The real one parses with llmgw.contracts.nodefacts; this one prints what it got,
        # and refuses a fabric named 'bad'.
        shift
        echo "$*" >"$T/render-facts-args"
        while [ $# -gt 0 ]; do
            case $1 in
                --fabric)
                    case $2 in bad*) echo "Error: --fabric: '$2' does not start with a fabric name" >&2; exit 2 ;; none) ;; *)
                    [ -n "$fab" ] || echo "fabrics:"; fab=1
                    printf -- '- name: %s\n  hcas:\n  - %s\n' "${2%%:*}" "${2#*:}" ;; esac ;;
                --nvidia-smi) printf 'discovery:\n  nvidia_smi: %s\n' "$2" ;;
                --engine) case $2 in none) ;; *) printf 'engines:\n  %s:\n    bin: %s\n' "${2%%=*}" "${2#*=}" ;; esac ;;
            esac
            shift 2
        done ;;
    join)
        shift
        echo "$*" >"$T/join-args"
        while [ $# -gt 0 ]; do
            case $1 in
                --node-id) node=$2; shift ;;
                --config) config=$2; shift ;;
                --state-dir) state=$2; shift ;;
            esac
            shift
        done
        [ -n "$LLMGW_JOIN_TOKEN" ] || exit 4
        if [ -e "$T/sc/plant" ]; then
            # What an agent that turned hostile could leave in the folder it owns: links to
            # root's things, which the rollback's rm -rf must take as links, never follow.
            ln -s "$T/srv/keep" "$state/to-dir"
            ln -s "$T/srv/keep/file" "$state/to-file"
            mkdir "$state/sub" && ln -s "$T/srv/keep" "$state/sub/deeper"
        fi
        # A rekey names no --state-dir: the agent's, in the sandbox.
        [ -n "$state" ] || state=$T/var/lib/llmgw-agent
        echo crt >"$state/node.crt"
        echo ca >"$state/ca.crt"
        written="kept as it was"
        [ -f "$config" ] || { printf 'server: cp:7443\nnode_id: %s\n' "$node" >"$config"; written=written; }
        # The real join's report (llmgw.cli.agent.join): its config and start lines only
        # when no installer runs it (LLMGW_BY_INSTALLER).
        echo "node $node joined"
        echo "state: pending"
        echo "next: ask the operator to approve it: llmgw ctl approve $node --fingerprint sha256:f"
        if [ "${LLMGW_BY_INSTALLER:-}" != 1 ]; then
            echo "config:      $config ($written)"
            echo "then start the agent: sudo systemctl enable --now llmgw-agent"
        fi
        ;;
    update-trust) shift; echo "$*" >"$T/update-trust-args"; echo "trust: written" ;;
esac
"""

APT_GET = r"""#!/bin/sh
printf '%s\n' "apt-get $*" >>"$T/calls"
case " $* " in
    *" install "*)
        mkdir -p "$T/usr/bin"
        cp "$T/b1/llmgw" "$T/usr/bin/llmgw"
        echo 1.0.0 >"$T/package-version" ;;
esac
"""


@dataclass
class Sandbox:
    """A host in a directory: ``run("install", ...)`` runs the installer of bundle ``b1``
    (or ``b2``, one version on) there."""

    root: Path

    def run(
        self, *args: str, bundle: str = "b1", token: str = "", path: str = ""
    ) -> subprocess.CompletedProcess[str]:
        (self.root / "calls").write_text("")
        env = {
            "PATH": f"{self.root / 'bin'}:{path or os.environ['PATH']}",
            "T": str(self.root),
            "LLMGW_AGENT_HEALTH_TIMEOUT": "2",
            "LLMGW_AGENT_SETTLE_SECONDS": "0",
        }
        if token:
            env["LLMGW_JOIN_TOKEN"] = token
        return subprocess.run(
            ["sh", str(self.root / bundle / "run.sh"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def calls(self) -> list[str]:
        return (self.root / "calls").read_text().splitlines()

    def said(self, result: subprocess.CompletedProcess[str]) -> list[str]:
        """The installer's own lines (==> and warnings), the sandbox's path as @."""
        return [
            line.replace(str(self.root), "@")
            for line in result.stderr.splitlines()
            if line.startswith(("==> ", "warning: ", "error: "))
        ]


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    if os.geteuid() != 0:
        unavailable("the installer checks that root owns the paths it manages: run as root")
    require_tools("sh", "sha256sum", "getent", "stat")
    if subprocess.run(["getent", "passwd", SERVICE_USER], capture_output=True).returncode:
        unavailable(f"no user {SERVICE_USER} here; the sandbox's service user is that one")
    root = tmp_path / "host"
    root.mkdir()
    root.chmod(0o755)
    (root / "sc").mkdir()
    lines = INSTALLER.read_text().rstrip("\n").split("\n")
    assert lines[-1] == 'main "$@"', "the installer's last line is its call of main"
    body = "\n".join(lines[:-1]) + "\n"
    for prefix in ("/etc/", "/var/lib/", "/usr/local/lib/", "/srv/", "/run/llmgw"):
        body = body.replace(prefix, f"{root}{prefix}")
    body = body.replace("/usr/share/keyrings", f"{root}/keyrings")
    body = body.replace("PACKAGE_BIN=/usr/bin/llmgw", f"PACKAGE_BIN={root}/usr/bin/llmgw")
    body = body.replace(
        "COMMAND_LINK=/usr/local/bin/llmgw", f"COMMAND_LINK={root}/usr/local/bin/llmgw"
    )
    body = body.replace(
        "PCI_DEVICES=/sys/bus/pci/devices", f"PCI_DEVICES={root}/sys/bus/pci/devices"
    )
    body = body.replace("PROC_SYS=/proc/sys", f"PROC_SYS={root}/proc/sys")
    for name, version in (("b1", "1.0.0"), ("b2", "1.1.0")):
        bundle = root / name
        (bundle / "systemd").mkdir(parents=True)
        for unit in UNITS.iterdir():
            if unit.suffix in (".service", ".path"):
                shutil.copy(unit, bundle / "systemd" / unit.name)
        (bundle / "run.sh").write_text(body + RUNNER.replace("__USER__", SERVICE_USER))
        llmgw = bundle / "llmgw"
        llmgw.write_text(FAKE_LLMGW.replace("__VERSION__", version))
        llmgw.chmod(0o755)
    (root / "bin").mkdir()
    (root / "bin" / "apt-get").write_text(APT_GET)
    (root / "bin" / "dpkg-query").write_text('#!/bin/sh\ncat "$T/package-version" 2>/dev/null\n')
    for tool in (root / "bin").iterdir():
        tool.chmod(0o755)
    (root / "repo.key").write_text("a key\n")
    return Sandbox(root)


JOIN = ("--node-id", "n1", "--enroll-url", "https://cp:7443", "--ca-hash", "sha256:ab")


def test_install_runs_its_steps_in_order_and_a_rerun_changes_nothing(sandbox: Sandbox) -> None:
    first = sandbox.run("install")
    assert first.returncode == 0, first.stderr
    units = "@/etc/systemd/system"
    assert sandbox.said(first) == [
        "==> install: llmgw 1.0.0 from @/b1",
        f"==> user: lingering on for {SERVICE_USER}",  # 2 (the user, 1, exists)
        "==> folders: made @/srv/llmgw/models",  # 3
        "==> folders: made @/srv/llmgw/cache",
        "==> binary: llmgw 1.0.0 into @/usr/local/lib/llmgw-agent",  # 4
        "==> binary: @/usr/local/bin/llmgw -> @/usr/local/lib/llmgw-agent/llmgw",
        f"==> units: {units}/llmgw-agent.service",  # 5
        f"==> units: {units}/llmgw-agent-update.path",
        f"==> units: {units}/llmgw-agent-update.service",
        f"==> units: {units}/llmgw-agent.service.d/10-install.conf "  # 6
        "(ReadWritePaths=@/srv/llmgw/models @/srv/llmgw/cache)",
        "==> not started: this node has no identity yet. Run this again with --node-id, "
        "--enroll-url and --ca-hash (the token in LLMGW_JOIN_TOKEN)",  # 12
        "==> done: llmgw 1.0.0 installed (@/usr/local/lib/llmgw-agent/llmgw)",
    ]
    assert sandbox.calls().count("systemctl daemon-reload") == 1
    again = sandbox.run("install")
    assert again.returncode == 0, again.stderr
    assert [line for line in sandbox.said(again) if "units:" in line or "binary:" in line] == []
    assert "systemctl daemon-reload" not in sandbox.calls()


def test_join_then_a_rerun_restarts_nothing_and_a_new_drop_in_restarts(sandbox: Sandbox) -> None:
    joined = sandbox.run("install", *JOIN, token="t0ken")
    assert joined.returncode == 0, joined.stderr
    said = sandbox.said(joined)
    order = [
        "==> join: node n1 at https://cp:7443",  # 8
        "==> config: @/etc/llmgw/agent.yaml (written)",  # 9
        "==> update helper: trusts the cluster CA in @/etc/llmgw/update/ca.pem",  # 10
        "==> service: starting llmgw-agent.service (enabled: it starts at boot)",  # 12
        "==> service: llmgw-agent.service is active and listens on :9443",
    ]
    assert [line for line in said if line in order] == order
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    assert "==> service: llmgw-agent.service runs and nothing changed; not restarted" in (
        sandbox.said(again)
    )
    assert not [
        c for c in sandbox.calls() if c.startswith(("systemctl restart", "systemctl daemon"))
    ]
    moved = sandbox.run("install", "--models-root", str(sandbox.root / "srv" / "m2"))
    assert moved.returncode == 0, moved.stderr
    assert "==> config: @/etc/llmgw/agent.yaml (updated)" in sandbox.said(moved)
    assert (
        "==> service: restarting llmgw-agent.service (what it runs with changed, above)"
        in sandbox.said(moved)
    )
    assert "systemctl daemon-reload" in sandbox.calls()
    refused = sandbox.run("install", "--node-id", "n2", *JOIN[2:])
    assert refused.returncode == 1
    assert "already joined as 'n1', not 'n2'" in refused.stderr


def test_upgrade_keeps_the_previous_and_rolls_back_when_the_new_one_fails(
    sandbox: Sandbox,
) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    upgraded = sandbox.run("upgrade", bundle="b2")
    assert upgraded.returncode == 0, upgraded.stderr
    assert sandbox.said(upgraded) == [
        "==> upgrade: llmgw 1.0.0 -> 1.1.0",
        "==> binary: kept llmgw 1.0.0 in @/usr/local/lib/llmgw-agent/previous for rollback",
        "==> done: llmgw 1.1.0 runs and listens on :9443 (llmgw 1.0.0 kept for rollback)",
    ]
    same = sandbox.run("upgrade", bundle="b2")
    assert sandbox.said(same) == ["==> llmgw 1.1.0 is installed already; nothing to upgrade"]
    assert sandbox.calls() == []  # nothing changed: no reload, no restart
    back = sandbox.run("rollback")
    assert back.returncode == 0, back.stderr
    assert "==> rollback: llmgw 1.1.0 -> 1.0.0" in sandbox.said(back)
    # The agent does not come up again: the upgrade rolls itself back (and says so).
    (sandbox.root / "sc" / "fail").touch()
    (sandbox.root / "sc" / "active-llmgw-agent.service").unlink()
    failed = sandbox.run("upgrade", bundle="b2")
    assert failed.returncode == 1
    assert "==> rollback: restoring llmgw 1.0.0" in sandbox.said(failed)
    installed = sandbox.root / "usr" / "local" / "lib" / "llmgw-agent" / "llmgw"
    assert installed.read_bytes() == (sandbox.root / "b1" / "llmgw").read_bytes()


def test_upgrade_with_a_ca_hash_moves_the_update_helpers_trust(sandbox: Sandbox) -> None:
    """After a CA rotation: 'upgrade --ca-hash NEW' runs the pinned update-trust (root-run,
    the agent's CA file only a candidate); without it an upgrade leaves the trust alone."""
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    args = sandbox.root / "update-trust-args"
    args.unlink()
    plain = sandbox.run("upgrade", bundle="b2")
    assert plain.returncode == 0, plain.stderr
    assert not args.exists()
    pin = "sha256:" + "c" * 64
    same = sandbox.run("upgrade", "--ca-hash", pin, bundle="b2")  # installed already
    assert same.returncode == 0, same.stderr
    assert f"--ca-hash {pin}" in args.read_text()
    assert "==> update helper: trusts the cluster CA in @/etc/llmgw/update/ca.pem" in sandbox.said(
        same
    )
    refused = sandbox.run("upgrade", "--node-id", "n1", bundle="b2")
    assert refused.returncode == 1
    assert "'upgrade' takes no options but --ca-hash" in refused.stderr


def test_an_upgrade_that_fails_halfway_through_its_copies_rolls_back(sandbox: Sandbox) -> None:
    # The new binary is in place when a unit cannot be copied (a full disk, say): under
    # set -e the script must not stop there, with the new binary and no rollback.
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    unit = sandbox.root / "b2" / "systemd" / "llmgw-agent-update.service"
    unit.write_text(unit.read_text() + "# changed in 1.1.0\n")
    run = sandbox.root / "b2" / "run.sh"
    failing_chmod = (
        "chmod() { case $2 in *llmgw-agent-update.service.new*) return 1 ;; esac; "
        'command chmod "$@"; }\nmain "$@"\n'
    )
    run.write_text(run.read_text().replace('main "$@"\n', failing_chmod))
    failed = sandbox.run("upgrade", bundle="b2")
    assert failed.returncode == 1
    said = sandbox.said(failed)
    assert "==> rollback: restoring llmgw 1.0.0" in said
    assert said[-1].startswith("error: upgrade to llmgw 1.1.0 failed: it could not be put in place")
    installed = sandbox.root / "usr" / "local" / "lib" / "llmgw-agent" / "llmgw"
    assert installed.read_bytes() == (sandbox.root / "b1" / "llmgw").read_bytes()
    assert "systemctl restart --no-block llmgw-agent.service" in sandbox.calls()


def test_a_rekey_whose_trust_copy_fails_still_starts_the_agent(sandbox: Sandbox) -> None:
    # The agent is stopped for the rekey; the update helper's trust written after it must
    # not end the script (set -e) before the agent is started again.
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    (sandbox.root / "etc" / "llmgw" / "update" / "node-id").unlink()
    run = sandbox.root / "b1" / "run.sh"
    failing_chmod = (
        'chmod() { case $2 in *node-id.new*) return 1 ;; esac; command chmod "$@"; }\nmain "$@"\n'
    )
    run.write_text(run.read_text().replace('main "$@"\n', failing_chmod))
    rekeyed = sandbox.run("rekey", *JOIN[2:], token="t0ken")
    assert rekeyed.returncode == 0, rekeyed.stderr
    assert "systemctl stop llmgw-agent.service" in sandbox.calls()
    assert "systemctl restart --no-block llmgw-agent.service" in sandbox.calls()
    assert sandbox.said(rekeyed)[-1] == (
        "==> done: node n1 rekeyed; the agent runs on its new identity"
    )


def test_package_installs_the_package_first_then_the_same_steps(sandbox: Sandbox) -> None:
    result = sandbox.run(
        "package", "--repo-url", "http://repo", "--repo-key", str(sandbox.root / "repo.key")
    )
    assert result.returncode == 0, result.stderr
    said = sandbox.said(result)
    assert said[:4] == [
        "==> package: repository key @/keyrings/llmgw.gpg",
        "==> package: @/etc/apt/sources.list.d/llmgw.list (http://repo/apt)",
        "==> package: apt-get update && apt-get install llmgw-agent",
        f"==> user: lingering on for {SERVICE_USER}",
    ]
    assert not [line for line in said if "binary:" in line]
    # The package ships the agent's unit and no update helper: only the drop-in is written.
    assert [line for line in said if "units:" in line] == [
        "==> units: @/etc/systemd/system/llmgw-agent.service.d/10-install.conf "
        "(ReadWritePaths=@/srv/llmgw/models @/srv/llmgw/cache)"
    ]
    assert said[-1] == "==> done: llmgw 1.0.0 installed from the package (@/usr/bin/llmgw)"


def test_a_restart_is_waited_for_as_a_new_invocation(sandbox: Sandbox) -> None:
    """restart --no-block returns before the job runs: the old agent is still active and
    listening then, and the installer must wait for the restarted one (a new InvocationID),
    not report it up at once."""
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    invocation = sandbox.root / "sc" / "invocation"
    assert invocation.read_text().strip() == "1"
    (sandbox.root / "sc" / "slow-restart").touch()
    moved = sandbox.run("install", *JOIN, "--models-root", str(sandbox.root / "srv" / "m2"))
    assert moved.returncode == 0, moved.stderr
    assert "==> service: llmgw-agent.service is active and listens on :9443" in sandbox.said(moved)
    # Had it not waited, the restart's job would still be a second away at its exit.
    assert invocation.read_text().strip() == "2"


def tree(root: Path) -> set[str]:
    """Every path under the sandbox host but the sandbox's own (bundles, stand-ins, calls)."""
    own = {"b1", "b2", "bin", "sc", "calls", "repo.key"}
    own |= {"render-facts-args", "join-args", "update-trust-args"}  # the stand-in llmgw's
    return {
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.relative_to(root).parts[0] not in own
    }


def test_a_fresh_install_that_fails_removes_what_it_created(sandbox: Sandbox) -> None:
    """The agent does not come up after the join: everything this run made (folders, units,
    binary, link, configuration, identity, records) is removed, the units it enabled are
    disabled again, and it says so; a folder that was there before is kept."""
    kept = sandbox.root / "srv" / "llmgw" / "models"
    kept.mkdir(parents=True)
    (kept / "weights.bin").write_text("an operator's model\n")
    before = tree(sandbox.root)
    (sandbox.root / "sc" / "fail").touch()
    failed = sandbox.run("install", *JOIN, token="t0ken")
    assert failed.returncode == 1
    said = sandbox.said(failed)
    assert "==> rollback: the install failed; removing what it created" in said
    assert said[-1].startswith("error: rolled back (removed "), said
    assert said[-1].endswith(": nothing was left installed"), said
    assert "@/usr/local/lib/llmgw-agent" in said[-1]
    assert any(line.startswith("warning: this node had joined as n1") for line in said), said
    assert tree(sandbox.root) == before
    assert (kept / "weights.bin").read_text() == "an operator's model\n"
    calls = sandbox.calls()
    assert "systemctl disable --now llmgw-agent.service" in calls
    assert "systemctl disable --now llmgw-agent-update.path" in calls
    # Nothing is left for the next run to trip over: it installs afresh.
    (sandbox.root / "sc" / "fail").unlink()
    again = sandbox.run("install", *JOIN, token="t0ken")
    assert again.returncode == 0, again.stderr


def test_the_rollback_never_follows_links_the_agent_left_in_its_folders(
    sandbox: Sandbox,
) -> None:
    """The agent user owns its state folder, which a failed fresh install removes as root: a
    link planted there (to a folder, to a file, one level down) goes, what it points at stays."""
    keep = sandbox.root / "srv" / "keep"
    keep.mkdir(parents=True)
    (keep / "file").write_text("root's own\n")
    before = tree(sandbox.root)
    (sandbox.root / "sc" / "plant").touch()
    (sandbox.root / "sc" / "fail").touch()
    failed = sandbox.run("install", *JOIN, token="t0ken")
    assert failed.returncode == 1
    assert sandbox.said(failed)[-1].endswith(": nothing was left installed")
    assert (keep / "file").read_text() == "root's own\n"
    assert tree(sandbox.root) == before


def test_a_failure_before_anything_is_made_says_nothing_was_left(sandbox: Sandbox) -> None:
    before = tree(sandbox.root)
    no_token = sandbox.run("install", *JOIN)  # the join has no token: refused at step 8
    assert no_token.returncode == 1
    said = sandbox.said(no_token)
    assert any(line.startswith("error: no join token") for line in said), said
    assert said[-1].endswith("nothing was left installed"), said
    assert tree(sandbox.root) == before


def test_a_failed_rerun_keeps_the_install_that_was_there(sandbox: Sandbox) -> None:
    """Over an existing install a failing run takes back only what it added itself (here a
    new model folder) and never the install: binary, units, configuration, identity stay."""
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    before = tree(sandbox.root)
    (sandbox.root / "sc" / "fail").touch()
    (sandbox.root / "sc" / "active-llmgw-agent.service").unlink()
    new_root = sandbox.root / "srv" / "m2"
    failed = sandbox.run("install", *JOIN, "--models-root", str(new_root))
    assert failed.returncode == 1
    said = sandbox.said(failed)
    assert said[-1] == (
        "error: rolled back what this run added (removed @/srv/m2); "
        "the install that was here before is kept"
    ), said
    assert not new_root.exists()
    # The install is all there (its drop-in and config name the new root: they were rewritten,
    # not created, and the next good run writes them again).
    assert tree(sandbox.root) == before
    assert "systemctl disable --now llmgw-agent.service" not in sandbox.calls()
