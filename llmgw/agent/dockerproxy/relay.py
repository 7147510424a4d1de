"""The Docker socket proxy's HTTP relay: a unix socket the agent may use, in front of dockerd's.

Each request is read whole (its head and body bounded), checked by :mod:`.policy`, and sent to
dockerd on a connection of its own; the answer is relayed as it comes, so that a followed log
or a wait streams through. Operations on an existing container first ask dockerd whether the
container carries llmgw's label and then name it by its full id, so that a name or id prefix
cannot point elsewhere between the check and the call. A refusal is a 403 whose JSON
``message`` says what was refused (the docker SDK shows it as the error's explanation).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.dockerproxy.policy import (
    Policy,
    Refused,
    check_create,
    check_list,
    is_llmgw_container,
    load_body,
    route,
)
from llmgw.errors import ConfigError
from llmgw.log import kv

__all__ = ["DEFAULT_LISTEN", "DEFAULT_UPSTREAM", "DockerProxy", "serve"]

log = logging.getLogger("llmgw.agent.dockerproxy")

DEFAULT_LISTEN = Path("/run/llmgw-docker-proxy/docker.sock")
DEFAULT_UPSTREAM = Path("/var/run/docker.sock")
HEAD_LIMIT = 64 * 1024
BODY_LIMIT = 4 * 1024 * 1024  # a container-create body; nothing else carries one
IDLE_S = 600.0  # an idle keep-alive connection of the docker SDK's pool
BODY_S = 30.0  # a request's body, once its head has come
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "content-length",
    "te",
    "trailer",
    "upgrade",
}


class BadRequest(Exception):
    """A request this relay cannot read; answered 400 (413 for a body too large)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    close: bool


def _reason(status: int) -> str:
    return {
        200: "OK",
        400: "Bad Request",
        403: "Forbidden",
        404: "Not Found",
        413: "Content Too Large",
        502: "Bad Gateway",
    }.get(status, "Error")


def _json_response(status: int, message: str, *, close: bool = False) -> bytes:
    body = json.dumps({"message": message}).encode()
    head = (
        f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    if close:
        head += "Connection: close\r\n"
    return head.encode("latin-1") + b"\r\n" + body


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise BadRequest("the connection ended inside a request head") from exc
    except asyncio.LimitOverrunError as exc:
        raise BadRequest(f"a request head above {HEAD_LIMIT} bytes") from exc


def _parse_headers(lines: list[str]) -> list[tuple[str, str]]:
    headers = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"a malformed header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return headers


def _header(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name]


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    body = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise BadRequest("a malformed chunk size") from exc
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return bytes(body)
        if len(body) + size > limit:
            raise BadRequest(f"a request body above {limit} bytes", 413)
        body += (await reader.readexactly(size + 2))[:-2]


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on a client connection; None when the client closed it."""
    head = await asyncio.wait_for(_read_head(reader), IDLE_S)
    if head is None:
        return None
    lines = head.decode("latin-1").split("\r\n")[:-2]
    # dockerd (Go) ends a line at a bare LF too: a header of ours holding one would reach it
    # as two, the second (a Transfer-Encoding, say) unseen by these checks.
    if any(c in line for line in lines for c in "\r\n\0"):
        raise BadRequest("a request head with a bare CR, LF or NUL")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise BadRequest(f"a malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    headers = _parse_headers(lines[1:])
    lengths = _header(headers, "content-length")
    encodings = _header(headers, "transfer-encoding")
    try:
        if encodings:
            if lengths or [e.lower() for e in encodings] != ["chunked"]:
                raise BadRequest("a body framed other than by one Content-Length or chunked")
            body = await asyncio.wait_for(_read_chunked(reader, BODY_LIMIT), BODY_S)
        elif lengths:
            if len(set(lengths)) != 1 or not lengths[0].isdigit():
                raise BadRequest(f"Content-Length {lengths!r}")
            size = int(lengths[0])
            if size > BODY_LIMIT:
                raise BadRequest(f"a request body above {BODY_LIMIT} bytes", 413)
            body = await asyncio.wait_for(reader.readexactly(size), BODY_S)
        else:
            body = b""
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise BadRequest("the connection ended inside a request body") from exc
    connection = ",".join(_header(headers, "connection")).lower()
    close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
    return Request(method, target, headers, body, close)


class DockerProxy:
    """Serves one client connection after another, each request checked by ``policy``."""

    def __init__(self, upstream: Path, policy: Policy) -> None:
        self.upstream = upstream
        self.policy = policy
        self._clients: set[asyncio.StreamWriter] = set()

    # --- dockerd -------------------------------------------------------------------------

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(str(self.upstream), limit=HEAD_LIMIT)
        except OSError as exc:
            raise Unreachable(
                f"llmgw-docker-proxy cannot reach dockerd at {self.upstream} "
                f"({exc.strerror or exc}); is docker running (systemctl start docker)?"
            ) from exc

    async def _ask(self, path: str) -> tuple[int, bytes]:
        """A GET of dockerd's own, for a check: its status and body."""
        reader, writer = await self._open_upstream()
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            status, headers, _ = await _read_response_head(reader)
            sink = _Collect()
            await _relay_body(reader, sink, headers, status, "GET")
            chunked = "chunked" in ",".join(_header(headers, "transfer-encoding")).lower()
            return status, _dechunk(bytes(sink.data)) if chunked else bytes(sink.data)
        finally:
            writer.close()

    # --- one client connection -----------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while True:
                try:
                    request = await read_request(reader)
                except BadRequest as exc:
                    writer.write(_json_response(exc.status, f"bad request: {exc}", close=True))
                    await writer.drain()
                    return
                if request is None:
                    return
                if not await self._serve(request, writer) or request.close:
                    return
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            self._clients.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        """End every client connection (the SDK keeps idle ones in its pool)."""
        for writer in list(self._clients):
            writer.close()
        await asyncio.sleep(0)

    async def _serve(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close after it."""
        try:
            target = await self._checked_target(request)
        except Refused as exc:
            log.warning(
                "refused a docker call",
                extra=kv(method=request.method, target=request.target[:200], reason=exc.message),
            )
            writer.write(_json_response(403, exc.message))
            await writer.drain()
            return True
        except Unreachable as exc:
            writer.write(_json_response(502, str(exc)))
            await writer.drain()
            return True
        except _Answer as answer:
            writer.write(_json_response(answer.status, answer.message))
            await writer.drain()
            return True
        except (BadRequest, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            message = (
                "dockerd's answer to the proxy's check could not be read; see: journalctl -u docker"
            )
            writer.write(_json_response(502, message))
            await writer.drain()
            return True
        log.debug("forwarding a docker call", extra=kv(method=request.method, target=target[:200]))
        try:
            upstream_reader, upstream_writer = await self._open_upstream()
        except Unreachable as exc:
            writer.write(_json_response(502, str(exc)))
            await writer.drain()
            return True
        try:
            upstream_writer.write(_request_bytes(request, target))
            await upstream_writer.drain()
            status, headers, head = await _read_response_head(upstream_reader)
            framed = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers)
            no_body = request.method == "HEAD" or status in (204, 304) or 100 <= status < 200
            keep = framed or no_body
            out = [head[0]] + [f"{k}: {v}" for k, v in headers if k.lower() != "connection"]
            if not keep:
                out.append("Connection: close")
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
            await _relay_body(upstream_reader, writer, headers, status, request.method)
            await writer.drain()
            return keep
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, BadRequest, ValueError):
            return False  # dockerd's answer broke off or is garbled: the connection ends
        finally:
            upstream_writer.close()

    async def _checked_target(self, request: Request) -> str:
        """The target to send dockerd, or Refused (or _Answer for a container not found)."""
        r = route(request.method, request.target)
        path, _, query = request.target.partition("?")
        prefix = path[: len(path) - len(r.path)]
        if r.kind == "create":
            check_create(load_body(request.body), self.policy)
            return request.target
        if request.body:
            raise Refused(f"{request.method} {r.path} takes no body on this socket")
        if r.kind == "list":
            check_list(request.target)
            return request.target
        if r.kind == "container":
            assert r.container is not None
            status, raw = await self._ask(f"{prefix}/containers/{r.container}/json")
            try:
                attrs = json.loads(raw)
            except ValueError:
                attrs = {"message": f"dockerd's answer to an inspect was not JSON ({status})"}
                status = 502
            if status != 200 or not isinstance(attrs, dict) or "Id" not in attrs:
                message = attrs.get("message") if isinstance(attrs, dict) else None
                raise _Answer(status if status >= 400 else 502, message or f"dockerd said {status}")
            if not is_llmgw_container(attrs):
                raise Refused(
                    f"container {r.container} is not llmgw's (no llmgw.shard label); this "
                    "socket acts on llmgw's containers only"
                )
            full = f"{prefix}/containers/{attrs['Id']}"
            rest = "" if r.operation == "remove" else f"/{r.operation}"
            return full + rest + (f"?{query}" if query else "")
        return request.target


class Unreachable(Exception):
    """dockerd's socket does not answer."""


class _Answer(Exception):
    """dockerd's own answer to a check (a container not found), passed on to the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Collect:
    """A writer that keeps what is written (for the proxy's own checks)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None


def _dechunk(data: bytes) -> bytes:
    """The payload of a chunked body (whole, as :class:`_Collect` kept it)."""
    out = bytearray()
    while True:
        line, _, data = data.partition(b"\r\n")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[:size]
        data = data[size + 2 :]


def _request_bytes(request: Request, target: str) -> bytes:
    lines = [f"{request.method} {target} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
    if request.body or request.method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(request.body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.body


async def _read_response_head(
    reader: asyncio.StreamReader,
) -> tuple[int, list[tuple[str, str]], list[str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")[:-2]
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise BadRequest(f"dockerd answered {lines[0][:80]!r}")
    return int(parts[1]), _parse_headers(lines[1:]), lines


async def _relay_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter | _Collect,
    headers: list[tuple[str, str]],
    status: int,
    method: str,
) -> None:
    """Copy a response body as its framing says: a length, chunks (each passed on as it
    comes: followed logs), or everything until dockerd closes."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return
    encodings = [e.lower() for e in _header(headers, "transfer-encoding")]
    lengths = _header(headers, "content-length")
    if encodings and encodings[-1] == "chunked":
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)  # ValueError: not passed on
            writer.write(line)
            if size == 0:
                while True:
                    trailer = await reader.readuntil(b"\r\n")
                    writer.write(trailer)
                    if trailer == b"\r\n":
                        break
                await writer.drain()
                return
            writer.write(await reader.readexactly(size + 2))
            await writer.drain()
    elif lengths:
        left = int(lengths[0])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            writer.write(data)
            left -= len(data)
            await writer.drain()
    else:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


# ------------------------------------------------------------------------------ serving


def _socket_group(group: str | None) -> int:
    if group is None:
        return -1
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"no group {group!r} for the proxy's socket; create it (the agent's installer "
            "does: install-agent.sh install --docker) or give another --group"
        ) from None


def _prepare_socket_path(listen: Path) -> None:
    try:
        info = listen.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(
            f"{listen} exists and is not a socket; remove it or give another --listen"
        )
    listen.unlink()  # a socket a previous run left


async def serve(
    listen: Path,
    upstream: Path,
    policy: Policy,
    *,
    group: str | None = None,
    mode: int = 0o660,
    on_ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Listen on ``listen`` (``mode``, group ``group``) until ``stop`` is set or SIGTERM."""
    gid = _socket_group(group)
    if not listen.parent.is_dir():
        raise ConfigError(
            f"{listen.parent} does not exist; create it (the unit's RuntimeDirectory= does) "
            "or give another --listen"
        )
    _prepare_socket_path(listen)
    proxy = DockerProxy(upstream, policy)
    # Nobody but the owner may connect before the mode and group are set.
    old = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(proxy.handle, path=str(listen), limit=HEAD_LIMIT)
    finally:
        os.umask(old)
    try:
        if gid != -1:
            os.chown(listen, -1, gid)
        os.chmod(listen, mode)
    except OSError as exc:
        server.close()
        raise ConfigError(
            f"cannot give {listen} to group {group}: {exc.strerror} (the proxy runs as uid "
            f"{os.geteuid()}, groups {sorted(os.getgroups())}); it must run as root or as a "
            f"member of {group} ({gid})"
        ) from exc
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # asyncio refuses signal handlers off the main thread (RuntimeError/ValueError) and on
        # loops without them (NotImplementedError); there the caller's ``stop`` ends the proxy.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    log.info(
        "docker proxy listening",
        extra=kv(
            listen=str(listen),
            upstream=str(upstream),
            bind_roots=",".join(str(r) for r in policy.bind_roots) or "none",
            host_network=policy.host_network,
        ),
    )
    if on_ready is not None:
        on_ready()
    try:
        await stop.wait()
    finally:
        server.close()
        await proxy.close()
        _remove_socket(listen)


def _remove_socket(listen: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        listen.unlink()
