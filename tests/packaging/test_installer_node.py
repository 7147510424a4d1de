"""install-agent.sh and the node guides (issue 37), in the sandbox of test_installer_runs:
the node's own address (--node-address, the old --address, --mgmt-interface), the lines it
prints (what it did and where, never the join's staging copy nor a step it does itself), a
bare --fabric NAME taking the active InfiniBand adapters found at install (by the real
'llmgw agent render-facts'), and model and cache roots edited by hand in agent.yaml kept by
the next install and upgrade."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ci import require_tools, unavailable

from .installer_sandbox import (
    CONFIG,
    DROPIN,
    INSTALLER,
    JOIN,
    RECORD,
    Sandbox,
    config,
    managed,
    restarted,
)

LLMGW = Path(sys.executable).parent / "llmgw"


def test_the_nodes_own_address_goes_into_agent_yaml_and_is_kept(sandbox: Sandbox) -> None:
    first = sandbox.run("install", *JOIN, "--node-address", "10.0.0.5", token="t0ken")
    assert first.returncode == 0, first.stderr
    assert managed(sandbox)[2] == 'mgmt_addr: "10.0.0.5"'
    assert "==> address: --node-address 10.0.0.5 (was none in @/etc/llmgw/agent.yaml)" in (
        sandbox.said(first)
    )
    # A re-run without it keeps it (agent.yaml says it), changes and restarts nothing.
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    assert "==> address: keeping --node-address 10.0.0.5 from @/etc/llmgw/agent.yaml" in (
        sandbox.said(again)
    )
    assert managed(sandbox)[2] == 'mgmt_addr: "10.0.0.5"' and not restarted(sandbox)
    # The interface instead: the address goes (the agent refuses both), the agent restarts.
    moved = sandbox.run("install", *JOIN, "--mgmt-interface", "eth1")
    assert moved.returncode == 0, moved.stderr
    assert (
        "==> address: --mgmt-interface eth1 (was --node-address 10.0.0.5 in "
        "@/etc/llmgw/agent.yaml)" in sandbox.said(moved)
    )
    assert managed(sandbox)[2] == 'mgmt_interface: "eth1"'
    assert "mgmt_addr" not in config(sandbox) and restarted(sandbox)
    cleared = sandbox.run("install", *JOIN, "--mgmt-interface", "none")
    assert cleared.returncode == 0, cleared.stderr
    assert "mgmt_" not in config(sandbox)


def test_address_is_the_old_name_and_says_so(sandbox: Sandbox) -> None:
    old = sandbox.run("install", *JOIN, "--address", "fd00::5", token="t0ken")
    assert old.returncode == 0, old.stderr
    assert sandbox.said(old)[0] == (
        "warning: --address is now --node-address (this node's own address; 'llmgw ctl "
        "join-command --address' is the control plane's); --address still works, for now"
    )
    # Quoted: YAML would read some IPv6 addresses (1:2:3:4:5:6:7:8) as numbers.
    assert managed(sandbox)[2] == 'mgmt_addr: "fd00::5"'


def test_an_address_set_by_hand_is_kept_unless_an_option_replaces_it(sandbox: Sandbox) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    path = sandbox.root / CONFIG
    path.write_text("mgmt_addr: 10.0.0.9  # the storage network\n" + path.read_text())
    kept = sandbox.run("install", *JOIN)
    assert kept.returncode == 0, kept.stderr
    assert config(sandbox).startswith("mgmt_addr: 10.0.0.9  # the storage network\n")
    assert "==> address: keeping --node-address 10.0.0.9 from @/etc/llmgw/agent.yaml" in (
        sandbox.said(kept)
    )
    replaced = sandbox.run("install", *JOIN, "--mgmt-interface", "bond0.100")
    assert replaced.returncode == 0, replaced.stderr
    assert "10.0.0.9" not in config(sandbox)
    assert managed(sandbox)[2] == 'mgmt_interface: "bond0.100"'


def test_bad_addresses_are_refused_before_anything_changes(sandbox: Sandbox) -> None:
    for args, piece in (
        (("--node-address", "10.0.0.5", "--mgmt-interface", "eth1"), "give one: the address"),
        (("--node-address", "gpu-01.lan"), "--node-address gpu-01.lan is not an IP address"),
        (("--mgmt-interface", "eth1;reboot"), "is not a network interface name"),
        (("--mgmt-interface", "enp1s0f0np0abcde"), "at most 15 letters"),
        (("--node-address", "10.0.0.5", "--address", "10.0.0.6"), "given twice"),
    ):
        refused = sandbox.run("install", *JOIN, *args, token="t0ken")
        assert refused.returncode == 1, args
        assert piece in refused.stderr, (args, refused.stderr)
        assert not (sandbox.root / CONFIG).exists()
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    upgrade = sandbox.run("upgrade", "--node-address", "10.0.0.5", bundle="b2")
    assert upgrade.returncode == 1
    assert "'upgrade' takes no options but --ca-hash" in upgrade.stderr


def test_an_install_says_what_it_did_and_where(sandbox: Sandbox) -> None:
    """The join's own report is for a join run by hand: under the installer it names neither
    its staging copy of agent.yaml (a file that is deleted) nor a start the installer does
    itself; the installer names the real agent.yaml and what it did to the service."""
    fresh = sandbox.run("install", *JOIN, token="t0ken")
    assert fresh.returncode == 0, fresh.stderr
    stage = os.environ.get("TMPDIR", "/tmp")
    assert f"{stage}/tmp." not in fresh.stderr and "/join/agent.yaml" not in fresh.stderr
    assert "systemctl enable --now" not in fresh.stderr
    said = sandbox.said(fresh)
    assert "==> config: @/etc/llmgw/agent.yaml (written)" in said
    assert said[-3:] == [
        "==> service: starting llmgw-agent.service (enabled: it starts at boot)",
        "==> service: llmgw-agent.service is active and listens on :9443",
        "==> done: llmgw 1.0.0 installed (@/usr/local/lib/llmgw-agent/llmgw)",
    ]
    # The join's approval step is kept: it is the operator's to do.
    assert "next: ask the operator to approve it: llmgw ctl approve n1" in fresh.stderr
    rekeyed = sandbox.run("rekey", *JOIN[2:], token="t0ken")
    assert rekeyed.returncode == 0, rekeyed.stderr
    assert "restart the agent" not in rekeyed.stderr
    assert sandbox.said(rekeyed) == [
        "==> rekey: stopping llmgw-agent.service; it starts again when the rekey is done, or fails",
        "==> update helper: trusts the cluster CA in @/etc/llmgw/update/ca.pem",
        "==> service: starting llmgw-agent.service on its new identity "
        "(@/var/lib/llmgw-agent/node.crt)",
        "==> done: node n1 rekeyed; the agent runs on its new identity",
    ]


def test_the_agents_programs_get_only_their_environment_and_the_installers_mark(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    """agent_run itself (the sandbox's stand-in replaces it elsewhere): as the service user,
    the environment reset to what it names, LLMGW_BY_INSTALLER=1 and the token among it."""
    require_tools("setpriv", "setsid")
    # A user with a group of its own name, as the service user has (Debian's nobody has not).
    user = "daemon"
    if subprocess.run(["getent", "group", user], capture_output=True).returncode:
        unavailable(f"no group {user} here; this test runs a program as that user")
    body = INSTALLER.read_text().rstrip("\n").rsplit("\n", 1)[0]
    script = tmp_path / "run.sh"
    script.write_text(
        body.replace("/var/lib/", f"{sandbox.root}/var/lib/")
        + f"\nSERVICE_USER={user}\nSTAGE=$(mktemp -d)\n"
        + 'agent_run "t0ken" /usr/bin/env\nrm -rf "$STAGE"\n'
    )
    done = subprocess.run(
        ["sh", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SECRET_OF_ROOT": "x"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stderr.splitlines() if "=" in line)
    assert env["LLMGW_BY_INSTALLER"] == "1" and env["LLMGW_JOIN_TOKEN"] == "t0ken"
    assert "SECRET_OF_ROOT" not in env and env["HOME"] == "/nonexistent"


def real_render_facts(sandbox: Sandbox, bundle: str = "b1") -> None:
    """The bundle's llmgw answers render-facts as the real one does (it is the real one)."""
    fake = sandbox.root / bundle / "llmgw"
    fake.rename(fake.with_name("llmgw.fake"))
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$2" = render-facts ]; then exec {LLMGW} "$@"; fi\n'
        f'exec {fake.with_name("llmgw.fake")} "$@"\n'
    )
    fake.chmod(0o755)


def ib_port(root: Path, adapter: str, state: str, layer: str = "InfiniBand") -> None:
    port = root / adapter / "ports" / "1"
    port.mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(f"{state}\n")
    (port / "link_layer").write_text(f"{layer}\n")


def test_a_bare_fabric_name_takes_the_active_adapters_found_at_install(
    sandbox: Sandbox,
) -> None:
    """The guide's '--fabric ib-b': the adapters with an ACTIVE InfiniBand port, listed in
    the output, written to agent.yaml and recorded as found, so a re-run (an adapter gone
    down meanwhile) keeps them rather than looking again."""
    real_render_facts(sandbox)
    ib = sandbox.root / "ib"
    ib_port(ib, "mlx5_0", "4: ACTIVE")
    ib_port(ib, "mlx5_1", "1: DOWN")
    ib_port(ib, "mlx5_2", "4: ACTIVE")
    ib_port(ib, "mlx5_3", "4: ACTIVE", "Ethernet")
    first = sandbox.run("install", *JOIN, "--fabric", "ib-b", "--ib-root", str(ib), token="t")
    assert first.returncode == 0, first.stderr
    assert (
        "==> facts: --fabric ib-b takes the active InfiniBand adapters in @/ib: mlx5_0, mlx5_2 "
        "(kept as --fabric ib-b:mlx5_0,mlx5_2)" in sandbox.said(first)
    )
    assert managed(sandbox)[2:6] == ["fabrics:", "- name: ib-b", "  hcas:", "  - mlx5_0"]
    assert managed(sandbox)[6] == "  - mlx5_2"
    assert "fabric ib-b:mlx5_0,mlx5_2" in (sandbox.root / RECORD).read_text().splitlines()
    ib_port(ib, "mlx5_2", "1: DOWN")  # found once, never looked for again
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    assert "==> facts: keeping --fabric ib-b:mlx5_0,mlx5_2 from the last install" in (
        sandbox.said(again)
    )
    # A bare name where no adapter is active: refused, with the fix, nothing changed.
    before = config(sandbox)
    ib_port(ib, "mlx5_0", "1: DOWN")
    refused = sandbox.run("install", *JOIN, "--fabric", "ib-c")
    assert refused.returncode == 1
    assert sandbox.said(refused)[-1] == (
        "error: node facts: --fabric: ib-c names no adapters, so it takes this node's active "
        "InfiniBand adapters, and @/ib has none; bring their links up (ibstat), or list the "
        "adapters: --fabric ib-c:HCA,HCA. Nothing was changed"
    )
    assert config(sandbox) == before


def test_roots_edited_in_agent_yaml_are_kept_by_install_and_upgrade(sandbox: Sandbox) -> None:
    assert sandbox.run("install", *JOIN, token="t0ken").returncode == 0
    path = sandbox.root / CONFIG
    hand = sandbox.root / "data" / "models"
    hand.parent.mkdir(mode=0o755)
    default = f"{sandbox.root}/srv/llmgw/models"
    path.write_text(path.read_text().replace(f"models_root: {default}", f'models_root: "{hand}"'))
    again = sandbox.run("install", *JOIN)
    assert again.returncode == 0, again.stderr
    assert (
        "==> facts: keeping --models-root @/data/models from @/etc/llmgw/agent.yaml (edited "
        "there; the last install had @/srv/llmgw/models)" in sandbox.said(again)
    )
    assert managed(sandbox)[0] == f"models_root: {hand}"
    assert f"ReadWritePaths=-{hand} -" in (sandbox.root / DROPIN).read_text()
    assert f"models_root {hand}" in (sandbox.root / RECORD).read_text()
    assert hand.is_dir() and restarted(sandbox)
    # Edited again, then upgraded: agent.yaml keeps it (an upgrade with facts rewrites the
    # file), and the upgrade says the unit may not write there until install runs.
    other = sandbox.root / "data" / "m2"
    path.write_text(path.read_text().replace(f"models_root: {hand}", f"models_root: {other}"))
    upgraded = sandbox.run("upgrade", "--engine", "vllm=/opt/vllm/bin/vllm", bundle="b2")
    assert upgraded.returncode == 0, upgraded.stderr
    assert managed(sandbox)[0] == f"models_root: {other}"
    assert (
        "warning: @/etc/llmgw/agent.yaml names models_root @/data/m2 and cache_root "
        f"@/srv/llmgw/cache, and the agent's unit may write -{hand} -{sandbox.root}/srv/llmgw/"
        "cache (@/etc/systemd/system/llmgw-agent.service.d/10-install.conf); run "
        "'install-agent.sh install' (no options needed: it keeps agent.yaml's roots) to make "
        "their folders and let the agent write there"
    ).replace(str(sandbox.root), "@") in sandbox.said(upgraded)
