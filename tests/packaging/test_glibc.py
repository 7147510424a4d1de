"""The glibc floor: every ELF that ships (the one-file binary, every library inside its
archive, the one-folder build, the binary in the bundle) needs glibc 2.31 at most, and the
binaries start in a plain Debian 11 (bullseye) rootfs."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.ci import require_tools, unavailable

from .distcheck import GLIBC_FLOOR, Dist, load_packaging_module, run_in_rootfs, version

elfinfo = load_packaging_module("elfinfo")


def assert_floor(needs: list, what: str) -> None:  # list of elfinfo.ElfNeeds
    assert needs, f"no ELF file found in {what}"
    over = [
        f"{n.name} needs GLIBC_{n.highest}"
        for n in needs
        if n.highest and elfinfo.version_key(n.highest) > elfinfo.version_key(GLIBC_FLOOR)
    ]
    assert not over, f"{what} needs a glibc newer than {GLIBC_FLOOR}:\n" + "\n".join(over)


def test_one_file_binary_and_every_library_inside(dist_x64: Dist) -> None:
    needs = elfinfo.needs_of_path(dist_x64.onefile)
    inside = [n for n in needs if "!" in n.name]
    # The archive holds libpython, the extension modules and the libraries they link.
    assert any("libpython3" in n.name for n in inside), [n.name for n in inside]
    assert len(inside) > 20
    assert_floor(needs, str(dist_x64.onefile))


def test_one_folder_build(dist_x64: Dist) -> None:
    assert_floor(elfinfo.needs_of_path(dist_x64.onedir), str(dist_x64.onedir))


def test_the_binary_in_the_bundle(dist_x64: Dist, tmp_path: Path) -> None:
    top = f"llmgw-agent-{version()}-linux-x64"
    with tarfile.open(dist_x64.bundle) as tar:
        member = tar.extractfile(f"{top}/llmgw")
        assert member is not None
        data = member.read()
        info = tar.extractfile(f"{top}/BUILD-INFO")
        assert info is not None
        build_info = dict(
            line.split(": ", 1) for line in info.read().decode().splitlines() if ": " in line
        )
    binary = tmp_path / "llmgw"
    binary.write_bytes(data)
    needs = elfinfo.needs_of_path(binary)
    assert_floor(needs, f"{dist_x64.bundle.name}:{top}/llmgw")
    assert build_info["glibc_floor"] == elfinfo.glibc_floor(needs)


def test_elfinfo_reads_what_readelf_reads() -> None:
    require_tools("readelf")
    readelf = shutil.which("readelf")
    assert readelf is not None
    checked = 0
    for name in ("libc.so.6", "libssl.so.3", "libz.so.1", "libstdc++.so.6"):
        for directory in ("/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64"):
            path = Path(directory) / name
            if not path.is_file():
                continue
            out = subprocess.run(
                [readelf, "-V", "-W", str(path)], capture_output=True, text=True, check=True
            ).stdout
            needed = out.split("Version needs section", 1)[-1] if "needs section" in out else ""
            expected = sorted(
                {w.split("GLIBC_", 1)[1] for w in needed.split() if w.startswith("GLIBC_2")},
                key=elfinfo.version_key,
            )
            assert list(elfinfo.elf_needs(path.read_bytes(), str(path)).glibc) == expected
            checked += 1
    if not checked:
        unavailable(
            "none of the usual shared libraries (libc.so.6, libz.so.1, ...) to compare with"
        )


@pytest.mark.parametrize("variant", ["onefile", "onedir"])
def test_binaries_start_in_debian_11(dist_x64: Dist, bullseye_amd64: Path, variant: str) -> None:
    program = dist_x64.onefile if variant == "onefile" else dist_x64.onedir
    result = run_in_rootfs(bullseye_amd64, program, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llmgw {version()}\n"
    libc = sorted((bullseye_amd64 / "lib" / "x86_64-linux-gnu").glob("libc-2.*.so"))
    assert [p.name for p in libc] == ["libc-2.31.so"]  # it is glibc 2.31 that ran it
