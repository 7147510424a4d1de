"""Who a request comes from behind proxies (llmgw.server.ha.proxies): X-Forwarded-For read only
from a trusted proxy, from the right past every trusted hop; the client put in the request's
``remote`` by the middleware; the address logins count against."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from llmgw.server.ha.follower import CLIENT_ADDR_HEADER, CLIENT_MAC_HEADER
from llmgw.server.ha.proxies import TrustedProxies, forwarded_middleware, login_source, parse_hop

TRUSTED = TrustedProxies(
    [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8:ffff::/48")]
)


@pytest.mark.parametrize(
    ("peer", "header", "client"),
    [
        ("10.1.2.3", ["198.51.100.7"], "198.51.100.7"),
        # The rightmost untrusted hop: what the client wrote itself on the left is not it.
        ("10.1.2.3", ["203.0.113.66, 198.51.100.7"], "198.51.100.7"),
        ("10.1.2.3", ["203.0.113.66, 198.51.100.7, 10.9.9.9"], "198.51.100.7"),
        ("10.1.2.3", ["203.0.113.66", "198.51.100.7, 10.9.9.9"], "198.51.100.7"),  # two headers
        ("10.1.2.3", ["10.4.4.4, 10.9.9.9"], "10.4.4.4"),  # every hop trusted: the leftmost
        ("10.1.2.3", ["198.51.100.7:5678"], "198.51.100.7"),
        ("10.1.2.3", ["[2001:db8::7]:443"], "2001:db8::7"),
        ("10.1.2.3", ["::ffff:198.51.100.7"], "198.51.100.7"),
        ("2001:db8:ffff:1::2", ["2001:db8:1::9"], "2001:db8:1::9"),
        # Garbage past a trusted hop: the last address a trusted hop vouched for.
        ("10.1.2.3", ["unknown"], "10.1.2.3"),
        ("10.1.2.3", ["198.51.100.7, garbage, 10.9.9.9"], "10.9.9.9"),
        # Not from a trusted proxy: its header says nothing.
        ("192.0.2.1", ["198.51.100.7"], "192.0.2.1"),
        ("2001:db8:1::1", ["198.51.100.7"], "2001:db8:1::1"),
    ],
)
def test_the_client_is_the_rightmost_untrusted_hop_behind_a_trusted_proxy(
    peer: str, header: list[str], client: str
) -> None:
    assert TRUSTED.client(peer, header) == client


def test_hops_are_addresses_with_or_without_a_port() -> None:
    assert parse_hop(" 192.0.2.1 ") == ipaddress.ip_address("192.0.2.1")
    assert parse_hop("[::1]:80") == ipaddress.ip_address("::1")
    assert parse_hop("::1") == ipaddress.ip_address("::1")
    for bad in ("", "unknown", "_hidden", "1.2.3.4:x:y", "[::1"):
        assert parse_hop(bad) is None, bad


def _served(trusted: TrustedProxies, headers: dict[str, str]) -> str:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(text=request.remote or "")

    app = web.Application(middlewares=[forwarded_middleware(trusted)])
    app.router.add_get("/", echo)

    async def go() -> str:
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/", headers=headers)
            return await resp.text()

    return asyncio.run(go())


def test_the_middleware_puts_the_client_in_remote_only_behind_a_trusted_proxy() -> None:
    loopback = TrustedProxies([ipaddress.ip_network("127.0.0.1/32")])
    forwarded = {"X-Forwarded-For": "198.51.100.7"}
    assert _served(loopback, forwarded) == "198.51.100.7"
    assert _served(TrustedProxies(), forwarded) == "127.0.0.1"  # none trusted: ignored
    assert _served(TRUSTED, forwarded) == "127.0.0.1"  # not this one
    assert _served(loopback, {}) == "127.0.0.1"


def test_a_standby_s_headers_that_are_not_ascii_are_no_standby_s() -> None:
    request = make_mocked_request(
        "POST",
        "/api/login",
        headers={CLIENT_ADDR_HEADER: "198.51.100.7é", CLIENT_MAC_HEADER: "00"},
    )
    assert login_source(request, "secret") == (request.remote or "")
