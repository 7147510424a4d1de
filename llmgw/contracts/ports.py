"""The ports llmgw listens on by default (DESIGN §2), one definition for both ends.

A node and its control plane must agree on these without configuration: ``llmgw agent join
https://cp`` dials the enrolment port, an agent's ``server: cp`` the gRPC stream port, and
the control plane's default ``enroll_listen``/``grpc_listen`` bind the same numbers. So they
are part of the wire contract, not of either side's configuration, and live here rather
than in :mod:`llmgw.netaddr` (which parses addresses and knows nothing of llmgw's services).

The multi-node range (:data:`DEFAULT_MULTINODE_PORTS`, a :class:`PortRange`) is the one
node-configured exception: its default lives here and so does the one parser of its
``"A-B"`` form, read by the agent's configuration, the control plane's scheduler (from the
inventory) and, through ``llmgw agent --check --print multinode_ports``, the installer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from llmgw.errors import ConfigError

__all__ = [
    "DEFAULT_DATA_PORT",
    "DEFAULT_ENROLL_PORT",
    "DEFAULT_GRPC_PORT",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_MULTINODE_PORTS",
    "PortRange",
]

DEFAULT_HTTP_PORT = 8080
"""Control plane: the gateway /v1, the admin API /api, bundles, /metrics, /healthz."""

DEFAULT_ENROLL_PORT = 8443
"""Control plane: enrolment, where a joining agent trades its one-time token for a cert."""

DEFAULT_GRPC_PORT = 7443
"""Control plane: the agents' Connect stream (gRPC over mTLS)."""

DEFAULT_DATA_PORT = 9443
"""Agent: its data plane, which only the control plane's gateway may call (mTLS)."""


MIN_PORT = 1024
"""The lowest port a multi-node range may hold: below it are the privileged ports."""

MAX_PORT = 65535


@dataclass(frozen=True)
class PortRange:
    """Ports ``first`` to ``last``, both included, written ``"first-last"`` (agent.yaml's
    ``multinode_ports``, the inventory's field, what ``llmgw agent --check --print`` shows).

    Building one checks it: :class:`ConfigError` (without key or file: the caller names
    them) when it is reversed or leaves 1024-65535."""

    first: int
    last: int

    def __post_init__(self) -> None:
        for port in (self.first, self.last):
            if not MIN_PORT <= port <= MAX_PORT:
                raise ConfigError(
                    f"{self}: port {port} is outside {MIN_PORT}-{MAX_PORT}; give a range of "
                    f"unprivileged ports, e.g. {DEFAULT_MULTINODE_PORTS_TEXT}"
                )
        if self.first > self.last:
            raise ConfigError(
                f"{self} is reversed: it starts above where it ends; write the lower port "
                f"first ({self.last}-{self.first})"
            )

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """``"A-B"`` (spaces around it ignored) as a range; ConfigError says what is wrong."""
        match = _RANGE.fullmatch(text.strip())
        if match is None:
            raise ConfigError(
                f"{text!r} is not a port range; write two port numbers joined by '-', "
                f"e.g. {DEFAULT_MULTINODE_PORTS_TEXT} (one port: 29500-29500)"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first, self.last + 1))

    def overlap(self, other: PortRange) -> PortRange | None:
        """The ports in both; None when they share none."""
        first, last = max(self.first, other.first), min(self.last, other.last)
        return PortRange(first, last) if first <= last else None


_RANGE = re.compile(r"([0-9]{1,5})-([0-9]{1,5})")

DEFAULT_MULTINODE_PORTS_TEXT = "29500-29999"

DEFAULT_MULTINODE_PORTS = PortRange(29500, 29999)
"""Agent: where a multi-node replica's shards meet across nodes (agent.yaml's
``multinode_ports``): rank 0's rendezvous (dist-init) port for the engines whose workers
dial rank 0 (sim, vLLM, SGLang: 29500 is PyTorch's default) and the endpoint of each
llama.cpp ``rpc-server`` worker. The control plane picks each replica's port inside the
ranges of all its nodes; the installer opens the range in the node's firewall from the
fabric's peers only."""
