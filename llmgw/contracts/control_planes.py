"""The list of control-plane instances the leader hands its agents (``pb.ControlPlanes``):
how long it may be and what each entry must be, checked alike by the control plane before
it sends one and by the agent when it takes one (and again when it reads it back from its
state directory).

Each entry is the ``host:port`` an agent dials for that instance's Connect stream, as
:func:`llmgw.netaddr.parse_hostport` reads it, with its port and never a wildcard address
(``0.0.0.0`` is a listen address, not one to dial). A list with one bad entry is refused
whole: an agent that kept the good part would drop, without a word, an instance the leader
meant it to know.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from llmgw.errors import ConfigError
from llmgw.netaddr import format_hostport, parse_hostport

__all__ = ["MAX_CONTROL_PLANES", "MAX_ENTRY_CHARS", "check_control_planes"]

MAX_CONTROL_PLANES = 64
"""Most instances one list may name (a cluster runs three or five)."""

MAX_ENTRY_CHARS = 300
"""Longest entry read: a host name (253) in brackets with a port, and some room."""


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
