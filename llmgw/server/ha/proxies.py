"""Who a request comes from behind reverse proxies: ``X-Forwarded-For`` honoured only from
the proxies server.yaml trusts (``trusted_proxies``, a list of CIDRs), and the address that
logins and password confirmations count against.

A client can write any ``X-Forwarded-For`` it likes, so the header says nothing unless the
connection comes from a trusted proxy; then its hops are read from the right (the nearest
proxy's entry) past every trusted one, and the first untrusted hop is the client (the
leftmost when all are trusted), as nginx's ``real_ip_recursive`` does. The middleware puts
that address in place of the request's ``remote``, so that everything downstream (the
lockout, the logs, a standby's forwarding to the leader) sees the client, not the proxy.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from llmgw.server.ha.follower import CLIENT_ADDR_HEADER, CLIENT_MAC_HEADER, client_addr

__all__ = ["Network", "TrustedProxies", "forwarded_middleware", "login_source", "parse_hop"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_MAX_HOPS = 32  # a longer chain is read from its right end only


def parse_hop(text: str) -> IPAddress | None:
    """One ``X-Forwarded-For`` entry as an address: ``192.0.2.1``, ``2001:db8::1``, and the
    forms with a port some proxies write (``192.0.2.1:5678``, ``[2001:db8::1]:443``)."""
    text = text.strip()
    if text.startswith("["):
        inside, bracket, _port = text[1:].partition("]")
        if not bracket:
            return None
        text = inside
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class TrustedProxies:
    """The reverse proxies whose ``X-Forwarded-For`` is believed."""

    def __init__(self, networks: Iterable[Network] = ()) -> None:
        self.networks = tuple(networks)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, addr: IPAddress | str | None) -> bool:
        ip = parse_hop(addr) if isinstance(addr, str) else addr
        return ip is not None and any(ip in net for net in self.networks)

    def client(self, peer: str, forwarded_for: Sequence[str]) -> str:
        """The client's address, for a connection from *peer* carrying these
        ``X-Forwarded-For`` header values (in the order received)."""
        if not self.trusts(peer):
            return peer
        hops = [h for value in forwarded_for for h in value.split(",")][-_MAX_HOPS:]
        client = peer
        for hop in reversed(hops):
            ip = parse_hop(hop)
            if ip is None:
                # Garbage past a trusted proxy: the last address a trusted hop vouched for.
                return client
            client = str(ip)
            if not self.trusts(ip):
                return client
        return client


def forwarded_middleware(trusted: TrustedProxies) -> Middleware:
    """The middleware that puts the client behind a trusted proxy in the request's
    ``remote`` (nothing at all when no proxy is trusted)."""

    @web.middleware
    async def forwarded(request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = request.remote
        if trusted and peer:
            values = request.headers.getall("X-Forwarded-For", [])
            if values:
                client = trusted.client(peer, values)
                if client != peer:
                    request = request.clone(remote=client)
        return await handler(request)

    return forwarded


def login_source(request: web.Request, secret: str) -> str:
    """The address a login or a password confirmation counts against: the client a standby
    forwarded for (signed under *secret*, the admin token), else the request's own (behind
    a trusted proxy, its client). Headers that are not even ASCII are no standby's."""
    for name in (CLIENT_ADDR_HEADER, CLIENT_MAC_HEADER):
        value = request.headers.get(name)
        if value is not None and not value.isascii():
            return request.remote or ""
    return client_addr(request, secret)
