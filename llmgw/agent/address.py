"""The address this node reports for its data plane: agent.yaml's ``advertise`` or
``mgmt_addr`` as written, ``mgmt_interface``'s current address, or else the address this
machine sends from towards the control plane (its route).

``mgmt_interface`` is read each time the address is reported (DHCP may change it): at start
and at ``llmgw agent --check`` a missing interface, or one without an address, is refused
with the fix; later, while the agent runs, the last address it had is kept and the problem
logged, so that a flapping link does not make the node report a different network.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from llmgw.agent.config import AgentConfig
from llmgw.errors import ConfigError
from llmgw.log import kv
from llmgw.netaddr import interface_address, parse_hostport

__all__ = ["DataplaneAddress", "configured_host", "source_address_towards"]

log = logging.getLogger("llmgw.agent")


def configured_host(cfg: AgentConfig) -> str | None:
    """The host agent.yaml names for the data plane: ``mgmt_addr``, or the address of
    ``mgmt_interface`` now (ConfigError naming the key and the file when it has none);
    None when neither is set, or ``advertise`` (host:port, used as it is) is."""
    if cfg.advertise:
        return None
    if cfg.mgmt_addr:
        return cfg.mgmt_addr
    if cfg.mgmt_interface is None:
        return None
    try:
        return interface_address(cfg.mgmt_interface)
    except ConfigError as exc:
        raise ConfigError(
            str(exc), key="mgmt_interface", file=str(cfg.source) if cfg.source else None
        ) from None


def source_address_towards(server: str) -> str:
    """The local address this machine uses to reach ``server`` (host:port): a UDP socket
    connected there (no packet is sent) takes the source address of its route. 127.0.0.1
    when there is no route (the agent then reports loopback, and says so)."""
    host, port = parse_hostport(server)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as exc:
        log.warning(
            "no route to the control plane to take this node's address from; reporting "
            "127.0.0.1 (set mgmt_interface or mgmt_addr in agent.yaml)",
            extra=kv(server=server, error=exc.strerror or str(exc)),
        )
        return "127.0.0.1"


class DataplaneAddress:
    """The host part of the data-plane address the agent reports, chosen once per report."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        # Checked at start (the agent refuses to start without it): the interface's address.
        self._last = configured_host(cfg)

    def host(self, bound_host: str, server: str) -> str:
        """The host to report: agent.yaml's choice, else the bound host unless it is a
        wildcard, else the route's source address towards ``server``."""
        if self.cfg.mgmt_addr:
            return self.cfg.mgmt_addr
        if self.cfg.mgmt_interface is not None:
            try:
                self._last = configured_host(self.cfg)
            except ConfigError as exc:
                log.warning(
                    "mgmt_interface has no address now; reporting the last one it had",
                    extra=kv(address=self._last, error=str(exc)),
                )
            assert self._last is not None
            return self._last
        try:
            if ipaddress.ip_address(bound_host).is_unspecified:
                return source_address_towards(server)
        except ValueError:
            pass
        return bound_host
