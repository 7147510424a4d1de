"""install-agent.sh's node life (issue 13) in the sandbox of test_installer_runs: node facts
written to agent.yaml and remembered, the model and cache roots remembered, re-pair with
--node-uid, the --rekey spelling of the verb, /usr/local/bin/llmgw, the multi-node port
range in the firewall, and the pre-flight (systemd >= 247, the warnings for what the node
lacks). The real agent's parser of node facts is tested in tests/unit (render-facts); the
installer in systemd containers in tests/dryrun."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.ci import require_tools

from .installer_sandbox import CONFIG, DROPIN, JOIN, RECORD, Sandbox, config, managed, restarted

LINK = Path("usr/local/bin/llmgw")


def test_node_facts_go_into_agent_yaml_and_are_remembered(sandbox: Sandbox) -> None:
    smi = "/opt/nvidia/bin/nvidia-smi"
    first = sandbox.run(
        "install", *JOIN, "--fabric", "ib-b:mlx5_2", "--nvidia-smi", smi,
        "--engine", "vllm=/opt/vllm/bin/vllm", token="t0ken",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    # The installer hands the facts to the agent's one parser and writes what it printed.
    assert (sandbox.root / "render-facts-args").read_text().split() == [
        "--fabric", "ib-b:mlx5_2", "--engine", "vllm=/opt/vllm/bin/vllm", "--nvidia-smi", smi,
    ]  # fmt: skip
    block = managed(sandbox)
    assert block[:2] == [
        f"models_root: {sandbox.root}/srv/llmgw/models",
        f"cache_root: {sandbox.root}/srv/llmgw/cache",
    ]
    assert block[2:] == [
        "fabrics:", "- name: ib-b", "  hcas:", "  - mlx5_2",
        "engines:", "  vllm:", "    bin: /opt/vllm/bin/vllm",
        "discovery:", f"  nvidia_smi: {smi}",
    ]  # fmt: skip
    # Facts are not the join's: 'agent join' writes no agent.yaml keys of its own here.
    assert "--fabric" not in (sandbox.root / "join-args").read_text()
    # A re-run without them keeps them, says so, changes and restarts nothing.
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    said = sandbox.said(again)
    assert "==> facts: keeping --fabric ib-b:mlx5_2 from the last install" in said
    assert (
        "==> facts: keeping --nvidia-smi /opt/nvidia/bin/nvidia-smi from the last install" in said
    )
    assert managed(sandbox)[2:] == block[2:]
    assert not restarted(sandbox)
    # Other values change them, say what they were, and restart the agent.
    other = sandbox.run("install", *JOIN, "--fabric", "ib-a:mlx5_0", "--engine", "none")
    assert other.returncode == 0, other.stderr
    assert "==> facts: --fabric ib-a:mlx5_0 (was ib-b:mlx5_2)" in sandbox.said(other)
    assert "==> facts: --engine none (was vllm=/opt/vllm/bin/vllm)" in sandbox.said(other)
    assert managed(sandbox)[2:] == [
        "fabrics:", "- name: ib-a", "  hcas:", "  - mlx5_0",
        "discovery:", f"  nvidia_smi: {smi}",
    ]  # fmt: skip
    assert restarted(sandbox)
    assert (sandbox.root / RECORD).read_text().splitlines()[2:] == [
        "fabric ib-a:mlx5_0",
        f"nvidia_smi {smi}",
    ]
    cleared = sandbox.run("install", *JOIN, "--fabric", "none", "--nvidia-smi", "none")
    assert cleared.returncode == 0, cleared.stderr
    assert len(managed(sandbox)) == 2, managed(sandbox)
    status = sandbox.run("status")
    assert "models-root: " in status.stdout


def test_the_model_and_cache_roots_are_remembered(sandbox: Sandbox) -> None:
    models, cache = sandbox.root / "data" / "models", sandbox.root / "data" / "cache"
    (sandbox.root / "data").mkdir(mode=0o755)
    first = sandbox.run("install", "--models-root", str(models), "--cache-root", str(cache))
    assert first.returncode == 0, first.stderr
    expected = f"ReadWritePaths=-{models} -{cache}"
    assert expected in (sandbox.root / DROPIN).read_text()
    # The trap this closes: a re-run without them reset the drop-in to /srv/llmgw/*.
    again = sandbox.run("install")
    assert again.returncode == 0, again.stderr
    assert expected in (sandbox.root / DROPIN).read_text()
    assert "==> facts: keeping --models-root @/data/models from the last install" in (
        sandbox.said(again)
    )
    moved = sandbox.run("install", "--models-root", str(sandbox.root / "data" / "m2"))
    assert "==> facts: --models-root @/data/m2 (was @/data/models)" in sandbox.said(moved)
    assert f"ReadWritePaths=-{sandbox.root}/data/m2 -{cache}" in (sandbox.root / DROPIN).read_text()


def test_an_install_older_than_the_record_keeps_the_roots_its_agent_yaml_names(
    sandbox: Sandbox,
) -> None:
    models = sandbox.root / "old-models"
    assert (
        sandbox.run("install", *JOIN, "--models-root", str(models), token="t0ken").returncode == 0
    )
    (sandbox.root / RECORD).unlink()  # as an installer without the record left it
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    assert f"ReadWritePaths=-{models} " in (sandbox.root / DROPIN).read_text()


@pytest.mark.parametrize(
    ("args", "piece"),
    [
        (("--fabric", "bad:mlx5_0"), "error: node facts: --fabric: 'bad:mlx5_0' does not start"),
        (("--fabric", "ib a"), "--fabric 'ib a' is not NAME:HCA[,HCA...]"),
        (("--engine", "vllm=/x", "--engine", "none"), "--engine none clears what an earlier"),
        (("--nvidia-smi", "nvidia-smi"), "--nvidia-smi 'nvidia-smi' is not an absolute path"),
        (("--ib-root", "/sys/class/$x"), "--ib-root '/sys/class/$x' holds a character other"),
        (("--ib-root", "/a", "--ib-root", "/b"), "--ib-root is given twice"),
        (("--models-root", "/srv/../etc"), "holds '.' or '..' components"),
        (("--fabric-peers", "10.0.0.0/99"), "--fabric-peers 10.0.0.0/99: the prefix length"),
        (("--node-uid", "u1"), "--node-uid re-pairs a node: it goes with --node-id"),
    ],
)
def test_bad_facts_are_refused_before_anything_changes(
    sandbox: Sandbox, args: tuple[str, ...], piece: str
) -> None:
    result = sandbox.run("install", *args)
    assert result.returncode != 0
    assert piece in result.stderr, result.stderr
    assert not (sandbox.root / "usr" / "local" / "lib" / "llmgw-agent").exists()
    assert not (sandbox.root / "srv").exists()


def test_a_fact_key_set_by_hand_is_not_overwritten(sandbox: Sandbox) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    path = sandbox.root / CONFIG
    path.write_text("discovery:\n  sysfs_root: /host/sys\n" + path.read_text())
    before = path.read_text()
    refused = sandbox.run("install", *JOIN, "--nvidia-smi", "/usr/bin/nvidia-smi")
    assert refused.returncode == 1
    assert "sets 'discovery:' itself (line 1)" in refused.stderr, refused.stderr
    assert path.read_text() == before


def test_re_pair_with_node_uid(sandbox: Sandbox) -> None:
    uid = "0123456789abcdef0123456789abcdef"
    assert sandbox.run("install").returncode == 0  # the agent is installed, the state is gone
    repaired = sandbox.run(
        "install", *JOIN, "--node-uid", uid, "--fabric", "ib-a:mlx5_0", token="t"
    )
    assert repaired.returncode == 0, repaired.stderr
    assert f"==> join: re-pairing as uid {uid} (it needs approval by fingerprint again)" in (
        sandbox.said(repaired)
    )
    assert f"--node-uid {uid}" in (sandbox.root / "join-args").read_text()
    assert managed(sandbox)[2] == "fabrics:"
    # With its identity still there, a re-pair is refused (a rekey is what it needs).
    again = sandbox.run("install", *JOIN, "--node-uid", uid, token="t")
    assert again.returncode == 1
    assert "this node still has its identity" in again.stderr
    assert "'llmgw ctl join-command --rekey n1'" in again.stderr
    bad = sandbox.run("install", *JOIN, "--node-uid", "a b", token="t")
    assert "--node-uid 'a b' is not a node uid" in bad.stderr


def test_rekey_is_also_spelled_dash_dash_rekey_and_keeps_the_facts_as_they_are(
    sandbox: Sandbox,
) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    rekeyed = sandbox.run("--rekey", *JOIN[2:], token="t1")
    assert rekeyed.returncode == 0, rekeyed.stderr
    assert (
        sandbox.said(rekeyed)[-1] == "==> done: node n1 rekeyed; the agent runs on its new identity"
    )
    assert "--rekey" in (sandbox.root / "join-args").read_text()
    refused = sandbox.run("rekey", *JOIN[2:], "--fabric", "ib-a:mlx5_0", token="t1")
    assert refused.returncode == 1
    assert "rekey keeps agent.yaml, the drop-in and the firewall as they are" in refused.stderr
    lost = sandbox.run("rekey", *JOIN[2:], "--node-uid", "u1", token="t1")
    assert "re-pairs with 'install --node-uid UID'" in lost.stderr


def test_upgrade_takes_node_facts_and_writes_them_once_the_new_version_runs(
    sandbox: Sandbox,
) -> None:
    assert sandbox.run("install", *JOIN, "--fabric", "ib-a:mlx5_0", token="t0ken").returncode == 0
    upgraded = sandbox.run("upgrade", "--engine", "vllm=/opt/v/bin/vllm", bundle="b2")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "==> facts: the agent runs with them" in sandbox.said(upgraded)
    assert "engines:" in managed(sandbox)
    assert "fabrics:" in managed(sandbox)  # kept from the install
    refused = sandbox.run("upgrade", "--models-root", "/data", bundle="b2")
    assert refused.returncode == 1
    assert "the others are install's" in refused.stderr


def test_usr_local_bin_llmgw_is_the_installed_binary_and_goes_with_it(sandbox: Sandbox) -> None:
    assert sandbox.run("install").returncode == 0
    link = sandbox.root / LINK
    assert os.readlink(link) == f"{sandbox.root}/usr/local/lib/llmgw-agent/llmgw"
    assert f"command:    {link} -> " in sandbox.run("status").stdout
    assert sandbox.run("uninstall").returncode == 0
    assert not link.exists() and not link.is_symlink()
    # An operator's own llmgw there is left alone, and said.
    link.write_text("#!/bin/sh\necho mine\n")
    result = sandbox.run("install")
    assert result.returncode == 0, result.stderr
    assert any(
        line.startswith(f"warning: @/{LINK} exists and is not this installer's link")
        for line in sandbox.said(result)
    )
    assert sandbox.run("uninstall").returncode == 0
    assert link.read_text() == "#!/bin/sh\necho mine\n"


def test_a_systemd_older_than_247_is_refused_before_anything_changes(sandbox: Sandbox) -> None:
    (sandbox.root / "sc" / "systemd-version").write_text("245\n")
    result = sandbox.run("install")
    assert result.returncode == 1
    assert "error: systemd 245 is older than 247, which the agent's hardened unit needs" in (
        result.stderr
    )
    assert not (sandbox.root / "usr" / "local" / "lib" / "llmgw-agent").exists()
    (sandbox.root / "sc" / "systemd-version").write_text("247\n")
    assert sandbox.run("install").returncode == 0


def nvidia_gpu(sandbox: Sandbox) -> None:
    device = sandbox.root / "sys" / "bus" / "pci" / "devices" / "0000:17:00.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (device / "class").write_text("0x030200\n")


def path_without(tmp: Path, *names: str) -> str:
    """A PATH of links to every program on this PATH but ``names``."""
    bindir = tmp / "path"
    bindir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            if entry.name in names or (bindir / entry.name).exists():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                (bindir / entry.name).symlink_to(entry.path)
    return str(bindir)


def test_preflight_warns_naming_what_to_install(sandbox: Sandbox, tmp_path: Path) -> None:
    nvidia_gpu(sandbox)
    path = path_without(tmp_path, "nvidia-smi", "nvidia-ctk", "docker", "dockerd")
    result = sandbox.run("install", *JOIN, token="t0ken", path=path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in sandbox.said(result) if line.startswith("warning:")]
    assert warnings == [
        "warning: this node has 1 NVIDIA GPU(s) on its PCI bus but no nvidia-smi on PATH: "
        "install NVIDIA's driver (Debian: apt-get install nvidia-driver; Ubuntu: "
        "ubuntu-drivers install; or your vendor's), or give --nvidia-smi PATH. Until then the "
        "agent reports this node degraded (no GPU driver) and it takes no GPU replicas"
    ]
    # Set to run engines in Docker: Docker and the NVIDIA Container Toolkit are named too.
    (sandbox.root / CONFIG).write_text(config(sandbox) + "runtime: docker\n")
    docker = sandbox.run("install", *JOIN, path=path)
    said = " ".join(sandbox.said(docker))
    assert "but Docker is not installed: apt-get install docker.io" in said
    assert "the NVIDIA Container Toolkit is not installed: install nvidia-container-toolkit" in said
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    given = sandbox.run("install", *JOIN, "--nvidia-smi", str(smi), path=path)
    assert "NVIDIA GPU(s) on its PCI bus" not in " ".join(sandbox.said(given))
    missing = sandbox.run("install", *JOIN, "--nvidia-smi", "/opt/none/nvidia-smi", path=path)
    assert "--nvidia-smi is /opt/none/nvidia-smi but it is not an executable" in missing.stderr


def test_preflight_requires_bubblewrap_and_says_how_to_allow_its_user_namespaces(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    """The agent runs process engines under bwrap: without it nothing is installed, and a
    host that turns unprivileged user namespaces off is told which setting and its fix, in
    the agent's own words (llmgw.agent.bwrap.userns_problem)."""
    from llmgw.agent.bwrap import userns_problem

    require_tools("bwrap", "setpriv")
    missing = sandbox.run("install", *JOIN, token="t0ken", path=path_without(tmp_path, "bwrap"))
    assert missing.returncode != 0
    assert sandbox.said(missing)[-1] == (
        "error: bubblewrap (bwrap) is not installed, and the agent runs process engines in its "
        "sandbox: apt-get install -y bubblewrap (or dnf install -y bubblewrap), then run this "
        "again. Nothing was changed"
    )
    assert not (sandbox.root / "usr/local/lib/llmgw-agent").exists()
    proc_sys = sandbox.root / "proc" / "sys"
    for rel, value in (
        ("kernel/unprivileged_userns_clone", "0"),
        ("kernel/apparmor_restrict_unprivileged_userns", "1"),
        ("user/max_user_namespaces", "0"),
    ):
        (proc_sys / rel).parent.mkdir(parents=True, exist_ok=True)
        (proc_sys / rel).write_text(value + "\n")
    off = sandbox.run("install", *JOIN, token="t0ken")
    assert off.returncode == 0, off.stderr
    # (The sandbox moves /etc/ under its root, in the installer's words too.)
    warnings = [
        line.replace("@/etc/", "/etc/") for line in sandbox.said(off) if line.startswith("warning:")
    ]
    agent_says = userns_problem(proc_sys)
    assert warnings == [
        f"warning: {agent_says}. Until then the agent refuses to start process engines here"
    ]
    for setting in (
        "kernel.unprivileged_userns_clone=0: sysctl -w kernel.unprivileged_userns_clone=1",
        "kernel.apparmor_restrict_unprivileged_userns=1: allow bwrap alone",
        "user.max_user_namespaces=0: sysctl -w user.max_user_namespaces=15000",
    ):
        assert setting in warnings[0]
    # A node that runs only Docker engines needs no bwrap.
    (sandbox.root / CONFIG).write_text(config(sandbox) + "runtime: docker\n")
    (tmp_path / "again").mkdir()
    docker = sandbox.run("install", *JOIN, path=path_without(tmp_path / "again", "bwrap"))
    assert docker.returncode == 0, docker.stderr
    assert "bubblewrap" not in docker.stderr


def test_the_multi_node_range_is_opened_from_the_allowed_sources_only(sandbox: Sandbox) -> None:
    """With ufw (a stand-in that keeps its rules): --firewall-from gets :9443 and the range,
    --fabric-peers the range alone; the range is agent.yaml's (asked of the agent); a re-run
    with other sources moves exactly those rules, and status lists them."""
    ufw = sandbox.root / "bin" / "ufw"
    ufw.write_text(UFW)
    ufw.chmod(0o755)
    result = sandbox.run(
        "install", *JOIN, "--firewall-from", "192.0.2.1", "--fabric-peers", "10.1.0.0/16",
        token="t0ken",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rules = (sandbox.root / "ufw-rules").read_text().splitlines()
    assert sorted(rules) == [
        "10.1.0.0/16 29500:29999",
        "192.0.2.1 29500:29999",
        "192.0.2.1 9443",
    ]
    assert "==> firewall (ufw): 29500-29999/tcp (multi-node replicas) from 10.1.0.0/16" in (
        sandbox.said(result)
    )
    status = sandbox.run("status").stdout
    assert "firewall:   ufw allows 29500-29999/tcp (multi-node replicas) from 10.1.0.0/16" in status
    assert "firewall:   ufw allows :9443/tcp from 192.0.2.1" in status
    # A re-run without them keeps them (the one-liner of a re-pair has none): nothing moves.
    kept = sandbox.run("install", *JOIN)
    assert kept.returncode == 0, kept.stderr
    assert "==> facts: keeping --fabric-peers 10.1.0.0/16 from the last install" in (
        sandbox.said(kept)
    )
    assert not [line for line in sandbox.said(kept) if line.startswith("==> firewall")]
    assert sorted((sandbox.root / "ufw-rules").read_text().splitlines()) == sorted(rules)
    # The range follows agent.yaml; 'none' removes the peers' rules.
    path = sandbox.root / CONFIG
    path.write_text("multinode_ports: 31000-31010\n" + path.read_text())
    moved = sandbox.run("install", *JOIN, "--fabric-peers", "none")
    assert moved.returncode == 0, moved.stderr
    assert sorted((sandbox.root / "ufw-rules").read_text().splitlines()) == [
        "192.0.2.1 31000:31010",
        "192.0.2.1 9443",
    ]
    cleared = sandbox.run("install", *JOIN, "--firewall-from", "none")
    assert "warning: ufw is active and no --firewall-from was given" in " ".join(
        sandbox.said(cleared)
    )
    assert (sandbox.root / "ufw-rules").read_text() == ""
    assert sandbox.run("install", *JOIN, "--firewall-from", "192.0.2.1").returncode == 0
    assert sandbox.run("uninstall").returncode == 0
    assert (sandbox.root / "ufw-rules").read_text() == ""


def test_an_older_firewall_record_without_ports_is_read_as_the_agent_port(
    sandbox: Sandbox,
) -> None:
    ufw = sandbox.root / "bin" / "ufw"
    ufw.write_text(UFW)
    ufw.chmod(0o755)
    assert sandbox.run("install", "--firewall-from", "192.0.2.1").returncode == 0
    record = sandbox.root / "var" / "lib" / "llmgw-agent-install" / "firewall"
    record.write_text("ufw 192.0.2.1\n")
    (sandbox.root / "ufw-rules").write_text("192.0.2.1 9443\n")
    # An install older than the facts record: its firewall's sources are what it keeps.
    (sandbox.root / RECORD).unlink()
    again = sandbox.run("install")
    assert "==> facts: keeping --firewall-from 192.0.2.1 from the last install" in (
        sandbox.said(again)
    )
    assert sorted((sandbox.root / "ufw-rules").read_text().splitlines()) == [
        "192.0.2.1 29500:29999",
        "192.0.2.1 9443",
    ]
    record.write_text("ufw 192.0.2.1\n")
    (sandbox.root / "ufw-rules").write_text("192.0.2.1 9443\n")
    result = sandbox.run("uninstall")
    assert "==> firewall: removing ufw rule for :9443/tcp from 192.0.2.1" in sandbox.said(result)
    assert (sandbox.root / "ufw-rules").read_text() == ""


# ufw as the installer calls it: 'status', 'allow proto tcp from S to any port P comment C',
# 'delete allow proto tcp from S to any port P'; its rules in $T/ufw-rules.
UFW = r"""#!/bin/sh
rules="$T/ufw-rules"
touch "$rules"
case $1 in
    status)
        echo "Status: active"
        while read -r source port; do
            printf '%s/tcp                   ALLOW       %s                 # llmgw-agent\n' "$port" "$source"
        done <"$rules"
        ;;
    allow) echo "$5 $9" >>"$rules" ;;
    delete) grep -vx "$6 ${10}" "$rules" >"$rules.new" || true; mv "$rules.new" "$rules" ;;
esac
"""


def test_help_is_asked_for_with_help_and_answered_on_stdout(sandbox: Sandbox) -> None:
    for word in ("--help", "-h", "help"):
        result = sandbox.run(word)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("Usage: install-agent.sh VERB [OPTIONS]")
        assert "--node-uid UID" in result.stdout and "(also: --rekey)" in result.stdout
    # Without a verb it is a usage error, on stderr.
    bare = sandbox.run()
    assert bare.returncode == 2 and bare.stderr.startswith("Usage: install-agent.sh")


def test_package_refuses_bad_facts_before_the_package_goes_in(sandbox: Sandbox) -> None:
    repo = ("--repo-url", "http://repo", "--repo-key", str(sandbox.root / "repo.key"))
    result = sandbox.run("package", *repo, "--fabric", "bad:mlx5_0")
    assert result.returncode == 1
    assert "node facts: --fabric: 'bad:mlx5_0' does not start" in result.stderr
    assert "Nothing was changed" in result.stderr
    assert not [call for call in sandbox.calls() if call.startswith("apt-get")]
    good = sandbox.run("package", *repo, "--fabric", "ib-a:mlx5_0")
    assert good.returncode == 0, good.stderr
    assert (sandbox.root / "render-facts-args").read_text().split() == ["--fabric", "ib-a:mlx5_0"]
    assert (sandbox.root / RECORD).read_text().splitlines()[-1] == "fabric ib-a:mlx5_0"


@pytest.mark.parametrize(
    ("line", "piece"),
    [
        ("fabric ib;reboot", "--fabric ib;reboot, remembered from the last install"),
        ("nvidia_smi /opt/$(id)", "--nvidia-smi /opt/$(id), remembered from the last install"),
        ("firewall_from 10.0.0.0/99", "--firewall-from 10.0.0.0/99, remembered from the last"),
    ],
)
def test_a_remembered_value_is_checked_again_before_it_is_used(
    sandbox: Sandbox, line: str, piece: str
) -> None:
    """The record is root's, but a hand edit (or a bad copy) must not reach agent.yaml, the
    unit or the firewall unchecked: the re-run stops before it changes anything, and giving
    the option again replaces the bad value."""
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    record = sandbox.root / RECORD
    record.write_text(record.read_text() + line + "\n")
    before = config(sandbox), (sandbox.root / DROPIN).read_text()
    refused = sandbox.run("install", *JOIN)
    assert refused.returncode == 1
    assert piece in refused.stderr, refused.stderr
    assert "nothing was changed" in refused.stderr
    assert (config(sandbox), (sandbox.root / DROPIN).read_text()) == before
    key = line.split()[0]
    option = "--" + key.replace("_", "-")
    value = {
        "fabric": "ib-a:mlx5_0",
        "nvidia_smi": "none",
        "firewall_from": "none",
    }[key]
    fixed = sandbox.run("install", *JOIN, option, value)
    assert fixed.returncode == 0, fixed.stderr


def test_an_older_install_s_hand_edited_root_is_checked_too(sandbox: Sandbox) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    (sandbox.root / RECORD).unlink()
    path = sandbox.root / CONFIG
    path.write_text(path.read_text().replace("models_root: /", "models_root: srv/"))
    refused = sandbox.run("install", *JOIN)
    assert refused.returncode == 1
    assert f"--models-root srv{sandbox.root}/srv/llmgw/models, set as models_root in " in (
        refused.stderr
    )


def test_upgrade_with_facts_refuses_an_agent_yaml_it_cannot_write_them_into(
    sandbox: Sandbox,
) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    path = sandbox.root / CONFIG
    path.write_text(path.read_text().replace("node_id:", "nodeid:"))  # not valid now
    refused = sandbox.run("upgrade", "--fabric", "ib-a:mlx5_0", bundle="b2")
    assert refused.returncode == 1
    assert "which is missing or not valid" in refused.stderr
    installed = sandbox.root / "usr" / "local" / "lib" / "llmgw-agent" / "llmgw"
    assert installed.read_bytes() == (sandbox.root / "b1" / "llmgw").read_bytes()


def test_facts_an_agent_does_not_come_up_with_are_taken_back(sandbox: Sandbox) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    before = config(sandbox)
    # The agent will not start again (the same version: only the facts change).
    (sandbox.root / "sc" / "fail").touch()
    (sandbox.root / "sc" / "active-llmgw-agent.service").unlink()
    failed = sandbox.run("upgrade", "--engine", "vllm=/opt/v/bin/vllm")
    assert failed.returncode == 1
    assert "did not come up with the new node facts" in failed.stderr
    assert config(sandbox) == before
    assert "engine" not in (sandbox.root / RECORD).read_text()  # nor remembered
