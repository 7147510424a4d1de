"""The ``sim`` engine's KV cache transfer over TCP: a prefill engine's kept blocks served on
``--kv-transfer-addr`` (:class:`BlockServer`) and a decode engine's pull of them (:func:`pull`).

It stands for NIXL's transfer between vLLM's engines (the NixlConnector): the prefill keeps
a finished prompt's blocks until a decode reads them, or until ``--kv-transfer-timeout``
(vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) passes, then frees them. The bytes are real:
``kv_bytes_per_token`` for each token of the blocks pulled cross the socket, so a transfer
takes what moving the KV cache over a link would.

The wire format, one exchange per connection. The decode sends a request frame: a 4-byte
big-endian length, then that many bytes of a JSON object ``{"engine_id": str,
"block_ids": [int, ...]}``. The prefill answers a header frame of the same form: either
``{"bytes": N}`` followed by exactly N bytes, or ``{"error": message}``; then it closes.
Bounds: a request frame may be at most :data:`MAX_REQUEST_BYTES` and at most what naming
every block held takes, so a peer cannot make the prefill allocate more than its holdings
say; the bytes sent come from one shared zero buffer. A malformed request (a length out of
bounds, not JSON, missing or ill-typed members, repeated ids) closes the connection without
an answer, as does one not done within ``--kv-transfer-timeout``; an unknown engine id or a block not held (never kept, pulled already, or freed
after the timeout) gets an ``error`` header. A pull claims the blocks it names: the whole
prompt each belongs to is freed, as vLLM frees a request's blocks once the decode has read
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import struct
from dataclasses import dataclass, field
from typing import Any

from llmgw.errors import EngineError

__all__ = ["MAX_REQUEST_BYTES", "BlockServer", "PullFailed", "TransferStats", "pull"]

log = logging.getLogger("llmgw.engine.sim")

MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""The largest pull request frame a prefill reads (about 200k block ids)."""
_MAX_HEADER_BYTES = 64 * 1024  # the answer's header: {"bytes": N} or an error message
_LENGTH = struct.Struct("!I")
_ZEROS = memoryview(bytes(256 * 1024))  # the KV bytes sent: shared, never allocated per pull
_READ_CHUNK = 256 * 1024
# Room in a request frame for each block held (an id of up to 19 digits and its ", ") and
# for the rest of the object (the engine id and the keys).
_BYTES_PER_ID = 24
_BYTES_BESIDES_IDS = 64 * 1024


class PullFailed(EngineError):
    """A decode's pull of remote blocks that did not deliver them: refused, cut short, or
    over its time. The decode recomputes the prompt itself."""


@dataclass(slots=True)
class TransferStats:
    """What one engine's transfers did, in both roles, as its ``/metrics`` shows them."""

    kept_requests: int = 0  # prompts whose blocks a prefill kept for a pull
    pulls_served: int = 0  # pulls this prefill answered with bytes
    pulls_refused: int = 0  # pulls answered with an error (unknown engine, blocks not held)
    bytes_sent: int = 0
    expired_requests: int = 0  # kept prompts freed unpulled after the timeout
    pulls_done: int = 0  # pulls this decode completed
    bytes_received: int = 0
    load_failures: int = 0  # pulls that failed: the decode recomputed the prompt


@dataclass(slots=True)
class _Kept:
    """One prompt's kept blocks: each block's token count, and the timer that frees them."""

    tokens: dict[int, int]
    timer: asyncio.TimerHandle | None = None
    freed: bool = field(default=False)


class BlockServer:
    """The kept blocks of engine ``engine_id`` and the TCP listener that serves them."""

    def __init__(
        self,
        engine_id: str,
        block_size: int,
        bytes_per_token: int,
        timeout_s: float,
        stats: TransferStats,
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.timeout_s = timeout_s
        self.stats = stats
        self._owner: dict[int, _Kept] = {}  # block id -> the prompt it belongs to
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    @property
    def held_blocks(self) -> int:
        """The blocks kept for a pull now."""
        return len(self._owner)

    # ----------------------------------------------------------------- keeping

    def keep(self, prompt_tokens: int) -> list[int]:
        """Keep a finished prompt of ``prompt_tokens`` tokens for a pull; its block ids.

        Freed when pulled or ``timeout_s`` from now, whichever comes first."""
        size = self.block_size
        counts = [min(size, prompt_tokens - at) for at in range(0, prompt_tokens, size)]
        kept = _Kept({next(self._ids): n for n in counts})
        for block in kept.tokens:
            self._owner[block] = kept
        kept.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, kept)
        self.stats.kept_requests += 1
        return list(kept.tokens)

    def _expire(self, kept: _Kept) -> None:
        if not kept.freed:
            self.stats.expired_requests += 1
            log.info(
                "sim: freed %d kept KV block(s) unpulled after %gs",
                len(kept.tokens),
                self.timeout_s,
                extra={"engine": "sim"},
            )
        self._free(kept)

    def _free(self, kept: _Kept) -> None:
        if kept.freed:
            return
        kept.freed = True
        if kept.timer is not None:
            kept.timer.cancel()
        for block in kept.tokens:
            self._owner.pop(block, None)

    # ----------------------------------------------------------------- serving

    async def open(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0: a free port); the address bound. EngineError when it
        cannot."""
        try:
            self._server = await asyncio.start_server(self._accept, host, port)
        except OSError as e:
            raise EngineError(
                f"sim: cannot listen for KV transfers on {host}:{port}: {e.strerror or e}; "
                "choose another --kv-transfer-addr or stop what holds it"
            ) from e
        bound = self._server.sockets[0].getsockname()
        return host, int(bound[1])

    async def close(self) -> None:
        """Stop listening, end the transfers under way and free every kept block."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for kept in list(self._owner.values()):
            self._free(kept)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            # The whole exchange, the request read and the bytes sent: a decode that stops
            # reading does not hold a connection for ever.
            async with asyncio.timeout(self.timeout_s):
                await self._exchange(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("sim: KV transfer connection ended: %r", e)
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limit = min(MAX_REQUEST_BYTES, _BYTES_BESIDES_IDS + _BYTES_PER_ID * len(self._owner))
        asked = await _read_frame(reader, limit)
        if asked is None:
            return
        engine_id = asked.get("engine_id")
        block_ids = asked.get("block_ids")
        if (
            not isinstance(engine_id, str)
            or not isinstance(block_ids, list)
            or not block_ids
            or not all(type(b) is int for b in block_ids)
            or len(set(block_ids)) != len(block_ids)
        ):
            log.debug("sim: malformed KV pull request closed")
            return
        if engine_id != self.engine_id:
            await self._refuse(
                writer,
                f"unknown engine id {engine_id!r}: this is KV engine {self.engine_id!r}; the "
                "kv_transfer_params name another engine (or one restarted since)",
            )
            return
        missing = [b for b in block_ids if b not in self._owner]
        if missing:
            await self._refuse(
                writer,
                f"{len(missing)} of {len(block_ids)} block(s) are not held (first: "
                f"{missing[0]}): never kept, pulled already, or freed after "
                f"{self.timeout_s:g}s unpulled; recompute the prompt",
            )
            return
        tokens = 0
        for block in block_ids:
            kept = self._owner[block]
            tokens += kept.tokens[block]
        for block in block_ids:  # claimed: the prompts they belong to are freed
            kept_or_none = self._owner.get(block)
            if kept_or_none is not None:
                self._free(kept_or_none)
        size = tokens * self.bytes_per_token
        writer.write(_frame({"bytes": size}))
        left = size
        while left > 0:
            n = min(left, len(_ZEROS))
            writer.write(_ZEROS[:n])
            left -= n
            await writer.drain()
        await writer.drain()
        self.stats.pulls_served += 1
        self.stats.bytes_sent += size

    async def _refuse(self, writer: asyncio.StreamWriter, message: str) -> None:
        self.stats.pulls_refused += 1
        log.info("sim: KV pull refused: %s", message, extra={"engine": "sim"})
        writer.write(_frame({"error": message}))
        await writer.drain()


async def pull(
    host: str,
    port: int,
    engine_id: str,
    block_ids: list[int],
    expect_bytes: int,
    timeout_s: float,
) -> int:
    """Pull ``block_ids`` of engine ``engine_id`` from ``host:port``: the bytes received
    (``expect_bytes``, no more, no less). :class:`PullFailed` says why it could not: refused,
    the connection cut, another size, or more than ``timeout_s`` in all."""
    where = f"{host}:{port}"
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(_frame({"engine_id": engine_id, "block_ids": block_ids}))
                await writer.drain()
                header = await _read_frame(reader, _MAX_HEADER_BYTES)
                if header is None:
                    raise PullFailed(f"KV pull from {where}: the prefill closed the connection")
                error = header.get("error")
                if error is not None:
                    raise PullFailed(f"KV pull from {where} refused: {error}")
                size = header.get("bytes")
                if type(size) is not int or size != expect_bytes:
                    raise PullFailed(
                        f"KV pull from {where}: offered {size!r} bytes, expected {expect_bytes} "
                        "(the blocks are another prompt's, or another kv_bytes_per_token)"
                    )
                got = 0
                while got < size:
                    chunk = await reader.read(min(_READ_CHUNK, size - got))
                    if not chunk:
                        raise PullFailed(
                            f"KV pull from {where}: connection closed after {got} of {size} bytes"
                        )
                    got += len(chunk)
                return got
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except TimeoutError:
        raise PullFailed(f"KV pull from {where}: no blocks within {timeout_s:g}s") from None
    except (OSError, asyncio.IncompleteReadError) as e:
        raise PullFailed(f"KV pull from {where} failed: {e!r}") from None


def _frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> dict[str, Any] | None:
    """One frame's JSON object; None for a closed connection or a frame out of bounds or
    not a JSON object (the caller closes the connection)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError:
        return None
    (length,) = _LENGTH.unpack(head)
    if not 0 < length <= limit:
        return None
    try:
        data = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None
