"""The frozen llmgw that `make dist` builds: it says its version, fits the size target, and a
one-file build unpacks itself into a directory it owns, never into a noexec $TMPDIR."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tests.ci import unavailable

from .distcheck import Dist, dist_x64, load_packaging_module, noexec_dir, version

__all__ = ["dist_x64", "noexec_dir"]  # fixtures, used by name

report = load_packaging_module("report")


def env_for(home: Path, tmpdir: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmpdir), **extra}


def unpacked(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("_MEI*")) if directory.is_dir() else []


def test_both_builds_say_their_version(dist_x64: Dist) -> None:
    for binary in (dist_x64.onefile, dist_x64.onedir_binary):
        result = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"llmgw {version()}\n"


def test_one_file_build_fits_the_size_target(dist_x64: Dist) -> None:
    size = dist_x64.onefile.stat().st_size
    assert size <= report.ONEFILE_SIZE_TARGET, f"{size / 1e6:.1f} MB"


def test_one_file_start_up_costs_little_more_than_one_folder(dist_x64: Dist) -> None:
    # What packaging adds: unpacking the archive at every start. (The absolute figures, and
    # their targets, are what `make dist` prints; they include importing llmgw's CLI.)
    onefile = min(report.start_times(dist_x64.onefile, 5))
    onedir = min(report.start_times(dist_x64.onedir_binary, 5))
    assert onefile - onedir <= 0.75, f"one-file {onefile:.2f} s, one-folder {onedir:.2f} s"


def test_one_file_build_runs_with_tmpdir_on_a_noexec_mount(
    dist_x64: Dist, tmp_path: Path, noexec_dir: Path | None
) -> None:
    if noexec_dir is None:
        unavailable("mounting a noexec tmpfs needs root; the next tests check where it unpacks")
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run(
        [str(dist_x64.onefile), "--version"],
        env=env_for(home, noexec_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llmgw {version()}\n"
    assert unpacked(noexec_dir) == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def unpacks_into(binary: Path, env: dict[str, str], *places: Path) -> Path:
    """Start the sim engine from ``binary`` (a long-running command), and say which of
    ``places`` holds its _MEI* directory while it runs; checks it is removed at exit."""
    port = free_port()
    process = subprocess.Popen(
        [str(binary), "engine", "sim", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # Serving: unpacked, and the bootloader waits on its child (a TERM while it is still
        # unpacking would end it before it can clean up).
        deadline = time.monotonic() + 60
        while not listening(port):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the sim engine did not listen within 60 s"
            time.sleep(0.05)
        holding = [place for place in places if unpacked(place)]
        assert len(holding) == 1, f"_MEI* directories in {holding} of {places}"
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert unpacked(holding[0]) == [], "the unpacked directory outlived the program"
    return holding[0]


def test_llmgw_runtime_dir_comes_first(dist_x64: Dist, tmp_path: Path) -> None:
    runtime, home, tmpdir = tmp_path / "run" / "llmgw", tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    env = env_for(home, tmpdir, LLMGW_RUNTIME_DIR=str(runtime))
    cache = home / ".cache" / "llmgw"
    assert unpacks_into(dist_x64.onefile, env, runtime, cache, tmpdir) == runtime
    assert runtime.stat().st_mode & 0o777 == 0o700  # created for this user alone


def test_without_it_the_users_cache_then_tmpdir(dist_x64: Dist, tmp_path: Path) -> None:
    home, tmpdir = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    cache = home / ".cache" / "llmgw"
    assert unpacks_into(dist_x64.onefile, env_for(home, tmpdir), cache, tmpdir) == cache
    # A $HOME that does not exist is not created: $TMPDIR (exec allowed here) serves.
    nowhere = tmp_path / "no-such-home"
    assert unpacks_into(dist_x64.onefile, env_for(nowhere, tmpdir), tmpdir) == tmpdir
    assert not nowhere.exists()


def test_the_one_folder_build_unpacks_nothing(dist_x64: Dist, tmp_path: Path) -> None:
    home, tmpdir = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    result = subprocess.run(
        [str(dist_x64.onedir_binary), "--version"],
        env=env_for(home, tmpdir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmpdir) == [] and os.listdir(home) == []


def test_both_builds_carry_python_systemd(dist_x64: Dist) -> None:
    # The journal handler of llmgw/log.py (LLMGW_* fields, priorities) and the libsystemd it
    # was compiled against (scripts/dist.sh checks the one-file archive the same way when it
    # builds; the dry run reads the fields back with journalctl).
    internal = dist_x64.onedir / "_internal"
    assert list((internal / "systemd").glob("_journal.*.so")), sorted(os.listdir(internal))
    assert (internal / "libsystemd.so.0").is_file()
    marker = b"systemd/_journal."
    assert marker in dist_x64.onefile.read_bytes(), "the one-file build lacks python-systemd"
