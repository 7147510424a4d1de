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
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path
from typing import IO

from llmgw.contracts.update_order import MAX_SMALL
from llmgw.errors import ArchiveError, UpdateError
from llmgw.fsutil import ArchivePolicy, list_archive, unpack_archive
from llmgw.versions import VERSION_PATTERN

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


_POLICY = ArchivePolicy(
    max_bytes=_MAX_UNPACKED,
    max_members=_MAX_MEMBERS,
    links=False,
    single_top=True,
    replace=False,
    place="bundle's folder",
)
_TOP = re.compile(rf"llmgw-agent-{VERSION_PATTERN}-linux-\w+")


def _refused(exc: ArchiveError) -> UpdateError:
    """The helper's words for an archive fsutil refused."""
    if exc.code == "unsafe":
        return UpdateError(f"the bundle's member {(exc.member or '')[:200]!r} {exc.reason}")
    if exc.code == "too_many":
        return UpdateError(f"the bundle has more than {_MAX_MEMBERS} members")
    if exc.code == "too_big":
        return UpdateError(f"the bundle unpacks to more than {_MAX_UNPACKED} bytes")
    return UpdateError(f"the bundle is not a readable .tar.gz ({exc.reason})")


def check_bundle(bundle: Path) -> tuple[str, dict[str, str]]:
    """The bundle's top folder and its BUILD-INFO; refused unless every member is a plain
    file or directory under one top folder and install-agent.sh, llmgw, BUILD-INFO exist."""
    try:
        members = list_archive(bundle, kind="tar.gz", policy=_POLICY)
    except ArchiveError as exc:
        raise _refused(exc) from None
    top = members[0].name.split("/")[0] if members else None
    if top is None or not _TOP.fullmatch(top):
        raise UpdateError(
            f"the bundle's top folder is {top!r}, not llmgw-agent-<version>-linux-<arch>"
        )
    files = {m.name for m in members if m.kind == "file"}
    for needed in ("install-agent.sh", "llmgw", "BUILD-INFO"):
        if f"{top}/{needed}" not in files:
            raise UpdateError(f"the bundle has no {top}/{needed}")
    info = {}
    for line in _read_member(bundle, f"{top}/BUILD-INFO").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return top, info


def _read_member(bundle: Path, name: str) -> str:
    """The first :data:`MAX_SMALL` bytes of the (checked) regular file ``name``."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            for member in tar:
                if member.name == name and member.isreg():
                    data = tar.extractfile(member)
                    if data is not None:
                        return data.read(MAX_SMALL).decode("utf-8", "replace")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise UpdateError(f"the bundle is not a readable .tar.gz ({exc})") from None
    raise UpdateError(f"the bundle has no {name}")


def unpack(bundle: Path, dest: Path) -> None:
    """Unpack what :func:`check_bundle` accepted into ``dest`` (fsutil's safe unpack: every
    member checked again, directories and regular files only, no owner, no set-id, sticky or
    group/world-write bits, every file created new, never through an existing path)."""
    try:
        unpack_archive(bundle, dest, kind="tar.gz", policy=_POLICY)
    except ArchiveError as exc:
        raise UpdateError(f"unpacking the bundle failed ({exc})", state="failed") from None


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
    match = re.search(rf"llmgw\s+({VERSION_PATTERN})", out.stdout)
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
