"""install-agent.sh in a sandbox (the fixture ``sandbox`` in conftest.py): the installer's text
with every path it manages moved under a temporary directory, the service user ``nobody``, and
the commands that would change the host replaced by stand-ins that record their calls; and
what the tests read back (agent.yaml, the facts record, the drop-in)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

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


def make_sandbox(tmp_path: Path) -> Sandbox:
    """A sandbox host under ``tmp_path`` with bundles b1 and b2 (the ``sandbox`` fixture)."""
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


CONFIG = Path("etc/llmgw/agent.yaml")


RECORD = Path("var/lib/llmgw-agent-install/facts")


DROPIN = Path("etc/systemd/system/llmgw-agent.service.d/10-install.conf")


def config(sandbox: Sandbox) -> str:
    return (sandbox.root / CONFIG).read_text()


def managed(sandbox: Sandbox) -> list[str]:
    """agent.yaml's lines from the installer's mark on."""
    lines = config(sandbox).splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("# install-agent.sh: set from")]
    assert len(marks) == 1, lines
    return lines[marks[0] + 1 :]


def restarted(sandbox: Sandbox) -> bool:
    return "systemctl restart --no-block llmgw-agent.service" in sandbox.calls()
