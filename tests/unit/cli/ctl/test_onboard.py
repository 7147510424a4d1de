"""``llmgw ctl onboard``: the steps a user sees, what is asked of the admin API (and what is
not: no token before ssh is proven, none left unrevoked after a failure, no approval of a
key that is not the host's), and the hosts-file run with its table. ssh is a stand-in on
PATH that runs the script it reads with sh, as a host would; the admin API records calls."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw import pki
from llmgw.contracts.joining import refusal
from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import FakeAPI

# The steps' module (its retry interval is shortened here).
onboarding_module = importlib.import_module("llmgw.cli.ctl.onboarding")

SECRET = "llmgw_jt_s3cr3t-token-value"

# The stand-in ssh: checks our two safety options, logs its argv, fails as FAKE_SSH_HOSTS
# says for a host (refuse, hostkey, flaky: refused until its second try, nonroot, newkey: an
# unknown key, accepted only with accept-new; cut: its install session cut off once, as when
# sshd restarts), else runs the script from stdin with sh, the agent's state directory and
# /etc/hostname and /etc/hosts moved under $FAKE_ROOT/HOST, uname -n saying HOST.hostname.
FAKE_SSH = r"""#!/bin/sh
printf '%s\n' "$*" >>"$FAKE_ROOT/ssh.log"
[ "$2" = BatchMode=yes ] || exit 254
case $4 in StrictHostKeyChecking=yes | StrictHostKeyChecking=accept-new) ;; *) exit 254 ;; esac
checking=${4#*=}
while [ "$1" != -- ]; do shift; done
host=${2#*@}
script=$(cat)
case " ${FAKE_SSH_HOSTS:-} " in
    *" $host=refuse "*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
    *" $host=hostkey "*) echo "Host key verification failed." >&2; exit 255 ;;
    *" $host=flaky "*)
        if [ ! -e "$FAKE_ROOT/$host.tried" ]; then
            : >"$FAKE_ROOT/$host.tried"
            echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255
        fi ;;
    *" $host=newkey "*)
        if [ ! -e "$FAKE_ROOT/$host.known" ]; then
            if [ "$checking" = yes ]; then
                echo "No ED25519 host key is known for $host and you have requested strict checking." >&2
                echo "Host key verification failed." >&2; exit 255
            fi
            echo "debug1: Server host key: ssh-ed25519 SHA256:newnewnew" >&2
            echo "Warning: Permanently added '$host' (ED25519) to the list of known hosts." >&2
            : >"$FAKE_ROOT/$host.known"
        fi ;;
    *" $host=cut "*)
        case $script in *"@@llmgw download"*)
            if [ ! -e "$FAKE_ROOT/$host.cut" ]; then
                : >"$FAKE_ROOT/$host.cut"
                echo "Connection to $host closed by remote host." >&2; exit 255
            fi ;;
        esac ;;
esac
bin=$FAKE_ROOT/bin-root
case " ${FAKE_SSH_HOSTS:-} " in *" $host=nonroot "*) bin=$FAKE_ROOT/bin-user ;; esac
mkdir -p "$FAKE_ROOT/$host"
printf '%s\n' "$script" | sed -e "s#/var/lib/llmgw-agent#$FAKE_ROOT/$host#g" \
    -e "s#/etc/hostname#$FAKE_ROOT/$host/hostname#g" -e "s#/etc/hosts#$FAKE_ROOT/$host/hosts#g" \
    | PATH="$bin:$PATH" FAKE_HOST=$host sh -s
"""
# uname -n and hostnamectl on the fake hosts: the name is $FAKE_ROOT/HOST.hostname.
UNAME = """#!/bin/sh
[ "$1" = -n ] || exec /bin/uname "$@"
cat "$FAKE_ROOT/$FAKE_HOST.hostname"
"""
HOSTNAMECTL = """#!/bin/sh
[ "$1" = set-hostname ] || exit 1
echo "$2" >"$FAKE_ROOT/$FAKE_HOST.hostname"
"""


def _cert(key: ec.EllipticCurvePrivateKey) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-01")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


class OnboardAPI(FakeAPI):
    """The admin API's nodes and join tokens, as far as onboard uses them. A node enrols when
    the one-liner (run by the stand-in ssh) writes its certificate into its state dir."""

    def __init__(self, root: Path) -> None:
        super().__init__(self.answer)
        self.root = root
        self.nodes: dict[str, dict[str, Any]] = {}
        self.engines: list[dict[str, Any]] = []  # GET /api/engines' rows
        self.inventory: dict[str, Any] = {}  # what an approved node reports (health...)
        self.rekeyed: dict[str, bool] = {}  # node -> whether it is re-paired (lost state)
        self.enrolled_fp: dict[str, str] = {}  # a node's fingerprint as the enrolment saw it
        self.revoked: list[str] = []
        self.minted = 0

    def answer(self, method: str, path: str, body: Any) -> Any:
        parts = path.strip("/").split("/")
        if path.startswith("/api/engines?"):
            return {"desired": [], "nodes": self.engines}
        if (method, path) == ("POST", "/api/join-tokens"):
            self.minted += 1
            node = body["node"]
            host = self.root / "host-of" / node
            verb = "rekey" if body.get("rekey") and body.get("re_pair") is not True else "join"
            if body.get("rekey"):
                self.rekeyed[node] = body.get("re_pair") is True
            # What the stand-in one-liner does: "download", "verify", "install", "join".
            command = (
                "(set -eu; : fetch https://cp:8080/agent/bundles/linux-x64.tar.gz; "
                f"export LLMGW_JOIN_TOKEN={SECRET}; "
                f'test "$(cat {self.root}/fail 2>/dev/null)" != {node} || '
                "{ echo 'curl: (7) Failed to connect to cp port 8080' >&2; exit 7; }; "
                "echo 'agent.tar.gz: OK'; echo '==> 3. binary' >&2; "
                f"echo '==> {verb}: node {node} at https://cp:8443' >&2; "
                f'cp "$FAKE_ROOT/$FAKE_HOST.crt" /var/lib/llmgw-agent/node.crt; '
                f'echo "$FAKE_HOST" >{host})'
            )
            return {"id": f"jt{self.minted}", "node": node, "command": command}
        if method == "DELETE" and parts[:2] == ["api", "join-tokens"]:
            self.revoked.append(parts[2])
            return {"id": parts[2]}
        if parts[:2] == ["api", "nodes"]:
            node = parts[2]
            if len(parts) == 4:
                action = parts[3]
                if action == "approve":
                    assert body["fingerprint"] == self.nodes[node]["fingerprint"]
                self.nodes[node]["state"] = "approved" if action == "approve" else "rejected"
                self.nodes[node]["cpus"] = 8
                self.nodes[node].update(self.inventory)
                return {"node": node}
            enrolled = (self.root / "host-of" / node).is_file()
            if enrolled and node in self.rekeyed:
                # A rekey (or re-pair) replaced the key of the record it keeps.
                host = (self.root / "host-of" / node).read_text().strip()
                self.nodes[node]["fingerprint"] = self.fingerprints[host]
                self.nodes[node]["connected"] = True
                if self.rekeyed.pop(node):
                    self.nodes[node]["state"] = "pending"  # a re-pair is approved again
            if enrolled and node not in self.nodes:
                host = (self.root / "host-of" / node).read_text().strip()
                self.nodes[node] = {
                    "state": "pending",
                    "connected": True,
                    "fingerprint": self.enrolled_fp.get(node, self.fingerprints[host]),
                    "cpus": None,
                    "gpus": [],
                    "health": "healthy",
                }
            if node not in self.nodes:
                raise APIError(f"no node {node}", status=404)
            return dict(self.nodes[node])
        raise AssertionError(f"unexpected call {method} {path}")

    fingerprints: dict[str, str] = {}


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> OnboardAPI:
    root = tmp_path / "fake"
    (root / "host-of").mkdir(parents=True)
    for name, uid in (("bin-root", 0), ("bin-user", 1000)):
        (root / name).mkdir()
        (root / name / "id").write_text(f"#!/bin/sh\necho {uid}\n")
        for tool, text in (("uname", UNAME), ("hostnamectl", HOSTNAMECTL)):
            (root / name / tool).write_text(text)
        for tool in (root / name).iterdir():
            tool.chmod(0o755)
    ssh = root / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ROOT", str(root))
    monkeypatch.delenv("FAKE_SSH_HOSTS", raising=False)
    monkeypatch.setattr(onboarding_module, "RETRY_INTERVAL", 0.01)
    fake = OnboardAPI(root)
    fake.fingerprints = {}
    for number, host in enumerate(("h1", "h2", "h3"), start=1):
        # Each machine is called as the node the tests onboard it as (gpu-0N on hN).
        (root / f"{host}.hostname").write_text(f"gpu-0{number}\n")
        key = ec.generate_private_key(ec.SECP256R1())
        (root / f"{host}.crt").write_bytes(_cert(key))
        fake.fingerprints[host] = pki.fingerprint(key.public_key())
    return fake


def ssh_log(api: OnboardAPI) -> str:
    path = api.root / "ssh.log"
    return path.read_text() if path.exists() else ""


def test_one_host_step_by_step(api: OnboardAPI) -> None:
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--port", "2222")
    assert out.exit_code == 0, out.output
    fp = api.fingerprints["h1"]
    assert out.output == (
        "gpu-01  connect: root@h1:2222\n"
        "gpu-01  download\n"
        "gpu-01  verify: SHA-256 matches the one the token's command holds\n"
        "gpu-01  install\n"
        "gpu-01  install: 3. binary\n"
        "gpu-01  join\n"
        f"gpu-01  approve: {fp}\n"
        "gpu-01  online: 8 CPUs, 0 GPUs, healthy\n"
    )
    assert [(m, p) for m, p, _ in api.calls] == [
        ("GET", "/api/nodes/gpu-01"),
        ("POST", "/api/join-tokens"),
        ("GET", "/api/nodes/gpu-01"),
        ("POST", "/api/nodes/gpu-01/approve"),
        ("GET", "/api/nodes/gpu-01"),
        ("GET", "/api/engines?node=gpu-01"),
    ]
    assert api.calls[1][2] == {"node": "gpu-01", "ttl": 1800}
    assert api.calls[3][2] == {"fingerprint": fp}
    # Two sessions (the probe, the install), the script on stdin: the token on no argv.
    log = ssh_log(api).splitlines()
    assert len(log) == 2 and all(line.endswith("-- root@h1 sh -s") for line in log)
    assert "-p 2222" in log[0]
    assert SECRET not in ssh_log(api)
    assert api.revoked == []


def test_node_facts_go_with_the_token(api: OnboardAPI) -> None:
    out = api.ctl(
        "onboard", "gpu-01", "--ssh", "h1", "--fabric", "ib0:mlx5_0", "--models-root", "/srv/m"
    )
    assert out.exit_code == 0, out.output
    facts = api.calls[1][2]["facts"]
    assert facts["models_root"] == "/srv/m" and facts["fabrics"] == ["ib0:mlx5_0"]


def test_json(api: OnboardAPI) -> None:
    out = api.ctl("--json", "onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["node"] == "gpu-01" and data["result"] == "online"
    assert data["fingerprint"] == api.fingerprints["h1"]
    assert data["steps"] == [
        "connect",
        "download",
        "verify",
        "install",
        "join",
        "approve",
        "online",
    ]
    assert "gpu-01  connect" in out.stderr


def test_a_key_that_is_not_the_hosts_is_rejected_not_approved(api: OnboardAPI) -> None:
    api.enrolled_fp["gpu-01"] = "sha256:" + "ab" * 32
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 1
    assert (
        f"node gpu-01 enrolled with key sha256:{'ab' * 32}, but the key on root@h1 is "
        f"{api.fingerprints['h1']}: someone else used its token. The node is rejected"
    ) in out.stderr
    paths = [(m, p) for m, p, _ in api.calls]
    assert ("POST", "/api/nodes/gpu-01/reject") in paths
    assert ("POST", "/api/nodes/gpu-01/approve") not in paths


def test_a_failed_install_revokes_the_token(api: OnboardAPI) -> None:
    (api.root / "fail").write_text("gpu-01")
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 1
    assert "the install on root@h1 failed at download (exit 7):" in out.stderr
    assert "curl: (7) Failed to connect to cp port 8080" in out.stderr
    assert api.revoked == ["jt1"]
    assert ("POST", "/api/nodes/gpu-01/approve") not in [(m, p) for m, p, _ in api.calls]


def test_a_node_online_already_is_left_alone(api: OnboardAPI) -> None:
    api.nodes["gpu-01"] = {"state": "approved", "connected": True, "cpus": 8}
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 0, out.output
    assert out.output == "gpu-01  skipped: already online; nothing done\n"
    assert api.calls == [("GET", "/api/nodes/gpu-01", None)]
    assert ssh_log(api) == ""


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("hostkey", "ssh refused ops@h1's host key (Host key verification failed.)"),
        ("nonroot", "ops on h1 is not root, and the installer needs root: add --sudo"),
        (
            "refuse",
            "ssh could not reach ops@h1 (ssh: connect to host h1 port 22: Connection refused)",
        ),
    ],
)
def test_refusals_before_any_token(
    api: OnboardAPI, monkeypatch: pytest.MonkeyPatch, mode: str, says: str
) -> None:
    monkeypatch.setenv("FAKE_SSH_HOSTS", f"h1={mode}")
    out = api.ctl("onboard", "gpu-01", "--ssh", "ops@h1", "--wait-ssh", "0")
    assert out.exit_code == 1
    assert says in out.stderr
    assert api.minted == 0
    assert len(ssh_log(api).splitlines()) == 1  # no retry with --wait-ssh 0


def test_wait_ssh_retries_a_host_that_does_not_answer_yet(
    api: OnboardAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h1=flaky")
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")  # the default: 2 minutes
    assert out.exit_code == 0, out.output
    assert (
        "gpu-01  connect: root@h1: no answer yet, or cut off (sshd restarting?); trying again\n"
        in out.output
    )


def test_a_host_key_refusal_is_not_retried(
    api: OnboardAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h1=hostkey")
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--wait-ssh", "1m")
    assert out.exit_code == 1
    assert len(ssh_log(api).splitlines()) == 1


def test_sudo_runs_the_script_under_sudo_n(api: OnboardAPI) -> None:
    out = api.ctl("onboard", "gpu-01", "--ssh", "ops@h1", "--sudo")
    assert out.exit_code == 0, out.output
    log = ssh_log(api).splitlines()
    assert len(log) == 2 and all(line.endswith("-- ops@h1 sudo -n sh -s") for line in log)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give NODE --ssh [USER@]HOST (one host), or --hosts FILE (many)"),
        (["gpu-01"], "give NODE --ssh [USER@]HOST"),
        (["gpu-01", "--ssh", "root@"], "has no host"),
        (["gpu-01", "--ssh", "h:22", "--port", "23"], "name two ports"),
        (
            ["gpu-01", "--ssh", "h", "--ssh-option", "StrictHostKeyChecking=accept-new"],
            "would change StrictHostKeyChecking=yes",
        ),
        (["gpu-01", "--ssh", "h", "--fabric", "ib-a", "--fabric", "ib-b"], "both name no"),
        (["gpu-01", "--ssh", "h", "--rekey", "--re-pair"], refusal("rekey_and_repair")),
        (["gpu-01", "--ssh", "h", "--rekey", "--lost-state"], refusal("rekey_and_repair")),
        (
            ["gpu-01", "--ssh", "h", "--rekey", "--fabric", "ib-a:mlx5_0"],
            refusal("facts_on_rekey", facts="--fabric"),
        ),
        (
            ["gpu-01", "--ssh", "h", "--rekey", "--package", "--repo-url", "u", "--repo-key", "k"],
            refusal("package_on_rekey"),
        ),
        (["a" * 65, "--ssh", "h", "--set-hostname"], "a host name at most 64"),
        (["gpu-01", "--hosts", "f"], "give it without NODE, --ssh and --port"),
        (["gpu-01", "--ssh", "h", "--package"], "--package installs from a signed repository"),
        (["gpu-01", "--ssh", "h", "--repo-url", "https://r"], "and those two only with --package"),
    ],
)
def test_usage(api: OnboardAPI, args: list[str], says: str) -> None:
    out = api.ctl("onboard", *args)
    assert out.exit_code == 2, out.output
    assert says in " ".join(out.stderr.split())
    assert api.calls == [] and ssh_log(api) == ""


def test_many_hosts_one_failing(
    api: OnboardAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h2=refuse")
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-01 root@h1\ngpu-02 root@h2\ngpu-03 root@h3\n")
    out = api.ctl("onboard", "--hosts", str(hosts), "--parallel", "3", "--wait-ssh", "0")
    assert out.exit_code == 1
    table = out.stdout[out.stdout.index("NODE  ") :].splitlines()
    assert table[0].split() == ["NODE", "RESULT", "TIME", "ERROR"]
    assert table[1].split()[:2] == ["gpu-01", "online"]
    assert table[2].split()[:2] == ["gpu-02", "failed"]
    assert "ssh could not reach root@h2 (ssh: connect to host h2 port 22" in table[2]
    assert table[3].split()[:2] == ["gpu-03", "online"]
    assert "1 of 3 hosts failed: gpu-02; their tokens are revoked" in out.stderr
    assert {n: v["state"] for n, v in api.nodes.items()} == {
        "gpu-01": "approved",
        "gpu-03": "approved",
    }
    # Run again: the two online are skipped, the third tried again.
    monkeypatch.setenv("FAKE_SSH_HOSTS", "")
    api.calls.clear()
    again = api.ctl("onboard", "--hosts", str(hosts))
    assert again.exit_code == 0, again.output
    assert "gpu-01  skipped: already online; nothing done" in again.stdout
    posts = [p for m, p, _ in api.calls if m == "POST"]
    assert posts == ["/api/join-tokens", "/api/nodes/gpu-02/approve"]


def test_per_host_options_replace_the_command_lines(api: OnboardAPI, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(
        "- node: gpu-01\n  ssh: root@h1\n  models_root: /srv/a\n"
        "- node: gpu-02\n  ssh: root@h2\n  ssh_option: [ConnectTimeout=3]\n"
    )
    out = api.ctl("onboard", "--hosts", str(hosts), "--models-root", "/srv/all")
    assert out.exit_code == 0, out.output
    minted = {
        b["node"]: b["facts"]["models_root"] for m, p, b in api.calls if p == "/api/join-tokens"
    }
    assert minted == {"gpu-01": "/srv/a", "gpu-02": "/srv/all"}
    assert "ConnectTimeout=3" in next(
        line for line in ssh_log(api).splitlines() if "root@h2" in line
    )


def test_a_bad_hosts_file_touches_nothing(api: OnboardAPI, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-01 root@h1\ngpu-01 root@h2\n")
    out = api.ctl("onboard", "--hosts", str(hosts))
    assert out.exit_code == 2
    assert "line 2: node gpu-01 is listed already (line 1)" in out.stderr
    assert api.calls == [] and ssh_log(api) == ""


def test_package_asks_for_the_package_verb(api: OnboardAPI) -> None:
    out = api.ctl(
        "onboard", "gpu-01", "--ssh", "h1", "--package",
        "--repo-url", "https://repo.example.net/llmgw", "--repo-key", "/etc/llmgw/repo.asc",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert api.calls[1][2]["package"] == {
        "repo_url": "https://repo.example.net/llmgw",
        "repo_key": "/etc/llmgw/repo.asc",
    }


OFFLINE = {
    "state": "approved",
    "connected": False,
    "fingerprint": "sha256:" + "0" * 64,
    "cpus": 8,
    "gpus": [],
    "health": "healthy",
}


@pytest.mark.parametrize("state", ["approved", "pending"])
def test_a_node_id_that_exists_is_refused_without_rekey_or_re_pair(
    api: OnboardAPI, state: str
) -> None:
    """Today's trap: onboarding gpu-01 again silently joined it afresh (a new uid, its old
    certificates denied). Now nothing is minted and nothing runs on the host."""
    api.nodes["gpu-01"] = {**OFFLINE, "state": state}
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 1
    assert (
        f"node gpu-01 exists already ({state}, not connected), and onboarding it again would "
        "join it afresh: a new uid, its old certificates denied. If root@h1 is that node, add "
        "--rekey (its state directory /var/lib/llmgw-agent is there) or --re-pair (it is "
        "gone); to put another machine under this id, revoke the old node first: llmgw ctl "
        "revoke gpu-01"
    ) in out.stderr
    assert api.minted == 0 and ssh_log(api) == ""


def test_rekey_mints_a_rekey_token_and_keeps_the_approval(api: OnboardAPI) -> None:
    api.nodes["gpu-01"] = dict(OFFLINE)
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--rekey")
    assert out.exit_code == 0, out.output
    assert api.calls[1] == (
        "POST",
        "/api/join-tokens",
        {"node": "gpu-01", "ttl": 1800, "rekey": True},
    )
    fp = api.fingerprints["h1"]
    assert "gpu-01  rekey\n" in out.output
    assert f"gpu-01  approve: {fp} (approved already: a rekey keeps its approval)\n" in out.output
    assert ("POST", "/api/nodes/gpu-01/approve") not in [(m, p) for m, p, _ in api.calls]
    assert out.output.endswith("gpu-01  online: 8 CPUs, 0 GPUs, healthy\n")


@pytest.mark.parametrize("flag", ["--re-pair", "--lost-state"])
def test_re_pair_re_pairs_and_approves_by_fingerprint(api: OnboardAPI, flag: str) -> None:
    api.nodes["gpu-01"] = dict(OFFLINE)
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", flag)
    assert out.exit_code == 0, out.output
    old = "warning: --lost-state is the old name of --re-pair; use --re-pair"
    assert (old in out.stderr) is (flag == "--lost-state")
    assert api.calls[1][2] == {"node": "gpu-01", "ttl": 1800, "rekey": True, "re_pair": True}
    assert api.calls[3] == (
        "POST", "/api/nodes/gpu-01/approve", {"fingerprint": api.fingerprints["h1"]}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (None, "node gpu-01 does not exist on this control plane, so there is nothing to rekey"),
        ({**OFFLINE, "state": "revoked"}, "node gpu-01 is revoked, and a revoked node comes"),
    ],
)
def test_rekey_needs_a_node_to_rekey(
    api: OnboardAPI, record: dict[str, Any] | None, says: str
) -> None:
    if record is not None:
        api.nodes["gpu-01"] = record
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--rekey")
    assert out.exit_code == 1
    assert says in out.stderr
    assert api.minted == 0 and ssh_log(api) == ""


def test_wait_ssh_retries_an_install_session_that_is_cut_off(
    api: OnboardAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sshd restarting under cloud-init, between the probe and the install (where the
    guide's own script stalled): the install session is tried again, with the same token."""
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h1=cut")
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 0, out.output
    assert (
        "gpu-01  install: root@h1: no answer yet, or cut off (sshd restarting?); trying again\n"
        in out.output
    )
    assert api.minted == 1 and api.revoked == []
    (api.root / "h1.cut").unlink()
    api.nodes.clear()
    (api.root / "host-of" / "gpu-01").unlink()
    once = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--wait-ssh", "0")
    assert once.exit_code == 1
    assert "ssh could not reach root@h1 (Connection to h1 closed by remote host.)" in once.stderr
    assert api.revoked == ["jt2"]


def test_a_new_host_key_is_accepted_only_when_asked_and_its_fingerprint_shown(
    api: OnboardAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SSH_HOSTS", "h1=newkey")
    refused = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert refused.exit_code == 1
    assert "let onboard accept an unknown key with --accept-new-host-key" in refused.stderr
    assert api.minted == 0
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--accept-new-host-key")
    assert out.exit_code == 0, out.output
    assert (
        "gpu-01  connect: root@h1: accepted its new host key SHA256:newnewnew (ssh-ed25519) into "
        "known_hosts; compare it with the machine's own (ssh-keygen -lf "
        "/etc/ssh/ssh_host_*_key.pub on its console, or its provisioning system's)\n"
    ) in out.output
    sessions = ssh_log(api).splitlines()[1:]
    assert all("StrictHostKeyChecking=accept-new" in line for line in sessions)
    assert " -v " in sessions[0] and " -v " not in sessions[1]  # ssh -v for the probe only


def test_one_name_for_host_and_node(api: OnboardAPI) -> None:
    """A machine called otherwise is warned about; --set-hostname names it after the node
    (and its 127.0.1.1 line in /etc/hosts, so that the name resolves)."""
    etc_hosts = Path("/etc/hosts").read_bytes()
    (api.root / "h1.hostname").write_text("ip-10-0-0-5\n")
    warned = api.ctl("--json", "onboard", "gpu-01", "--ssh", "root@h1")
    assert warned.exit_code == 0, warned.output
    warning = (
        "root@h1 is called ip-10-0-0-5, not gpu-01: one name for host, node and certificate "
        "keeps logs, alerts and the console in step; --set-hostname names it gpu-01"
    )
    assert f"gpu-01  connect: warning: {warning}\n" in warned.stderr
    assert json.loads(warned.stdout)["warnings"] == [warning]
    api.nodes.clear()
    (api.root / "host-of" / "gpu-01").unlink()
    (api.root / "h1").mkdir(exist_ok=True)
    (api.root / "h1" / "hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tip-10-0-0-5\n")
    named = api.ctl("onboard", "gpu-01", "--ssh", "root@h1", "--set-hostname")
    assert named.exit_code == 0, named.output
    assert "warning" not in named.output
    assert "gpu-01  hostname: gpu-01 (was ip-10-0-0-5)\n" in named.output
    assert (api.root / "h1.hostname").read_text() == "gpu-01\n"
    assert (api.root / "h1" / "hosts").read_text() == "127.0.0.1\tlocalhost\n127.0.1.1\tgpu-01\n"
    assert Path("/etc/hosts").read_bytes() == etc_hosts  # the test machine's own, untouched


def test_a_degraded_node_says_why_and_engines_being_installed_are_said(api: OnboardAPI) -> None:
    why = (
        "engine vllm (/opt/vllm/bin/vllm) will not run: exit 127; ldd: libcudart.so.12 => "
        "not found; install its CUDA runtime"
    )
    api.inventory = {"health": "degraded", "degraded": [{"code": "engine", "message": why}]}
    api.engines = [
        {"node": "gpu-01", "engine": "vllm", "desired": "0.33.0", "state": "installing"},
        {"node": "gpu-01", "engine": "sglang", "desired": "0.5.0", "state": "no-build",
         "reason": "no sglang 0.5.0 build for its architecture arm64"},
    ]  # fmt: skip
    out = api.ctl("onboard", "gpu-01", "--ssh", "root@h1")
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[-2:] == [
        "gpu-01  engines: installing vllm 0.33.0; no sglang 0.5.0 build for its architecture "
        "arm64 (the control plane's desired engines: follow them with 'llmgw ctl engines')",
        f"gpu-01  online: 8 CPUs, 0 GPUs, degraded: {why}",
    ]
