"""The bootstrap relay: bytes both ways between the transfer address and a real server on
loopback (an echo server, and an HTTP server shaped like SGLang's bootstrap server), each
side's close reaching the other, a port it cannot listen on refused with the fix; and the
shard supervisor running it with an SGLang prefill's engine: opened before the engine
starts (at the bootstrap port the engine's command names), closed when the shard ends or the
agent stops, opened again on adoption, and a failure to listen failing the shard."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent import bootstrap
from llmgw.agent.bootstrap import CHUNK, relayed
from llmgw.agent.records import ShardRecords
from llmgw.agent.runtimes import Handle, Launch
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import RELAY_RESTART, Shard, ShardManager, ShardSpec, ShardState
from llmgw.contracts.ports import PortRange
from llmgw.errors import ShardError

pytestmark = pytest.mark.timeout(60)

WAIT_S = 20.0
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def refused(port: int) -> bool:
    """Nothing listens on loopback ``port``."""
    with socket.socket() as s:
        return s.connect_ex((LOOPBACK, port)) != 0


# --------------------------------------------------------------------------- the relay alone


class Upstream:
    """A TCP server on loopback standing in for the bootstrap server: echoes what it reads
    (unless ``echo`` is off), and remembers each connection's end (EOF seen) and its writer."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.ended = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.received = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Upstream:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self.writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        with contextlib.suppress(OSError):
            while data := await reader.read(CHUNK):
                self.received += data
                if self.echo:
                    writer.write(data)
                    await writer.drain()
        self.ended.set()
        writer.close()


@contextlib.asynccontextmanager
async def relay_to(port: int) -> AsyncIterator[bootstrap.BootstrapRelay]:
    relay = await bootstrap.start(LOOPBACK, 0, port, shard="t")
    assert relay.listen_port > 0
    try:
        yield relay
    finally:
        await relay.close()


def test_bytes_go_both_ways_through_the_relay_more_than_a_chunk_at_a_time() -> None:
    payload = os.urandom(5 * CHUNK + 123)

    async def main() -> None:
        async with Upstream() as upstream, relay_to(upstream.port) as relay:
            reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
            # Written whole while the echo comes back: the relay must pipe both ways at
            # once (each way drained), or this would stall.
            writer.write(payload)
            back = await asyncio.wait_for(reader.readexactly(len(payload)), WAIT_S)
            assert back == payload
            assert bytes(upstream.received) == payload
            writer.close()
            assert relay.connections == 1

    asyncio.run(main())


async def _route(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {"method": request.method, "query": dict(request.query), "body": body.decode()}
    )


def test_an_http_server_like_sglangs_bootstrap_answers_through_the_relay() -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/route", _route)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with relay_to(port) as relay, aiohttp.ClientSession() as session:
                base = f"http://{LOOPBACK}:{relay.listen_port}/route"
                # The decode's query and a registration, as SGLang's clients send them.
                async with session.get(f"{base}?prefill_dp_rank=-1&target_tp_rank=0") as resp:
                    assert resp.status == 200
                    got = await resp.json()
                assert got["method"] == "GET"
                assert got["query"] == {"prefill_dp_rank": "-1", "target_tp_rank": "0"}
                put = {"rank_ip": "10.1.0.5", "rank_port": 40123}
                async with session.put(base, json=put) as resp:
                    assert json.loads((await resp.json())["body"]) == put
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_client_that_closes_closes_the_bootstrap_servers_side() -> None:
    async def main() -> None:
        async with Upstream() as upstream, relay_to(upstream.port) as relay:
            reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            writer.close()
            await asyncio.wait_for(upstream.ended.wait(), WAIT_S)

    asyncio.run(main())


def test_a_bootstrap_server_that_closes_closes_the_clients_side() -> None:
    async def main() -> None:
        async with Upstream() as upstream, relay_to(upstream.port) as relay:
            reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            upstream.writers[0].close()
            # Everything it sent, then the end.
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            writer.close()

    asyncio.run(main())


def test_a_client_that_reads_nothing_stalls_the_server_not_the_relays_memory() -> None:
    total = 128 << 20
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        block = bytes(1 << 20)
        with contextlib.suppress(OSError):
            while sent < total:
                writer.write(block)
                await writer.drain()
                sent += len(block)
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(flood, LOOPBACK, 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with relay_to(port) as relay:
                _, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
                # Until the server's writes stall: the relay reads no more than it can pass on.
                last, still = -1, 0
                while still < 5 and sent < total:
                    await asyncio.sleep(0.1)
                    last, still = sent, (still + 1 if sent == last else 0)
                # What the sockets' kernel buffers hold, not the whole flood.
                assert sent < total // 4, sent
                writer.close()
        finally:
            server.close()

    asyncio.run(main())


def test_closing_the_relay_closes_its_connections_and_stops_listening() -> None:
    async def main() -> None:
        async with Upstream() as upstream:
            relay = await bootstrap.start(LOOPBACK, free_port(), upstream.port, shard="t")
            reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            await asyncio.wait_for(relay.close(), WAIT_S)
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            await asyncio.wait_for(upstream.ended.wait(), WAIT_S)
            assert refused(relay.listen_port)
            await relay.close()  # twice: nothing more
            writer.close()

    asyncio.run(main())


def test_without_its_bootstrap_server_a_connection_is_closed_and_a_retry_gets_through() -> None:
    target = free_port()  # nothing there yet: the engine still loading

    async def main() -> None:
        async with relay_to(target) as relay:
            reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            writer.close()
            # The bootstrap server comes up at its port: the decode's retry is relayed.
            server = await asyncio.start_server(_echo, LOOPBACK, target)
            try:
                reader, writer = await asyncio.open_connection(LOOPBACK, relay.listen_port)
                writer.write(b"again")
                assert await asyncio.wait_for(reader.readexactly(5), WAIT_S) == b"again"
                writer.close()
            finally:
                server.close()

    asyncio.run(main())


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_a_port_another_process_holds_is_refused_with_what_to_do() -> None:
    with socket.socket() as held:
        held.bind((LOOPBACK, 0))
        held.listen()
        port = held.getsockname()[1]

        async def main() -> None:
            await bootstrap.start(LOOPBACK, port, free_port(), shard="t")

        with pytest.raises(ShardError) as info:
            asyncio.run(main())
    assert info.value.message.startswith(
        "the relay to its SGLang bootstrap server cannot listen on its transfer address "
        f"127.0.0.1:{port}: "
    )
    assert info.value.message.endswith(
        f"; another process of this node holds that port (ss -ltnp 'sport = :{port}' names "
        "it): stop it, or move agent.yaml's multinode_ports to a range nothing else on this "
        "node binds and re-run install-agent.sh so that the firewall follows"
    )


def test_an_address_that_is_not_this_nodes_is_refused_with_what_to_do() -> None:
    async def main() -> None:
        await bootstrap.start("192.0.2.1", 30010, free_port(), shard="t")  # TEST-NET-1

    with pytest.raises(ShardError) as info:
        asyncio.run(main())
    assert info.value.message.endswith(
        "; 192.0.2.1 is not an address of this node (ip -brief address lists them): the "
        "control plane places it on an address the agent reported, so restart the agent if "
        "the node's addresses changed since it started"
    )


def test_only_an_sglang_prefill_is_relayed() -> None:
    assert relayed("sglang", "prefill")
    assert not relayed("sglang", "decode")
    assert not relayed("sglang", "")
    assert not relayed("vllm", "prefill")
    assert not relayed("sim", "prefill")
    assert not relayed("no-such-engine", "prefill")


# --------------------------------------------------------------------------- the supervisor

# An SGLang prefill as the test runs it: its health on the engine port and a bootstrap
# server (GET/PUT /route) on the port its command names, both on loopback.
FAKE_ENGINE = """
import asyncio, sys
from aiohttp import web

async def health(request):
    return web.Response(text="ok")

async def route(request):
    return web.json_response({"bootstrap": int(sys.argv[2]), "method": request.method})

async def main():
    for port, path, handler in ((sys.argv[1], "/health", health), (sys.argv[2], "/route", route)):
        app = web.Application()
        app.router.add_route("*", path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


class Runtime(ProcessRuntime):
    """The process runtime, counting the engines it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0

    async def start(self, launch: Launch) -> Handle:
        self.started += 1
        return await super().start(launch)


@dataclasses.dataclass
class Node:
    manager: ShardManager
    runtime: Runtime
    events: list[tuple[str, str]]
    commands: list[tuple[str, ...]]


def _node(state_dir: Path, transfer_port: int) -> Node:
    """A manager whose multinode_ports is the transfer port alone, launching the fake engine
    at the ports of the real SGLang command it builds (kept in ``commands``)."""
    events: list[tuple[str, str]] = []
    commands: list[tuple[str, ...]] = []
    runtime = Runtime()

    def launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        real = manager._process_launch(spec, port, log_path)
        commands.append(real.argv)
        argv = real.argv
        boot = argv[argv.index("--disaggregation-bootstrap-port") + 1]
        fake = (sys.executable, "-c", FAKE_ENGINE, str(port), boot)
        return Launch(shard_id=spec.shard_id, argv=fake, port=port, log_path=log_path)

    def on_status(shard: Shard) -> None:
        events.append((shard.state, shard.reason))

    manager = ShardManager(
        state_dir,
        runtime,
        on_status,
        startup_timeout=WAIT_S,
        make_launch=launch,
        multinode_ports=PortRange(transfer_port, transfer_port),
    )
    return Node(manager, runtime, events, commands)


def _prefill(transfer_port: int) -> ShardSpec:
    return ShardSpec(
        shard_id="p0",
        replica_id="r1",
        model="llama",
        engine="sglang",
        source="/models/llama",
        disagg_role="prefill",
        transfer_addr=f"{LOOPBACK}:{transfer_port}",
    )


async def _ready(node: Node, shard_id: str = "p0") -> None:
    deadline = time.monotonic() + WAIT_S
    while node.manager.ready_port(shard_id) is None:
        assert time.monotonic() < deadline, node.events
        await asyncio.sleep(0.05)


async def _route_through(port: int) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{LOOPBACK}:{port}/route") as resp,
    ):
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


def _run(state_dir: Path, transfer_port: int, body: Callable[[Node], Awaitable[None]]) -> None:
    async def main() -> None:
        node = _node(state_dir, transfer_port)
        await node.manager.open()
        try:
            await body(node)
        finally:
            await node.manager.stop_all(grace=5.0)
            await node.manager.close()

    asyncio.run(main())


def test_the_supervisor_relays_a_prefill_to_its_bootstrap_port_and_stops_with_the_shard(
    tmp_path: Path,
) -> None:
    transfer = free_port()

    async def body(node: Node) -> None:
        shard = await node.manager.start(_prefill(transfer))
        boot = shard.spec.bootstrap_port
        assert boot > 0 and boot not in (transfer, shard.port)
        # The engine's real command: HTTP API and bootstrap server on loopback, at the port
        # the relay pipes to.
        (argv,) = node.commands
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == str(boot)
        assert shard.relay is not None and shard.relay.target_port == boot
        await _ready(node)
        assert await _route_through(transfer) == {"bootstrap": boot, "method": "GET"}
        # Recorded, so that the next agent relays to it again.
        (record,) = node.manager.records.load()
        assert record.bootstrap_port == boot
        await node.manager.stop("p0", grace=5.0)
        assert shard.relay is None
        assert refused(transfer)

    _run(tmp_path, transfer, body)


def test_a_prefill_whose_engine_dies_loses_its_relay(tmp_path: Path) -> None:
    transfer = free_port()

    async def body(node: Node) -> None:
        shard = await node.manager.start(_prefill(transfer))
        await _ready(node)
        os.killpg(shard.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while shard.state != ShardState.FAILED:
            assert time.monotonic() < deadline, node.events
            await asyncio.sleep(0.05)
        assert shard.relay is None
        assert refused(transfer)

    _run(tmp_path, transfer, body)


def test_other_shards_get_no_relay_and_no_bootstrap_port(tmp_path: Path) -> None:
    async def main() -> None:
        manager = ShardManager(tmp_path, ProcessRuntime(), lambda shard: None)
        decode = dataclasses.replace(_prefill(30010), disagg_role="decode")
        launch = manager._process_launch(decode, 41000, tmp_path / "d.log")
        assert "--disaggregation-bootstrap-port" not in launch.argv
        assert launch.argv[launch.argv.index("--host") + 1] == "127.0.0.1"
        assert await bootstrap.open_relay(decode) is None

    asyncio.run(main())


def test_a_relay_that_cannot_listen_fails_the_shard_before_its_engine_starts(
    tmp_path: Path,
) -> None:
    with socket.socket() as held:
        held.bind((LOOPBACK, 0))
        held.listen()
        transfer = held.getsockname()[1]

        async def body(node: Node) -> None:
            with pytest.raises(ShardError, match="another process of this node holds"):
                await node.manager.start(_prefill(transfer))
            assert node.runtime.started == 0
            shard = node.manager.get("p0")
            assert shard is not None and shard.state == ShardState.FAILED
            assert shard.reason.startswith(
                "the relay to its SGLang bootstrap server cannot listen on its transfer "
                f"address 127.0.0.1:{transfer}"
            )
            assert node.events[-1] == (ShardState.FAILED, shard.reason)

        _run(tmp_path, transfer, body)


def _adopt(state_dir: Path, transfer: int) -> tuple[Node, int]:
    """Start a prefill, let its agent stop (the engine runs on); returns the next agent's
    node (not opened yet) and the engine's pid."""

    async def first() -> int:
        node = _node(state_dir, transfer)
        await node.manager.open()
        shard = await node.manager.start(_prefill(transfer))
        await _ready(node)
        await node.manager.close()
        # The engine outlives its agent; the relay does not.
        assert shard.relay is None and refused(transfer)
        return shard.pid

    pid = asyncio.run(first())
    return _node(state_dir, transfer), pid


def test_the_next_agent_relays_an_adopted_prefill_again(tmp_path: Path) -> None:
    transfer = free_port()
    node, pid = _adopt(tmp_path, transfer)

    async def second() -> None:
        await node.manager.open()
        try:
            adopted, dead = await node.manager.adopt_all()
            assert dead == [] and [s.shard_id for s in adopted] == ["p0"]
            boot = adopted[0].spec.bootstrap_port
            assert await _route_through(transfer) == {"bootstrap": boot, "method": "GET"}
            await node.manager.stop("p0", grace=5.0)
            assert refused(transfer)
        finally:
            await node.manager.stop_all(grace=5.0)
            await node.manager.close()

    try:
        asyncio.run(second())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.parametrize("case", ["older-agent", "port-held"])
def test_an_adopted_prefill_that_cannot_be_relayed_again_is_restarted(
    tmp_path: Path, case: str
) -> None:
    transfer = free_port()
    node, pid = _adopt(tmp_path, transfer)
    records = ShardRecords(tmp_path)
    (record,) = records.load()
    held = socket.socket()
    if case == "older-agent":
        # An older agent's record: no bootstrap port (its engine listened on every address).
        records.save([dataclasses.replace(record, bootstrap_port=0)])
    else:
        held.bind((LOOPBACK, transfer))
        held.listen()

    async def second() -> list[Shard]:
        await node.manager.open()
        try:
            adopted, dead = await node.manager.adopt_all()
            assert adopted == [] and [r.shard_id for r in dead] == ["p0"]
            return node.manager.snapshot()
        finally:
            await node.manager.close()

    try:
        (shard,) = asyncio.run(second())
    finally:
        held.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert shard.state == ShardState.FAILED
    assert shard.reason.startswith(f"{RELAY_RESTART}: ")
    if case == "older-agent":
        assert "an older agent had its HTTP API listen on every address" in shard.reason
    else:
        assert "another process of this node holds that port" in shard.reason
    # Its engine was stopped, so that the control plane starts it again.
    deadline = time.monotonic() + WAIT_S
    while _alive(pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, ended but not reaped by this test's process, does not)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
