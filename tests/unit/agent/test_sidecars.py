"""Sidecars and multi-node shards, with ShardManager and real processes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.agent.runtimes.base import Handle, Launch
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import (
    NEVER_STARTED,
    Shard,
    ShardManager,
    ShardSpec,
    ShardState,
)
from llmgw.agent.sidecars import (
    DEFAULT_READY_AFTER_S,
    DEFAULT_TIMEOUT_S,
    SidecarSpec,
)
from llmgw.agent.stream import StreamClient
from llmgw.contracts.ports import PortRange
from llmgw.errors import ShardError
from llmgw.proto import control_pb2 as pb
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import generate
from llmgw.sim.rendezvous import JOINED

pytestmark = pytest.mark.timeout(90)

WAIT_S = 30.0
"""The most any one step may take (an interpreter start on a busy machine, with margin);
a step that takes longer fails the test."""

# A sidecar: after DELAY seconds it answers GET /health with 200 on 127.0.0.1:PORT. It
# writes the time it can first answer to HEALTHY_FILE, and on SIGTERM whether the engine's
# port (LLMGW_ENGINE_PORT) still answered to STOPPED_FILE.
SIDECAR = r"""
import http.server, os, signal, socket, sys, time
port, delay, healthy_file, stopped_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]

def on_term(signum, frame):
    engine = int(os.environ.get("LLMGW_ENGINE_PORT", "0"))
    try:
        socket.create_connection(("127.0.0.1", engine), timeout=1).close()
        alive = True
    except OSError:
        alive = False
    with open(stopped_file, "w") as f:
        f.write("engine-alive" if alive else "engine-gone")
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
print("sidecar starting", os.environ.get("LLMGW_SIDECAR"), os.environ.get("LLMGW_SHARD_ID"),
      flush=True)
time.sleep(delay)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Handler)
with open(healthy_file, "w") as f:
    f.write(repr(time.time()))
print("sidecar up", flush=True)
server.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of this test still answers kill(0).
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def environ_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


@dataclass(frozen=True)
class Event:
    shard_id: str
    state: str
    pid: int
    port: int
    reason: str
    at: float


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = asyncio.Event()

    def __call__(self, shard: Shard) -> None:
        self.events.append(
            Event(shard.shard_id, shard.state, shard.pid, shard.port, shard.reason, time.time())
        )
        self._changed.set()

    def states(self, shard_id: str) -> list[str]:
        return [e.state for e in self.events if e.shard_id == shard_id]

    async def wait_for(
        self, shard_id: str, state: str, *, after: int = 0, timeout: float = WAIT_S
    ) -> Event:
        async def scan() -> Event:
            while True:
                for e in self.events[after:]:
                    if e.shard_id == shard_id and e.state == state:
                        return e
                self._changed.clear()
                await self._changed.wait()

        try:
            return await asyncio.wait_for(scan(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"shard {shard_id} not {state} within {timeout:g}s; saw {self.states(shard_id)}"
            ) from None


class CountingRuntime(ProcessRuntime):
    """The process runtime, remembering when it was asked to start an engine."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, Launch]] = []

    async def start(self, launch: Launch) -> Handle:
        self.starts.append((time.time(), launch))
        return await super().start(launch)


@dataclass
class Files:
    script: Path
    healthy: Path
    stopped: Path


@pytest.fixture
def files(tmp_path: Path) -> Files:
    script = tmp_path / "sidecar.py"
    script.write_text(SIDECAR)
    return Files(script, tmp_path / "healthy", tmp_path / "stopped")


def web_sidecar(files: Files, port: int, *, delay: float = 1.0, **kw: Any) -> SidecarSpec:
    argv = (sys.executable, str(files.script), str(port), str(delay))
    return SidecarSpec(
        name=kw.pop("name", "web"),
        argv=(*argv, str(files.healthy), str(files.stopped)),
        health_url=kw.pop("health_url", f"http://127.0.0.1:{port}/health"),
        **kw,
    )


def sim_spec(shard_id: str = "s1", **kw: Any) -> ShardSpec:
    return ShardSpec(shard_id=shard_id, replica_id="r1", model="sim-model", engine="sim", **kw)


def run(
    state_dir: Path,
    body: Callable[[ShardManager, Recorder, CountingRuntime], Awaitable[None]],
    **kw: Any,
) -> None:
    async def main() -> None:
        recorder = Recorder()
        runtime = CountingRuntime()
        manager = ShardManager(state_dir, runtime, recorder, startup_timeout=WAIT_S, **kw)
        await manager.open()
        try:
            await body(manager, recorder, runtime)
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    asyncio.run(main())


def records(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "shards.json").read_text())


async def get_status(port: int, path: str = "/health") -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as resp,
    ):
        return resp.status


# ------------------------------------------------------------------ the spec


def test_spec_from_order_fills_defaults_and_validates() -> None:
    spec = SidecarSpec.from_order(pb.Sidecar(name="proxy", argv=["/bin/proxy", "-v"]))
    assert spec == SidecarSpec("proxy", ("/bin/proxy", "-v"), "", DEFAULT_TIMEOUT_S, 1.0)
    assert DEFAULT_READY_AFTER_S == 1.0
    given = pb.Sidecar(
        name="m", argv=["x"], health_url="http://127.0.0.1:9/h", timeout_s=5, ready_after_s=2
    )
    assert SidecarSpec.from_order(given) == SidecarSpec("m", ("x",), "http://127.0.0.1:9/h", 5, 2)
    assert "answer 200" in SidecarSpec.from_order(given).waits_for()
    assert "keep running for 1s" in spec.waits_for()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": ""}, "sidecar name ''"),
        ({"name": "../evil"}, "sidecar name '../evil'"),
        ({"argv": ()}, "has no command"),
        ({"argv": ("",)}, "has no command"),
        ({"health_url": "127.0.0.1:9/h"}, "is not an http(s) URL"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"ready_after_s": 10, "timeout_s": 5}, "below timeout_s"),
    ],
)
def test_spec_validation(kwargs: dict[str, Any], needle: str) -> None:
    fields: dict[str, Any] = {"name": "ok", "argv": ("x",), **kwargs}
    with pytest.raises(ShardError) as info:
        SidecarSpec(**fields)
    assert needle in str(info.value)


def test_start_order_carries_every_field_into_the_spec() -> None:
    seen: list[ShardSpec] = []

    class Shards:
        async def start(self, spec: ShardSpec) -> None:
            seen.append(spec)

    class Client:
        shards = Shards()

    order = pb.StartShard(
        shard_id="r1-s1",
        replica_id="r1",
        model="m",
        engine="sim",
        rank=1,
        params={"seed": "3"},
        extra_args=["--tps", "9"],
        gpus=["GPU-a", "GPU-b"],
        nodes=2,
        dist_init_addr="10.0.0.1:29500",
        source="/srv/llmgw/models/m",
        gpu_memory_mib=40960,
        sidecars=[pb.Sidecar(name="proxy", argv=["p"], health_url="http://127.0.0.1:1/")],
        profile="2x2",
    )
    asyncio.run(StreamClient._start(Client(), order))  # type: ignore[arg-type]
    assert seen == [
        ShardSpec(
            shard_id="r1-s1",
            replica_id="r1",
            model="m",
            engine="sim",
            rank=1,
            params={"seed": "3"},
            extra_args=("--tps", "9"),
            nodes=2,
            dist_init_addr="10.0.0.1:29500",
            gpus=("GPU-a", "GPU-b"),
            source="/srv/llmgw/models/m",
            gpu_memory_mib=40960,
            sidecars=(SidecarSpec("proxy", ("p",), "http://127.0.0.1:1/"),),
            profile="2x2",
        )
    ]
    # A control plane that predates these fields says nodes 0: one node.
    seen.clear()
    asyncio.run(StreamClient._start(Client(), pb.StartShard(shard_id="x", engine="sim")))  # type: ignore[arg-type]
    assert seen[0].nodes == 1 and seen[0].sidecars == () and not seen[0].worker


# ------------------------------------------------------------------ sidecars before the engine


def test_engine_starts_only_after_its_sidecar_is_healthy(tmp_path: Path, files: Files) -> None:
    state_dir = tmp_path / "state"
    side_port = free_port()

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        ordered_at = time.time()
        shard = await manager.start(sim_spec(sidecars=(web_sidecar(files, side_port),)))
        assert shard.state == ShardState.STARTING and shard.pid == 0
        assert runtime.starts == []  # the sidecar is not healthy yet: no engine

        # Ready within the deadline, or the test fails.
        ready = await rec.wait_for("s1", ShardState.READY, timeout=WAIT_S)
        assert rec.states("s1") == [
            ShardState.STARTING,
            ShardState.STARTING,
            ShardState.READY,
        ]  # no engine, engine, ready

        # The order: sidecar healthy, then (and only then) the engine started.
        healthy_at = float(files.healthy.read_text())
        assert len(runtime.starts) == 1
        engine_started_at = runtime.starts[0][0]
        sidecar = shard.sidecars.sidecars[0] if shard.sidecars else None
        assert sidecar is not None and sidecar.healthy_at is not None
        assert ordered_at < healthy_at <= sidecar.healthy_at <= engine_started_at
        assert engine_started_at - ordered_at >= 1.0  # the sidecar's delay
        assert ready.at - ordered_at < WAIT_S

        # The sidecar is a process of its own session, logging to <shard>.<sidecar>.log,
        # told the shard, its name and the engine's port.
        assert os.getsid(sidecar.pid) == sidecar.pid
        log = (state_dir / "logs" / "s1.web.log").read_text()
        assert "sidecar starting web s1" in log and "sidecar up" in log
        assert f"LLMGW_ENGINE_PORT={shard.port}".encode() in environ_of(sidecar.pid)
        assert await get_status(shard.port) == 200

        # Recorded with the shard, for adoption.
        rec_s1 = records(state_dir)["s1"]
        assert rec_s1["sidecars"] == [
            {
                "name": "web",
                "argv": list(sidecar.spec.argv),
                "health_url": f"http://127.0.0.1:{side_port}/health",
                "timeout_s": DEFAULT_TIMEOUT_S,
                "ready_after_s": DEFAULT_READY_AFTER_S,
                "pid": sidecar.pid,
                "start_time": sidecar.start_time,
                "sandboxed": False,
            }
        ]

        # Stopping the shard stops the engine first, then the sidecar.
        engine_pid = shard.pid
        final = await manager.stop("s1", grace=5.0)
        assert final is not None and final.state == ShardState.EXITED
        assert not pid_alive(engine_pid) and not pid_alive(sidecar.pid)
        assert files.stopped.read_text() == "engine-gone"
        assert "s1" not in records(state_dir)

    run(state_dir, body)


def test_sidecar_without_health_url_is_healthy_after_ready_after_s(
    tmp_path: Path, files: Files
) -> None:
    state_dir = tmp_path / "state"
    side = SidecarSpec("idle", (sys.executable, "-c", "import time; time.sleep(60)"), "", 10, 0.7)

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        shard = await manager.start(sim_spec(sidecars=(side,)))
        await rec.wait_for("s1", ShardState.READY)
        assert shard.sidecars is not None
        sidecar = shard.sidecars.sidecars[0]
        assert sidecar.started_at is not None
        assert runtime.starts[0][0] - sidecar.started_at >= 0.7

    run(state_dir, body)


def test_sidecar_never_healthy_fails_the_shard_and_no_engine_starts(
    tmp_path: Path, files: Files
) -> None:
    state_dir = tmp_path / "state"
    side_port, never = free_port(), free_port()
    # It listens on one port, but its health URL names another: never healthy.
    side = web_sidecar(
        files, side_port, delay=0, health_url=f"http://127.0.0.1:{never}/health", timeout_s=1.5
    )

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        began = time.monotonic()
        shard = await manager.start(sim_spec(sidecars=(side,)))
        failed = await rec.wait_for("s1", ShardState.FAILED, timeout=1.5 + WAIT_S)
        assert time.monotonic() - began >= 1.5
        assert "sidecar 'web' of shard s1 not healthy after 1.5s" in failed.reason
        assert f"waited for http://127.0.0.1:{never}/health to answer 200" in failed.reason
        assert "the engine was not started" in failed.reason
        assert rec.states("s1") == [ShardState.STARTING, ShardState.FAILED]
        # No engine: the runtime was never asked, nothing wrote the engine's log.
        assert runtime.starts == []
        assert not manager.log_path("s1").exists()
        assert failed.pid == 0
        # The sidecar was stopped.
        assert shard.sidecars is not None
        assert not pid_alive(shard.sidecars.sidecars[0].pid)
        assert records(state_dir)["s1"]["state"] == ShardState.FAILED

    run(state_dir, body)


def test_sidecar_exiting_before_healthy_fails_the_shard(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    side = SidecarSpec(
        "broken",
        (sys.executable, "-c", "import sys; print('no config'); sys.exit(3)"),
        "http://127.0.0.1:9/health",
        30,
    )
    second = SidecarSpec("later", (sys.executable, "-c", "import time; time.sleep(60)"))

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        shard = await manager.start(sim_spec(sidecars=(side, second)))
        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert "sidecar 'broken' exited with code 3 before it was healthy" in failed.reason
        assert "log: no config" in failed.reason
        assert runtime.starts == []
        assert shard.sidecars is not None
        assert shard.sidecars.sidecars[1].pid == 0  # the next one never started

    run(state_dir, body)


def test_duplicate_sidecar_names_are_refused_before_anything_starts(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    one = SidecarSpec("a", ("true",))

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        with pytest.raises(ShardError, match="sidecar name\\(s\\) a appear more than once"):
            await manager.start(sim_spec(sidecars=(one, one)))
        assert rec.events == [] and runtime.starts == []
        assert not (state_dir / "logs").exists()

    run(state_dir, body)


def test_sidecar_dying_while_the_engine_runs_fails_the_shard(tmp_path: Path, files: Files) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        shard = await manager.start(sim_spec(sidecars=(web_sidecar(files, free_port()),)))
        await rec.wait_for("s1", ShardState.READY)
        assert shard.sidecars is not None
        engine_pid, sidecar_pid = shard.pid, shard.sidecars.sidecars[0].pid
        os.kill(sidecar_pid, signal.SIGKILL)
        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert failed.reason.startswith("sidecar 'web' was killed by signal 9")
        assert "engine stopped" in failed.reason
        assert not pid_alive(engine_pid)
        assert manager.ready_port("s1") is None

    run(state_dir, body)


def test_engine_dying_stops_its_sidecars(tmp_path: Path, files: Files) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        shard = await manager.start(sim_spec(sidecars=(web_sidecar(files, free_port()),)))
        await rec.wait_for("s1", ShardState.READY)
        assert shard.sidecars is not None
        os.kill(shard.pid, signal.SIGKILL)
        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert "engine killed by signal 9" in failed.reason
        # Stopped by the time the failure is reported: a restart finds its port free.
        assert not pid_alive(shard.sidecars.sidecars[0].pid)
        assert files.stopped.read_text() == "engine-gone"

        # Started afresh, sidecar and all.
        mark = len(rec.events)
        again = await manager.start(sim_spec(sidecars=(web_sidecar(files, free_port()),)))
        await rec.wait_for("s1", ShardState.READY, after=mark)
        assert again.pid != shard.pid

    run(state_dir, body)


def test_stop_while_the_sidecar_is_starting(tmp_path: Path, files: Files) -> None:
    state_dir = tmp_path / "state"
    side = web_sidecar(files, free_port(), delay=60)

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        shard = await manager.start(sim_spec(sidecars=(side,)))
        assert shard.sidecars is not None
        sidecar = shard.sidecars.sidecars[0]
        await asyncio.wait_for(_until(lambda: sidecar.pid > 0), WAIT_S)
        final = await asyncio.wait_for(manager.stop("s1", grace=5.0), WAIT_S)
        assert final is not None and final.state == ShardState.EXITED
        assert rec.states("s1") == [ShardState.STARTING, ShardState.EXITED]
        assert runtime.starts == []
        assert not pid_alive(sidecar.pid)

    run(state_dir, body)


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():  # noqa: ASYNC110 - polling a process's state is the point
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ adoption


def test_adoption_takes_sidecars_back_and_watches_them(tmp_path: Path, files: Files) -> None:
    state_dir = tmp_path / "state"
    spec = sim_spec(sidecars=(web_sidecar(files, free_port(), delay=0),))

    async def first() -> tuple[int, int]:
        manager = ShardManager(state_dir, ProcessRuntime(), Recorder(), startup_timeout=WAIT_S)
        recorder = manager.on_status
        assert isinstance(recorder, Recorder)
        await manager.open()
        shard = await manager.start(spec)
        await recorder.wait_for("s1", ShardState.READY)
        await manager.close()  # an agent that stops leaves engines and sidecars running
        assert shard.sidecars is not None
        return shard.pid, shard.sidecars.sidecars[0].pid

    engine_pid, sidecar_pid = asyncio.run(first())
    assert pid_alive(engine_pid) and pid_alive(sidecar_pid)

    async def second(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        adopted, dead = await manager.adopt_all()
        assert [s.shard_id for s in adopted] == ["s1"] and dead == []
        shard = adopted[0]
        assert shard.spec == spec
        assert shard.sidecars is not None
        assert shard.sidecars.sidecars[0].pid == sidecar_pid
        await rec.wait_for("s1", ShardState.READY)
        assert runtime.starts == []
        # The adopted sidecar dies: the shard fails and its engine is stopped.
        os.kill(sidecar_pid, signal.SIGKILL)
        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert failed.reason.startswith("sidecar 'web' exited (exit code unknown")
        await asyncio.wait_for(_until(lambda: not pid_alive(engine_pid)), WAIT_S)

    run(state_dir, second)


def test_adoption_with_a_sidecar_gone_fails_and_a_dead_engine_stops_sidecars(
    tmp_path: Path, files: Files
) -> None:
    state_dir = tmp_path / "state"
    spec = sim_spec(sidecars=(web_sidecar(files, free_port(), delay=0),))

    async def first() -> tuple[int, int]:
        recorder = Recorder()
        manager = ShardManager(state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S)
        await manager.open()
        shard = await manager.start(spec)
        await recorder.wait_for("s1", ShardState.READY)
        await manager.close()
        assert shard.sidecars is not None
        return shard.pid, shard.sidecars.sidecars[0].pid

    # The sidecar dies while no agent runs: the engine is adopted, then stopped.
    engine_pid, sidecar_pid = asyncio.run(first())
    os.kill(sidecar_pid, signal.SIGKILL)
    asyncio.run(asyncio.wait_for(_until(lambda: not pid_alive(sidecar_pid)), WAIT_S))

    async def second(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        adopted, _ = await manager.adopt_all()
        assert [s.shard_id for s in adopted] == ["s1"]
        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert failed.reason.startswith("sidecar 'web' exited while the agent was down")
        await asyncio.wait_for(_until(lambda: not pid_alive(engine_pid)), WAIT_S)

    run(state_dir, second)

    # The engine dies while no agent runs: its orphaned sidecar is stopped on adoption.
    state_dir2 = tmp_path / "state2"
    files.stopped.unlink(missing_ok=True)
    state_dir = state_dir2
    engine_pid, sidecar_pid = asyncio.run(first())
    os.killpg(engine_pid, signal.SIGKILL)
    asyncio.run(asyncio.wait_for(_until(lambda: not pid_alive(engine_pid)), WAIT_S))

    async def third(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        adopted, dead = await manager.adopt_all()
        assert adopted == [] and [r.shard_id for r in dead] == ["s1"]
        assert not pid_alive(sidecar_pid)

    run(state_dir2, third)


def test_agent_stopped_during_sidecar_start_leaves_nothing_behind(
    tmp_path: Path, files: Files
) -> None:
    state_dir = tmp_path / "state"
    spec = sim_spec(sidecars=(web_sidecar(files, free_port(), delay=60),))

    async def first() -> int:
        manager = ShardManager(state_dir, ProcessRuntime(), Recorder(), startup_timeout=WAIT_S)
        await manager.open()
        shard = await manager.start(spec)
        assert shard.sidecars is not None
        sidecar = shard.sidecars.sidecars[0]
        await asyncio.wait_for(_until(lambda: sidecar.pid > 0), WAIT_S)
        await manager.close()
        return sidecar.pid

    sidecar_pid = asyncio.run(first())
    assert pid_alive(sidecar_pid)
    assert records(state_dir)["s1"]["sidecars"][0]["pid"] == sidecar_pid

    async def second(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        adopted, dead = await manager.adopt_all()
        assert adopted == [] and [r.shard_id for r in dead] == ["s1"]
        assert rec.events[-1].reason == NEVER_STARTED
        assert not pid_alive(sidecar_pid)

    run(state_dir, second)


# ------------------------------------------------------------------ multi-node


def test_two_node_replica_as_two_managers_on_loopback(tmp_path: Path) -> None:
    dist_port = free_port()
    dist = f"127.0.0.1:{dist_port}"
    worker_dir = tmp_path / "node-b"
    # A previous run's line in the worker's log must not pass for this run's join.
    (worker_dir / "logs").mkdir(parents=True)
    (worker_dir / "logs" / "r1-s1.log").write_text(f"sim rank 1 {JOINED} {dist} (old run)\n")

    async def main() -> None:
        rec0, rec1 = Recorder(), Recorder()
        # Rank 0 binds the dist-init port: it must be in node A's multinode_ports.
        node_a = ShardManager(
            tmp_path / "node-a",
            ProcessRuntime(),
            rec0,
            startup_timeout=WAIT_S,
            multinode_ports=PortRange(dist_port, dist_port),
        )
        node_b = ShardManager(worker_dir, ProcessRuntime(), rec1, startup_timeout=WAIT_S)
        await node_a.open()
        await node_b.open()
        shape: dict[str, Any] = {
            "replica_id": "r1",
            "model": "sim-model",
            "engine": "sim",
            "nodes": 2,
        }
        try:
            # The worker first: with no rank 0 to join it is not ready, whatever the time.
            worker = await node_b.start(
                ShardSpec("r1-s1", rank=1, dist_init_addr=dist, params={"seed": "4"}, **shape)
            )
            assert worker.port == 0
            await asyncio.sleep(3.0)
            assert worker.state == ShardState.STARTING and rec1.states("r1-s1") == [
                ShardState.STARTING
            ]

            rank0 = await node_a.start(
                ShardSpec("r1-s0", rank=0, dist_init_addr=dist, params={"seed": "4"}, **shape)
            )
            await rec1.wait_for("r1-s1", ShardState.READY)
            await rec0.wait_for("r1-s0", ShardState.READY)
            assert node_b.ready_port("r1-s1") is None  # a worker serves nothing
            port = node_a.ready_port("r1-s0")
            assert port == rank0.port and port > 0

            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "sim-model", "prompt": "abc", "max_tokens": 8},
                ) as resp,
            ):
                body = await resp.json()
            tokens, _ = generate(SimConfig(seed=4), "abc", max_tokens=8, seed=None)
            assert body["choices"][0]["text"] == "".join(tokens)

            # Recorded with their shape, for adoption.
            rec_w = records(worker_dir)["r1-s1"]
            assert (rec_w["nodes"], rec_w["rank"], rec_w["dist_init_addr"]) == (2, 1, dist)
            assert rec_w["port"] == 0 and rec_w["log_offset"] > 0

            # The worker dies: rank 0 exits, naming it, and both shards fail.
            os.kill(worker.pid, signal.SIGKILL)
            await rec1.wait_for("r1-s1", ShardState.FAILED)
            failed = await rec0.wait_for("r1-s0", ShardState.FAILED, timeout=10.0)
            assert "worker rank 1" in failed.reason and "is gone" in failed.reason
        finally:
            for manager in (node_a, node_b):
                await manager.stop_all(grace=5.0)
                await manager.close()

    asyncio.run(main())


def test_worker_of_another_engine_is_ready_after_the_grace(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    def launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        argv = (sys.executable, "-c", "import time; time.sleep(60)")
        return Launch(shard_id=spec.shard_id, argv=argv, port=port, log_path=log_path)

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        began = time.monotonic()
        await manager.start(
            ShardSpec("w", "r1", "m", "vllm", rank=1, nodes=2, dist_init_addr="10.0.0.1:29500")
        )
        await rec.wait_for("w", ShardState.READY)
        assert time.monotonic() - began >= 0.8
        assert manager.ready_port("w") is None

    run(state_dir, body, make_launch=launch, worker_grace=0.8)


@pytest.mark.parametrize(
    ("shape", "needle"),
    [
        ({"nodes": 0}, "nodes must be at least 1"),
        ({"nodes": 2, "rank": 2, "dist_init_addr": "h:1"}, "rank 2 is out of range"),
        ({"nodes": 2, "rank": 1}, "needs dist_init_addr HOST:PORT"),
    ],
)
def test_bad_replica_shape_starts_nothing(
    tmp_path: Path, shape: dict[str, Any], needle: str
) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder, runtime: CountingRuntime) -> None:
        with pytest.raises(ShardError, match=needle):
            await manager.start(sim_spec(**shape))
        assert rec.events == [] and runtime.starts == []

    run(state_dir, body)
