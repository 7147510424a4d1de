"""The linux-arm64 build (`make dist ARCH=arm64`, which .ci/run builds): it needs glibc 2.31 at
most and says its version in a Debian 11 arm64 rootfs, emulated by qemu-user. Without a current
build these tests skip locally and fail under CI=true (or LLMGW_TEST_ARM64=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .distcheck import GLIBC_FLOOR, Dist, load_packaging_module, run_in_rootfs, version

elfinfo = load_packaging_module("elfinfo")
EM_AARCH64 = 183


def test_it_is_an_arm64_program_below_the_glibc_floor(dist_arm64: Dist) -> None:
    header = dist_arm64.onefile.read_bytes()[:20]
    assert int.from_bytes(header[18:20], "little") == EM_AARCH64
    needs = elfinfo.needs_of_path(dist_arm64.onefile) + elfinfo.needs_of_path(dist_arm64.onedir)
    floor = elfinfo.glibc_floor(needs)
    assert floor is not None
    assert elfinfo.version_key(floor) <= elfinfo.version_key(GLIBC_FLOOR), [
        n.name for n in needs if n.highest == floor
    ]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", ["onefile", "onedir"])
def test_it_says_its_version_under_qemu_in_debian_11(
    dist_arm64: Dist, bullseye_arm64: Path, variant: str
) -> None:
    program = dist_arm64.onefile if variant == "onefile" else dist_arm64.onedir
    result = run_in_rootfs(bullseye_arm64, program, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llmgw {version()}\n"


def test_it_carries_python_systemd(dist_arm64: Dist) -> None:
    # Compiled under emulation against the arm64 rootfs's libsystemd (scripts/dist.sh).
    internal = dist_arm64.onedir / "_internal"
    assert list((internal / "systemd").glob("_journal.*aarch64*.so")), sorted(os.listdir(internal))
    assert (internal / "libsystemd.so.0").is_file()
    assert b"systemd/_journal." in dist_arm64.onefile.read_bytes()


def test_it_carries_psycopg_binary(dist_arm64: Dist) -> None:
    # psycopg's C implementation and the libpq of its aarch64 wheel (packaging/llmgw.spec);
    # test_dist_postgres runs this build's control plane on PostgreSQL under qemu.
    internal = dist_arm64.onedir / "_internal"
    assert list((internal / "psycopg_binary").glob("_psycopg.*aarch64*.so")), sorted(
        os.listdir(internal)
    )
    assert list((internal / "psycopg_binary.libs").glob("libpq-*.so.*"))
    assert b"psycopg_binary/_psycopg." in dist_arm64.onefile.read_bytes()


def test_it_carries_uvloop(dist_arm64: Dist) -> None:
    # Its compiled loop from the aarch64 wheel (packaging/llmgw.spec): every daemon's loop.
    internal = dist_arm64.onedir / "_internal"
    assert list((internal / "uvloop").glob("loop.*aarch64*.so")), sorted(os.listdir(internal))
    assert b"uvloop/loop." in dist_arm64.onefile.read_bytes()
