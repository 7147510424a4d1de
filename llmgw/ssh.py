"""Running a shell script on another machine through the system OpenSSH client, so that the
operator's ``~/.ssh/config``, ssh agent, jump hosts and ``known_hosts`` apply as they expect.

The script goes on ssh's standard input (the remote command line is only ``sh -s``, or
``sudo -n sh -s``), so a secret inside it is on no command line at either end. The client
runs with ``BatchMode=yes`` (nothing is ever typed through it) and
``StrictHostKeyChecking=yes``: the host key is what authenticates the machine, so an unknown
or changed one is refused before anything runs. Only where the operator asks for it
(``accept_new_host_key``, as ``StrictHostKeyChecking=accept-new`` does) is an unknown key
accepted and added to known_hosts, its fingerprint read from ssh's own account of the key
exchange (``-v``) for the operator to compare; a changed key is refused all the same. What
ssh says when it fails is translated into the errors below; only an unreachable host (or a
session cut off, as when sshd restarts) is retryable.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import (
    ConfigError,
    HostKeyError,
    SshAuthError,
    SshError,
    SshUnreachable,
    SudoPasswordRequired,
)
from llmgw.netaddr import format_hostport, parse_hostport

__all__ = [
    "SSH_EXIT",
    "HostKey",
    "RemoteResult",
    "RemoteRun",
    "SshTarget",
    "classify_failure",
    "last_lines",
    "parse_destination",
]

SSH_EXIT = 255
"""The exit status of ssh's own failures (the remote command's are passed through)."""

# Options of ours that --ssh-option may not change: they are what makes the run safe.
_FIXED = {
    "batchmode": "BatchMode=yes (nothing is typed through ssh)",
    "stricthostkeychecking": "StrictHostKeyChecking=yes (the host key authenticates the "
    "machine; --accept-new-host-key accepts an unknown one, never a changed one)",
}
# What ssh -v says of the key the server proved (the target's is the last one: a jump
# host's comes first), and what it says when it added an unknown key to known_hosts.
_SERVER_KEY = re.compile(r"^debug1: Server host key: (\S+) (\S+:\S+)", re.MULTILINE)
_ADDED = re.compile(r"^Warning: Permanently added .* to the list of known hosts", re.MULTILINE)
_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*=.+$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")

_HOST_KEY = (
    "host key verification failed",
    "remote host identification has changed",
    "no ed25519 host key is known",
    "no rsa host key is known",
    "no ecdsa host key is known",
    "host key for",
)
_UNREACHABLE = (
    "connection refused",
    "connection timed out",
    "operation timed out",
    "no route to host",
    "network is unreachable",
    "connection reset",
    "connection closed by",
    "kex_exchange_identification",
    "could not resolve hostname",
    "temporary failure in name resolution",
    # A session cut off under way (sshd restarted, the machine rebooted).
    "closed by remote host",
    "broken pipe",
)


def parse_destination(spec: str) -> tuple[str | None, str, int | None]:
    """``[USER@]HOST[:PORT]`` (IPv6 as ``[::1]:22``) into (user, host, port); ConfigError
    naming what is wrong."""
    text = spec.strip()
    user: str | None = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        if not _USER.fullmatch(user):
            raise ConfigError(
                f"{spec!r}: {user!r} is not a user name; write USER@HOST, e.g. root@10.0.0.5"
            )
    if not text:
        raise ConfigError(f"{spec!r} has no host; write [USER@]HOST[:PORT], e.g. root@gpu-01")
    if text.count(":") > 1 and not text.startswith("["):
        # A bare IPv6 address: ssh takes it as it is; a port needs the brackets.
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            raise ConfigError(
                f"{spec!r} is not HOST[:PORT]; write an IPv6 address with a port as [::1]:22"
            ) from None
        return user, text, None
    host, port = parse_hostport(text, default_port=0, what=repr(spec))
    return user, host, port or None


@dataclass(frozen=True)
class SshTarget:
    """Where to ssh and how: the destination and the options ssh is given for it."""

    host: str
    user: str | None = None
    port: int | None = None
    identity: Path | None = None
    options: tuple[str, ...] = ()  # K=V, as -o takes them
    ssh: str = "ssh"  # the client program
    accept_new_host_key: bool = False  # StrictHostKeyChecking=accept-new instead of yes

    def __post_init__(self) -> None:
        for option in self.options:
            if not _OPTION.fullmatch(option):
                raise ConfigError(
                    f"--ssh-option {option!r} is not KEY=VALUE; write e.g. ConnectTimeout=20"
                )
            key = option.partition("=")[0].lower()
            if key in _FIXED:
                raise ConfigError(
                    f"--ssh-option {option!r} would change {_FIXED[key]}; onboard always runs "
                    "ssh so. Leave it out (pin the host key in known_hosts instead)"
                )

    @property
    def destination(self) -> str:
        """``user@host`` as ssh takes it (an IPv6 host bare: the port goes in -p)."""
        return f"{self.user}@{self.host}" if self.user else self.host

    def describe(self) -> str:
        where = format_hostport(self.host, self.port) if self.port else self.host
        return f"{self.user}@{where}" if self.user else where

    def argv(
        self, remote_command: str, *, connect_timeout: float = 15, verbose: bool = False
    ) -> list[str]:
        """The ssh command line: our fixed options first (ssh keeps the first value it is
        given for an option, so neither ~/.ssh/config nor a later -o can loosen them), then
        the operator's, then the destination and ``remote_command``. ``verbose``: -v, for
        the server's host key (:attr:`RemoteResult.host_key`)."""
        checking = "accept-new" if self.accept_new_host_key else "yes"
        args = [
            self.ssh,
            "-o",
            "BatchMode=yes",
            "-o",
            f"StrictHostKeyChecking={checking}",
            "-o",
            f"ConnectTimeout={max(1, round(connect_timeout))}",
            "-T",
        ]
        if verbose:
            args.append("-v")
        if self.port:
            args += ["-p", str(self.port)]
        if self.identity is not None:
            args += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            args += ["-o", option]
        return [*args, "--", self.destination, remote_command]


def classify_failure(target: SshTarget, stderr: str, *, sudo: bool) -> SshError:
    """The error for an ssh that exited 255 (or a sudo that refused), from what it said."""
    said = stderr.lower()
    last = _last_line(stderr)
    where = target.describe()
    if sudo and ("a password is required" in said or "sudo: a terminal is required" in said):
        return SudoPasswordRequired(
            f"sudo on {where} asks for a password, and onboard never types one through ssh "
            "(sudo -n). Give the user passwordless sudo there (a line 'USER ALL=(ALL) "
            "NOPASSWD: ALL' in /etc/sudoers.d/), or ssh as root"
        )
    if any(marker in said for marker in _HOST_KEY):
        changed = "identification has changed" in said
        what = (
            "it is not the one known_hosts pins, and a changed key is never accepted"
            if changed
            else "it is unknown or not the one known_hosts pins"
        )
        unknown = (
            ""
            if changed or target.accept_new_host_key
            else " (or let onboard accept an unknown key with --accept-new-host-key: it "
            "prints the fingerprint to compare)"
        )
        return HostKeyError(
            f"ssh refused {where}'s host key ({last}): {what}. Get the key "
            f"(ssh-keyscan {_keyscan_args(target)}), compare its fingerprint (ssh-keygen -lf) "
            "with the machine's own, read on its console or from the provisioning system, "
            f"then add it to known_hosts{unknown}; if the machine was reinstalled, first "
            f"remove the old key: ssh-keygen -R {_known_hosts_name(target)}"
        )
    if "permission denied" in said or "too many authentication failures" in said:
        return SshAuthError(
            f"ssh could not log in to {where} ({last}); check the user, the key (--identity "
            "FILE, or the ssh agent) and that its public key is in the user's "
            "~/.ssh/authorized_keys there"
        )
    if any(marker in said for marker in _UNREACHABLE):
        return SshUnreachable(
            f"ssh could not reach {where} ({last}); check that the machine is up and sshd "
            "listens there, or give it time with --wait-ssh 5m"
        )
    return SshError(f"ssh to {where} failed ({last or 'no message'}); run ssh -v to see why")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _keyscan_args(target: SshTarget) -> str:
    return f"-p {target.port} {target.host}" if target.port else target.host


def _known_hosts_name(target: SshTarget) -> str:
    return f"'[{target.host}]:{target.port}'" if target.port else target.host


@dataclass(frozen=True)
class HostKey:
    """The host key the server proved (from ``ssh -v``): its type and SHA-256 fingerprint,
    and whether ssh added it to known_hosts just now (it was unknown)."""

    type: str
    fingerprint: str
    added: bool


@dataclass(frozen=True)
class RemoteResult:
    """How a remote script ended: its exit status and its output (stdout and stderr merged
    by the script's ``exec 2>&1``), and what ssh itself said on its stderr (its -v debug
    lines left out); with ``verbose``, the host key the server proved."""

    returncode: int
    output: list[str]
    ssh_stderr: str
    host_key: HostKey | None = None


class RemoteRun:
    """One ssh session running one script given on its standard input, its output read line
    by line as it comes (``on_line``), bounded by ``timeout`` (then ssh is killed)."""

    def __init__(self, target: SshTarget, *, sudo: bool = False) -> None:
        self.target = target
        self.sudo = sudo

    @property
    def remote_command(self) -> str:
        return "sudo -n sh -s" if self.sudo else "sh -s"

    def _start(self, argv: list[str]) -> subprocess.Popen[str]:
        """ssh started, its three pipes open, in a session of its own (killed as a group)."""
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SshError(
                f"no ssh client ({self.target.ssh}) on this machine; install OpenSSH's "
                "client (apt-get install openssh-client)"
            ) from None

    def run(
        self,
        script: str,
        *,
        timeout: float,
        on_line: Callable[[str], None] = lambda line: None,
        connect_timeout: float = 15,
        verbose: bool = False,
    ) -> RemoteResult:
        """Run ``script``; the RemoteResult of a script that ran (whatever its status), or the
        SshError of an ssh that failed (exit 255, or sudo's refusal). ``verbose``: read the
        server's host key from ssh -v."""
        argv = self.target.argv(
            self.remote_command, connect_timeout=connect_timeout, verbose=verbose
        )
        proc = self._start(argv)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        errors: list[str] = []
        stderr_pipe = proc.stderr
        reader = threading.Thread(target=lambda: errors.append(stderr_pipe.read()), daemon=True)
        reader.start()
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        lines: list[str] = []
        try:
            try:
                proc.stdin.write(script)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # ssh failed before it read the script: its status says why
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                lines.append(line)
                on_line(line)
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
        host_key, stderr = _read_stderr("".join(errors))
        if killed.is_set():
            raise SshError(
                f"the script on {self.target.describe()} did not finish within {timeout:.0f}s "
                "(ssh was stopped); see what it printed last, and run it again"
            )
        if returncode == SSH_EXIT or (self.sudo and returncode == 1 and _sudo_refused(stderr)):
            raise classify_failure(self.target, stderr, sudo=self.sudo)
        return RemoteResult(
            returncode=returncode, output=lines, ssh_stderr=stderr, host_key=host_key
        )


def _sudo_refused(stderr: str) -> bool:
    said = stderr.lower()
    return "sudo:" in said and ("password is required" in said or "terminal is required" in said)


def last_lines(lines: Sequence[str], limit: int = 12) -> str:
    """The last ``limit`` lines of a remote script's output, for a message."""
    return "\n".join(lines[-limit:])


def _read_stderr(raw: str) -> tuple[HostKey | None, str]:
    """What ssh wrote to stderr: the server's host key (from ssh -v's debug lines, the last
    one named), and the rest without those debug lines."""
    keys = _SERVER_KEY.findall(raw)
    host_key = (
        HostKey(type=keys[-1][0], fingerprint=keys[-1][1], added=bool(_ADDED.search(raw)))
        if keys
        else None
    )
    stderr = "".join(line for line in raw.splitlines(keepends=True) if not line.startswith("debug"))
    return host_key, stderr
