"""The frozen llmgw runs the control plane on PostgreSQL (server.yaml's database: a
postgresql:// URL): both x64 builds here, and the one-folder build in a Debian 11 rootfs,
which has no libpq of its own (x64 natively, arm64 under qemu-user), start `llmgw server
--config` on a fresh database of the session's throwaway cluster (tests/pg.py), answer
/healthz, lead (the lease in the database is theirs), and give the lease up when stopped.

Every run sets PSYCOPG_IMPL=binary: psycopg then refuses to load unless its C implementation
(psycopg_binary, with the libpq its wheel carries) is in the build, where it would otherwise
fall back to its ctypes one on whatever libpq the machine has (this one has Debian's, from the
postgresql package the tests need).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.pg import Cluster

from .distcheck import Dist, copied_into_rootfs, rootfs_argv

INSTANCE = "frozen-1"
ONLY_THE_BUNDLED_LIBPQ = {"PSYCOPG_IMPL": "binary"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthz(port: int, token: str = "") -> dict[str, Any] | None:
    """/healthz: its status and role, and with a reader's token (the admin token) the rest."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=2) as resp:
            return dict(json.loads(resp.read()))
    except (urllib.error.URLError, OSError):
        return None


def lease(cluster: Cluster, database: str) -> tuple[str, int, float]:
    holder, epoch, expires = (
        cluster.psql("SELECT holder, epoch, expires_at FROM leader_lease", database)
        .strip()
        .split("|")
    )
    return holder, int(epoch), float(expires)


def lead_and_stop(
    cluster: Cluster,
    files: Path,
    seen_as: str,
    command: list[str],
    env: dict[str, str] | None = None,
    *,
    start_within: float = 60,
) -> None:
    """Run the frozen ``command`` + ``server --config`` on a fresh database; its files go in
    ``files``, which the server sees as ``seen_as``: check it leads, then stop it."""
    database = cluster.fresh_database()
    http_port = free_port()
    cluster.password_file(files)
    (files / "server.yaml").write_text(
        yaml.safe_dump(
            {
                "state_dir": f"{seen_as}/state",
                "http_listen": f"127.0.0.1:{http_port}",
                "grpc_listen": f"127.0.0.1:{free_port()}",
                "enroll_listen": "127.0.0.1:0",
                "instance_id": INSTANCE,
                "database": {
                    "url": cluster.url(database, password=False),
                    "password_file": f"{seen_as}/db-password",
                },
            }
        )
    )
    log_path = files / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*command, "server", "--config", f"{seen_as}/server.yaml"],
            stdout=log,
            stderr=log,
            env=env,
        )
    try:
        deadline = time.monotonic() + start_within
        health = None
        while health is None:
            assert server.poll() is None, (
                f"llmgw server exited with {server.returncode}:\n{log_path.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"no /healthz within {start_within:.0f} s:\n{log_path.read_text()}"
            )
            time.sleep(0.2)
            health = healthz(http_port)
        assert health == {"status": "ok", "role": "leader"}, health  # all a stranger sees
        health = healthz(http_port, (files / "state" / "admin.token").read_text().strip())
        assert health is not None and health["status"] == "ok", health
        assert health["epoch"] == 1, health
        text = log_path.read_text()
        assert 'msg="control plane started"' in text and "epoch=1" in text, text
        assert "standby" not in text, text
        holder, epoch, _expires = lease(cluster, database)
        assert (holder, epoch) == (INSTANCE, 1)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, log_path.read_text()
    # A clean stop gives the lease up (expired at once) for a standby to take.
    assert lease(cluster, database) == (INSTANCE, 1, 0.0)


@contextlib.contextmanager
def folder_in(rootfs: Path) -> Iterator[tuple[Path, str]]:
    """A new folder inside ``rootfs``: where it is here, and as a program run there sees it;
    removed afterwards."""
    here = Path(tempfile.mkdtemp(prefix="llmgw-pg-", dir=rootfs / "opt"))
    try:
        yield here, f"/opt/{here.name}"
    finally:
        shutil.rmtree(here, ignore_errors=True)


def lead_in_rootfs(rootfs: Path, onedir: Path, cluster: Cluster, start_within: float) -> None:
    """:func:`lead_and_stop` with a copy of ``onedir`` run in ``rootfs``, which must have no
    libpq of its own: the build's is then the only one."""
    assert not list(rootfs.glob("usr/lib/*/libpq.so*")), "this rootfs has a libpq"
    env = [f"{name}={value}" for name, value in ONLY_THE_BUNDLED_LIBPQ.items()]
    with folder_in(rootfs) as (here, there), copied_into_rootfs(rootfs, onedir) as inside:
        command = rootfs_argv(rootfs, *env, inside)
        lead_and_stop(cluster, here, there, command, start_within=start_within)


@pytest.mark.parametrize("variant", ["onefile", "onedir"])
def test_both_builds_lead_on_postgresql(
    dist_x64: Dist, pg_cluster: Cluster, tmp_path: Path, variant: str
) -> None:
    binary = dist_x64.onefile if variant == "onefile" else dist_x64.onedir_binary
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **ONLY_THE_BUNDLED_LIBPQ}
    lead_and_stop(pg_cluster, tmp_path, str(tmp_path), [str(binary)], env)


def test_the_package_build_leads_on_postgresql_in_debian_11(
    dist_x64: Dist, pg_cluster: Cluster, bullseye_amd64: Path
) -> None:
    lead_in_rootfs(bullseye_amd64, dist_x64.onedir, pg_cluster, start_within=60)


@pytest.mark.timeout(1800)
def test_the_arm64_package_build_leads_on_postgresql_under_qemu(
    dist_arm64: Dist, pg_cluster: Cluster, bullseye_arm64: Path
) -> None:
    # Emulated, a start takes many times what it takes natively.
    lead_in_rootfs(bullseye_arm64, dist_arm64.onedir, pg_cluster, start_within=600)
