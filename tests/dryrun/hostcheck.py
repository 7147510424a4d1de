"""What the dry run may not touch: the host's own Docker objects and mounts.

:func:`take` lists the host's containers (with their state and start time), images (with their
tags), networks, volumes and mounts (``/proc/self/mountinfo``); :func:`changes` compares two
lists and says, one line a thing, what changed outside the objects of llmgw's own test
harnesses. tests/dryrun/conftest.py takes one list before the session and one after, and fails
the session naming what changed.

The harnesses' own objects are told by their names, which all carry the prefix ``llmgw``
(the dry run's ``llmgw-dryrun-*`` containers and networks, the package tests'
``llmgw-pkgtest-*``, the test images ``llmgw-test-*:local``, the docker runtime's
``llmgw-*`` engines, which the other half of the suite starts beside this one under .ci/run),
or by a label of theirs (``llmgw.*``); mounts by where they are: below the session's
temporary directory, on a path with a component named ``llmgw*``, or Docker's own for its
containers (below its data root and ``/run/docker``), which follow the containers' fate.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

PREFIX = "llmgw"
LABEL_PREFIX = "llmgw."

# Mount points made once for the whole host by a tool the suite runs, never undone, and so
# not a change a test may be blamed for: iproute2 makes /run/netns a mount of its own at the
# first 'ip netns add' (tests/unit/agent/test_address.py, in the other half of the suite under
# .ci/run), and scripts/dist.sh mounts binfmt_misc for the arm64 build's emulation.
HOST_ONCE = ("/run/netns", "/proc/sys/fs/binfmt_misc")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo, without its ids (a remount gives the same mount new ones)."""

    point: str
    root: str
    fstype: str
    source: str
    options: str
    super_options: str

    def __str__(self) -> str:
        return f"{self.point} ({self.fstype} {self.source}, {self.options}; {self.super_options})"


@dataclass(frozen=True)
class Snapshot:
    """The host's Docker objects (None: no Docker daemon answered) and mounts."""

    # id -> (name, image, status, started at, whether it is a harness's)
    containers: dict[str, tuple[str, str, str, str, bool]] | None
    # id -> (sorted tags, whether it is a harness's)
    images: dict[str, tuple[tuple[str, ...], bool]] | None
    # id -> (name, whether it is a harness's)
    networks: dict[str, tuple[str, bool]] | None
    # name -> (name, driver, whether it is a harness's)
    volumes: dict[str, tuple[str, str, bool]] | None
    mounts: Counter[Mount] = field(default_factory=Counter)


def _docker(*args: str) -> list[str] | None:
    """The lines ``docker ARGS`` prints; None when it fails (no daemon)."""
    try:
        done = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=120, check=False
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [line for line in done.stdout.splitlines() if line.strip()]


def _labelled(labels: object) -> bool:
    return isinstance(labels, dict) and any(str(k).startswith(LABEL_PREFIX) for k in labels)


def _inspect(kind: str, ids: list[str]) -> list[dict[str, object]]:
    if not ids:
        return []
    lines = _docker(kind, "inspect", "--format", "{{json .}}", *ids)
    # An object removed between the listing and the inspection: listed without details.
    return [json.loads(line) for line in lines or []]


def _containers() -> dict[str, tuple[str, str, str, str, bool]] | None:
    ids = _docker("ps", "-aq", "--no-trunc")
    if ids is None:
        return None
    found = {}
    for item in _inspect("container", ids):
        config, state = item.get("Config") or {}, item.get("State") or {}
        assert isinstance(config, dict) and isinstance(state, dict)
        name = str(item.get("Name", "")).lstrip("/")
        ours = name.startswith(PREFIX) or _labelled(config.get("Labels"))
        found[str(item["Id"])] = (
            name,
            str(config.get("Image", "")),
            str(state.get("Status", "")),
            str(state.get("StartedAt", "")),
            ours,
        )
    return found


def _images() -> dict[str, tuple[tuple[str, ...], bool]] | None:
    ids = _docker("image", "ls", "-q", "--no-trunc")
    if ids is None:
        return None
    found = {}
    for item in _inspect("image", sorted(set(ids))):
        tags = tuple(sorted(str(t) for t in item.get("RepoTags") or []))
        config = item.get("Config") or {}
        labels = config.get("Labels") if isinstance(config, dict) else None
        ours = any(t.startswith(PREFIX) for t in tags) or _labelled(labels)
        found[str(item["Id"])] = (tags, ours)
    return found


def _networks() -> dict[str, tuple[str, bool]] | None:
    ids = _docker("network", "ls", "-q", "--no-trunc")
    if ids is None:
        return None
    found = {}
    for item in _inspect("network", ids):
        name = str(item["Name"])
        found[str(item["Id"])] = (name, name.startswith(PREFIX) or _labelled(item.get("Labels")))
    return found


def _volumes() -> dict[str, tuple[str, str, bool]] | None:
    names = _docker("volume", "ls", "-q")
    if names is None:
        return None
    return {
        str(item["Name"]): (
            str(item["Name"]),
            str(item.get("Driver", "")),
            str(item["Name"]).startswith(PREFIX) or _labelled(item.get("Labels")),
        )
        for item in _inspect("volume", names)
    }


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def read_mounts(text: str) -> Counter[Mount]:
    """The mounts of a mountinfo text (proc(5)): ``ID PARENT MAJ:MIN ROOT POINT OPTIONS
    [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``."""
    mounts: Counter[Mount] = Counter()
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        mounts[
            Mount(
                point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                fstype=rest[0],
                source=_unescape(rest[1]),
                options=fields[5],
                super_options=rest[2],
            )
        ] += 1
    return mounts


def take() -> Snapshot:
    """The host as it is now (Docker's part None when no daemon answers)."""
    return Snapshot(
        containers=_containers(),
        images=_images(),
        networks=_networks(),
        volumes=_volumes(),
        mounts=read_mounts(Path("/proc/self/mountinfo").read_text()),
    )


def docker_root() -> str:
    """Docker's data root, whose mounts are its containers'."""
    lines = _docker("info", "--format", "{{.DockerRootDir}}")
    return lines[0] if lines else "/var/lib/docker"


def _mount_is_ours(mount: Mount, own_dirs: tuple[str, ...]) -> bool:
    path = PurePosixPath(mount.point)
    if mount.point in HOST_ONCE:
        return True
    if any(part.startswith(PREFIX) for part in path.parts):
        return True
    return any(path == PurePosixPath(d) or PurePosixPath(d) in path.parents for d in own_dirs)


def changes(before: Snapshot, after: Snapshot, *, own_dirs: tuple[str, ...]) -> list[str]:
    """What changed from ``before`` to ``after`` outside the harnesses' objects, one line a
    thing: an object removed, changed or left behind; a mount gone, added or remounted.
    ``own_dirs``: the directories whose mounts are the harness's or its containers' (the
    session's temporary directory, Docker's data root, /run/docker)."""
    found: list[str] = []
    found += _compare(
        "container",
        before.containers,
        after.containers,
        describe=lambda v: f"{v[0]} (image {v[1]}, {v[2]}, started {v[3]})",
    )
    found += _compare(
        "image", before.images, after.images, describe=lambda v: ", ".join(v[0]) or "<untagged>"
    )
    found += _compare("network", before.networks, after.networks, describe=lambda v: v[0])
    found += _compare(
        "volume", before.volumes, after.volumes, describe=lambda v: f"{v[0]} (driver {v[1]})"
    )
    gone = before.mounts - after.mounts
    added = after.mounts - before.mounts
    found += [f"mount gone: {m}" for m in sorted(gone, key=str) if not _mount_is_ours(m, own_dirs)]
    found += [
        f"mount added: {m}" for m in sorted(added, key=str) if not _mount_is_ours(m, own_dirs)
    ]
    return found


def _compare(
    kind: str,
    before: Mapping[str, tuple[Any, ...]] | None,
    after: Mapping[str, tuple[Any, ...]] | None,
    *,
    describe: Callable[[tuple[Any, ...]], str],
) -> list[str]:
    """Objects of one kind: ``{key: (..., ours)}`` each (None: Docker did not answer)."""
    if before is None or after is None:
        return []
    found = []
    for key, value in before.items():
        if value[-1]:
            continue  # a harness's: whatever became of it
        if key not in after:
            found.append(f"{kind} removed: {describe(value)}")
        elif after[key][:-1] != value[:-1]:
            found.append(f"{kind} changed: {describe(value)} -> {describe(after[key])}")
    for key, value in after.items():
        if key not in before and not value[-1]:
            found.append(f"{kind} added and left: {describe(value)}")
    return found
