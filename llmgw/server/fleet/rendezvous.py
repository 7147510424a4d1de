"""A multi-node replica's rendezvous port (pure: no store, no I/O): the lowest port inside
the ``multinode_ports`` of every node of the replica that no replica uses on any of them.

One rule for both kinds of rendezvous: where the workers dial rank 0 (sim, vLLM, SGLang) it
is rank 0's dist-init port; where rank 0 dials its workers (llama.cpp) each worker's
endpoint binds it on its own node. Either way it must be free on every node of the replica
and inside every node's range, since that range is all each node's firewall opens to the
fabric's peers (install-agent.sh). A node's range is what its inventory reports
(:func:`llmgw.contracts.inventory.multinode_ports`: the default for an agent that reports
none). When there is no such port the answer is a :class:`NoPort` whose reason names the
nodes, their ranges and the fix, as placement answers with an ``Unplaceable``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.inventory import multinode_ports
from llmgw.contracts.ports import PortRange
from llmgw.errors import ConfigError

__all__ = ["FIREWALL_FIX", "NoPort", "rendezvous_port"]

FIREWALL_FIX = "re-run install-agent.sh there so that the firewall follows"


@dataclass(frozen=True)
class NoPort:
    """Why the nodes of a replica have no rendezvous port to give it."""

    reason: str


def rendezvous_port(
    nodes: Sequence[str], inventories: Mapping[str, Mapping[str, Any]], used: Set[int]
) -> int | NoPort:
    """The lowest port in every range of ``nodes`` (as ``inventories``, by node id, report
    them) that is not in ``used`` (the ports of the replicas on any of those nodes)."""
    order = list(dict.fromkeys(nodes))
    ranges: dict[str, PortRange] = {}
    for node_id in order:
        try:
            ranges[node_id] = multinode_ports(inventories.get(node_id, {}))
        except ConfigError as exc:
            return NoPort(
                f"node {node_id} reports multinode_ports {exc.message}; fix multinode_ports in "
                f"agent.yaml on {node_id}, restart its agent, and {FIREWALL_FIX}"
            )
    named = ", ".join(f"{node_id} {ranges[node_id]}" for node_id in order)
    where = ", ".join(order)
    common: PortRange | None = ranges[order[0]]
    for node_id in order[1:]:
        common = common.overlap(ranges[node_id]) if common is not None else None
    if common is None:
        return NoPort(
            f"its nodes share no multi-node port: their multinode_ports do not overlap "
            f"({named}); widen multinode_ports in agent.yaml on {where} so that they overlap, "
            f"and {FIREWALL_FIX}"
        )
    for port in common:
        if port not in used:
            return port
    count = f"{len(common)} port" if len(common) == 1 else f"{len(common)} ports"
    return NoPort(
        f"every multi-node port its nodes share is taken by other multi-node replicas on them "
        f"({common}: {count}; {named}); widen multinode_ports in agent.yaml on {where}, and "
        f"{FIREWALL_FIX}"
    )
