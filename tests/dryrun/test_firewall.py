"""--firewall-from for real (Debian 12): the installer's rules in a container running
firewalld and in one with plain nft (no ufw, no firewalld running). In each: the rules are
there, :9443 is reached from the allowed source (the lab's gateway, the host) and not from
another machine on the same network, and uninstall leaves the firewall exactly as it found
it, an operator's own rules included. (ufw is the life-cycle test's firewall.)

A stand-in listener (python3 -m http.server) holds :9443: the rules are what is tested, and
an install without join options starts no agent."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab, Node

PORT = 9443
RANGE = "29500-29999"  # the multi-node range (agent.yaml's default), from the same sources
NFT_TABLE = "llmgw"
OTHER_SOURCES = ("10.99.0.0/16", "fd00:99::/64")  # allowed, but no machine of the lab is there
OPERATOR_RICH_RULE = (
    'rule family="ipv4" source address="192.0.2.0/24" port port="22" protocol="tcp" accept'
)


@dataclass
class Firewalls:
    firewalld: Node
    nft: Node
    installer: str  # install-agent.sh as the containers see it


@pytest.fixture(scope="module")
def firewalls(lab: Lab) -> Iterator[Firewalls]:
    image = systemd_image_of("bookworm")
    firewalld = lab.boot(image, "dry-firewalld")
    nft = lab.boot(image, "dry-nft")
    folder = lab.unpack(lab.bundle_n, "firewall-unpacked")
    for node in (firewalld, nft):
        node.sh(f"systemd-run --unit=probe-listener python3 -m http.server {PORT}")
        node.container.wait_for(
            f"ss -ltnH '( sport = :{PORT} )' | grep -q LISTEN", what=f"a listener on :{PORT}"
        )
    yield Firewalls(firewalld, nft, f"{folder}/install-agent.sh")


def from_host(node: Node) -> bool:
    """Whether the host (its source address on the lab network is the gateway) reaches :9443."""
    try:
        socket.create_connection((node.ip, PORT), timeout=3).close()
    except OSError:
        return False
    return True


def from_peer(peer: Node, node: Node) -> bool:
    """Whether another container of the lab network reaches ``node``'s :9443."""
    probe = (
        "python3 -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2]),"
        f" ), 3).close()' {node.ip} {PORT}"
    )
    return peer.sh(probe, check=False).returncode == 0


def install(fw: Firewalls, node: Node, *sources: str) -> str:
    flags = " ".join(f"--firewall-from {source}" for source in sources)
    result = node.sh(f"sh {fw.installer} install {flags}")
    return result.stdout + result.stderr


def firewalld_state(node: Node) -> str:
    return node.out("firewall-cmd --list-all; firewall-cmd --permanent --list-all")


def test_firewalld_rules_allow_only_the_given_sources_and_go_exactly(
    lab: Lab, firewalls: Firewalls
) -> None:
    node, peer = firewalls.firewalld, firewalls.nft
    node.sh("systemctl unmask firewalld.service && systemctl start firewalld.service")
    assert node.out("firewall-cmd --state") == "running"
    node.sh(
        f"firewall-cmd --permanent --add-rich-rule='{OPERATOR_RICH_RULE}' && firewall-cmd --reload"
    )
    before = firewalld_state(node)
    assert not from_host(node), "firewalld's public zone let :9443 in before any install"

    said = install(firewalls, node, lab.gateway, *OTHER_SOURCES)
    assert f"firewall (firewalld): :{PORT}/tcp from {lab.gateway}" in said, said
    for listing in ("firewall-cmd --list-rich-rules", "firewall-cmd --permanent --list-rich-rules"):
        rules = set(node.out(listing).splitlines())
        assert rules == {
            OPERATOR_RICH_RULE,
            *(
                f'rule family="{family}" source address="{source}" port port="{ports}" '
                'protocol="tcp" accept'
                for family, source in (
                    ("ipv4", lab.gateway),
                    ("ipv4", OTHER_SOURCES[0]),
                    ("ipv6", OTHER_SOURCES[1]),
                )
                for ports in (PORT, RANGE)
            ),
        }, listing
    assert from_host(node)
    assert not from_peer(peer, node), "a machine outside the given sources reached :9443"
    # The rules are permanent: a reload (or a reboot) keeps them.
    node.sh("firewall-cmd --reload")
    assert from_host(node)
    assert not from_peer(peer, node)
    status = node.out(f"sh {firewalls.installer} status")
    assert f"firewall:   firewalld allows :{PORT}/tcp from {lab.gateway}" in status

    node.sh(f"sh {firewalls.installer} uninstall")
    assert firewalld_state(node) == before
    assert not from_host(node)


def test_nft_rules_allow_only_the_given_sources_and_go_exactly(
    lab: Lab, firewalls: Firewalls
) -> None:
    node, peer = firewalls.nft, firewalls.firewalld
    # Neither ufw nor firewalld runs here: nft is the backend.
    assert node.out("systemctl is-active firewalld.service || true") == "inactive"
    assert node.out("ufw status") == "Status: inactive"
    # An operator's own table, which the installer must leave alone.
    node.sh(
        "nft add table inet operator && nft add chain inet operator input "
        "'{ type filter hook input priority 10; policy accept; }' && "
        "nft add rule inet operator input tcp dport 22 accept"
    )
    before = node.out("nft list ruleset")
    assert from_host(node) and from_peer(peer, node)  # no rule for :9443 yet

    said = install(firewalls, node, lab.gateway, *OTHER_SOURCES)
    assert f"firewall (nft): :{PORT}/tcp from {lab.gateway}" in said, said
    assert f"nft rules (table inet {NFT_TABLE}) do not survive a reboot" in said
    table = node.out(f"nft list table inet {NFT_TABLE}")
    accepts = [line.strip() for line in table.splitlines() if line.strip().endswith("accept")]
    assert sorted(accepts) == sorted(
        f"{family} saddr {source} tcp dport {ports} accept"
        for family, source in (
            ("ip", lab.gateway),
            ("ip", OTHER_SOURCES[0]),
            ("ip6", OTHER_SOURCES[1]),
        )
        for ports in (PORT, RANGE)
    ), table
    assert table.count(f"tcp dport {PORT} drop") == 1, table
    assert table.count(f"tcp dport {RANGE} drop") == 1, table
    assert from_host(node)
    assert not from_peer(peer, node), "a machine outside the given sources reached :9443"

    # Again with the gateway alone: the other sources' rules go, the gateway's stays.
    install(firewalls, node, lab.gateway)
    table = node.out(f"nft list table inet {NFT_TABLE}")
    assert "10.99.0.0/16" not in table and "fd00:99::" not in table, table
    assert f"ip saddr {lab.gateway} tcp dport {PORT} accept" in table
    assert from_host(node) and not from_peer(peer, node)

    node.sh(f"sh {firewalls.installer} uninstall")
    assert node.out("nft list ruleset") == before
    assert from_host(node) and from_peer(peer, node)
