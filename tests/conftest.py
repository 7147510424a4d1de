"""Under ``CI=true`` nothing skips: a skip that does not come through
:func:`tests.ci.unavailable` (a ``skipif`` marker, ``pytest.importorskip``, a bare
``pytest.skip``, in a test, a fixture or at collection) is reported as a failure, so that CI
cannot pass while a part of the suite did not run."""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.ci import CI, CI_NOTE


def _as_failure(report: Any) -> None:
    if not (CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = str(reason).removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n({CI_NOTE}; a test that cannot run says so "
        "through tests.ci.unavailable, and .ci/run must provide what it lacks)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    _as_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _as_failure(outcome.get_result())


ARM64_FIXTURES = frozenset({"dist_arm64", "bullseye_arm64"})
"""What the arm64 build makes (its binaries, its emulated rootfs): a test that takes one is
marked ``arm64``, so that CI can run the rest while that build is still running (.ci/run)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if ARM64_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.arm64)


@pytest.fixture(scope="session")
def pg_cluster() -> Generator[Any, None, None]:
    """A throwaway PostgreSQL cluster for the session (tests.pg), started on first use."""
    from tests.pg import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.destroy()


@pytest.fixture(autouse=True)
def _own_user_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test its own $XDG_CONFIG_HOME: 'llmgw ctl login' keeps tokens there, which must
    neither leak from the user running the suite into a test nor from one test to another."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))


def _orphans_of(base: str) -> list[tuple[int, str]]:
    """The processes this session started that nothing stops now: left without a parent
    (reparented to PID 1), or children of this process (a Popen a fixture forgot); llmgw's
    (Python), sandboxed engines (bwrap) or haproxy, with ``base`` (the session's temporary
    directory) in their command line."""
    found = []
    parents = {1, os.getpid()}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) not in parents or fields[0] == "Z":
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        program = os.path.basename(args[0]) if args else ""
        where = next((a for a in args if base in a), None)
        if where is not None and (program.startswith("python") or program in ("bwrap", "haproxy")):
            found.append((int(entry.name), f"{program} ... {where}"))
    return found


@pytest.fixture(scope="module", autouse=True)
def _no_orphans(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Generator[None, None, None]:
    """After a module's tests and fixtures, the processes they left behind (a control plane,
    an agent, an engine whose agent was killed) are killed and named in a warning: one
    module's leak must not slow every later one (two cores) nor outlive the suite."""
    base = str(tmp_path_factory.getbasetemp())
    before = {pid for pid, _ in _orphans_of(base)}
    yield
    leaked = [(pid, text) for pid, text in _orphans_of(base) if pid not in before]
    for pid, _ in leaked:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if leaked:
        names = "; ".join(f"{pid}: {text}" for pid, text in leaked[:5])
        warnings.warn(
            f"{request.module.__name__} left {len(leaked)} process(es) running, now killed: "
            f"{names}",
            stacklevel=1,
        )
