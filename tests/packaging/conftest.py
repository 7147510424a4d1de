"""Fixtures of the packaging tests: the stand-in packages and a systemd container to install
them in (pkgcheck.py has the helpers), the real builds under dist/ (distcheck.py), and the
installer's sandbox host (installer_sandbox.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import require_tools, unavailable

from .distcheck import Dist, current_dist, dist_for, root_rootfs
from .installer_sandbox import Sandbox, make_sandbox
from .pkgcheck import (
    CURRENT,
    PREVIOUS,
    Container,
    Packages,
    build_packages,
    make_standin,
    remove_stale_containers,
    systemd_image_of,
)


@pytest.fixture(scope="session")
def packages_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory containers see at MOUNT: packages of both versions, repositories."""
    return tmp_path_factory.mktemp("packages")


@pytest.fixture(scope="session")
def standin_packages(packages_root: Path) -> dict[str, Packages]:
    """The six packages around the stand-in (and its stand-in bundles), for PREVIOUS and
    CURRENT."""
    require_tools("dpkg-deb")
    built = {}
    for version in (PREVIOUS, CURRENT):
        payload = make_standin(packages_root / f"standin-{version}", version)
        out = packages_root / f"v{version}"
        files = build_packages(payload, out)
        assert len(files) == 6, files
        built[version] = Packages(version, out)
    return built


@pytest.fixture(scope="session")
def systemd_image() -> str:
    """$LLMGW_TEST_SYSTEMD_IMAGE (.ci/run builds it), else built here (debootstrap once)."""
    require_tools("docker")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        unavailable("dockerd is not reachable; start it: dockerd >/var/log/dockerd.log 2>&1 &")
    remove_stale_containers()
    return systemd_image_of("bookworm")


@pytest.fixture
def container(systemd_image: str, packages_root: Path) -> Iterator[Container]:
    """A fresh systemd container that sees ``packages_root`` at MOUNT."""
    booted = Container.boot(systemd_image, packages_root)
    try:
        yield booted
    finally:
        booted.remove()


@pytest.fixture(scope="session")
def dist_x64() -> Dist:
    """The x64 build, current with these sources."""
    return current_dist("x64")


@pytest.fixture(scope="session")
def dist_arm64() -> Dist:
    """The arm64 build (`make dist ARCH=arm64`, slow the first time: emulated), current with
    these sources; .ci/run builds it, and LLMGW_TEST_ARM64=1 demands it outside CI too."""
    if os.environ.get("LLMGW_TEST_ARM64") == "1" and not dist_for("arm64").onefile.is_file():
        pytest.fail(
            "no dist/llmgw-linux-arm64; LLMGW_TEST_ARM64=1 asks for it: make dist ARCH=arm64"
        )
    return current_dist("arm64")


@pytest.fixture(scope="session")
def bullseye_amd64() -> Path:
    return root_rootfs("bullseye", "amd64")


@pytest.fixture(scope="session")
def bullseye_arm64() -> Path:
    return root_rootfs("bullseye", "arm64")


@pytest.fixture
def noexec_dir(tmp_path: Path) -> Iterator[Path | None]:
    """A tmpfs mounted noexec (root only; None otherwise), unmounted afterwards."""
    target = tmp_path / "noexec"
    target.mkdir()
    if os.geteuid() != 0:
        yield None
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=256m", "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    """install-agent.sh's sandbox host (installer_sandbox.py)."""
    return make_sandbox(tmp_path)
