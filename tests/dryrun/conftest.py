"""The lab every dry-run module shares: one network, one control plane, the bundles.

The control plane runs the N+1 build (scripts/dist.sh --version N+1): it refuses agents of a
newer release than its own, so the lab's N -> N+1 upgrade and signed update run against a
control plane at N+1, as an operator's would (control plane first, then agents). Agents start
at N, inside its supported window."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import unavailable
from tests.packaging.pkgcheck import ROOT

from . import hostcheck
from .lab import ONEFILE, Lab, OrderedSteps, docker_ready, next_version, read_version


def build_next() -> Path:
    """A real build of these sources stamped N+1 (scripts/dist.sh --version; cached by its
    inputs): its folder dist/vN+1."""
    version = next_version(read_version())
    out = ROOT / "dist" / f"v{version}"
    built = subprocess.run(
        [str(ROOT / "scripts" / "dist.sh"), "--version", version, "x64"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        cwd=ROOT,
    )
    if built.returncode != 0 or not (out / f"llmgw-agent-{version}-linux-x64.tar.gz").is_file():
        raise AssertionError(
            f"scripts/dist.sh --version {version} x64 failed (exit {built.returncode}):\n"
            f"{built.stderr[-3000:]}"
        )
    return out


@pytest.fixture(scope="session", autouse=True)
def host_untouched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The dry run touches nothing on the host but its own Docker objects and its temporary
    directory: the host's containers, images, networks, volumes and mounts are listed before
    the session and after it, and a change outside llmgw's own (hostcheck.py says which those
    are) fails the session, naming it."""
    own_dirs = (str(tmp_path_factory.getbasetemp()), hostcheck.docker_root(), "/run/docker")
    before = hostcheck.take()
    yield
    changed = hostcheck.changes(before, hostcheck.take(), own_dirs=own_dirs)
    if changed:
        pytest.fail(
            "the session changed the host outside its own objects (names and labels "
            f"{hostcheck.PREFIX}*, its temporary directory):\n  " + "\n  ".join(changed)
        )


@pytest.fixture(scope="package")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    docker_ready()
    if not os.access(ONEFILE, os.X_OK):
        unavailable(f"no {ONEFILE}; build it first: make dist")
    built = Lab(tmp_path_factory.mktemp("dryrun"), next_build=build_next())
    try:
        built.start()
        yield built
    finally:
        built.stop()


@pytest.fixture(scope="module", autouse=True)
def module_leaves_nothing_up(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that uses the lab leaves no node of its own running, nor a model it deployed
    (Lab.end_module): the next modules start on a quiet lab."""
    uses_lab = any(
        "lab" in item.fixturenames
        for item in request.session.items
        if item.module is request.module
    )
    if not uses_lab:
        yield
        return
    lab: Lab = request.getfixturevalue("lab")
    mark = lab.module_mark()
    yield
    lab.end_module(mark)


@pytest.fixture(scope="package")
def bundle_next(lab: Lab) -> Path:
    """The N+1 build's bundle (the control plane runs its binary)."""
    return lab.bundle_next


@pytest.fixture
def in_order(request: pytest.FixtureRequest, steps: OrderedSteps) -> Iterator[None]:
    """For a module of ordered steps (its own ``steps`` fixture): a step after a failed one
    fails at once, naming it."""
    if steps.failed:
        pytest.fail(f"not run: the earlier step {steps.failed} failed")
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        steps.failed = request.node.name
