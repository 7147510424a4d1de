"""Builds stamped with another version (`scripts/dist.sh --version V`, `make dist VERSION=V`):
the same sources, `__version__` set to V in the build's copy of the tree, in dist/vV/. The
installer's upgrade tests use them as "N+1". Also: the frozen build reaches every subcommand
(they are imported lazily, so PyInstaller must have frozen their modules all the same). And
version skew with real builds: the N+1 build as an agent is refused by a control plane at N
and taken once that control plane runs N+1.

The stamped build checked is dist/v<N+1> (N = llmgw/__init__.py's version, its last number
plus one), or $LLMGW_TEST_STAMPED_VERSION. When it is missing or stale it is built here
under CI=true (about a minute with the build rootfs cached); elsewhere those tests skip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.ci import CI
from tests.integration.harness import Server, make_agent, start_server, stop_process, wait_for

from .distcheck import DIST, ROOT, Dist, load_packaging_module, missing, version

bundle = load_packaging_module("bundle")
DIST_SH = ROOT / "scripts" / "dist.sh"
VERSION_ENV = "LLMGW_TEST_STAMPED_VERSION"


def next_version() -> str:
    given = os.environ.get(VERSION_ENV)
    if given:
        return given
    *head, last = version().split(".")
    return ".".join([*head, str(int(last) + 1)])


def stamped(v: str, arch: str = "x64") -> Dist:
    out = DIST / f"v{v}"
    return Dist(
        arch=arch,
        onefile=out / f"llmgw-linux-{arch}",
        onedir=out / f"llmgw-onedir-{arch}",
        bundle=out / f"llmgw-agent-{v}-linux-{arch}.tar.gz",
    )


def dist_sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DIST_SH), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="session")
def dist_next() -> Dist:
    """dist/v<N+1>, current with these sources; built here under CI=true when it is not."""
    v = next_version()
    if dist_sh("--check", "--version", v).returncode != 0:
        if not CI or os.geteuid() != 0:
            missing(f"no current dist/v{v}; build it: make dist VERSION={v} (as root)")
        built = dist_sh("--allow-missing-installer", "--version", v, timeout=1800)
        assert built.returncode == 0, built.stderr[-3000:]
    return stamped(v)


# ------------------------------------------------------------------- what is refused


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--version",), "--version needs a value, e.g. --version 0.1.1"),
        (("--version", "v1"), "--version 'v1' must start with a digit (e.g. 0.1.1)"),
        (("--version", "1.0/../x"), "--version '1.0/../x' may hold only digits, letters and"),
        (("--version", "1.0;rm"), "--version '1.0;rm' may hold only digits, letters and"),
        (("--version", "1.0", "ppc"), "usage: "),
    ],
)
def test_a_bad_version_is_refused_before_anything_is_built(
    args: tuple[str, ...], message: str
) -> None:
    before = (ROOT / "llmgw" / "__init__.py").read_bytes()
    listing = sorted(p.name for p in DIST.iterdir()) if DIST.is_dir() else []
    result = dist_sh(*args)
    assert result.returncode == 1
    assert message in result.stderr
    assert (ROOT / "llmgw" / "__init__.py").read_bytes() == before
    assert (sorted(p.name for p in DIST.iterdir()) if DIST.is_dir() else []) == listing


def test_check_of_a_version_never_built_names_the_make_command() -> None:
    result = dist_sh("--check", "--version", "0.0.0-never")
    assert result.returncode == 1
    assert (
        "dist/v0.0.0-never/llmgw-linux-x64 is missing or was built from other sources; "
        "run make dist VERSION=0.0.0-never"
    ) in result.stderr
    assert not (DIST / "v0.0.0-never").exists()


def test_top_level_sums_leave_out_the_stamped_builds(tmp_path: Path) -> None:
    """dist/SHA256SUMS covers dist/'s own artifacts; a dist/vV/ has its own SHA256SUMS."""
    (tmp_path / "llmgw-linux-x64").write_bytes(b"n")
    (tmp_path / "v0.1.1").mkdir()
    (tmp_path / "v0.1.1" / "llmgw-linux-x64").write_bytes(b"n+1")
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "x").write_bytes(b"x")
    sums = bundle.write_sums(tmp_path, ("v[0-9]*",))
    assert sums.read_text() == (
        f"{hashlib.sha256(b'n').hexdigest()}  llmgw-linux-x64\n"
        f"{hashlib.sha256(b'x').hexdigest()}  vendor/x\n"
    )
    inner = bundle.write_sums(tmp_path / "v0.1.1")
    assert inner.read_text() == f"{hashlib.sha256(b'n+1').hexdigest()}  llmgw-linux-x64\n"


# ---------------------------------------------------------------- the stamped build


def test_stamped_build_says_its_version_and_the_checkout_keeps_its_own(dist_next: Dist) -> None:
    v = dist_next.bundle.parent.name.removeprefix("v")
    assert v != version()
    for binary in (dist_next.onefile, dist_next.onedir_binary):
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"llmgw {v}\n"
    assert f'\n__version__ = "{version()}"\n' in (ROOT / "llmgw" / "__init__.py").read_text()


def test_stamped_bundle_and_sums(dist_next: Dist) -> None:
    v = dist_next.bundle.parent.name.removeprefix("v")
    top = f"llmgw-agent-{v}-linux-x64"
    with tarfile.open(dist_next.bundle) as tar:
        names = tar.getnames()
        assert {n.split("/")[0] for n in names} == {top}
        binary = tar.extractfile(f"{top}/llmgw")
        assert binary is not None and binary.read() == dist_next.onefile.read_bytes()
        info = tar.extractfile(f"{top}/BUILD-INFO")
        assert info is not None
        fields = dict(line.split(": ", 1) for line in info.read().decode().splitlines())
    assert fields["version"] == v
    sums = dist_next.bundle.parent / "SHA256SUMS"
    listed = {line.split("  ", 1)[1] for line in sums.read_text().splitlines()}
    assert {dist_next.onefile.name, dist_next.bundle.name, "llmgw-onedir-x64/llmgw"} <= listed
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=sums.parent, check=True)
    top_level = DIST / "SHA256SUMS"
    if top_level.is_file():
        assert f"v{v}/" not in top_level.read_text()


def test_stamped_build_is_cached_by_its_inputs(dist_next: Dist) -> None:
    v = dist_next.bundle.parent.name.removeprefix("v")
    check = dist_sh("--check", "--version", v)
    assert check.returncode == 0, check.stderr
    assert f"dist/v{v}/llmgw-linux-x64 and dist/v{v}/llmgw-onedir-x64 are current" in check.stderr
    assert (dist_next.bundle.parent / ".inputs-x64").read_text().strip()


# --------------------------------------------------------- the frozen build's commands


def test_frozen_build_reaches_every_subcommand(dist_x64: Dist) -> None:
    """Each subcommand and each of its own subcommands answers --help in the one-folder
    build: the modules imported on first use were frozen."""
    binary = str(dist_x64.onedir_binary)
    top = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    commands = top.stdout.split("Commands:\n", 1)[1].split()
    for name in ("agent", "ctl", "engine", "server", "up"):
        assert name in commands
        result = subprocess.run([binary, name, "--help"], capture_output=True, text=True)
        assert result.returncode == 0, (name, result.stderr[-2000:])
        if "Commands:\n" not in result.stdout:
            continue
        listed = result.stdout.split("Commands:\n", 1)[1].splitlines()
        # A command's line starts with two spaces; a wrapped help text's with more.
        for sub in (
            line.split()[0] for line in listed if line.startswith("  ") and line[2:3] != " "
        ):
            nested = subprocess.run([binary, name, sub, "--help"], capture_output=True, text=True)
            assert nested.returncode == 0, (name, sub, nested.stderr[-2000:])


# ------------------------------------------- version skew: an agent newer than the control plane


def test_an_agent_built_newer_is_refused_until_the_control_plane_is_upgraded(
    dist_next: Dist, tmp_path: Path
) -> None:
    """The N+1 build as an agent against a control plane at N (these sources): refused with
    both versions and the fix, retried with backoff (never exits); the same control plane's
    state served by the N+1 build takes it (control plane first, then agents)."""
    n, v = version(), dist_next.bundle.parent.name.removeprefix("v")
    server = start_server(tmp_path)
    agent = make_agent(tmp_path, server, "skew-1")
    log_path = agent.dir / "agent.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [str(dist_next.onefile), "agent", "--config", str(agent.config)],
            stdout=out,
            stderr=out,
        )
    servers = [server.proc]
    refusal = (
        f"this agent is llmgw {v}, newer than the control plane's llmgw {n}; upgrade the "
        f"control plane to {v} or later first (control plane first, then agents)"
    )
    try:
        wait_for(
            lambda: log_path.read_text(errors="replace").count(refusal) >= 2,
            what="the agent's refusal, retried",
            timeout=60,
        )
        said = log_path.read_text(errors="replace")
        assert proc.poll() is None, said  # retrying, not exited
        assert f"refused by 127.0.0.1:{server.grpc_port}: {refusal}" in said
        assert "Traceback" not in said
        refused = [
            e
            for e in server.api("GET", "/api/events?subject=skew-1")
            if e["kind"] == "stream_refused"
        ]
        assert refused and refusal in refused[0]["message"], refused
        assert "the agent is newer than this control plane" in server.log()
        assert [nd for nd in server.nodes() if nd["id"] == "skew-1"] == []  # never admitted

        stop_process(server.proc)
        with open(tmp_path / "server-next.log", "wb") as out:
            upgraded = subprocess.Popen(
                [str(dist_next.onefile), "server", "--config", str(tmp_path / "server.yaml")],
                stdout=out,
                stderr=out,
            )
        servers.append(upgraded)
        node = wait_for(
            lambda: (
                next(
                    (nd for nd in server.nodes() if nd["id"] == "skew-1" and nd["connected"]), None
                )
                if _up(server)
                else None
            ),
            what="the agent connected to the control plane at N+1",
            timeout=90,
            interval=0.5,
        )
        assert node["agent_version"] == v
        assert server.api("GET", "/api/status")["version"] == v
    finally:
        stop_process(proc)
        for p in servers:
            stop_process(p)


def _up(server: Server) -> bool:
    try:
        server.api("GET", "/api/status")
    except OSError:
        return False
    return True
