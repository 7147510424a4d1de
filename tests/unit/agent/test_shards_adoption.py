"""Engines outlive the agent: a restarted agent adopts them, and reports those that died.

The "agent" here is a small driver script run as a real process, so that it can be killed
with SIGKILL or stopped with SIGTERM while its engine (a real ``sim``) keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.runtimes.base import ShardRecord
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import (
    DIED_WHILE_DOWN,
    EXITED_WHILE_ADOPTED,
    Shard,
    ShardManager,
    ShardState,
)
from llmgw.procutil import process_start_time

pytestmark = pytest.mark.timeout(60)

WAIT_S = 30.0

DRIVER = r"""
import asyncio, json, signal, sys
from pathlib import Path

from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import ShardManager, ShardSpec


def say(**fields):
    print(json.dumps(fields), flush=True)


def report(shard):
    say(event="status", shard=shard.shard_id, state=shard.state, pid=shard.pid,
        port=shard.port, reason=shard.reason, exit_code=shard.exit_code)


async def main(state_dir, mode):
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    manager = ShardManager(Path(state_dir), ProcessRuntime(), report, startup_timeout=30.0)
    await manager.open()
    if mode == "start":
        await manager.start(ShardSpec("s1", "r1", "sim-model", "sim", rank=2,
                                      params={"seed": "7"}, extra_args=("--tps", "500")))
    else:
        adopted, dead = await manager.adopt_all()
        say(event="adopted", adopted=[s.shard_id for s in adopted],
            dead=[r.shard_id for r in dead])
    await stop.wait()
    # An agent that stops leaves its engines running: it closes, it never calls stop_all.
    await manager.close()
    say(event="closed")


asyncio.run(main(*sys.argv[1:]))
"""


# -- /proc helpers -----------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, …"""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def running(pid: int) -> bool:
    """Alive and not a zombie (the sandbox's init may be slow to reap orphans)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def group_running(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def sim_engines_on(port: int) -> list[int]:
    """Running sim engines serving ``port``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv and b"sim" in argv and b"--port" in argv:
            i = argv.index(b"--port")
            if argv[i + 1 : i + 2] == [str(port).encode()] and running(int(entry.name)):
                found.append(int(entry.name))
    return found


def fd_targets(pid: int) -> dict[int, str]:
    fds = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            fds[int(entry.name)] = os.readlink(entry)
    return fds


def health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def wait_until(predicate: Any, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- the driver ("agent") process --------------------------------------------------------


class Driver:
    """A driver process and the JSON lines it prints."""

    def __init__(self, script: Path, state_dir: Path, mode: str) -> None:
        self.stderr_path = state_dir.parent / f"driver-{time.monotonic_ns()}.err"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), str(state_dir), mode],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                bufsize=0,
            )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.events: list[dict[str, Any]] = []
        self.eof = False
        self._buf = b""

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self.events.append(json.loads(line))

    def expect(self, after: int = 0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            for event in self.events[after:]:
                if all(event.get(k) == v for k, v in match.items()):
                    return event
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(
                    f"driver never said {match}; said {self.events}; stderr: "
                    f"{self.stderr_path.read_text(errors='replace')[-2000:]}"
                )
            self._read(0.2)

    def states(self) -> list[str]:
        return [e["state"] for e in self.events if e["event"] == "status"]

    def read_to_eof(self, timeout: float = 10.0) -> None:
        """Whatever the driver printed, up to EOF: nothing else may hold its stdout."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            assert time.monotonic() < deadline, "the driver's stdout is still held open"
            self._read(0.2)

    def sigkill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(10) == -signal.SIGKILL
        self.read_to_eof()

    def sigterm(self) -> None:
        self.proc.terminate()
        self.expect(event="closed")
        assert self.proc.wait(10) == 0
        self.read_to_eof()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def spawned() -> Iterator[list[int]]:
    """Process groups to kill at the end, whatever the test did."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def drivers(tmp_path: Path) -> Iterator[Any]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    started: list[Driver] = []

    def start(state_dir: Path, mode: str) -> Driver:
        driver = Driver(script, state_dir, mode)
        started.append(driver)
        return driver

    yield start
    for driver in started:
        driver.close()


def records(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "shards.json").read_text())


def write_records(state_dir: Path, data: object) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "shards.json").write_text(json.dumps(data))


def record_json(
    pid: int, start_time: int | None, port: int = 1, state: str = ShardState.READY
) -> dict[str, Any]:
    return {
        "replica_id": "r1",
        "model": "m",
        "engine": "sim",
        "rank": 0,
        "params": {},
        "extra_args": [],
        "pid": pid,
        "start_time": start_time,
        "port": port,
        "state": state,
    }


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None, str]] = []
        self.changed = asyncio.Event()

    def __call__(self, shard: Shard) -> None:
        self.events.append((shard.shard_id, shard.state, shard.exit_code, shard.reason))
        self.changed.set()

    async def wait_for(self, shard_id: str, state: str) -> tuple[str, str, int | None, str]:
        async def scan() -> tuple[str, str, int | None, str]:
            while True:
                for event in self.events:
                    if event[:2] == (shard_id, state):
                        return event
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(scan(), WAIT_S)


def orphan(code: str) -> int:
    """Start ``python -c code`` as a session leader whose parent has already exited, as an
    engine is after its agent died; returns its pid."""
    launcher = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True,\n"
        "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,\n"
        "                     stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher, code], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


# -- tests -------------------------------------------------------------------------------


def test_engine_survives_sigkilled_agent_and_is_adopted(
    tmp_path: Path, drivers: Any, spawned: list[int]
) -> None:
    state_dir = tmp_path / "state"
    first = drivers(state_dir, "start")
    ready = first.expect(event="status", state=ShardState.READY)
    pid, port = ready["pid"], ready["port"]
    spawned.append(pid)
    assert first.states() == [ShardState.STARTING, ShardState.READY]

    # The record holds everything needed to find the engine again and to rebuild the shard.
    rec = records(state_dir)["s1"]
    assert rec["pid"] == pid and rec["port"] == port and rec["state"] == ShardState.READY
    assert rec["start_time"] == process_start_time(pid)
    assert (rec["rank"], rec["params"], rec["extra_args"]) == (2, {"seed": "7"}, ["--tps", "500"])
    assert "container_id" not in rec

    # The engine holds /dev/null, its log and its own sockets: nothing of the agent's.
    engine_fds = fd_targets(pid)
    assert engine_fds[0] == "/dev/null"
    assert engine_fds[1] == engine_fds[2] == str(state_dir / "logs" / "s1.log")
    agent_ends = {
        t for t in fd_targets(first.proc.pid).values() if t.startswith(("pipe:", "socket:"))
    }
    assert agent_ends, "the driver has at least its stdout pipe"
    assert not agent_ends & set(engine_fds.values())
    assert os.getsid(pid) == pid

    # SIGKILL the agent: its stdout reaches EOF (the engine does not hold it) and the engine
    # goes on serving.
    first.sigkill()
    assert running(pid)
    assert health(port) == 200

    second = drivers(state_dir, "adopt")
    assert second.expect(event="adopted") == {"event": "adopted", "adopted": ["s1"], "dead": []}
    adopted = second.expect(event="status", state=ShardState.READY)
    assert (adopted["pid"], adopted["port"]) == (pid, port)
    assert second.states() == [ShardState.STARTING, ShardState.READY]
    assert sim_engines_on(port) == [pid]
    assert records(state_dir)["s1"] == {**rec, "state": ShardState.READY}

    # The adopted engine dies: the new agent sees it without being its parent.
    os.kill(pid, signal.SIGKILL)
    failed = second.expect(event="status", state=ShardState.FAILED)
    assert failed["pid"] == pid
    assert failed["exit_code"] is None
    assert failed["reason"].startswith(EXITED_WHILE_ADOPTED)
    wait_until(lambda: records(state_dir)["s1"]["state"] == ShardState.FAILED)
    second.sigterm()

    # A record of a failed shard is not adopted again, nor reported again: it is dropped.
    async def main() -> None:
        manager = ShardManager(state_dir, ProcessRuntime(), lambda shard: None)
        await manager.open()
        try:
            assert await manager.adopt_all() == ([], [])
            assert manager.snapshot() == []
        finally:
            await manager.close()

    asyncio.run(main())
    assert records(state_dir) == {}


def test_alternating_kill_and_term_keep_one_engine(
    tmp_path: Path, drivers: Any, spawned: list[int]
) -> None:
    state_dir = tmp_path / "state"
    driver = drivers(state_dir, "start")
    ready = driver.expect(event="status", state=ShardState.READY)
    pid, port = ready["pid"], ready["port"]
    spawned.append(pid)
    # Cycle 0 stops the very agent that started the engine with SIGTERM: an agent that
    # stops cleanly, as its parent, must not take its engine down either.
    for cycle in range(10):
        if cycle % 2 == 0:
            driver.sigterm()
        else:
            driver.sigkill()
        assert running(pid), f"cycle {cycle}: the engine died with its agent"
        assert sim_engines_on(port) == [pid]
        driver = drivers(state_dir, "adopt")
        assert driver.expect(event="adopted")["adopted"] == ["s1"], f"cycle {cycle}"
        again = driver.expect(event="status", state=ShardState.READY)
        assert (again["pid"], again["port"]) == (pid, port)
        assert sim_engines_on(port) == [pid]
    assert health(port) == 200
    driver.sigterm()
    assert sim_engines_on(port) == [pid]


def test_pid_reuse_dead_pids_and_finished_records(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    me = os.getpid()
    my_start = process_start_time(me)
    assert my_start is not None
    # A live process with the right start time that does not lead its own session.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    try:
        child_start = process_start_time(child.pid)
        write_records(
            state_dir,
            {
                # This pid lives, but it is not the process that was recorded.
                "reused": record_json(me, my_start + 1),
                "not-leader": record_json(child.pid, child_start),
                "dead": record_json(finished.pid, 12345),
                "no-start-time": record_json(child.pid, None),
                "was-failed": record_json(me, my_start, state=ShardState.FAILED),
                "was-exited": record_json(me, my_start, state=ShardState.EXITED),
            },
        )
        recorder = Recorder()

        async def main() -> tuple[list[Shard], list[ShardRecord], list[Shard]]:
            manager = ShardManager(state_dir, ProcessRuntime(), recorder)
            await manager.open()
            try:
                adopted, dead = await manager.adopt_all()
                return adopted, dead, manager.snapshot()
            finally:
                await manager.close()

        adopted, dead, shards = asyncio.run(main())
        assert child.poll() is None  # left alone
    finally:
        child.kill()
        child.wait()
    expected = {"reused", "not-leader", "dead", "no-start-time"}
    assert adopted == []
    assert {r.shard_id for r in dead} == expected
    assert next(r for r in dead if r.shard_id == "reused").pid == me
    # They stay, failed, so that the next Hello reports them; nothing was started.
    assert {s.shard_id for s in shards} == expected
    for shard in shards:
        assert shard.state == ShardState.FAILED
        assert shard.reason == DIED_WHILE_DOWN
        assert shard.handle is None and shard.task is None
    assert sorted(recorder.events) == sorted(
        (sid, ShardState.FAILED, None, DIED_WHILE_DOWN) for sid in expected
    )
    assert {sid: r["state"] for sid, r in records(state_dir).items()} == dict.fromkeys(
        expected, ShardState.FAILED
    )


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe garbage",
        b"[]",
        json.dumps({"s1": "not an object"}).encode(),
        json.dumps({"s1": {"replica_id": "r1", "model": "m", "engine": "sim"}}).encode(),
        json.dumps({"s1": {**record_json(1, 1), "params": {"a": 1}}}).encode(),
        json.dumps({"s1": {**record_json(1, 1), "pid": "1"}}).encode(),
    ],
)
def test_corrupt_records_are_moved_aside(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "shards.json").write_bytes(content)
    recorder = Recorder()

    async def main() -> tuple[list[Shard], list[ShardRecord]]:
        manager = ShardManager(state_dir, ProcessRuntime(), recorder)
        await manager.open()
        try:
            return await manager.adopt_all()
        finally:
            await manager.close()

    with caplog.at_level(logging.WARNING, logger="llmgw.agent.records"):
        assert asyncio.run(main()) == ([], [])
    assert recorder.events == []
    aside = list(state_dir.glob("shards.json.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes() == content
    assert records(state_dir) == {}
    assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_missing_records_adopt_nothing(tmp_path: Path) -> None:
    async def main() -> tuple[list[Shard], list[ShardRecord]]:
        manager = ShardManager(tmp_path / "state", ProcessRuntime(), lambda shard: None)
        await manager.open()
        try:
            return await manager.adopt_all()
        finally:
            await manager.close()

    assert asyncio.run(main()) == ([], [])


HELPER_AND_LEADER_IGNORE_TERM = (
    "import signal, subprocess, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen(['sh', '-c', 'trap \"\" TERM; sleep 60; exit 0'])\n"
    "time.sleep(60)\n"
)


def test_stop_of_an_adopted_shard_kills_its_process_group(
    tmp_path: Path, spawned: list[int]
) -> None:
    state_dir = tmp_path / "state"
    pid = orphan(HELPER_AND_LEADER_IGNORE_TERM)
    spawned.append(pid)
    wait_until(lambda: len(group_running(pid)) >= 3)  # leader, sh, sleep
    write_records(state_dir, {"s1": record_json(pid, process_start_time(pid), port=1)})
    recorder = Recorder()

    async def main() -> None:
        manager = ShardManager(state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S)
        await manager.open()
        try:
            adopted, dead = await manager.adopt_all()
            assert dead == []
            assert [s.pid for s in adopted] == [pid]
            assert adopted[0].state == ShardState.STARTING  # nothing answers on port 1
            handle = adopted[0].handle
            assert handle is not None and manager.runtime.alive(handle)
            began = time.monotonic()
            final = await manager.stop("s1", grace=0.5)
            # Both ignore SIGTERM: they are killed once the grace is over.
            assert time.monotonic() - began >= 0.5
            assert final is not None and final.state == ShardState.EXITED
            assert final.reason == "stopped"
            assert manager.get("s1") is None
        finally:
            await manager.close()

    asyncio.run(main())
    assert group_running(pid) == []
    assert [e[1] for e in recorder.events] == [ShardState.STARTING, ShardState.EXITED]
    assert records(state_dir) == {}


def test_adopted_wait_polls_proc_without_pidfd(
    monkeypatch: pytest.MonkeyPatch, spawned: list[int]
) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    pid = orphan("import time; time.sleep(60)")
    spawned.append(pid)
    record = ShardRecord(
        "s1", "r1", "m", "sim", pid=pid, start_time=process_start_time(pid), port=1
    )

    async def main() -> None:
        runtime = ProcessRuntime()
        handle = await runtime.adopt(record)
        assert handle is not None and handle.pid == pid
        assert runtime.alive(handle)
        waiter = asyncio.create_task(runtime.wait(handle))
        await asyncio.sleep(0.6)
        assert not waiter.done()
        os.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(waiter, 5.0) is None
        assert not runtime.alive(handle)
        # Stopping what has already ended is a no-op.
        await runtime.stop(handle, grace=0.1)

    asyncio.run(main())


def test_adopted_wait_through_pidfd(spawned: list[int]) -> None:
    pid = orphan("import time; time.sleep(60)")
    spawned.append(pid)
    record = ShardRecord(
        "s1", "r1", "m", "sim", pid=pid, start_time=process_start_time(pid), port=1
    )

    async def main() -> None:
        runtime = ProcessRuntime()
        handle = await runtime.adopt(record)
        assert handle is not None
        waiters = [asyncio.create_task(runtime.wait(handle)) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)
        os.kill(pid, signal.SIGKILL)
        # Two waiters at once (the watcher and stop()) both see the end.
        assert await asyncio.wait_for(asyncio.gather(*waiters), 5.0) == [None, None]

    asyncio.run(main())
