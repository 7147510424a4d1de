"""The host check of the dry run (hostcheck.py, conftest.py's ``host_untouched``): what it
counts as a change of the host, and that it sees a real one."""

from __future__ import annotations

import subprocess
import uuid
from collections import Counter

from tests.ci import require_tools

from . import hostcheck
from .hostcheck import Mount, Snapshot, changes, read_mounts

OWN = ("/tmp/pytest-of-root/pytest-7", "/var/lib/docker", "/run/docker")
MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 22 0:26 / /sys/fs/cgroup/memory rw,nosuid shared:9 - cgroup cgroup rw,memory
41 22 0:40 / /srv/with\\040space rw - tmpfs tmpfs rw,size=4k
"""


def snapshot(**parts: object) -> Snapshot:
    base: dict[str, object] = {
        "containers": {
            "c-host": ("postgres-dev", "postgres:16", "running", "2026-01-01T00:00:00Z", False),
            "c-ours": ("llmgw-dryrun-1-ab", "llmgw-test-systemd:local", "running", "t0", True),
        },
        "images": {"i-host": (("postgres:16",), False), "i-ours": (("llmgw-test:local",), True)},
        "networks": {"n-bridge": ("bridge", False), "n-ours": ("llmgw-dryrun-1-ab", True)},
        "volumes": {"pgdata": ("pgdata", "local", False)},
        "mounts": read_mounts(MOUNTINFO),
    }
    base.update(parts)
    return Snapshot(**base)  # type: ignore[arg-type]


def test_mountinfo_is_read_without_ids_and_with_escapes() -> None:
    mounts = read_mounts(MOUNTINFO)
    assert Mount("/srv/with space", "/", "tmpfs", "tmpfs", "rw", "rw,size=4k") in mounts
    assert Mount("/sys/fs/cgroup/memory", "/", "cgroup", "cgroup", "rw,nosuid", "rw,memory") in (
        mounts
    )
    assert sum(mounts.values()) == 3


def test_nothing_changed_outside_the_harness_is_no_change() -> None:
    before = snapshot()
    after = snapshot(
        containers={
            **before.containers,
            "c-new": ("llmgw-pkgtest-2-cd", "x", "running", "t", True),
        },  # type: ignore[dict-item]
        networks={"n-bridge": ("bridge", False)},  # the harness's own network went
        mounts=before.mounts
        + read_mounts(
            "50 22 0:50 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw\n"
            "51 22 0:51 / /run/docker/netns/abc rw - nsfs nsfs rw\n"
            "52 22 0:52 / /tmp/pytest-of-root/pytest-7/t0/noexec rw,noexec - tmpfs tmpfs rw\n"
            "53 22 0:53 / /var/cache/llmgw-test/dist/x/proc rw - proc proc rw\n"
            "54 22 0:54 / /run/netns rw - tmpfs tmpfs rw\n"
        ),
    )
    assert changes(before, after, own_dirs=OWN) == []
    # Without a Docker daemon (None) only the mounts are compared.
    assert changes(before, snapshot(containers=None, images=None), own_dirs=OWN) == []


def test_the_hosts_own_objects_and_mounts_changed_are_named() -> None:
    before = snapshot()
    after = snapshot(
        containers={
            "c-host": ("postgres-dev", "postgres:16", "exited", "2026-01-01T00:00:00Z", False),
            "c-stray": ("busy_turing", "debian:12", "running", "t1", False),
        },
        images={"i-ours": (("llmgw-test:local",), True)},
        networks={"n-ours": ("llmgw-dryrun-1-ab", True)},
        volumes={},
        mounts=Counter(
            {
                Mount("/", "/", "ext4", "/dev/vda", "rw,relatime", "rw,discard"): 1,
                # the cgroup hierarchy remounted read-only
                Mount(
                    "/sys/fs/cgroup/memory", "/", "cgroup", "cgroup", "ro,nosuid", "rw,memory"
                ): 1,
                Mount("/srv/with space", "/", "tmpfs", "tmpfs", "rw", "rw,size=4k"): 1,
            }
        ),
    )
    found = changes(before, after, own_dirs=OWN)
    assert found == [
        "container changed: postgres-dev (image postgres:16, running, started "
        "2026-01-01T00:00:00Z) -> postgres-dev (image postgres:16, exited, started "
        "2026-01-01T00:00:00Z)",
        "container added and left: busy_turing (image debian:12, running, started t1)",
        "image removed: postgres:16",
        "network removed: bridge",
        "volume removed: pgdata (driver local)",
        "mount gone: /sys/fs/cgroup/memory (cgroup cgroup, rw,nosuid; rw,memory)",
        "mount added: /sys/fs/cgroup/memory (cgroup cgroup, ro,nosuid; rw,memory)",
    ]


def test_a_real_docker_object_outside_the_harness_is_seen() -> None:
    """Against this host's dockerd: its default networks are the host's, the mounts are
    read, and a network that is not the harness's, made and left, is a change."""
    require_tools("docker")
    before = hostcheck.take()
    assert before.networks is not None, "docker did not answer"
    assert ("bridge", False) in before.networks.values()
    assert any(m.point == "/" for m in before.mounts)
    # A name without the harness's prefix, removed at once (the session's own check, after
    # the session, never sees it).
    name = f"hostcheck-probe-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "network", "create", name], capture_output=True, check=True)
    try:
        after = hostcheck.take()
    finally:
        subprocess.run(["docker", "network", "rm", name], capture_output=True, check=False)
    assert f"network added and left: {name}" in changes(before, after, own_dirs=OWN)
