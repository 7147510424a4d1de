"""Slow clients on every listener of a real control plane and agent, configured with short
limits (``listeners:`` in server.yaml and agent.yaml) so that the attack is scaled down for
CI: 200 connections per listener that trickle their request header (or never finish the
TLS handshake) are all closed within the timeout, :8443 holds at most its cap per source
address, and the listeners keep serving everyone else meanwhile."""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.integration.harness import (
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

TIMEOUT = 1.0  # header and body timeout of every listener here (handshakes: twice that)
SLACK = 4.0  # closing may lag the timeout by this much on a loaded CI machine
CONNS = 200
CAP = 40  # enroll_connections_per_source


@dataclass
class Slow:
    server: Server
    agent: Agent
    enroll_port: int


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slow]:
    tmp = tmp_path_factory.mktemp("slow")
    # Honest handshakes (the test's own) must finish within the handshake timeout on a busy
    # CI machine too: twice the others, still well inside TIMEOUT + SLACK.
    limits = {
        "header_timeout": TIMEOUT,
        "handshake_timeout": 2 * TIMEOUT,
        "body_timeout": TIMEOUT,
    }
    server = start_server_with(tmp, listeners={**limits, "enroll_connections_per_source": CAP})
    agent: Agent | None = None
    try:
        agent = start_agent(make_agent(tmp, server, "slow-1", extra={"listeners": limits}))
        wait_for(
            lambda: any(n["id"] == "slow-1" and n["connected"] for n in server.nodes()),
            what="the agent connected",
        )
        # The data plane listens once the stream is up; the enrolment port is in the log.
        wait_for(lambda: "data plane listening" in agent.log(), what="the data plane")
        enroll = wait_for(
            lambda: _port_in(server.log(), "enrolment listening"), what="enrolment port"
        )
        yield Slow(server, agent, enroll)
    finally:
        if agent is not None and agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def _port_in(log: str, message: str) -> int | None:
    for line in log.splitlines():
        if message in line and "addr=" in line:
            return int(line.rsplit("addr=", 1)[1].split()[0].rsplit(":", 1)[1])
    return None


async def _slowloris(
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    hostname: str = "127.0.0.1",
    first: bytes = b"GET /healthz HTTP/1.1\r\nHost: t\r\n",
    trickle: bool = True,
    conns: int = CONNS,
    refused: list[int] | None = None,
) -> list[float | None]:
    """Open ``conns`` connections that send ``first`` and then a header byte every 0.3 s;
    return how long each stayed open (None: still open after TIMEOUT + SLACK). Connections
    closed before the TLS handshake completed are counted in ``refused``."""

    async def one() -> float | None:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=tls, server_hostname=hostname if tls else None
            )
        except (ConnectionError, ssl.SSLError, OSError):
            if refused is not None:
                refused.append(1)
            return time.monotonic() - started
        writer.write(first)

        async def drip() -> None:
            while trickle:
                await asyncio.sleep(0.3)
                writer.write(b"X")

        dripping = asyncio.create_task(drip())
        try:
            async with asyncio.timeout(TIMEOUT + SLACK):
                while await reader.read(4096):
                    pass
            return time.monotonic() - started
        except (ConnectionError, ssl.SSLError, OSError):
            return time.monotonic() - started
        except TimeoutError:
            return None
        finally:
            dripping.cancel()
            writer.close()

    return await asyncio.gather(*(one() for _ in range(conns)))


def _healthz(server: Server) -> int:
    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as resp:
        return int(resp.status)


def _assert_all_closed(held: list[float | None]) -> None:
    still_open = sum(1 for h in held if h is None)
    assert still_open == 0, f"{still_open} of {len(held)} slow connections still open"
    assert max(h for h in held if h is not None) < TIMEOUT + SLACK


def test_8080_slow_headers_are_cut_and_healthz_answers_meanwhile(slow: Slow) -> None:
    async def main() -> list[float | None]:
        attack = asyncio.ensure_future(_slowloris(slow.server.http_port))
        await asyncio.sleep(TIMEOUT / 2)
        # Mid-attack, an honest client is served at once.
        assert await asyncio.to_thread(_healthz, slow.server) == 200
        return await attack

    held = asyncio.run(main())
    _assert_all_closed(held)
    assert min(h for h in held if h is not None) >= TIMEOUT * 0.8  # cut by the timeout


def test_8080_stalled_bodies_are_cut(slow: Slow) -> None:
    key = slow.server.api_key("slow-bodies")
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    held = asyncio.run(_slowloris(slow.server.http_port, first=first, trickle=False, conns=50))
    _assert_all_closed(held)
    assert min(h for h in held if h is not None) >= TIMEOUT * 0.8  # cut by the timeout


def test_8443_caps_each_source_and_times_out_handshakes_and_headers(slow: Slow) -> None:
    ctx = ssl.create_default_context(cafile=str(slow.server.pki_dir / "ca.crt"))

    refused: list[int] = []

    async def main() -> tuple[list[float | None], list[float | None]]:
        tls = asyncio.ensure_future(_slowloris(slow.enroll_port, tls=ctx, refused=refused))
        await asyncio.sleep(TIMEOUT / 2)
        # The cap is per source: another loopback address still fetches the CA.
        ca = await asyncio.to_thread(_fetch_ca_from, slow.enroll_port, ctx, "127.0.0.2")
        assert b"BEGIN CERTIFICATE" in ca
        held_tls = await tls
        # TCP connections that never start the handshake.
        held_raw = await _slowloris(slow.enroll_port, first=b"", trickle=False, conns=CAP)
        return held_tls, held_raw

    held_tls, held_raw = asyncio.run(main())
    _assert_all_closed(held_tls)
    _assert_all_closed(held_raw)
    # Over the cap: closed before the handshake; under it: held until the header timeout.
    assert len(refused) >= CONNS - CAP, f"{len(refused)} of {CONNS} refused by the cap of {CAP}"
    assert len(refused) < CONNS
    log = slow.server.log()
    assert "closed slow or excess client connections" in log
    assert "listener=enroll" in log


def _fetch_ca_from(port: int, ctx: ssl.SSLContext, source: str) -> bytes:
    import http.client
    import socket

    raw = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.sock = sock
        conn.request("GET", "/enroll/ca")
        return conn.getresponse().read()


def test_9443_stalled_handshakes_and_slow_headers_are_closed(slow: Slow) -> None:
    pki_dir = slow.server.pki_dir
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(pki_dir / "client.crt", pki_dir / "client.key")

    async def main() -> tuple[list[float | None], list[float | None]]:
        raw = asyncio.ensure_future(
            _slowloris(slow.agent.dataplane_port, first=b"\x16\x03\x01", trickle=False)
        )
        # Even the control plane's own certificate may not trickle a header.
        tls = await _slowloris(slow.agent.dataplane_port, tls=ctx, hostname="slow-1", conns=50)
        return await raw, tls

    held_raw, held_tls = asyncio.run(main())
    _assert_all_closed(held_raw)
    _assert_all_closed(held_tls)
    wait_for(lambda: "listener=dataplane" in slow.agent.log(), what="the data plane's summary")


def test_7443_connections_that_never_finish_the_handshake_are_closed(slow: Slow) -> None:
    async def main() -> list[float | None]:
        half = asyncio.ensure_future(
            _slowloris(slow.server.grpc_port, first=b"\x16\x03\x01\x02\x00", trickle=False)
        )
        silent = await _slowloris(slow.server.grpc_port, first=b"", trickle=False, conns=100)
        return [*await half, *silent]

    _assert_all_closed(asyncio.run(main()))


def test_zz_everything_still_serves_without_tracebacks(slow: Slow) -> None:
    assert _healthz(slow.server) == 200
    nodes = {n["id"]: n for n in slow.server.nodes()}
    assert nodes["slow-1"]["connected"], nodes
    for text in (slow.server.log(), slow.agent.log()):
        assert "Traceback" not in text
    # The attackers' address got its connections back: it is served again.
    ctx = ssl.create_default_context(cafile=str(slow.server.pki_dir / "ca.crt"))
    ca = _fetch_ca_from(slow.enroll_port, ctx, "127.0.0.1")
    assert ca == (slow.server.pki_dir / "ca.crt").read_bytes()
