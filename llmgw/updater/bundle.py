"""What the root helper does with a bundle whose SHA-256 the signed order vouched for (runs as
root): check its members, unpack it, ask the installed agent its version, and run the
bundle's ``install-agent.sh upgrade``.

Even a signed bundle is unpacked only if every member is a plain file or directory inside
its one top folder ``llmgw-agent-<version>-linux-<arch>/`` holding ``install-agent.sh``,
``llmgw`` and ``BUILD-INFO``; files are created new (``O_EXCL``, ``O_NOFOLLOW``), without
owners or special bits. The installer runs with an environment of the helper's own.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path
from typing import IO

from llmgw.contracts.update_order import MAX_SMALL
from llmgw.errors import UpdateError

__all__ = [
    "HEALTH_ENV",
    "PACKAGE_BINARY",
    "SETTLE_ENV",
    "check_bundle",
    "installed_version",
    "run_installer",
    "unpack",
]

# Where the llmgw-agent .deb/.rpm puts the program: such a node is upgraded by its package
# manager, not by a bundle's installer.
PACKAGE_BINARY = Path("/usr/lib/llmgw/llmgw")
HEALTH_ENV = "LLMGW_AGENT_HEALTH_TIMEOUT"
SETTLE_ENV = "LLMGW_AGENT_SETTLE_SECONDS"

_MAX_UNPACKED = 8 << 30
_MAX_MEMBERS = 10_000


def _member_problem(member: tarfile.TarInfo, top: str | None) -> str | None:
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or "\\" in name:
        return "an absolute path"
    if any(p in ("..", "") for p in parts[:-1]) or parts[-1] == "..":
        return "a '..' or empty path component"
    if not (member.isfile() or member.isdir()):
        kind = "a link" if member.issym() or member.islnk() else "not a file or directory"
        return kind
    if top is not None and parts[0] != top:
        return f"outside the top folder {top}/"
    return None


def check_bundle(bundle: Path) -> tuple[str, dict[str, str]]:
    """The bundle's top folder and its BUILD-INFO; refused unless every member is a plain
    file or directory under one top folder and install-agent.sh, llmgw, BUILD-INFO exist."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            members: list[tarfile.TarInfo] = []
            total = 0
            top: str | None = None
            for member in tar:
                if len(members) >= _MAX_MEMBERS:
                    raise UpdateError(f"the bundle has more than {_MAX_MEMBERS} members")
                member_top = member.name.split("/")[0]
                top = top or member_top
                problem = _member_problem(member, top)
                if problem:
                    raise UpdateError(f"the bundle's member {member.name[:200]!r} is {problem}")
                total += member.size
                if total > _MAX_UNPACKED:
                    raise UpdateError(f"the bundle unpacks to more than {_MAX_UNPACKED} bytes")
                members.append(member)
            if top is None or not re.fullmatch(r"llmgw-agent-[0-9][0-9A-Za-z.+~-]*-linux-\w+", top):
                raise UpdateError(
                    f"the bundle's top folder is {top!r}, not llmgw-agent-<version>-linux-<arch>"
                )
            files = {m.name: m for m in members if m.isfile()}
            for needed in ("install-agent.sh", "llmgw", "BUILD-INFO"):
                if f"{top}/{needed}" not in files:
                    raise UpdateError(f"the bundle has no {top}/{needed}")
            info_file = tar.extractfile(files[f"{top}/BUILD-INFO"])
            assert info_file is not None
            info_text = info_file.read(MAX_SMALL).decode("utf-8", "replace")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise UpdateError(f"the bundle is not a readable .tar.gz ({exc})") from None
    info = {}
    for line in info_text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return top, info


def unpack(bundle: Path, dest: Path) -> None:
    """Unpack what :func:`check_bundle` accepted: directories and regular files only, no
    owner, no special bits, every path checked again and every file created new (O_EXCL,
    O_NOFOLLOW) under ``dest``. Done by hand rather than with tarfile's extraction filters,
    which the frozen binary's CPython (3.11.2) does not have."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            for member in tar:
                if _member_problem(member, None):
                    raise UpdateError(
                        f"the bundle's member {member.name[:200]!r} changed under us",
                        state="failed",
                    )
                target = dest.joinpath(*member.name.split("/"))
                mode = member.mode & 0o755
                if member.isdir():
                    target.mkdir(mode=0o755, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:
                    raise UpdateError(
                        f"the bundle's member {member.name[:200]!r} has no data", state="failed"
                    )
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(target, flags, 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                    os.fchmod(out.fileno(), mode)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise UpdateError(f"unpacking the bundle failed ({exc})", state="failed") from None
    except OSError as exc:
        raise UpdateError(f"unpacking the bundle failed: {exc}", state="failed") from None


def installed_version(binary: Path) -> str:
    """The version the installed agent binary reports (``llmgw --version``)."""
    if not binary.exists() and PACKAGE_BINARY.exists():
        raise UpdateError(
            f"this node's agent came from the llmgw-agent package ({PACKAGE_BINARY}), not from "
            "a bundle: signed updates replace bundle installs only. Upgrade it with its "
            "package manager (apt-get install llmgw-agent, or dnf upgrade llmgw-agent)",
            state="refused",
        )
    try:
        # As root, with an environment of its own: nothing of the caller's (TMPDIR and the
        # like) chooses where a one-file build unpacks; its bootloader then takes a fresh
        # root-owned directory under /var/tmp or /tmp (packaging/pyinstaller-runtime-dir.patch).
        out = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpdateError(
            f"cannot run the installed agent {binary} --version ({exc}); the installed version "
            "is unknown, so a downgrade cannot be ruled out. Reinstall the agent by hand",
            state="refused",
        ) from None
    match = re.search(r"llmgw\s+([0-9][0-9A-Za-z.+~-]*)", out.stdout)
    if out.returncode != 0 or not match:
        raise UpdateError(
            f"the installed agent {binary} --version said {out.stdout.strip()[:100]!r} "
            f"(exit {out.returncode}); the installed version is unknown, so a downgrade "
            "cannot be ruled out. Reinstall the agent by hand",
            state="refused",
        )
    return match.group(1)


def run_installer(top: Path) -> tuple[int, list[str]]:
    """Run ``top/install-agent.sh upgrade``; its stdout goes to ours (the journal), its
    stderr too, and the last lines of stderr are kept for the status."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }
    for name in (HEALTH_ENV, SETTLE_ENV):
        if os.environ.get(name):
            env[name] = os.environ[name]
    tail: collections.deque[str] = collections.deque(maxlen=5)
    proc = subprocess.Popen(
        ["/bin/sh", str(top / "install-agent.sh"), "upgrade"],
        cwd=top,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=sys.stdout.fileno() if _has_fileno(sys.stdout) else None,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode("utf-8", "replace").rstrip()
        print(line, file=sys.stderr, flush=True)
        if line.strip():
            tail.append(line.strip()[:300])
    return proc.wait(), list(tail)


def _has_fileno(stream: IO[str]) -> bool:
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True
