#!/usr/bin/env python3
"""Benchmark: what one Python relay hop costs at the least on this machine.

``bench/gateway.py`` reports the gateway's and the agent's CPU per request against a target
(80 µs each). This benchmark says how much of that a hop in Python cannot avoid here, by
timing three relays that do nothing but relay, each in a process of its own between the
same load generator and the same stand-in engine (a fixed 200-byte JSON answer, written by
a bare asyncio protocol):

* ``aiohttp``: aiohttp's low-level server (what both hops are built on) forwarding through
  llmgw's own upstream client (:mod:`llmgw.http.pool`), no policy, no routing, no TLS;
* ``raw``: a bare asyncio protocol (request line, headers, Content-Length body; keep-alive;
  one write per answer) forwarding through the same upstream client;
* ``echo``: a bare asyncio protocol that answers itself without any upstream: what
  receiving a request and writing an answer costs alone;
* ``raw`` with TLS towards the engine (what the gateway's hop has: TLS to the agent), and
  with TLS from the client (what the agent's hop has: TLS from the gateway), on a P-256
  certificate as the cluster's are.

Each runs on the event loop llmgw/loop.py picks (uvloop where installed). CPU is the relay
process's user + system time from /proc over a fixed window at concurrency 64. The figures
are a floor for a hop that also authenticates, applies a key's policy, routes and accounts:
if ``raw`` alone is near the target, the target cannot be met by trimming llmgw's own code.

Usage: python bench/hop_floor.py [--duration S] [--concurrency N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from llmgw.loop import choose as choose_event_loop

BODY = json.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    + BODY
)
REQUEST_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
).encode()
TARGET_CPU_US_PER_HOP = 80.0
LABELS = {
    "echo": "answer alone, no upstream (bare asyncio protocol)",
    "raw": "relay: bare asyncio protocol + llmgw.http client",
    "aiohttp": "relay: aiohttp low-level server + llmgw.http client",
    "raw-tls-up": "relay as raw, TLS to the engine (the gateway's hop)",
    "raw-tls-in": "relay as raw, TLS from the client (the agent's hop)",
}
TICKS = os.sysconf("SC_CLK_TCK")


Handler = Callable[[asyncio.Transport, bytes, bytes], None]
"""What a request is handed to: the connection, the request's head and its body."""


class _Requests(asyncio.Protocol):
    """HTTP/1.1 requests framed by Content-Length, handed to ``handle`` one at a time."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._need: int | None = None
        self._head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self._buf += data
        while True:
            if self._need is None:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head = self._buf[:end]
                self._buf = self._buf[end + 4 :]
                length = 0
                for line in self._head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self._need = length
            if len(self._buf) < self._need:
                return
            body, self._buf = self._buf[: self._need], self._buf[self._need :]
            self._need = None
            self.handle(self.transport, self._head, body)


def _answer(transport: asyncio.Transport, head: bytes, body: bytes) -> None:
    """The stand-in engine's (and the echo relay's) answer to every request."""
    transport.write(ANSWER)


class _Relay:
    """Each request sent on to ``upstream`` through llmgw's upstream client, its answer
    written back in one write."""

    def __init__(self, pool: Any, upstream: tuple[str, int]) -> None:
        self.pool = pool
        self.upstream = upstream
        self.running: set[asyncio.Future[None]] = set()

    def handle(self, transport: asyncio.Transport, head: bytes, body: bytes) -> None:
        # One request at a time per connection: the load generator does not pipeline.
        task = asyncio.ensure_future(self._relay(transport, head, body))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _relay(self, transport: asyncio.Transport, head: bytes, body: bytes) -> None:
        host, port = self.upstream
        path = head.split(b" ", 2)[1].decode()
        resp = await self.pool.request(
            "POST", host, port, path, body=body, headers=(("Content-Type", "application/json"),)
        )
        data = await resp.read()
        resp.release()
        transport.write(
            b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (resp.status, len(data))
            + data
        )


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for 127.0.0.1 (cert, key)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _server_ssl(cert: tuple[Path, Path] | None) -> ssl.SSLContext | None:
    if cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert)
    return ctx


def _client_ssl(cert: tuple[Path, Path] | None) -> ssl.SSLContext | None:
    if cert is None:
        return None
    return ssl.create_default_context(cafile=str(cert[0]))


def _serve(
    kind: str,
    sock: socket.socket,
    upstream: tuple[str, int],
    tls_in: tuple[Path, Path] | None = None,
    tls_up: tuple[Path, Path] | None = None,
) -> None:
    factory = choose_event_loop().factory

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if kind == "engine" or kind == "echo":
            await loop.create_server(lambda: _Requests(_answer), sock=sock, ssl=_server_ssl(tls_in))
        elif kind == "raw":
            from llmgw.http.pool import UpstreamPool

            relay = _Relay(UpstreamPool(ssl=_client_ssl(tls_up)), upstream)
            await loop.create_server(
                lambda: _Requests(relay.handle), sock=sock, ssl=_server_ssl(tls_in)
            )
        else:
            from aiohttp import web

            from llmgw.http.pool import UpstreamPool

            pool = UpstreamPool()
            host, port = upstream

            async def handle(request: web.BaseRequest) -> web.Response:
                body = await request.read()
                resp = await pool.request(
                    "POST",
                    host,
                    port,
                    request.path,
                    body=body,
                    headers=(("Content-Type", "application/json"),),
                )
                data = await resp.read()
                resp.release()
                return web.Response(body=data, status=resp.status, content_type="application/json")

            server = web.Server(handle, access_log=None)
            await loop.create_server(server, sock=sock)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def _listen() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def _load(
    port: int, duration: float, concurrency: int, pid: int, tls: tuple[Path, Path] | None
) -> tuple[int, float]:
    scheme = "https" if tls else "http"
    url = f"{scheme}://127.0.0.1:{port}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=concurrency, ssl=_client_ssl(tls) or False)
    async with aiohttp.ClientSession(connector=conn) as session:
        count = 0
        stop_at = 0.0
        measuring = False

        async def worker() -> None:
            nonlocal count
            while time.monotonic() < stop_at:
                async with session.post(
                    url, data=REQUEST_BODY, headers={"Content-Type": "application/json"}
                ) as resp:
                    await resp.read()
                    assert resp.status == 200
                if measuring:
                    count += 1

        stop_at = time.monotonic() + 0.5  # warm up: connections opened, code paths hot
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        measuring = True
        cpu0 = _cpu(pid)
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count, _cpu(pid) - cpu0


def measure(
    kind: str, duration: float, concurrency: int, cert: tuple[Path, Path]
) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    tls_in = cert if kind == "raw-tls-in" else None
    tls_up = cert if kind == "raw-tls-up" else None
    kind = kind.split("-")[0]
    engine_sock = _listen()
    engine_addr = engine_sock.getsockname()
    procs = []
    engine = ctx.Process(target=_serve, args=("engine", engine_sock, ("", 0), tls_up), daemon=True)
    engine.start()
    procs.append(engine)
    try:
        if kind == "echo":
            target_pid, port = engine.pid, engine_addr[1]
        else:
            relay_sock = _listen()
            relay = ctx.Process(
                target=_serve, args=(kind, relay_sock, engine_addr, tls_in, tls_up), daemon=True
            )
            relay.start()
            procs.append(relay)
            target_pid, port = relay.pid, relay_sock.getsockname()[1]
        time.sleep(0.5)
        assert target_pid is not None
        count, cpu = asyncio.run(_load(port, duration, concurrency, target_pid, tls_in))
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    return {"requests": count, "req_per_s": count / duration, "cpu_us": cpu / max(count, 1) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per relay")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-hop-") as tmp:
        cert = _certificate(Path(tmp))
        for kind in LABELS:
            print(f"[bench] {kind} ...", file=sys.stderr)
            results[kind] = measure(kind, args.duration, args.concurrency, cert)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"one relay hop at the least ({os.cpu_count()} CPUs, python "
        f"{sys.version.split()[0]}, concurrency {args.concurrency}, {args.duration:g} s each)"
    )
    for kind, row in results.items():
        print(
            f"  {LABELS[kind]:<62} {row['cpu_us']:6.0f} µs CPU/request  "
            f"({row['req_per_s']:.0f} req/s)"
        )
    print(f"  target per hop in bench/gateway.py: <= {TARGET_CPU_US_PER_HOP:g} µs")


if __name__ == "__main__":
    main()
