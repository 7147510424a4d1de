"""The list of control-plane instances the leader hands its agents (``pb.ControlPlanes``):
how long it may be and what each entry must be, checked alike by the control plane before
it sends one and by the agent when it takes one (and again when it reads it back from its
state directory); and, with it, the certificate serials of every retired instance, which
the agent's data plane refuses (:class:`ControlPlaneList`).

Each entry is the ``host:port`` an agent dials for that instance's Connect stream, as
:func:`llmgw.netaddr.parse_hostport` reads it, with its port and never a wildcard address
(``0.0.0.0`` is a listen address, not one to dial). A list with one bad entry is refused
whole: an agent that kept the good part would drop, without a word, an instance the leader
meant it to know. The retired serials are lowercase hex as :func:`llmgw.pki.serial_hex`
writes them (an X.509 serial is at most 20 bytes: 40 digits), at most
:data:`MAX_RETIRED_SERIALS`; one bad serial refuses them whole too, for the same reason.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.errors import ConfigError
from llmgw.netaddr import format_hostport, parse_hostport

__all__ = [
    "MAX_CONTROL_PLANES",
    "MAX_ENTRY_CHARS",
    "MAX_RETIRED_SERIALS",
    "MAX_SERIAL_CHARS",
    "ControlPlaneList",
    "check_control_planes",
    "check_retired_serials",
]

MAX_CONTROL_PLANES = 64
"""Most instances one list may name (a cluster runs three or five)."""

MAX_ENTRY_CHARS = 300
"""Longest entry read: a host name (253) in brackets with a port, and some room."""

MAX_RETIRED_SERIALS = 256
"""Most retired serials one list carries (two per retired instance: the newest retired
first, so a cluster would have to retire 128 instances before the oldest fell off, by which
time their certificates have long expired)."""

MAX_SERIAL_CHARS = 40
"""An X.509 serial number is at most 20 bytes (RFC 5280 4.1.2.2): 40 hex digits."""

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class ControlPlaneList:
    """What the leader tells its agents of the cluster's instances: the stream address of
    every current one (this instance's first) and the certificate serials (server and
    client) of every retired one."""

    servers: tuple[str, ...]
    retired_serials: tuple[str, ...] = ()


def check_control_planes(values: Sequence[object]) -> tuple[str, ...]:
    """The list normalised (``host:port``, IPv6 in brackets), duplicates dropped, in its
    order. ConfigError says why it is refused: empty, longer than
    :data:`MAX_CONTROL_PLANES`, or an entry that is not a ``host:port`` to dial (the
    entry's index and, cut short, its text)."""
    if not values:
        raise ConfigError("the list of control planes is empty")
    if len(values) > MAX_CONTROL_PLANES:
        raise ConfigError(
            f"the list names {len(values)} control planes, more than the "
            f"{MAX_CONTROL_PLANES} an agent takes"
        )
    result: list[str] = []
    for index, value in enumerate(values):
        where = f"control plane [{index}]"
        if not isinstance(value, str):
            raise ConfigError(f"{where} is not a string host:port")
        if len(value) > MAX_ENTRY_CHARS:
            raise ConfigError(
                f"{where} is {len(value)} characters long ({value[:40]!r}...), longer than "
                f"any host:port ({MAX_ENTRY_CHARS})"
            )
        host, port = parse_hostport(value, what=where)
        try:
            unspecified = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            unspecified = False
        if unspecified:
            raise ConfigError(
                f"{where} {value!r} is a wildcard listen address, not one to dial; the control "
                "plane should name the address agents reach it at (its 'advertise' setting)"
            )
        address = format_hostport(host, port)
        if address not in result:
            result.append(address)
    return tuple(result)


def check_retired_serials(values: Sequence[object]) -> tuple[str, ...]:
    """The retired serials, duplicates dropped, in their order (an empty list is fine: none
    retired). ConfigError says why they are refused: more than :data:`MAX_RETIRED_SERIALS`,
    or an entry that is not lowercase hex of at most :data:`MAX_SERIAL_CHARS` digits (its
    index and, cut short, its text)."""
    if len(values) > MAX_RETIRED_SERIALS:
        raise ConfigError(
            f"the list names {len(values)} retired certificate serials, more than the "
            f"{MAX_RETIRED_SERIALS} an agent takes"
        )
    result: list[str] = []
    for index, value in enumerate(values):
        where = f"retired serial [{index}]"
        if not isinstance(value, str):
            raise ConfigError(f"{where} is not a string")
        if not value or len(value) > MAX_SERIAL_CHARS or not _HEX.fullmatch(value):
            raise ConfigError(
                f"{where} {value[:48]!r} is not a certificate serial (lowercase hex, 1 to "
                f"{MAX_SERIAL_CHARS} digits)"
            )
        if value not in result:
            result.append(value)
    return tuple(result)
