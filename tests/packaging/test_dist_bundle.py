"""The agent bundle (packaging/bundle.py): its layout, BUILD-INFO, SHA256SUMS, the refusal
without an installer, and byte-identical rebuilds."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from llmgw.agent import config as agent_config
from llmgw.agent.config import load_agent_config
from tests.ci import require_tools

from .distcheck import ROOT, Dist, load_packaging_module, version

bundle = load_packaging_module("bundle")
BUILDER = ROOT / "packaging" / "bundle.py"
EPOCH = "1700000000"


def fake_tree(root: Path, *, installer: bool, unit: bool) -> Path:
    """The parts of a checkout the bundle builder reads, in ``root``."""
    (root / "llmgw").mkdir(parents=True)
    (root / "llmgw" / "__init__.py").write_text('__version__ = "9.8.7"\n')
    (root / "README.md").write_text("# llmgw\n")
    (root / "packaging").mkdir()
    shutil.copy(ROOT / "packaging" / "agent.example.yaml", root / "packaging")
    (root / "systemd").mkdir()
    (root / "systemd" / "llmgw-server.service").write_text("[Service]\n")
    if unit:
        (root / "systemd" / "llmgw-agent.service").write_text("[Service]\n")
        (root / "systemd" / "llmgw-agent-update.path").write_text("[Path]\n")
        (root / "systemd" / "llmgw-docker-proxy.service").write_text("[Service]\n")
    if installer:
        (root / "installer").mkdir()
        (root / "installer" / "install-agent.sh").write_text("#!/bin/sh\nmain() { :; }\nmain\n")
        (root / "installer" / "lib.txt").write_text("data\n")
    return root


def a_binary(tmp_path: Path) -> Path:
    """An ELF executable to bundle: this machine's /bin/true (any ELF file would do)."""
    binary = tmp_path / "llmgw"
    shutil.copy("/bin/true", binary)
    return binary


def members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_layout_modes_owners_and_times(tmp_path: Path) -> None:
    root = fake_tree(tmp_path / "src", installer=True, unit=True)
    out, warnings = bundle.build_bundle(
        a_binary(tmp_path),
        arch="arm64",
        out_dir=tmp_path / "out",
        root=root,
        epoch=1234567890,
        revision="abc123",
    )
    assert warnings == []
    assert out == tmp_path / "out" / "llmgw-agent-9.8.7-linux-arm64.tar.gz"
    top = "llmgw-agent-9.8.7-linux-arm64"
    found = members(out)
    assert sorted(found) == [
        top,
        f"{top}/BUILD-INFO",
        f"{top}/README.md",
        f"{top}/agent.example.yaml",
        f"{top}/install-agent.sh",
        f"{top}/lib.txt",
        f"{top}/llmgw",
        f"{top}/systemd",
        f"{top}/systemd/llmgw-agent-update.path",
        f"{top}/systemd/llmgw-agent.service",
        f"{top}/systemd/llmgw-docker-proxy.service",
    ]
    modes = {name.removeprefix(f"{top}/"): stat.S_IMODE(m.mode) for name, m in found.items()}
    assert modes["llmgw"] == modes["install-agent.sh"] == modes["systemd"] == 0o755
    assert modes["README.md"] == modes["BUILD-INFO"] == modes["lib.txt"] == 0o644
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in found.values()} == {
        (0, 0, "root", "root", 1234567890)
    }
    with tarfile.open(out) as tar:
        info = tar.extractfile(f"{top}/BUILD-INFO")
        assert info is not None
        text = info.read().decode()
    digest = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
    assert text.splitlines()[:5] == [
        "name: llmgw-agent",
        "version: 9.8.7",
        "revision: abc123",
        "architecture: linux-arm64",
        "build_time: 2009-02-13T23:31:30Z",
    ]
    assert f"binary_sha256: {digest}" in text
    assert "glibc_floor: 2." in text


def test_without_the_installer_it_refuses_unless_told(tmp_path: Path) -> None:
    root = fake_tree(tmp_path / "src", installer=False, unit=True)
    with pytest.raises(bundle.BundleError) as info:
        bundle.build_bundle(a_binary(tmp_path), arch="x64", out_dir=tmp_path / "out", root=root)
    assert "install-agent.sh does not exist" in str(info.value)
    assert "--allow-missing-installer" in str(info.value)
    assert not (tmp_path / "out").exists()
    out, warnings = bundle.build_bundle(
        a_binary(tmp_path),
        arch="x64",
        out_dir=tmp_path / "out",
        root=root,
        allow_missing_installer=True,
    )
    assert [w.split(" does not exist")[0] for w in warnings] == [
        str(root / "installer" / "install-agent.sh")
    ]
    assert not any(name.endswith("install-agent.sh") for name in members(out))


def test_without_the_agent_unit_it_refuses_unless_told(tmp_path: Path) -> None:
    root = fake_tree(tmp_path / "src", installer=True, unit=False)
    with pytest.raises(bundle.BundleError, match=r"llmgw-agent\.service does not exist"):
        bundle.build_bundle(a_binary(tmp_path), arch="x64", out_dir=tmp_path / "out", root=root)
    out, _ = bundle.build_bundle(
        a_binary(tmp_path), arch="x64", out_dir=tmp_path, root=root, allow_missing_installer=True
    )
    assert not any("/systemd/" in name for name in members(out))


def test_generated_docs_go_in_as_they_lie_and_licenses_are_required(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "man" / "man1").mkdir(parents=True)
    (docs / "man" / "man1" / "llmgw.1.gz").write_bytes(b"page")
    with pytest.raises(bundle.BundleError, match="has no LICENSES"):
        bundle.build_bundle(a_binary(tmp_path), arch="x64", out_dir=tmp_path / "out", docs=docs)
    (docs / "LICENSES").write_text("Format: ...\n")
    out, _ = bundle.build_bundle(
        a_binary(tmp_path), arch="x64", out_dir=tmp_path / "out", docs=docs
    )
    found = members(out)
    top = next(iter(found)).split("/")[0]
    assert found[f"{top}/LICENSES"].mode == 0o644
    assert f"{top}/man/man1/llmgw.1.gz" in found


def test_a_binary_above_the_glibc_floor_is_refused(tmp_path: Path) -> None:
    root = fake_tree(tmp_path / "src", installer=True, unit=True)
    with pytest.raises(bundle.BundleError, match=r"needs glibc 2\.\d+, above the floor of 2\.1\b"):
        bundle.build_bundle(
            a_binary(tmp_path), arch="x64", out_dir=tmp_path, root=root, glibc_max="2.1"
        )


def test_two_builds_from_the_same_binary_are_byte_identical(tmp_path: Path) -> None:
    binary = a_binary(tmp_path)
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
    outputs = []
    for run in ("one", "two"):
        out = tmp_path / run
        build = [sys.executable, str(BUILDER), "build", "--binary", str(binary), "--arch", "x64"]
        result = subprocess.run(
            [*build, "--out", str(out), "--allow-missing-installer"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        outputs.append(Path(result.stdout.strip()))
        time.sleep(1.1)  # a timestamp that leaked in would differ
        binary.touch()
    first, second = (p.read_bytes() for p in outputs)
    assert first == second
    assert first[4:8] == b"\0\0\0\0"  # gzip's MTIME field
    assert {m.mtime for m in members(outputs[0]).values()} == {int(EPOCH)}


def test_sums_cover_every_file_and_sha256sum_agrees(tmp_path: Path) -> None:
    (tmp_path / "a.tar.gz").write_bytes(b"bundle")
    (tmp_path / "onedir" / "_internal").mkdir(parents=True)
    (tmp_path / "onedir" / "_internal" / "lib.so").write_bytes(b"lib")
    (tmp_path / ".inputs-x64").write_text("not an artifact")
    sums = bundle.write_sums(tmp_path)
    assert sums.read_text() == (
        f"{hashlib.sha256(b'bundle').hexdigest()}  a.tar.gz\n"
        f"{hashlib.sha256(b'lib').hexdigest()}  onedir/_internal/lib.so\n"
    )
    require_tools("sha256sum")
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=tmp_path, check=True)


def test_agent_example_yaml_is_valid_and_names_every_key() -> None:
    path = ROOT / "packaging" / "agent.example.yaml"
    config = load_agent_config(path)
    assert config.servers == ("cp-1.example.net:7443",)
    text = path.read_text()
    for key in agent_config._TOP_KEYS:
        assert f"\n{key}:" in text or f"\n# {key}:" in text, f"{key} is not in {path.name}"


# -- what `make dist` built -----------------------------------------------------------------


def test_the_dist_bundle(dist_x64: Dist) -> None:
    top = f"llmgw-agent-{version()}-linux-x64"
    found = members(dist_x64.bundle)
    assert {name.split("/")[0] for name in found} == {top}
    names = {name.removeprefix(f"{top}/") for name in found}
    assert {"llmgw", "agent.example.yaml", "README.md", "BUILD-INFO"} <= names
    # What the build generates for it: the licences of everything bundled, the manual pages
    # and the shell completions (tests/packaging/test_lint.py checks what they say).
    assert {
        "LICENSES",
        "man/man1/llmgw.1.gz",
        "man/man1/llmgw-ctl.1.gz",
        "completions/llmgw.bash",
        "completions/_llmgw",
        "completions/llmgw.fish",
    } <= names
    # The installer and the agent's units: exactly what the checkout has.
    installer = ROOT / "installer" / "install-agent.sh"
    assert "install-agent.sh" in names, "the bundle has no installer: build it with 'make dist'"
    units = {f"systemd/{p.name}" for p in (ROOT / "systemd").glob("llmgw-agent*")}
    units.add("systemd/llmgw-docker-proxy.service")  # install-agent.sh --docker installs it
    assert {n for n in names if n.startswith("systemd/") and n != "systemd"} == units
    with tarfile.open(dist_x64.bundle) as tar:
        binary = tar.extractfile(f"{top}/llmgw")
        assert binary is not None
        assert binary.read() == dist_x64.onefile.read_bytes()
        shipped = tar.getmember(f"{top}/install-agent.sh")
        script = tar.extractfile(shipped)
        assert script is not None and script.read() == installer.read_bytes()
        assert shipped.mode == 0o755
        info = tar.extractfile(f"{top}/BUILD-INFO")
        assert info is not None
        fields = dict(line.split(": ", 1) for line in info.read().decode().splitlines())
    assert fields["version"] == version()
    assert fields["architecture"] == "linux-x64"
    assert fields["revision"] != "unknown"


def test_dist_sha256sums_check(dist_x64: Dist) -> None:
    sums = dist_x64.bundle.parent / "SHA256SUMS"
    require_tools("sha256sum")
    # CI builds arm64 while this runs: dist.sh writes into dist/ under an exclusive lock on
    # dist/.lock, so the files and their sums are read here under a shared one.
    with open(sums.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        listed = {line.split("  ", 1)[1] for line in sums.read_text().splitlines()}
        assert {
            dist_x64.onefile.name,
            dist_x64.bundle.name,
            f"{dist_x64.bundle.name}.cdx.json",
            "llmgw-onedir-x64/llmgw",
        } <= listed
        subprocess.run(
            ["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=sums.parent, check=True
        )
