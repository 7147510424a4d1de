"""The fixture of the hostile-input tests: one real ``llmgw up`` for the package (what the
tests share besides is in cluster.py)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.integration.harness import free_port, start_up, stop_process
from tests.integration.hostile.cluster import Cluster, rss


@pytest.fixture(scope="package")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One real ``llmgw up`` for the package, every listener on a port of its own."""
    state = tmp_path_factory.mktemp("hostile-up")
    ports = {name: free_port() for name in ("http", "grpc", "enroll", "agent")}
    started = start_up(
        state,
        port=ports["http"],
        grpc_port=ports["grpc"],
        agent_port=ports["agent"],
        enroll_port=ports["enroll"],
    )
    cluster = Cluster(
        started.proc,
        state,
        ports["http"],
        ports["grpc"],
        ports["enroll"],
        ports["agent"],
        started.api_key,
        output=started.output,
    )
    cluster.rss_at_start = {pid: rss(pid) for pid in cluster.pids()}
    try:
        yield cluster
    finally:
        stop_process(started.proc, signal.SIGINT, timeout=60)  # type: ignore[arg-type]
