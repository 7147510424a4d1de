"""ShardManager with the real process runtime, starting real ``sim`` engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.agent.runtimes import Launch
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import Shard, ShardManager, ShardSpec, ShardState
from llmgw.agent.traffic import ShardTraffic
from llmgw.contracts.ports import PortRange
from llmgw.errors import ShardError
from llmgw.procutil import process_start_time

pytestmark = pytest.mark.timeout(60)

WAIT_S = 30.0


@dataclass(frozen=True)
class Event:
    shard_id: str
    state: str
    pid: int
    port: int
    exit_code: int | None
    reason: str


class Recorder:
    """The on_status callback: remembers every status change, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = asyncio.Event()

    def __call__(self, shard: Shard) -> None:
        self.events.append(
            Event(shard.shard_id, shard.state, shard.pid, shard.port, shard.exit_code, shard.reason)
        )
        self._changed.set()

    def states(self, shard_id: str) -> list[str]:
        return [e.state for e in self.events if e.shard_id == shard_id]

    async def wait_for(self, shard_id: str, state: str, *, after: int = 0) -> Event:
        async def scan() -> Event:
            while True:
                for e in self.events[after:]:
                    if e.shard_id == shard_id and e.state == state:
                        return e
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(scan(), WAIT_S)


def spec(shard_id: str = "s1", **params: str) -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id, replica_id="r1", model="sim-model", engine="sim", params=params
    )


def run_with_manager(
    state_dir: Path, body: Callable[[ShardManager, Recorder], Awaitable[None]]
) -> None:
    async def main() -> None:
        recorder = Recorder()
        manager = ShardManager(state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S)
        await manager.open()
        try:
            await body(manager, recorder)
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    asyncio.run(main())


def records(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "shards.json").read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def get_health(port: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/health") as resp,
    ):
        return resp.status


def test_start_ready_records_idempotent_and_stop(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder) -> None:
        shard = await manager.start(spec(seed="3"))
        assert shard.state == ShardState.STARTING
        assert shard.pid > 0 and shard.port > 0
        assert manager.ready_port("s1") is None
        pid, port = shard.pid, shard.port

        # Starting again while starting is a no-op.
        assert await manager.start(spec(seed="3")) is shard

        # The engine leads its own session and process group.
        assert os.getsid(pid) == pid
        assert os.getpgid(pid) == pid

        ready = await rec.wait_for("s1", ShardState.READY)
        assert (ready.pid, ready.port) == (pid, port)
        assert rec.states("s1") == [ShardState.STARTING, ShardState.READY]
        assert manager.ready_port("s1") == port
        assert manager.get("s1") is shard
        assert await get_health(port) == 200

        # Starting again while ready is a no-op: same process, no new status.
        again = await manager.start(spec(seed="3"))
        assert again is shard and again.pid == pid and again.port == port
        assert rec.states("s1") == [ShardState.STARTING, ShardState.READY]

        # shards.json names the process precisely enough to find it after an agent restart.
        path = state_dir / "shards.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        rec_s1 = records(state_dir)["s1"]
        assert rec_s1["pid"] == pid
        assert rec_s1["port"] == port
        assert rec_s1["state"] == ShardState.READY
        assert rec_s1["model"] == "sim-model" and rec_s1["engine"] == "sim"
        assert rec_s1["replica_id"] == "r1"
        start_time = process_start_time(pid)
        assert isinstance(start_time, int)
        assert rec_s1["start_time"] == start_time

        # The engine's output goes to the shard's log.
        assert manager.log_path("s1").exists()

        final = await manager.stop("s1", grace=5.0)
        assert final is shard
        assert final.state == ShardState.EXITED
        assert rec.states("s1")[-1] == ShardState.EXITED
        assert not pid_alive(pid)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
        assert manager.get("s1") is None
        assert manager.ready_port("s1") is None
        assert "s1" not in records(state_dir)
        assert await manager.stop("s1") is None  # unknown now

    run_with_manager(state_dir, body)


def test_sigkill_is_reported_failed_and_restart_works(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder) -> None:
        shard = await manager.start(spec())
        await rec.wait_for("s1", ShardState.READY)
        pid = shard.pid
        os.kill(pid, signal.SIGKILL)

        failed = await rec.wait_for("s1", ShardState.FAILED)
        assert failed.exit_code == -9
        assert "signal 9" in failed.reason
        assert rec.states("s1") == [ShardState.STARTING, ShardState.READY, ShardState.FAILED]
        assert manager.ready_port("s1") is None
        assert records(state_dir)["s1"]["state"] == ShardState.FAILED

        # A failed shard is started afresh by start().
        mark = len(rec.events)
        again = await manager.start(spec())
        assert again is not shard
        assert again.pid != pid
        ready = await rec.wait_for("s1", ShardState.READY, after=mark)
        assert manager.ready_port("s1") == ready.port
        assert records(state_dir)["s1"]["pid"] == again.pid

    run_with_manager(state_dir, body)


def test_stop_while_starting(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder) -> None:
        shard = await manager.start(spec("early", ttft_ms="0"))
        pid = shard.pid
        final = await manager.stop("early", grace=5.0)
        assert final is not None and final.state == ShardState.EXITED
        assert ShardState.READY not in rec.states("early")
        assert ShardState.FAILED not in rec.states("early")
        assert rec.states("early")[-1] == ShardState.EXITED
        assert not pid_alive(pid)
        assert "early" not in records(state_dir)

    run_with_manager(state_dir, body)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (ShardSpec("s1", "r1", "m", engine="no-such-engine"), "no-such-engine"),
        (ShardSpec("s1", "r1", "m", engine="sim", params={"tps": "fast"}), "tps"),
        (ShardSpec("s1", "r1", "m", engine="sim", params={"colour": "red"}), "colour"),
    ],
)
def test_bad_spec_is_shard_error_and_starts_nothing(
    tmp_path: Path, bad: ShardSpec, needle: str
) -> None:
    state_dir = tmp_path / "state"

    async def body(manager: ShardManager, rec: Recorder) -> None:
        with pytest.raises(ShardError) as info:
            await manager.start(bad)
        assert needle in str(info.value)
        assert manager.get("s1") is None
        assert rec.events == []
        assert not (state_dir / "logs").exists()

    run_with_manager(state_dir, body)


def _fd_targets(pid: int) -> dict[int, str]:
    targets = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            targets[int(entry.name)] = os.readlink(entry)
    return targets


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_engine_holds_nothing_of_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir = tmp_path / "state"
    # Meant for the agent alone: an engine must not notify systemd or watch 'llmgw up'.
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("LLMGW_PARENT_PID", "1")
    full = ShardSpec(
        shard_id="s1",
        replica_id="r1",
        model="sim-model",
        engine="sim",
        rank=3,
        params={"seed": "5"},
        extra_args=("--max-tokens", "16"),
    )

    async def body(manager: ShardManager, rec: Recorder) -> None:
        shard = await manager.start(full)
        await rec.wait_for("s1", ShardState.READY)
        engine = _fd_targets(shard.pid)
        assert engine[0] == "/dev/null"
        assert engine[1] == engine[2] == str(manager.log_path("s1"))
        # Pipes and sockets the agent holds (its event loop's, its HTTP client's) are not
        # inherited: the engine's are its own.
        ours = {t for t in _fd_targets(os.getpid()).values() if t.startswith(("pipe:", "socket:"))}
        assert ours
        assert not ours & set(engine.values())
        environ = _environ(shard.pid)
        assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"LLMGW_PARENT_PID="))]
        # The record is enough to rebuild the shard after an agent restart.
        rec_s1 = records(state_dir)["s1"]
        assert rec_s1["rank"] == 3
        assert rec_s1["params"] == {"seed": "5"}
        assert rec_s1["extra_args"] == ["--max-tokens", "16"]

    run_with_manager(state_dir, body)


def test_close_leaves_engines_running(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"

    async def main() -> int:
        recorder = Recorder()
        manager = ShardManager(state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S)
        await manager.open()
        shard = await manager.start(spec())
        await recorder.wait_for("s1", ShardState.READY)
        await manager.close()
        assert recorder.states("s1") == [ShardState.STARTING, ShardState.READY]
        return shard.pid

    pid = asyncio.run(main())
    try:
        assert pid_alive(pid)
        assert records(state_dir)["s1"]["state"] == ShardState.READY
    finally:
        os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


# --------------------------------------------------------------------------- llama.cpp RPC


def _llamacpp(shard_id: str, rank: int, **kw: Any) -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id,
        replica_id="r9",
        model="big",
        engine="llamacpp",
        rank=rank,
        nodes=3,
        dist_init_addr="10.1.0.5:50052",
        source="/models/big.gguf",
        gpus=("GPU-aaaa",),
        **kw,
    )


def test_llamacpp_rank0_dials_the_workers_the_order_names(tmp_path: Path) -> None:
    manager = ShardManager(tmp_path, ProcessRuntime(), Recorder())
    manager.binary_of = lambda engine: "/opt/llama/bin/llama-server"
    launch = manager.make_launch(
        _llamacpp("r9-s0", 0, worker_addrs=("10.1.0.6:50052", "10.1.0.7:50052")),
        43000,
        tmp_path / "r9-s0.log",
    )
    argv = list(launch.argv)
    assert argv[0] == "/opt/llama/bin/llama-server"
    assert argv[argv.index("--rpc") + 1] == "10.1.0.6:50052,10.1.0.7:50052"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    # An order without the workers' endpoints is refused, naming what is missing.
    with pytest.raises(ShardError, match="worker_addrs"):
        manager.make_launch(_llamacpp("r9-s0", 0), 43000, tmp_path / "x.log")
    with pytest.raises(ShardError, match="listen_addr"):
        manager.make_launch(_llamacpp("r9-s1", 1), 43001, tmp_path / "x.log")


def test_llamacpp_worker_runs_rpc_server_on_its_listen_addr(tmp_path: Path) -> None:
    """A real process: an ``rpc-server`` stand-in beside ``llama-server`` records its argv
    and environment; the worker is ready once it has run for the grace period, serves
    nothing, and its record keeps the endpoint."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    seen = tmp_path / "seen"
    fake = bindir / "rpc-server"
    fake.write_text(f'#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $*" > {seen}\nexec sleep 60\n')
    fake.chmod(0o755)
    state_dir = tmp_path / "state"

    async def main() -> None:
        recorder = Recorder()
        manager = ShardManager(
            state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S, worker_grace=0.2
        )
        manager.binary_of = lambda engine: str(bindir / "llama-server")
        await manager.open()
        try:
            worker = _llamacpp("r9-s2", 2, listen_addr="127.0.0.1:29599")
            await manager.start(worker)
            await recorder.wait_for("r9-s2", ShardState.READY)
            assert seen.read_text().split() == [
                "GPU-aaaa",
                "--host",
                "127.0.0.1",
                "--port",
                "29599",
            ]
            assert manager.ready_port("r9-s2") is None  # a worker serves nothing
            saved = records(state_dir)["r9-s2"]
            assert (saved["listen_addr"], saved["worker_addrs"]) == ("127.0.0.1:29599", [])
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- multinode_ports

NODE_PORTS = PortRange(30000, 30099)


def _multi(engine: str, rank: int, **kw: Any) -> ShardSpec:
    fields: dict[str, Any] = {"nodes": 2, "dist_init_addr": "10.1.0.5:30000", **kw}
    return ShardSpec(
        shard_id=f"r7-s{rank}", replica_id="r7", model="big", engine=engine, rank=rank, **fields
    )


class Launched(Exception):
    """What the stand-in launcher raises: the order got past every check before it."""


def _port_checked(tmp_path: Path) -> tuple[ShardManager, Recorder, list[str]]:
    """A node whose multinode_ports is 30000-30099, with a launcher that records the shard
    and raises :class:`Launched` instead of running anything."""
    launched: list[str] = []

    def launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        launched.append(spec.shard_id)
        raise Launched

    recorder = Recorder()
    manager = ShardManager(
        tmp_path, ProcessRuntime(), recorder, make_launch=launch, multinode_ports=NODE_PORTS
    )
    return manager, recorder, launched


def _start(manager: ShardManager, order: ShardSpec) -> None:
    async def main() -> None:
        await manager.start(order)

    with contextlib.suppress(Launched):
        asyncio.run(main())


@pytest.mark.parametrize(
    "order",
    [
        _multi("sim", 0, dist_init_addr="10.1.0.5:30099"),  # rank 0 binds it: inside
        _multi("vllm", 0, dist_init_addr="[fd00::5]:30000"),
        _multi("sim", 1, dist_init_addr="10.1.0.5:29500"),  # a worker dials it: not ours
        _multi("sglang", 1, dist_init_addr="10.1.0.5:50000"),
        # llama.cpp: rank 0 dials the workers, which bind their endpoints here.
        _multi("llamacpp", 0, dist_init_addr="10.1.0.5:50052", worker_addrs=("10.1.0.6:1",)),
        _multi("llamacpp", 1, dist_init_addr="10.1.0.5:50052", listen_addr="10.1.0.6:30042"),
        _multi("llamacpp", 1, worker_addrs=("10.1.0.6:30042",)),  # no listen_addr: its entry
        # One node meets no one: no rendezvous port to check.
        ShardSpec("one", "r8", "m", "sim", dist_init_addr="10.1.0.5:29500"),
    ],
    ids=lambda spec: f"{spec.engine}-rank{spec.rank}-of-{spec.nodes}",
)
def test_an_order_that_binds_inside_multinode_ports_goes_ahead(
    tmp_path: Path, order: ShardSpec
) -> None:
    manager, _, launched = _port_checked(tmp_path)
    _start(manager, order)
    assert launched == [order.shard_id]


@pytest.mark.parametrize(
    ("order", "what"),
    [
        (
            _multi("sim", 0, dist_init_addr="10.1.0.5:29500"),
            "its dist-init address (dist_init_addr) 10.1.0.5:29500",
        ),
        (
            _multi("vllm", 0, dist_init_addr="[fd00::5]:30100"),
            "its dist-init address (dist_init_addr) [fd00::5]:30100",
        ),
        (
            _multi("sglang", 0, dist_init_addr="10.1.0.5:29999"),
            "its dist-init address (dist_init_addr) 10.1.0.5:29999",
        ),
        (
            _multi("llamacpp", 1, listen_addr="10.1.0.6:50052"),
            "its rpc-server endpoint (listen_addr) 10.1.0.6:50052",
        ),
        (
            _multi("llamacpp", 1, worker_addrs=("10.1.0.6:50052",)),
            "its rpc-server endpoint (listen_addr) 10.1.0.6:50052",
        ),
    ],
    ids=["sim", "vllm-v6", "sglang", "llamacpp-listen", "llamacpp-peers"],
)
def test_an_order_that_binds_outside_multinode_ports_is_refused(
    tmp_path: Path, order: ShardSpec, what: str
) -> None:
    manager, recorder, launched = _port_checked(tmp_path)
    with pytest.raises(ShardError) as info:
        _start(manager, order)
    assert str(info.value) == (
        f"shard {order.shard_id}: {what} is outside this node's multinode_ports 30000-30099, "
        "the only ports its firewall opens to the fabric's peers; the control plane places "
        "inside the range a node reports, so restart the agent if agent.yaml changed since it "
        "started (or upgrade a control plane that predates the range), or widen "
        "multinode_ports in agent.yaml to hold it and re-run install-agent.sh so that the "
        "firewall follows"
    )
    # Refused before anything: no launch, no status, no shard, no record to adopt.
    assert launched == [] and recorder.events == []
    assert manager.get(order.shard_id) is None
    assert manager.records.load() == []


def test_without_a_range_the_manager_holds_to_the_default(tmp_path: Path) -> None:
    manager = ShardManager(tmp_path, ProcessRuntime(), Recorder())
    assert manager.multinode_ports == PortRange(29500, 29999)
    with pytest.raises(ShardError, match="outside this node's multinode_ports 29500-29999"):
        _start(manager, _multi("sim", 0, dist_init_addr="10.1.0.5:30000"))


# -- a drained stop (a shard retired make-before-break: llmgw.agent.traffic) ----------------


def test_idle_at_once_without_requests_and_when_the_last_one_ends() -> None:
    async def main() -> None:
        traffic = ShardTraffic()
        assert await traffic.idle("s1", 5) is True
        traffic.enter("s1")
        traffic.enter("s1")
        traffic.enter("s2")
        waiter = asyncio.create_task(traffic.idle("s1", 5))
        await asyncio.sleep(0.01)
        traffic.leave("s1")
        await asyncio.sleep(0.01)
        assert not waiter.done() and traffic.inflight("s1") == 1
        traffic.leave("s1")
        assert await asyncio.wait_for(waiter, 1) is True
        assert traffic.inflight("s2") == 1  # another shard's requests are its own
        assert await traffic.idle("s2", 0.05) is False  # the timeout: still one in flight

    asyncio.run(main())


def test_a_drained_stop_waits_for_the_requests_in_flight(tmp_path: Path) -> None:
    async def main() -> None:
        traffic = ShardTraffic()
        recorder = Recorder()
        manager = ShardManager(
            tmp_path, ProcessRuntime(), recorder, startup_timeout=WAIT_S, traffic=traffic
        )
        await manager.open()
        try:
            shard = await manager.start(spec())
            await recorder.wait_for("s1", ShardState.READY)
            port = manager.ready_port("s1")
            assert port == shard.port
            traffic.enter("s1")  # a request the data plane is relaying
            stopping = asyncio.create_task(manager.stop("s1", grace=5.0, drain=30.0))
            await asyncio.sleep(0.2)
            assert manager.ready_port("s1") is None  # new requests: not taken here
            assert not stopping.done() and pid_alive(shard.pid)
            traffic.leave("s1")
            stopped = await asyncio.wait_for(stopping, WAIT_S)
            assert stopped is not None and stopped.state == ShardState.EXITED
            assert "s1" not in manager.shards

            # A drain that runs out stops the engine all the same.
            other = await manager.start(spec("s2"))
            await recorder.wait_for("s2", ShardState.READY)
            traffic.enter("s2")
            began = time.monotonic()
            await manager.stop("s2", grace=5.0, drain=0.3)
            assert time.monotonic() - began >= 0.3
            assert not pid_alive(other.pid)
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    asyncio.run(main())
