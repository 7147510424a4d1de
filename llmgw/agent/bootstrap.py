"""The bootstrap relay: the one door from the fabric to an SGLang prefill's bootstrap server,
a TCP relay from the shard's ``transfer_addr`` to the loopback port the server binds.

SGLang binds its bootstrap server on the HTTP ``--host`` (:mod:`llmgw.engines.disagg`), and
llmgw keeps every engine's HTTP API on 127.0.0.1, where only the agent's mTLS data plane
reaches it. So the agent picks a second loopback port for the bootstrap server
(``--disaggregation-bootstrap-port``) and listens on the transfer address itself, the one
the decode pool and the gateway (``bootstrap_host``/``bootstrap_port``) dial; each
connection there is piped to ``127.0.0.1:<bootstrap port>`` and nothing else of the engine
is reachable from the network. The relay reads no payload: the bootstrap server speaks
HTTP/1.1 over TCP and takes nothing from the connection's addresses (the prefill's ranks
register ``SGLANG_HOST_IP`` in the body, and the decode dials those directly).

Each direction is read in chunks of :data:`CHUNK` bytes, each written out and drained
before the next is read, so a connection holds at most a chunk plus the transports' write
buffers whatever the peers send; when either side closes (or fails), both are closed: the
bootstrap's clients send whole requests and never half-close. A connection the bootstrap
server does not take within :data:`CONNECT_TIMEOUT_S` (its engine still loading) is closed,
and the decode retries. The shard supervisor (:mod:`llmgw.agent.shards`) starts a relay with
the engine of an SGLang prefill shard (and again when it adopts one after an agent restart)
and closes it when the shard ends or the agent stops; a relay that cannot listen fails the
shard with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from typing import Protocol

from llmgw.engines.disagg import runs_bootstrap_server
from llmgw.engines.registry import ENGINES
from llmgw.errors import ConfigError, ShardError
from llmgw.log import kv
from llmgw.netaddr import parse_hostport

__all__ = [
    "CHUNK",
    "CLOSE_GRACE_S",
    "CONNECT_TIMEOUT_S",
    "TARGET_HOST",
    "BootstrapRelay",
    "Relayed",
    "adopt_relay",
    "open_relay",
    "relayed",
    "start",
]

log = logging.getLogger("llmgw.agent.bootstrap")

TARGET_HOST = "127.0.0.1"
"""Where the bootstrap server listens: the engine's HTTP ``--host``."""
CHUNK = 64 * 1024
"""The most one read takes from a side before it is written to the other and drained."""
CONNECT_TIMEOUT_S = 5.0
"""How long a relayed connection waits for the bootstrap server to accept it (loopback:
only an engine hung or overloaded takes long)."""
CLOSE_GRACE_S = 1.0
"""How long a closed connection may take to send what it still holds before it is reset."""


def relayed(engine: str, role: str) -> bool:
    """Whether a shard of ``engine`` in ``role`` gets a relay: an SGLang prefill."""
    row = ENGINES.get(engine)
    return row is not None and runs_bootstrap_server(row.disagg_handover, role)


class BootstrapRelay:
    """One shard's relay, listening until :meth:`close`."""

    def __init__(self, listen_host: str, listen_port: int, target_port: int, shard: str) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_port = target_port
        self.shard = shard
        self.connections = 0
        """Connections accepted so far."""
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def listen(self) -> str:
        host = self.listen_host
        return f"[{host}]:{self.listen_port}" if ":" in host else f"{host}:{self.listen_port}"

    async def _listen(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._relay, self.listen_host, self.listen_port, limit=CHUNK
            )
        except OSError as exc:
            raise ShardError(self._bind_failure(exc)) from None
        # Port 0 (tests): the one the system gave.
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "bootstrap relay listening",
            extra=kv(shard=self.shard, listen=self.listen, target=self._target),
        )

    @property
    def _target(self) -> str:
        return f"{TARGET_HOST}:{self.target_port}"

    def _bind_failure(self, exc: OSError) -> str:
        what = (
            f"the relay to its SGLang bootstrap server cannot listen on its transfer address "
            f"{self.listen}: {exc.strerror or exc}"
        )
        if exc.errno == errno.EADDRINUSE:
            return (
                f"{what}; another process of this node holds that port (ss -ltnp 'sport = "
                f":{self.listen_port}' names it): stop it, or move agent.yaml's multinode_ports "
                "to a range nothing else on this node binds and re-run install-agent.sh so "
                "that the firewall follows"
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return (
                f"{what}; {self.listen_host} is not an address of this node (ip -brief "
                "address lists them): the control plane places it on an address the agent "
                "reported, so restart the agent if the node's addresses changed since it "
                "started"
            )
        return (
            f"{what}; check that the agent may bind that address and port (multinode_ports "
            "in agent.yaml), then start the shard again"
        )

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection on the transfer address, piped to the bootstrap server."""
        task = asyncio.current_task()
        assert task is not None
        if self._closed:
            await _close(writer)
            return
        self._pipes.add(task)
        self.connections += 1
        ends = [writer]
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(TARGET_HOST, self.target_port, limit=CHUNK),
                    CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as exc:
                # Its engine still loading (or gone): the decode retries its request.
                log.debug(
                    "bootstrap relay: the bootstrap server did not take a connection",
                    extra=kv(shard=self.shard, target=self._target, error=str(exc) or "timeout"),
                )
                return
            ends.append(up_writer)
            await _pipe_both(reader, writer, up_reader, up_writer)
        finally:
            # Whatever ended it (either side, or the relay closed): both sides closed.
            await asyncio.gather(*(_close(w) for w in ends))
            self._pipes.discard(task)

    async def close(self) -> None:
        """Stop listening and close every connection relayed; closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        pipes = list(self._pipes)
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        log.info(
            "bootstrap relay closed",
            extra=kv(shard=self.shard, listen=self.listen, connections=self.connections),
        )


async def start(
    listen_host: str, listen_port: int, target_port: int, *, shard: str = ""
) -> BootstrapRelay:
    """A relay listening on ``listen_host:listen_port`` that pipes each connection to
    ``127.0.0.1:target_port``; ShardError saying why and what to do when it cannot listen
    (``shard`` names it in the logs)."""
    relay = BootstrapRelay(listen_host, listen_port, target_port, shard)
    await relay._listen()
    return relay


async def _pipe_both(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Pipe a to b and b to a until either side closes or fails."""
    ways = {
        asyncio.create_task(_pipe(a_reader, b_writer)),
        asyncio.create_task(_pipe(b_reader, a_writer)),
    }
    try:
        await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for way in ways:
            way.cancel()
        await asyncio.gather(*ways, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer``, a chunk at a time, each drained before the next read
    (the bound on what a connection holds); returns at the end of ``reader`` or on an error
    of either side."""
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close one side; what it still has to send goes within :data:`CLOSE_GRACE_S`, else the
    connection is reset (a peer that reads nothing must not hold the relay open)."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_GRACE_S)
    except TimeoutError:
        writer.transport.abort()
    except OSError:
        pass


class Relayed(Protocol):
    """What the relay needs of a shard's order (a :class:`~llmgw.agent.shardspec.ShardSpec`)."""

    @property
    def shard_id(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def disagg_role(self) -> str: ...
    @property
    def transfer_addr(self) -> str: ...
    @property
    def bootstrap_port(self) -> int: ...


async def open_relay(spec: Relayed) -> BootstrapRelay | None:
    """The relay of a shard with a bootstrap port (an SGLang prefill), listening on its
    transfer address; None for a shard without one; ShardError when it cannot listen."""
    if not spec.bootstrap_port:
        return None
    try:
        host, port = parse_hostport(spec.transfer_addr)
    except ConfigError as exc:  # checked with the order: only a damaged record gets here
        raise ShardError(f"its transfer_addr cannot be relayed: {exc}") from None
    return await start(host, port, spec.bootstrap_port, shard=spec.shard_id)


async def adopt_relay(spec: Relayed) -> BootstrapRelay | None:
    """The relay of an adopted shard, opened again; ShardError when its engine must start
    again instead: the relay cannot listen, or the record is an older agent's, whose SGLang
    prefill had its HTTP API listen on every address (no bootstrap port recorded)."""
    if relayed(spec.engine, spec.disagg_role) and not spec.bootstrap_port:
        raise ShardError(
            "an older agent had its HTTP API listen on every address for its bootstrap "
            "server's sake; it starts again with both on loopback, behind the relay"
        )
    return await open_relay(spec)
