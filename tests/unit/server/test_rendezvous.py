"""llmgw.server.fleet.rendezvous: a multi-node replica's port, inside every node's multinode_ports
and free on all of them, or the reason there is none."""

from __future__ import annotations

from llmgw.server.fleet.rendezvous import NoPort, rendezvous_port

FIX = "re-run install-agent.sh there so that the firewall follows"


def test_the_lowest_port_in_every_range_that_is_free() -> None:
    inventories = {
        "a": {"multinode_ports": "30000-30100"},
        "b": {"multinode_ports": "30050-30200"},
    }
    assert rendezvous_port(["a", "b"], inventories, set()) == 30050
    assert rendezvous_port(["a", "b"], inventories, {30050, 30051, 29500}) == 30052
    # Ranks may repeat a node: it counts once.
    assert rendezvous_port(["a", "b", "a"], inventories, set()) == 30050


def test_a_node_that_reports_nothing_has_the_default_range() -> None:
    assert rendezvous_port(["a", "b"], {"a": {}, "b": {"multinode_ports": ""}}, set()) == 29500
    assert rendezvous_port(["a"], {}, {29500}) == 29501  # no inventory stored yet


def test_ranges_that_do_not_overlap() -> None:
    inventories = {
        "a": {"multinode_ports": "30000-30099"},
        "b": {"multinode_ports": "30050-30200"},
        "c": {"multinode_ports": "30100-30200"},
    }
    assert rendezvous_port(["a", "b", "c"], inventories, set()) == NoPort(
        "its nodes share no multi-node port: their multinode_ports do not overlap (a "
        "30000-30099, b 30050-30200, c 30100-30200); widen multinode_ports in agent.yaml on "
        f"a, b, c so that they overlap, and {FIX}"
    )


def test_a_shared_range_that_is_full() -> None:
    inventories = {"a": {"multinode_ports": "30000-30001"}, "b": {"multinode_ports": "1024-30001"}}
    assert rendezvous_port(["b", "a"], inventories, {30000}) == 30001
    assert rendezvous_port(["b", "a"], inventories, {30000, 30001}) == NoPort(
        "every multi-node port its nodes share is taken by other multi-node replicas on them "
        "(30000-30001: 2 ports; b 1024-30001, a 30000-30001); widen multinode_ports in "
        f"agent.yaml on b, a, and {FIX}"
    )


def test_a_range_no_agent_would_report() -> None:
    inventories = {"a": {}, "b": {"multinode_ports": "31000-30000"}}
    assert rendezvous_port(["a", "b"], inventories, set()) == NoPort(
        "node b reports multinode_ports 31000-30000 is reversed: it starts above where it "
        "ends; write the lower port first (30000-31000); fix multinode_ports in agent.yaml on b, "
        f"restart its agent, and {FIX}"
    )
