"""Network names and addresses: ``host:port``, host names, this machine's addresses, node ids.

The one ``host:port`` parser of llmgw (config files, ``dist_init_addr``, rendezvous and
llama.cpp RPC peers, enrolment answers): IPv6 in brackets, host names checked, ports
1-65535 (0 where a listener may pick one). Node ids are DNS names that can go into a
certificate and can never be mistaken for the control plane (``llmgw-`` is reserved).
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from llmgw.errors import ConfigError

__all__ = [
    "CONTROL_PLANE_NAME",
    "LOOPBACK_HOSTS",
    "RESERVED_NAMES",
    "RESERVED_PREFIX",
    "check_node_id_free",
    "format_hostport",
    "interface_address",
    "is_hostname",
    "is_ip_address",
    "is_loopback_host",
    "local_addresses",
    "parse_host",
    "parse_hostport",
    "validate_node_id",
]

CONTROL_PLANE_NAME = "llmgw-control-plane"
"""DNS SAN of every control-plane certificate (llmgw.pki); never a node id."""
RESERVED_NAMES = frozenset({CONTROL_PLANE_NAME})
RESERVED_PREFIX = "llmgw-"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?")
_NODE_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")
_CERT_HOST = re.compile(r"[A-Za-z0-9_*.-]+")
_IF_INET6 = Path("/proc/net/if_inet6")
_SIOCGIFADDR = 0x8915
# /proc/net/if_inet6's scope field for global addresses (ULAs included), and the flags of an
# address that cannot be used yet or any longer: tentative (DAD running), deprecated, DAD
# failed.
_SCOPE_GLOBAL = 0x00
_IFA_UNUSABLE = 0x40 | 0x20 | 0x08
_NODE_ID_RULE = (
    "a node id must be a DNS name: lowercase letters, digits, '-' and '.', labels of 1-63 "
    "characters that neither start nor end with '-', at most 253 characters in all, not an IP "
    "address, not 'localhost', and not starting with 'llmgw-' (reserved)"
)


# -- host:port ---------------------------------------------------------------------------------


def is_hostname(value: str) -> bool:
    """True for a DNS-style host name: dot-separated labels of 1-63 letters, digits, '-' or
    '_' (not starting or ending with '-'), at most 253 characters."""
    if not value or len(value) > 253:
        return False
    return all(len(label) <= 63 and _LABEL.fullmatch(label) for label in value.split("."))


def is_ip_address(value: str) -> bool:
    """True for an IPv4 or IPv6 address (without brackets)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _check_host(host: str, value: str) -> None:
    if is_ip_address(host):
        return
    if all(label.isdigit() for label in host.split(".")):
        raise ConfigError(f"{host!r} in {value!r} is not a valid IPv4 address")
    if not is_hostname(host):
        raise ConfigError(
            f"{host!r} in {value!r} is not a valid host name or IP address "
            "(letters, digits, '-', '_' and '.', labels of 1-63 characters)"
        )


def parse_hostport(
    value: str,
    *,
    default_port: int | None = None,
    allow_zero: bool = False,
    what: str | None = None,
) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:7443``) into ``(host, port)``.

    A bare host gets ``default_port``; without one the port is required. IPv6 hosts are
    returned without brackets. ``allow_zero`` admits port 0 (listen on a free port).
    Raises :class:`ConfigError`; ``what`` (e.g. ``"dist_init_addr"``) is put before the
    message, else it has no key or file (callers that know them, like the config
    ``Checker``, add them)."""
    try:
        return _parse_hostport(value, default_port=default_port, allow_zero=allow_zero)
    except ConfigError as exc:
        if what is None:
            raise
        raise ConfigError(f"{what}: {exc.message}") from None


def _parse_hostport(value: str, *, default_port: int | None, allow_zero: bool) -> tuple[str, int]:
    if not isinstance(value, str):
        raise ConfigError(f"must be a string host:port, got {type(value).__name__}")
    text = value.strip()
    if not text:
        raise ConfigError("is empty; give host:port, e.g. 10.0.0.1:7443")
    port_text: str | None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{value!r} has '[' without ']'; write IPv6 as [::1]:7443")
        host = text[1:close]
        rest = text[close + 1 :]
        if rest == "":
            port_text = None
        elif rest.startswith(":"):
            port_text = rest[1:]
        else:
            raise ConfigError(f"{value!r}: expected ':port' after ']', got {rest!r}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(
                f"{host!r} in {value!r} is not an IPv6 address; brackets are only for IPv6"
            ) from None
    elif text.count(":") > 1:
        raise ConfigError(f"{value!r}: an IPv6 address needs brackets, e.g. [::1]:7443")
    else:
        host, sep, port_part = text.partition(":")
        port_text = port_part if sep else None
        if not host:
            raise ConfigError(f"{value!r} has no host; to listen on every address use 0.0.0.0")
        _check_host(host, value)
    if port_text is None:
        if default_port is None:
            raise ConfigError(f"{value!r} has no port; give host:port")
        return host, default_port
    lowest = 0 if allow_zero else 1
    if not _PORT.fullmatch(port_text) or not lowest <= int(port_text) <= 65535:
        raise ConfigError(
            f"port {port_text!r} in {value!r} must be a number from {lowest} to 65535"
            + (" (0: pick a free port)" if allow_zero else "")
        )
    return host, int(port_text)


def format_hostport(host: str, port: int) -> str:
    """The inverse of :func:`parse_hostport`: brackets around IPv6 hosts."""
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` as written (brackets allowed) is reached from this machine alone:
    ``localhost``, 127.0.0.0/8, ``::1`` or an IPv4-mapped loopback address. No name is
    resolved: what a name resolves to can change between the check and its use."""
    bare = host.strip().strip("[]").split("%", 1)[0].rstrip(".").lower()
    if bare == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def parse_host(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str | None:
    """A name a certificate can carry: an address (brackets and an IPv6 zone id dropped),
    or a DNS name lower-cased without its final dot (``*`` allowed, for wildcards); None
    for a blank one. ConfigError (key ``hosts``) for anything else."""
    text = host.strip()
    if not text:
        return None
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    bare = bare.split("%", 1)[0]  # an IPv6 zone id is not part of the address
    try:
        return ipaddress.ip_address(bare)
    except ValueError:
        pass
    if not text.isascii() or not _CERT_HOST.fullmatch(text) or len(text) > 253:
        raise ConfigError(
            f"{host!r} is neither an IP address nor a DNS name; "
            "give host names in ASCII (letters, digits, '-', '.')",
            key="hosts",
        )
    return text.lower().rstrip(".")


# -- node ids ----------------------------------------------------------------------------------


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` if it is a valid node id, else raise ConfigError stating the rule."""

    def bad(reason: str) -> ConfigError:
        return ConfigError(f"invalid node id {node_id!r}: {reason}; {_NODE_ID_RULE}", key="node_id")

    if not isinstance(node_id, str) or not node_id:
        raise bad("it is empty")
    if len(node_id) > 253:
        raise bad(f"it is {len(node_id)} characters long")
    if node_id != node_id.lower():
        raise bad("it contains upper-case letters")
    for label in node_id.split("."):
        if not label:
            raise bad("it has an empty label")
        if len(label) > 63:
            raise bad(f"label {label[:20]!r}... is {len(label)} characters long")
        if not _NODE_LABEL.fullmatch(label):
            raise bad(f"label {label!r} has a character or hyphen where none is allowed")
    if node_id in RESERVED_NAMES:
        raise bad("it is the name every control-plane certificate carries, so no node may take it")
    if node_id.startswith(RESERVED_PREFIX):
        raise bad(f"names starting with {RESERVED_PREFIX!r} are reserved for llmgw itself")
    if node_id == "localhost" or node_id.endswith(".localhost"):
        raise bad("'localhost' names the local machine, not a node")
    if is_ip_address(node_id):
        raise bad("it is an IP address, and TLS would check it as one")
    return node_id


def check_node_id_free(
    node_id: str, taken: Iterable[str], *, instances: Mapping[str, str] | None = None
) -> str:
    """:func:`validate_node_id`, then refuse (ConfigError) a node id among ``taken``, the names
    the control plane answers to (``pki.control_plane_names`` of its certificate), or among
    ``instances`` (name -> the id of the control-plane instance that answers to it, for the
    other instances sharing its database): a node certificate for such a name would match
    wherever an agent or an operator dials that control plane."""
    validate_node_id(node_id)
    fix = (
        "give this machine another node id (node_id in its agent.yaml, 'llmgw ctl "
        "join-command --node OTHER-ID')"
    )
    if node_id in {name.lower().rstrip(".") for name in taken}:
        raise ConfigError(
            f"invalid node id {node_id!r}: the control plane answers to that name (it is in the "
            "control plane's TLS certificate), and a node under it could pose as the control "
            f"plane; {fix}",
            key="node_id",
        )
    owner = (instances or {}).get(node_id)
    if owner is not None:
        raise ConfigError(
            f"invalid node id {node_id!r}: control-plane instance {owner} answers to that name "
            "(it is in that instance's TLS certificate), and a node under it could pose as "
            f"that instance; {fix}",
            key="node_id",
        )
    return node_id


# -- this machine ------------------------------------------------------------------------------


def _ipv4_addresses() -> list[str]:
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        return []
    return [addr for _, ifname in interfaces if (addr := _interface_ipv4(ifname)) is not None]


def _ipv6_addresses() -> list[str]:
    found: list[str] = []
    try:
        lines = _IF_INET6.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return found
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        try:
            addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        except ValueError:
            continue
        if addr.is_link_local:
            continue
        found.append(str(addr))
    return found


def _interface_ipv4(name: str) -> str | None:
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    with sock:
        request = struct.pack("256s", name.encode()[:15])
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:  # no IPv4 address on it (EADDRNOTAVAIL), or it vanished
            return None
    return socket.inet_ntoa(reply[20:24])


def _interface_ipv6(name: str) -> str | None:
    try:
        lines = _IF_INET6.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        fields = line.split()
        if len(fields) != 6 or fields[5] != name:
            continue
        try:
            addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            scope, flags = int(fields[3], 16), int(fields[4], 16)
        except ValueError:
            continue
        if scope == _SCOPE_GLOBAL and not flags & _IFA_UNUSABLE and not addr.is_link_local:
            return str(addr)
    return None


def interface_address(name: str) -> str:
    """The address of network interface ``name`` a peer should dial: its IPv4 address, else
    its first global IPv6 address (link-local ones are never it). ConfigError, saying what to
    do, when there is no such interface or it has no such address."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        try:
            present = ", ".join(sorted(n for _, n in socket.if_nameindex()))
        except OSError:
            present = "?"
        raise ConfigError(
            f"this machine has no network interface {name!r} (it has: {present}); name the "
            "one the control plane reaches this node on ('ip -brief address' lists them), or "
            "set mgmt_addr: ADDRESS instead"
        ) from None
    found = _interface_ipv4(name) or _interface_ipv6(name)
    if found is None:
        raise ConfigError(
            f"network interface {name!r} has no IPv4 or global IPv6 address (is it up and "
            f"configured? 'ip address show {name}'); give it one, name another interface, or "
            "set mgmt_addr: ADDRESS instead"
        )
    return found


def local_addresses() -> list[str]:
    """Every name and address this machine may be reached at: hostname, FQDN, each interface's
    IPv4 and IPv6 addresses (IPv6 link-local dropped) and loopback. Deduplicated, stable order;
    never raises, and leaves out names that could not go into a certificate."""
    candidates: list[str] = []
    for lookup in (socket.gethostname, socket.getfqdn):
        try:
            candidates.append(lookup())
        except (OSError, UnicodeError):
            continue
    candidates += _ipv4_addresses()
    candidates += _ipv6_addresses()
    candidates += LOOPBACK_HOSTS
    result: list[str] = []
    seen: set[object] = set()
    for candidate in candidates:
        try:
            entry = parse_host(candidate)
        except ConfigError:
            continue
        if entry is None or entry in seen:
            continue
        seen.add(entry)
        result.append(candidate.strip())
    return result
