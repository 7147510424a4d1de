"""What the tests of `make dist`'s output (dist/) share: where the artifacts are, fixtures for
them (test modules import these by name), and running a binary in a Debian rootfs.

The binaries are built by `make dist` and `make dist ARCH=arm64` (under CI=true, .ci/run's
steps before `make test`): without them, or when they were built from other sources, these
tests skip locally and fail under CI=true (``tests.ci.unavailable``; LLMGW_TEST_STALE_DIST=1
tests whatever dist/ holds, LLMGW_TEST_ARM64=1 demands the arm64 build outside CI too).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tests.ci import unavailable

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
GLIBC_FLOOR = "2.31"  # Debian 11, the oldest target


def load_packaging_module(name: str) -> ModuleType:
    """packaging/NAME.py (not a package: scripts run by `make dist`), imported by path."""
    if str(ROOT / "packaging") not in sys.path:
        sys.path.insert(0, str(ROOT / "packaging"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "packaging" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def version() -> str:
    text = (ROOT / "llmgw" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert match
    return match.group(1)


@dataclass(frozen=True)
class Dist:
    """What `make dist` left in dist/ for one architecture."""

    arch: str
    onefile: Path
    onedir: Path
    bundle: Path

    @property
    def onedir_binary(self) -> Path:
        return self.onedir / "llmgw"


def dist_for(arch: str) -> Dist:
    return Dist(
        arch=arch,
        onefile=DIST / f"llmgw-linux-{arch}",
        onedir=DIST / f"llmgw-onedir-{arch}",
        bundle=DIST / f"llmgw-agent-{version()}-linux-{arch}.tar.gz",
    )


def missing(reason: str) -> None:
    """Skip, or under CI=true fail: there the dist step must have built what is missing."""
    unavailable(f"{reason}; .ci/run builds it with 'make dist' before the tests")


def current_dist(arch: str) -> Dist:
    """The build for ``arch``, current with these sources (scripts/dist.sh --check says so)."""
    dist = dist_for(arch)
    make = "make dist" if arch == "x64" else f"make dist ARCH={arch}"
    if not dist.onefile.is_file():
        missing(f"no {dist.onefile.relative_to(ROOT)}; run '{make}' (needs root) first")
    check = subprocess.run(
        [str(ROOT / "scripts" / "dist.sh"), "--check", arch],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check.returncode != 0 and os.environ.get("LLMGW_TEST_STALE_DIST") != "1":
        missing(
            f"dist/ was built from other sources than these; run '{make}' ({check.stderr.strip()})"
        )
    if not dist.bundle.is_file():
        missing(f"no {dist.bundle.relative_to(ROOT)}; run '{make}'")
    return dist


def root_rootfs(suite: str, deb_arch: str) -> Path:
    """A cached minbase rootfs (scripts/debian-rootfs.sh); needs root the first time."""
    if os.geteuid() != 0 or shutil.which("chroot") is None or shutil.which("unshare") is None:
        missing("running a binary in a Debian rootfs needs root (chroot, mount namespaces)")
    result = subprocess.run(
        [str(ROOT / "scripts" / "debian-rootfs.sh"), suite, deb_arch],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/debian-rootfs.sh {suite} {deb_arch} failed:\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def copied_into_rootfs(rootfs: Path, program: Path) -> Iterator[str]:
    """A copy of ``program`` (a file or a one-folder build) in ``rootfs``, removed afterwards;
    yields the path of its executable as seen inside the rootfs."""
    place = rootfs / "opt" / f"llmgw-test-{os.getpid()}"
    shutil.rmtree(place, ignore_errors=True)
    place.mkdir(parents=True)
    try:
        if program.is_dir():
            shutil.copytree(program, place / program.name, symlinks=True)
            yield f"/opt/{place.name}/{program.name}/llmgw"
        else:
            shutil.copy2(program, place / "llmgw")
            yield f"/opt/{place.name}/llmgw"
    finally:
        shutil.rmtree(place, ignore_errors=True)


def rootfs_argv(rootfs: Path, *command: str) -> list[str]:
    """The command line that runs ``command`` (a path inside ``rootfs``, its arguments) there
    with chroot, in a mount namespace of its own with /proc mounted (the bootloader reads
    /proc/self/exe), in an environment of PATH and HOME alone; leading NAME=VALUE words add to
    it (env's syntax). The network is this machine's."""
    script = (
        'set -e; mount -t proc proc "$1/proc"; root=$1; shift; '
        'exec chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root "$@"'
    )
    unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    return [*unshare, str(rootfs), *command]


def run_in_rootfs(rootfs: Path, program: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a copy of ``program`` (a file or a one-folder build) in ``rootfs``
    (:func:`copied_into_rootfs`, :func:`rootfs_argv`)."""
    with copied_into_rootfs(rootfs, program) as inside:
        return subprocess.run(
            rootfs_argv(rootfs, inside, *args), capture_output=True, text=True, timeout=600
        )
