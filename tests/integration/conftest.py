"""Fixtures shared by the integration tests: a control plane of the test's own (``server``),
and a dockerd (``api``) and the test engine's image (``image``) for the docker runtime's
tests; without those two the docker tests are unavailable."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.utils
import pytest

from llmgw.agent.runtimes.containers import LABEL_NODE
from llmgw.loop import ENV as EVENT_LOOP_ENV
from tests.ci import unavailable
from tests.integration.docker_engine import DEFAULT_IMAGE, IMAGE_ENV, NODE
from tests.integration.harness import Server, start_server, stop_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def event_loop_of_processes() -> Iterator[str]:
    """Every process these tests start runs on uvloop, as it does in production
    (llmgw/loop.py), and fails at start where uvloop is missing instead of quietly running on
    asyncio's loop. ``LLMGW_EVENT_LOOP=asyncio pytest ...`` runs them on asyncio's."""
    with pytest.MonkeyPatch.context() as mp:
        name = os.environ.get(EVENT_LOOP_ENV) or "uvloop"
        mp.setenv(EVENT_LOOP_ENV, name)
        yield name


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A control plane started in ``tmp_path`` for the test, stopped after it."""
    srv = start_server(tmp_path)
    try:
        yield srv
    finally:
        stop_process(srv.proc)


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    """A client of the dockerd the environment names; this run's containers removed after."""
    try:
        client = docker.APIClient(version="auto", **docker.utils.kwargs_from_env())
    except docker.errors.DockerException as exc:
        unavailable(f"dockerd is not reachable ({exc}); start it: dockerd >/tmp/dockerd.log 2>&1 &")
    # What earlier runs that were killed left behind: ended and older than any test run.
    stale = client.containers(
        all=True, filters={"label": [LABEL_NODE], "status": ["created", "exited", "dead"]}
    )
    for c in stale:
        if c["Labels"][LABEL_NODE].startswith("dtest-") and c["Created"] < time.time() - 600:
            client.remove_container(c["Id"], force=True)
    try:
        yield client
    finally:
        for c in client.containers(all=True, filters={"label": [f"{LABEL_NODE}={NODE}"]}):
            client.remove_container(c["Id"], force=True)
        client.close()


@pytest.fixture(scope="module")
def image(api: Any) -> str:
    """``$LLMGW_TEST_DOCKER_IMAGE`` (.ci/run builds it), else built here."""
    name = os.environ.get(IMAGE_ENV)
    if name:
        try:
            api.inspect_image(name)
        except docker.errors.ImageNotFound:
            unavailable(f"${IMAGE_ENV} names {name}, which is not on this node")
        return name
    build = subprocess.run(
        [str(ROOT / "scripts" / "docker-test-image.sh"), DEFAULT_IMAGE],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    if build.returncode != 0:
        unavailable(f"could not build the test image: {build.stderr.strip()[-600:]}")
    return DEFAULT_IMAGE
