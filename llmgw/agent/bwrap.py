"""bubblewrap (``bwrap``), the program every sandboxed engine runs under: found, probed once
(can it make the namespaces, can it mount a fresh /proc), and what a failure means.

bwrap needs unprivileged user namespaces: a host that turned them off
(``kernel.unprivileged_userns_clone=0``, Ubuntu's
``kernel.apparmor_restrict_unprivileged_userns=1``, ``user.max_user_namespaces=0``) gets one
message, :func:`userns_problem`, naming the setting and the fix; the installer's pre-flight
says the same. A /proc with covered sub-mounts (systemd's ProtectKernelTunables=, Docker's
masked paths) makes the kernel refuse a fresh /proc in a new user namespace unless an
uncovered proc mount is also visible (the agent's unit binds one); where there is none the
sandbox falls back to the host's /proc, still in a pid namespace of its own, with the agent
made non-dumpable, and says what that weakens (:data:`HOST_PROC_WARNING`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import ShardError
from llmgw.log import kv
from llmgw.procutil import Finished, run_to_end

__all__ = [
    "HOST_PROC_WARNING",
    "NO_BWRAP",
    "Bubblewrap",
    "BwrapFeatures",
    "make_undumpable",
    "userns_problem",
]

log = logging.getLogger("llmgw.agent.bwrap")

_PROBE_TIMEOUT_S = 20.0
_PROC_SYS = Path("/proc/sys")

NO_BWRAP = (
    "bubblewrap (bwrap) is not installed; process engines run inside it: "
    "apt-get install bubblewrap (dnf install bubblewrap), or set sandbox: false in the "
    "profile to run this engine unconfined"
)

HOST_PROC_WARNING = (
    "this node cannot mount a fresh /proc inside an engine's sandbox (its /proc has covered "
    "sub-mounts and no uncovered proc mount is visible); engines see the host's /proc, each "
    "still in a pid namespace of its own and the agent not dumpable, so no engine can signal "
    "the agent or read its files, but one engine can read another's files through "
    "/proc/<pid>/root; run the agent under the packaged llmgw-agent unit (it binds an "
    "uncovered /proc for bubblewrap), or its container with --security-opt "
    'systempaths=unconfined (README "The agent as a container"), to close that'
)

# What each setting that turns user namespaces off says, and its fix. The installer's
# pre-flight (installer/install-agent.sh, check_userns) prints the same.
_USERNS_SETTINGS: tuple[tuple[str, str, Callable[[str], bool], str], ...] = (
    (
        "kernel/unprivileged_userns_clone",
        "kernel.unprivileged_userns_clone",
        lambda v: v == "0",
        "sysctl -w kernel.unprivileged_userns_clone=1 and keep it in "
        "/etc/sysctl.d/90-llmgw-userns.conf",
    ),
    (
        "kernel/apparmor_restrict_unprivileged_userns",
        "kernel.apparmor_restrict_unprivileged_userns",
        lambda v: v == "1",
        "allow bwrap alone an unprivileged user namespace with an AppArmor profile: "
        "printf 'abi <abi/4.0>,\\ninclude <tunables/global>\\nprofile bwrap /usr/bin/bwrap "
        "flags=(unconfined) {\\n  userns,\\n}\\n' >/etc/apparmor.d/bwrap && "
        "apparmor_parser -r /etc/apparmor.d/bwrap",
    ),
    (
        "user/max_user_namespaces",
        "user.max_user_namespaces",
        lambda v: v == "0",
        "sysctl -w user.max_user_namespaces=15000 and keep it in "
        "/etc/sysctl.d/90-llmgw-userns.conf",
    ),
)

# bwrap's own words when it cannot make a namespace (bubblewrap.c, utils.c).
_USERNS_WORDS = (
    "No permissions to create new namespace",
    "No permissions to creating new namespace",
    "Creating new namespace failed",
    "setting up uid map",
    "unprivileged user namespaces",
    "max_user_namespaces",
    "Operation not permitted",
)
_PROC_WORDS = "Can't mount proc"


def userns_problem(proc_sys: Path = _PROC_SYS, bwrap_said: str = "") -> str:
    """Why bubblewrap cannot make a user namespace here, with the fix: each setting that
    turns them off, else (a seccomp filter, a container) what bwrap said."""
    found: list[str] = []
    for rel, name, off, fix in _USERNS_SETTINGS:
        try:
            value = (proc_sys / rel).read_text().strip()
        except OSError:
            continue
        if off(value):
            found.append(f"{name}={value}: {fix}")
    said = f" (bwrap: {bwrap_said})" if bwrap_said else ""
    if found:
        return (
            "engines run in a bubblewrap sandbox, which needs unprivileged user namespaces, "
            f"and this host turns them off: {'; '.join(found)}{said}; or set sandbox: false "
            "in the profile to run its engine unconfined"
        )
    return (
        "engines run in a bubblewrap sandbox, which needs unprivileged user namespaces, and "
        f"bwrap could not make one{said}; under systemd the llmgw-agent unit must allow them "
        "(RestrictNamespaces=user mnt pid ipc, as the packaged unit does), and in a container "
        "its seccomp profile must too (llmgw's compose file gives the agent's container "
        'packaging/compose/seccomp-agent.json: README "The agent as a container"); or set '
        "sandbox: false in the profile to run its engine unconfined"
    )


@dataclass(frozen=True)
class BwrapFeatures:
    """What this node's bwrap can do, found by running it once."""

    program: str
    fresh_proc: bool
    """A new /proc of the sandbox's pid namespace (else the host's, bound: HOST_PROC_WARNING)."""
    disable_userns: bool
    """``--disable-userns`` (bubblewrap 0.8, a writable /proc/sys): the engine cannot make
    user namespaces itself."""


def make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) on this process: /proc/<pid>/{root,environ,fd,mem} of the
    agent are then closed to processes of the same user (sandboxed engines on the host's
    /proc), and it leaves no core dump."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        err = ctypes.get_errno()
        raise ShardError(f"cannot make the agent non-dumpable: {os.strerror(err)}")


class Bubblewrap:
    """The node's bwrap, probed on first use; a success is kept, a failure asked again next
    time (the operator may have fixed the host meanwhile)."""

    def __init__(
        self,
        program: str | None = None,
        *,
        proc_sys: Path = _PROC_SYS,
        on_host_proc: Callable[[], None] = make_undumpable,
    ) -> None:
        self.program = program
        self.proc_sys = proc_sys
        self.on_host_proc = on_host_proc
        self._features: BwrapFeatures | None = None
        self._lock = asyncio.Lock()

    async def features(self) -> BwrapFeatures:
        """What bwrap can do here; ShardError with the fix when it cannot sandbox at all."""
        if self._features is not None:
            return self._features
        async with self._lock:
            if self._features is None:
                self._features = await asyncio.to_thread(self._probe)
                if not self._features.fresh_proc:
                    self.on_host_proc()
                    log.warning("engine sandbox weakened", extra=kv(why=HOST_PROC_WARNING))
            return self._features

    def _probe(self) -> BwrapFeatures:
        program = self.program or shutil.which("bwrap") or "/usr/bin/bwrap"
        if not os.access(program, os.X_OK):
            raise ShardError(NO_BWRAP + f" (looked for {program})")
        base = [program, "--unshare-user", "--unshare-pid", "--unshare-ipc"]
        base += ["--ro-bind", "/", "/", "--dev", "/dev"]
        fresh = self._run([*base, "--proc", "/proc", "true"])
        if fresh.returncode == 0:
            return self._features_of([*base, "--proc", "/proc"], fresh_proc=True)
        said = _bwrap_said(fresh)
        if _PROC_WORDS in said:
            host = self._run([*base, "--ro-bind", "/proc", "/proc", "true"])
            if host.returncode == 0:
                return self._features_of([*base, "--ro-bind", "/proc", "/proc"], fresh_proc=False)
            said = _bwrap_said(host)
        if any(word in said for word in _USERNS_WORDS):
            raise ShardError(userns_problem(self.proc_sys, said))
        raise ShardError(
            f"bubblewrap ({program}) cannot make an engine's sandbox: {said or 'no reason given'}; "
            "check that it runs for the agent's user, or set sandbox: false in the profile "
            "to run its engine unconfined"
        )

    def _features_of(self, working: list[str], *, fresh_proc: bool) -> BwrapFeatures:
        # --disable-userns is bubblewrap 0.8's, and it writes the sandbox's own
        # user.max_user_namespaces, which a read-only /proc/sys (the host's /proc) refuses.
        limited = self._run([*working, "--disable-userns", "true"])
        return BwrapFeatures(
            program=working[0], fresh_proc=fresh_proc, disable_userns=limited.returncode == 0
        )

    def _run(self, argv: list[str]) -> Finished:
        try:
            return run_to_end(argv, _PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ShardError(
                f"bubblewrap ({argv[0]}) did not finish a trial run within "
                f"{_PROBE_TIMEOUT_S:.0f}s; check the host's load and its bwrap"
            ) from None
        except OSError as exc:
            raise ShardError(f"{NO_BWRAP} ({argv[0]}: {exc.strerror})") from exc


def _bwrap_said(finished: Finished) -> str:
    text = (finished.stderr or finished.stdout).strip()
    return " | ".join(text.splitlines()[-3:])[-400:]
