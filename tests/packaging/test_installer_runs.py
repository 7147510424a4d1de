"""install-agent.sh's verbs run whole, in a sandbox: the installer's text with every path it
manages moved under a temporary directory, the service user ``nobody``, and the commands
that would change the host (systemctl, useradd, loginctl, apt-get, chown ...) replaced by
stand-ins that record their calls. What is checked is the run order (the numbered steps, one
block at the end of the script) and what "changed?" decides: a re-run changes and restarts
nothing, a changed drop-in restarts the agent, an upgrade keeps the previous binary and rolls
back when the new one does not come up. The real thing, in systemd containers, is the dry
run's (tests/dryrun)."""

from __future__ import annotations

from pathlib import Path

from .installer_sandbox import JOIN, SERVICE_USER, Sandbox


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
