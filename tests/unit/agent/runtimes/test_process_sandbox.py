"""llmgw.agent.runtimes.process with an engine in its bubblewrap sandbox: a stop gives the
engine its SIGTERM and its grace (bwrap, which dies of a SIGTERM at once, is spared), an
engine killed by a signal is reported so, and a restarted agent adopts and stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.bwrap import Bubblewrap
from llmgw.agent.runtimes.base import Handle, Launch, ShardRecord
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.sandbox import Sandboxed, Sandboxes, SandboxLayout
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.procutil import process_running
from tests.ci import require_tools

# An engine that takes its time to stop: it notes the SIGTERM, cleans up for 0.8 s, notes
# that it finished, and exits 0. Its notes go to its HOME (the shard's scratch).
ENGINE = """
import os, signal, sys, time
home = os.environ["HOME"]
def note(name):
    with open(os.path.join(home, name), "w") as f:
        f.write(str(os.getpid()))
def term(*_):
    note("term")
    time.sleep(0.8)
    note("clean")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
note("up")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def sandboxed(tmp_path: Path) -> Sandboxed:
    require_tools("bwrap")
    layout = SandboxLayout.for_node(
        tmp_path / "state",
        config_file=tmp_path / "agent.yaml",
        key_file=tmp_path / "state" / "node.key",
        models_root=tmp_path / "models",
        cache_root=tmp_path / "cache",
    )
    made = asyncio.run(
        Sandboxes(layout, Bubblewrap()).prepare(
            "s1", SandboxPolicy(), program=sys.executable, model=None, multi_node=False
        )
    )
    assert made is not None
    return made


def launch(sandboxed: Sandboxed, tmp_path: Path, code: str = ENGINE) -> Launch:
    plain = Launch(
        shard_id="s1",
        argv=(sys.executable, "-c", code),
        port=1,
        log_path=tmp_path / "logs" / "s1.log",
    )
    return sandboxed.launch(plain)


async def wait_note(home: Path, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (home / name).exists():
        assert time.monotonic() < deadline, f"no {name} note in {timeout}s"
        await asyncio.sleep(0.02)


def test_a_stop_gives_the_sandboxed_engine_its_grace(sandboxed: Sandboxed, tmp_path: Path) -> None:
    home = sandboxed.plan.scratch / "home"
    runtime = ProcessRuntime()

    async def main() -> tuple[Handle, float]:
        handle = await runtime.start(launch(sandboxed, tmp_path))
        assert handle.sandboxed
        await wait_note(home, "up")
        began = time.monotonic()
        await runtime.stop(handle, grace=10.0)
        return handle, time.monotonic() - began

    handle, took = asyncio.run(main())
    # bwrap is the recorded process and leads the session; the engine is another process.
    assert int((home / "up").read_text()) != handle.pid
    assert (home / "term").exists() and (home / "clean").exists(), "no grace: killed at once"
    assert took >= 0.7
    assert not runtime.alive(handle)
    assert gone_within(handle.pid)
    log = (tmp_path / "logs" / "s1.log").read_text()
    assert "bwrap:" not in log, log


def test_an_engine_killed_by_a_signal_is_reported_killed(
    sandboxed: Sandboxed, tmp_path: Path
) -> None:
    runtime = ProcessRuntime()
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"

    async def main() -> int | None:
        handle = await runtime.start(launch(sandboxed, tmp_path, code))
        return await runtime.wait(handle)

    assert asyncio.run(main()) == -9
    exits = "import sys; sys.exit(3)"

    async def exits_3() -> int | None:
        return await runtime.wait(await runtime.start(launch(sandboxed, tmp_path, exits)))

    assert asyncio.run(exits_3()) == 3


def test_a_restarted_agent_adopts_the_sandboxed_engine_and_stops_it_gracefully(
    sandboxed: Sandboxed, tmp_path: Path
) -> None:
    home = sandboxed.plan.scratch / "home"
    first = ProcessRuntime()

    async def start() -> Handle:
        handle = await first.start(launch(sandboxed, tmp_path))
        await wait_note(home, "up")
        return handle

    handle = asyncio.run(start())
    record = ShardRecord(
        shard_id="s1",
        replica_id="r1",
        model="m",
        engine="sim",
        pid=handle.pid,
        start_time=handle.start_time,
        sandboxed=True,
    )
    second = ProcessRuntime()  # the next agent

    async def adopt_and_stop() -> Handle | None:
        adopted = await second.adopt(record)
        assert adopted is not None and adopted.sandboxed
        await second.stop(adopted, grace=10.0)
        return adopted

    adopted = asyncio.run(adopt_and_stop())
    assert adopted is not None
    assert (home / "clean").exists(), "the adopted engine was not given its grace"
    assert not process_running(handle.pid, handle.start_time)
    # The whole sandbox went: nothing is left in bwrap's session (its reaper, the engine).
    assert gone_within(handle.pid)


def gone_within(sid: int, timeout: float = 5.0) -> bool:
    """Session ``sid`` empties within ``timeout`` (a SIGKILL takes a moment to land)."""
    deadline = time.monotonic() + timeout
    while session_members(sid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a zombie waits for the node's init: gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                if os.getsid(int(entry)) == sid and stat[stat.rindex(b")") + 2 :][:1] != b"Z":
                    found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


def test_the_sandbox_goes_whole_when_bwrap_itself_is_killed(
    sandboxed: Sandboxed, tmp_path: Path
) -> None:
    # bwrap's outer process killed (what a test's or an operator's `kill -9 PID` of the
    # recorded engine does): the sandbox's init and the engine in it must not live on.
    runtime = ProcessRuntime()
    home = sandboxed.plan.scratch / "home"

    async def main() -> tuple[int | None, int]:
        handle = await runtime.start(launch(sandboxed, tmp_path))
        await wait_note(home, "up")
        os.kill(handle.pid, signal.SIGKILL)
        return await runtime.wait(handle), handle.pid

    _code, group = asyncio.run(main())
    deadline = time.monotonic() + 10
    while _members(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _members(group)


def _members(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found
