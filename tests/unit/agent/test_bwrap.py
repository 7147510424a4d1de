"""llmgw.agent.bwrap: the message a host without user namespaces gets (from each setting, and
from the real bwrap in a user namespace whose max_user_namespaces is 0, through the agent's
shard start), and the host-/proc fallback where a fresh /proc cannot be mounted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmgw.agent.bwrap import HOST_PROC_WARNING, userns_problem
from tests.ci import require_tools, unavailable

ROOT = Path(__file__).resolve().parents[3]


def fake_proc_sys(tmp_path: Path, **values: str) -> Path:
    for rel, value in values.items():
        path = tmp_path / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("setting", "value", "fix"),
    [
        (
            "kernel__unprivileged_userns_clone",
            "0",
            "kernel.unprivileged_userns_clone=0: sysctl -w kernel.unprivileged_userns_clone=1",
        ),
        (
            "kernel__apparmor_restrict_unprivileged_userns",
            "1",
            "kernel.apparmor_restrict_unprivileged_userns=1: allow bwrap alone an unprivileged "
            "user namespace with an AppArmor profile",
        ),
        (
            "user__max_user_namespaces",
            "0",
            "user.max_user_namespaces=0: sysctl -w user.max_user_namespaces=15000",
        ),
    ],
)
def test_each_setting_that_turns_user_namespaces_off_is_named_with_its_fix(
    tmp_path: Path, setting: str, value: str, fix: str
) -> None:
    # The others as a host that allows them has them.
    allowed = {
        "kernel__unprivileged_userns_clone": "1",
        "kernel__apparmor_restrict_unprivileged_userns": "0",
        "user__max_user_namespaces": "63000",
    }
    proc_sys = fake_proc_sys(tmp_path, **{**allowed, setting: value})
    message = userns_problem(proc_sys, "bwrap: No permissions to create new namespace")
    assert message.startswith(
        "engines run in a bubblewrap sandbox, which needs unprivileged user namespaces, and "
        "this host turns them off: "
    )
    assert fix in message
    assert message.count("sysctl -w") + message.count("apparmor_parser") == 1
    assert "set sandbox: false in the profile" in message


def test_without_a_setting_to_blame_the_message_names_the_units_namespaces(tmp_path: Path) -> None:
    message = userns_problem(
        fake_proc_sys(tmp_path), "bwrap: setting up uid map: Permission denied"
    )
    assert "bwrap could not make one (bwrap: bwrap: setting up uid map" in message
    assert "RestrictNamespaces=user mnt pid ipc" in message


def run_child(prelude: str, code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``code`` run by this interpreter as ``tmp_path/child.py`` after the shell ``prelude``,
    which ends by running ``"$0" "$1"`` (the interpreter and the script)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        ["sh", "-c", prelude, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


SHARD_START = """
    import asyncio, sys
    from pathlib import Path
    from llmgw.agent.bwrap import Bubblewrap
    from llmgw.agent.runtimes import ProcessRuntime
    from llmgw.agent.sandbox import SandboxLayout, Sandboxes
    from llmgw.agent.shards import ShardManager, ShardSpec
    from llmgw.errors import ShardError

    tmp = Path(sys.argv[0]).parent
    layout = SandboxLayout.for_node(
        tmp / "state", config_file=tmp / "agent.yaml", key_file=tmp / "state" / "node.key",
        models_root=tmp / "models", cache_root=tmp / "cache",
    )

    async def main() -> None:
        manager = ShardManager(
            tmp / "state", ProcessRuntime(), lambda shard: None,
            sandboxes=Sandboxes(layout, Bubblewrap()),
        )
        await manager.open()
        try:
            await manager.start(ShardSpec(shard_id="s1", replica_id="r1", model="m", engine="sim"))
            print("started")
        except ShardError as exc:
            print("refused:", exc)
        finally:
            await manager.stop_all(5.0)
            await manager.close()

    asyncio.run(main())
"""


def test_a_user_namespace_limit_of_zero_refuses_the_sandboxed_engine_with_the_fix(
    tmp_path: Path,
) -> None:
    """The nearest real thing to a host with user namespaces off: a user namespace of our
    own (unshare -U -r) in which max_user_namespaces is 0, so that the real bwrap fails as
    it would there; the agent's shard start says why and what to do."""
    require_tools("bwrap", "unshare")
    result = run_child(
        "unshare -U -r sh -c 'echo 0 >/proc/sys/user/max_user_namespaces && "
        'exec "$0" "$1"\' "$0" "$1"',
        SHARD_START,
        tmp_path,
    )
    if result.returncode != 0 and result.stderr.startswith("unshare:"):
        unavailable(f"cannot make a user namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    assert out.startswith("refused: engines run in a bubblewrap sandbox"), out
    assert (
        "this host turns them off: user.max_user_namespaces=0: sysctl -w "
        "user.max_user_namespaces=15000 and keep it in /etc/sysctl.d/90-llmgw-userns.conf"
    ) in out
    assert "(bwrap: bwrap: Creating new namespace failed" in out
    # Nothing was started, and the scratch it would have had was not left behind half made.
    assert not (tmp_path / "state" / "logs").exists()


HOST_PROC = """
    import asyncio, ctypes, os, subprocess, sys
    from pathlib import Path
    from llmgw.agent.bwrap import Bubblewrap
    from llmgw.agent.sandbox import SandboxLayout, Sandboxes
    from llmgw.contracts.sandbox import SandboxPolicy

    tmp = Path(sys.argv[0]).parent
    (tmp / "state").mkdir(exist_ok=True)
    layout = SandboxLayout.for_node(
        tmp / "state", config_file=tmp / "agent.yaml", key_file=tmp / "state" / "node.key",
        models_root=tmp / "models", cache_root=tmp / "cache",
    )
    made = asyncio.run(Sandboxes(layout, Bubblewrap()).prepare(
        "s1", SandboxPolicy(), program=sys.executable, model=None, multi_node=False,
    ))
    libc = ctypes.CDLL(None, use_errno=True)
    print("fresh_proc", made.features.fresh_proc)
    print("agent dumpable", libc.prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE
    probe = (
        "import os, signal, sys\\n"
        "agent = int(sys.argv[1])\\n"
        "for what in ('environ', 'root/etc/hostname'):\\n"
        "    try:\\n"
        "        open(f'/proc/{agent}/{what}', 'rb').read(1); print(what, 'readable')\\n"
        "    except OSError as exc:\\n"
        "        print(what, type(exc).__name__)\\n"
        "try:\\n"
        "    os.kill(agent, 0); print('signal reaches the agent')\\n"
        "except OSError as exc:\\n"
        "    print('signal', type(exc).__name__)\\n"
    )
    argv = made.plan.command([sys.executable, "-c", probe, str(os.getpid())], made.features)
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **made.plan.env})
    print(done.stdout.strip())
    print(done.stderr.strip())
"""


def test_where_a_fresh_proc_cannot_be_mounted_the_hosts_is_bound_and_the_agent_is_closed(
    tmp_path: Path,
) -> None:
    """A /proc with a read-only sub-mount (what ProtectKernelTunables= and Docker's masked
    paths make) and no uncovered proc mount: the kernel refuses a fresh /proc to bwrap. The
    sandbox binds the host's, in a pid namespace of its own, and the agent is made
    non-dumpable: the engine can neither read the agent's /proc entries nor signal it."""
    require_tools("bwrap", "unshare", "mount", "findmnt")
    if os.geteuid() != 0:
        unavailable("covering /proc/sys in a mount namespace needs root")
    result = run_child(
        # Any other proc mount of this machine (a chroot's, a debootstrap's) would be an
        # uncovered one: out of this mount namespace with them.
        "unshare -m --propagation private sh -c 'for m in $(findmnt -rn -t proc -o TARGET); "
        'do [ "$m" = /proc ] || umount -l "$m"; done; '
        "mount --bind /proc/sys /proc/sys && "
        'mount -o remount,bind,ro /proc/sys && exec "$0" "$1"\' "$0" "$1"',
        HOST_PROC,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["fresh_proc False", "agent dumpable 0"], result.stdout + result.stderr
    assert lines[2:5] == [
        "environ PermissionError",
        "root/etc/hostname PermissionError",
        "signal ProcessLookupError",
    ], result.stdout + result.stderr
    assert "engine sandbox weakened" in result.stderr
    assert "one engine can read another's files through /proc/<pid>/root" in HOST_PROC_WARNING


def _layout(tmp_path: Path) -> object:
    from llmgw.agent.sandbox import SandboxLayout

    (tmp_path / "state").mkdir(exist_ok=True)
    return SandboxLayout.for_node(
        tmp_path / "state",
        config_file=tmp_path / "agent.yaml",
        key_file=tmp_path / "state" / "node.key",
        models_root=tmp_path / "models",
        cache_root=tmp_path / "cache",
    )


def test_without_bubblewrap_a_node_refuses_and_llmgw_up_runs_unconfined_saying_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    import logging

    from llmgw.agent.bwrap import Bubblewrap
    from llmgw.agent.sandbox import Sandboxes
    from llmgw.contracts.sandbox import SandboxPolicy
    from llmgw.errors import ShardError

    missing = str(tmp_path / "no-bwrap")

    def prepare(sandboxes: Sandboxes, shard: str) -> object:
        return asyncio.run(
            sandboxes.prepare(
                shard, SandboxPolicy(), program=sys.executable, model=None, multi_node=False
            )
        )

    required = Sandboxes(_layout(tmp_path), Bubblewrap(missing))  # type: ignore[arg-type]
    with pytest.raises(ShardError, match="bubblewrap"):
        prepare(required, "s1")
    relaxed = Sandboxes(_layout(tmp_path), Bubblewrap(missing), required=False)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.sandbox"):
        assert prepare(relaxed, "s1") is None
        assert prepare(relaxed, "s2") is None
    said = [r for r in caplog.records if "engines not sandboxed" in r.getMessage()]
    assert len(said) == 1  # once, not per shard
    assert "bubblewrap" in said[0].__dict__["fields"]["reason"]  # the fix, from the probe
