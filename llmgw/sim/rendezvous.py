"""The rendezvous of a multi-node ``sim`` replica: rank 0 gathers its workers over TCP.

Rank 0 listens on the dist-init address (the one socket an engine may bind off loopback);
each worker dials it, says which rank it is, and stays connected for as long as the
replica lives. Both ends send a heartbeat every ``heartbeat_s``; a peer that is silent for
``peer_timeout_s``, or whose connection closes or resets, is gone, and a replica that lost
a member is over: rank 0 exits when a worker goes, a worker exits when rank 0 goes.

The protocol is lines of ASCII, one message a line::

    worker -> rank 0    HELLO <rank> <nodes>
    rank 0 -> worker    WELCOME | REFUSE <reason>      (then the connection is closed)
    both ways           PING                           (the heartbeat; any line counts)
    both ways           BYE                            (leaving on purpose)

A worker whose rank is out of range, taken already, or whose node count differs from
rank 0's is refused. A worker that cannot connect retries with backoff until its join
timeout; a refused worker gives up at once (retrying cannot fix its rank).

Errors::

    EngineError
    └── RendezvousError     the replica could not assemble, or lost a member
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from llmgw.errors import EngineError

__all__ = ["JOINED", "Leader", "RendezvousError", "Worker"]

log = logging.getLogger("llmgw.engine.sim")

JOINED = "joined rank 0 at"
"""Words of the line a worker logs once rank 0 has welcomed it; the agent reads a worker's
log for them to tell that it has joined (a worker answers nothing it could ask)."""

_LINE_LIMIT = 1024
_BACKOFF_FIRST_S = 0.1
_BACKOFF_CAP_S = 2.0


class RendezvousError(EngineError):
    """A multi-node replica could not assemble, or one of its members went away."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


async def _beat(writer: asyncio.StreamWriter, interval_s: float) -> None:
    while True:
        writer.write(b"PING\n")
        await writer.drain()
        await asyncio.sleep(interval_s)


async def _keep(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    heartbeat_s: float,
    peer_timeout_s: float,
) -> str | None:
    """Exchange heartbeats until the link ends: None when the peer said BYE, else why it is
    gone."""
    beats = asyncio.create_task(_beat(writer, heartbeat_s))
    try:
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), peer_timeout_s)
            except TimeoutError:
                return f"silent for {peer_timeout_s:g}s"
            except ValueError:
                return "sent a line that is not part of the protocol"
            except OSError as exc:
                return f"connection lost ({_describe(exc)})"
            if not line:
                return "connection closed"
            if line.strip() == b"BYE":
                return None
            if beats.done():
                failure = beats.exception()
                return f"connection lost ({_describe(failure) if failure else 'cannot send'})"
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await beats


def _close(writer: asyncio.StreamWriter, goodbye: bool = False) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        if goodbye and not writer.is_closing():
            writer.write(b"BYE\n")
        writer.close()


@dataclass
class _Member:
    rank: int
    peer: str
    writer: asyncio.StreamWriter


class Leader:
    """Rank 0's side: listen on the dist-init address, admit every worker, watch them."""

    def __init__(
        self, host: str, port: int, nodes: int, *, heartbeat_s: float, peer_timeout_s: float
    ) -> None:
        self.host, self.port, self.nodes = host, port, nodes
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.members: dict[int, _Member] = {}
        self._complete = asyncio.Event()
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def open(self) -> None:
        """Bind the dist-init address; RendezvousError when it cannot be bound."""
        try:
            self._server = await asyncio.start_server(
                self._admit, self.host, self.port, limit=_LINE_LIMIT
            )
        except OSError as exc:
            raise RendezvousError(
                f"sim rank 0: cannot listen on the dist-init address {self.addr}: "
                f"{_describe(exc)}; choose another port or stop what holds it"
            ) from exc
        log.info(
            "sim rank 0 waiting for %d worker(s) on %s",
            self.nodes - 1,
            self.addr,
        )

    def missing(self) -> list[int]:
        return [r for r in range(1, self.nodes) if r not in self.members]

    async def gather(self, timeout_s: float) -> None:
        """Return once every worker has joined; RendezvousError when they have not within
        ``timeout_s``, or when one that joined went away meanwhile."""
        complete = asyncio.ensure_future(self._complete.wait())
        waited: set[asyncio.Future[Any]] = {complete, self._lost}
        try:
            await asyncio.wait(waited, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            complete.cancel()
        if self._lost.done():
            raise RendezvousError(self._lost.result())
        if not self._complete.is_set():
            ranks = ", ".join(map(str, self.missing()))
            raise RendezvousError(
                f"sim rank 0: rank(s) {ranks} of {self.nodes} did not join within "
                f"{timeout_s:g}s at {self.addr}; start them with --rank R --nodes {self.nodes} "
                f"--dist-init-addr {self.addr}, or check that they can reach this address"
            )
        log.info("sim rank 0: all %d ranks joined", self.nodes)

    async def lost(self) -> None:
        """Wait until a worker goes away, then raise RendezvousError naming it."""
        raise RendezvousError(await asyncio.shield(self._lost))

    async def close(self, *, goodbye: bool = True) -> None:
        """Stop listening and close every worker's connection, saying BYE first when
        ``goodbye`` (the replica is stopped on purpose, not broken)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for member in self.members.values():
            _close(member.writer, goodbye=goodbye)
        # Closed connections end their handlers; one stuck on a full send buffer is cancelled.
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _refusal(self, line: bytes) -> tuple[int, str]:
        """The rank a HELLO claims and, when it may not join, why."""
        words = line.split()
        if len(words) != 3 or words[0] != b"HELLO" or not all(w.isdigit() for w in words[1:]):
            return -1, f"expected 'HELLO <rank> <nodes>', got {line[:80]!r}"
        rank, nodes = int(words[1]), int(words[2])
        if nodes != self.nodes:
            return rank, f"this replica has {self.nodes} nodes, the worker was told {nodes}"
        if not 1 <= rank < self.nodes:
            return rank, f"rank {rank} is out of range for {self.nodes} nodes (1..{self.nodes - 1})"
        if rank in self.members:
            return rank, f"rank {rank} has already joined (from {self.members[rank].peer})"
        return rank, ""

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._member(reader, writer)
        except asyncio.CancelledError:
            # The connection's own task, cancelled only by close(): ending quietly keeps
            # asyncio (3.11) from logging the cancellation as an unhandled error.
            _close(writer)
        finally:
            self._tasks.discard(task)

    async def _member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer_name(writer)
        try:
            line = await asyncio.wait_for(reader.readline(), self.peer_timeout_s)
        except (TimeoutError, ValueError, OSError) as exc:
            log.warning("sim rank 0: dropped a connection from %s: %s", peer, _describe(exc))
            _close(writer)
            return
        rank, refusal = self._refusal(line)
        if refusal or self._closing:
            refusal = refusal or "rank 0 is shutting down"
            log.warning("sim rank 0: refused a worker from %s: %s", peer, refusal)
            with contextlib.suppress(OSError):
                writer.write(f"REFUSE {refusal}\n".encode())
                await writer.drain()
            _close(writer)
            return
        # Taken before the first await so that a second HELLO for this rank is refused.
        self.members[rank] = _Member(rank, peer, writer)
        try:
            writer.write(b"WELCOME\n")
            await writer.drain()
        except OSError as exc:
            why: str | None = f"connection lost ({_describe(exc)})"
        else:
            log.info(
                "sim rank 0: worker rank %d joined from %s (%d of %d ranks)",
                rank,
                peer,
                len(self.members) + 1,
                self.nodes,
            )
            if not self.missing():
                self._complete.set()
            why = await _keep(reader, writer, self.heartbeat_s, self.peer_timeout_s)
        _close(writer)
        if self._closing:
            return
        how = why if why is not None else "it left (BYE)"
        message = (
            f"sim rank 0: worker rank {rank} ({peer}) is gone: {how}; "
            "a worker that dies takes its replica down"
        )
        log.error("%s", message)
        if not self._lost.done():
            self._lost.set_result(message)


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class Worker:
    """A worker's side: join rank 0, then stay connected until the replica ends."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        nodes: int,
        *,
        heartbeat_s: float,
        peer_timeout_s: float,
    ) -> None:
        self.host, self.port, self.rank, self.nodes = host, port, rank, nodes
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def join(self, timeout_s: float) -> None:
        """Dial rank 0 until it welcomes this rank; RendezvousError when it refuses, or when
        ``timeout_s`` passes first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = _BACKOFF_FIRST_S
        last = "not tried"
        while (remaining := deadline - loop.time()) > 0:
            try:
                reader, writer, line = await self._hello(remaining)
            except (OSError, TimeoutError, ValueError) as exc:
                last = _describe(exc)
            else:
                if line.startswith(b"WELCOME"):
                    self._reader, self._writer = reader, writer
                    log.info(
                        "sim rank %d %s %s (%d nodes)", self.rank, JOINED, self.addr, self.nodes
                    )
                    return
                _close(writer)
                if line.startswith(b"REFUSE"):
                    reason = line[len(b"REFUSE") :].decode(errors="replace").strip()
                    raise RendezvousError(
                        f"sim rank {self.rank}: rank 0 at {self.addr} refused this worker: "
                        f"{reason}; check --rank and --nodes"
                    )
                last = (
                    f"answered {line[:40]!r}, which is not the rendezvous"
                    if line
                    else "closed the connection without an answer"
                )
            await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))
            delay = min(delay * 2, _BACKOFF_CAP_S)
        raise RendezvousError(
            f"sim rank {self.rank}: could not join rank 0 at {self.addr} within {timeout_s:g}s "
            f"(last try: {last}); check that rank 0 runs and that this node can reach {self.addr}"
        )

    async def stay(self) -> None:
        """Stay in the replica: return when rank 0 ends it (BYE), raise RendezvousError when
        rank 0 is gone."""
        assert self._reader is not None and self._writer is not None
        why = await _keep(self._reader, self._writer, self.heartbeat_s, self.peer_timeout_s)
        _close(self._writer)
        self._writer = None
        if why is None:
            log.info("sim rank %d: rank 0 ended the replica", self.rank)
            return
        message = f"sim rank {self.rank}: rank 0 at {self.addr} is gone: {why}; leaving the replica"
        log.error("%s", message)
        raise RendezvousError(message)

    async def _hello(
        self, remaining: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """One try: connect, say HELLO, read the answer line."""
        limit = min(remaining, self.peer_timeout_s)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=_LINE_LIMIT), limit
        )
        try:
            writer.write(f"HELLO {self.rank} {self.nodes}\n".encode())
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), limit)
        except BaseException:
            _close(writer)
            raise
        return reader, writer, line

    def close(self) -> None:
        """Leave the replica on purpose (BYE)."""
        if self._writer is not None:
            _close(self._writer, goodbye=True)
            self._writer = None
