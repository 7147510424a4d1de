"""The lab every dry-run module shares: one network, one control plane, the bundles."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import unavailable
from tests.packaging.pkgcheck import ROOT

from .lab import ONEFILE, Lab, OrderedSteps, docker_ready, next_version, read_version


@pytest.fixture(scope="package")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    docker_ready()
    if not os.access(ONEFILE, os.X_OK):
        unavailable(f"no {ONEFILE}; build it first: make dist")
    built = Lab(tmp_path_factory.mktemp("dryrun"))
    try:
        built.start()
        yield built
    finally:
        built.stop()


@pytest.fixture(scope="package")
def bundle_next(lab: Lab) -> Path:
    """A real build of these sources stamped N+1 (scripts/dist.sh --version), its bundle."""
    version = next_version(read_version())
    bundle = ROOT / "dist" / f"v{version}" / f"llmgw-agent-{version}-linux-x64.tar.gz"
    built = subprocess.run(
        [str(ROOT / "scripts" / "dist.sh"), "--version", version, "x64"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        cwd=ROOT,
    )
    if built.returncode != 0 or not bundle.is_file():
        raise AssertionError(
            f"scripts/dist.sh --version {version} x64 failed (exit {built.returncode}):\n"
            f"{built.stderr[-3000:]}"
        )
    return bundle


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
