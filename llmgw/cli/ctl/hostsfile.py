"""The hosts file of ``llmgw ctl onboard --hosts FILE``: which node is on which machine, and
what differs per host.

Two shapes. Lines of ``NODE [USER@]HOST[:PORT]`` (``#`` starts a comment)::

    gpu-01 root@10.0.0.11
    gpu-02 ops@10.0.0.12:2222

or a YAML list of mappings, each with ``node`` and ``ssh`` and any of the per-host options
(those of the command line, spelt with underscores; a list for a repeatable one)::

    - node: gpu-01
      ssh: root@10.0.0.11
      fabric: [ib0:mlx5_0]
    - node: gpu-02
      ssh: ops@10.0.0.12
      sudo: true
      identity: ~/.ssh/rack7

A per-host option replaces the command line's of the same name for that host. Everything is
checked before any host is touched: one bad entry refuses the whole file, naming its line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw.errors import ConfigError
from llmgw.netaddr import validate_node_id
from llmgw.ssh import parse_destination

__all__ = ["FACT_KEYS", "HOST_KEYS", "HostEntry", "parse_hosts", "read_hosts"]

# The node facts a host may set, by key, and whether each is repeatable (a list).
FACT_KEYS: dict[str, bool] = {
    "fabric": True,
    "nvidia_smi": False,
    "ib_root": False,
    "engine": True,
    "models_root": False,
    "cache_root": False,
    "firewall_from": True,
    "fabric_peers": True,
    "node_address": False,
    "mgmt_interface": False,
}
# The ssh options a host may set, and their types.
HOST_KEYS: dict[str, type] = {
    "port": int,
    "identity": str,
    "ssh_option": list,
    "sudo": bool,
}


@dataclass(frozen=True)
class HostEntry:
    """One host of the file: its node id, where to ssh, and the options it sets itself
    (``settings``: HOST_KEYS and FACT_KEYS keys; a repeatable one as a tuple)."""

    node: str
    user: str | None
    host: str
    port: int | None
    line: int
    settings: Mapping[str, Any] = field(default_factory=dict)


def read_hosts(path: Path) -> list[HostEntry]:
    """The file's entries; ConfigError naming the file (and the line) when it is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the hosts file: {exc.strerror}; give a readable file of "
            "'NODE [USER@]HOST[:PORT]' lines or a YAML list",
            file=str(path),
        ) from None
    except UnicodeDecodeError:
        raise ConfigError("is not UTF-8 text; write it as plain text", file=str(path)) from None
    return parse_hosts(text, name=str(path))


def parse_hosts(text: str, *, name: str = "hosts file") -> list[HostEntry]:
    """``text`` as lines or as a YAML list (the first line that is not blank nor a comment
    starting with ``-`` says which)."""
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in meaningful if not line.startswith("#")), None)
    if first is None:
        raise ConfigError("lists no host; write one 'NODE [USER@]HOST[:PORT]' per line", file=name)
    entries = _from_yaml(text, name) if first.startswith("-") else _from_lines(text, name)
    seen: dict[str, int] = {}
    for entry in entries:
        if entry.node in seen:
            raise ConfigError(
                f"line {entry.line}: node {entry.node} is listed already (line "
                f"{seen[entry.node]}); a node is on one host: remove one of them",
                file=name,
            )
        seen[entry.node] = entry.line
    return entries


def _from_lines(text: str, name: str) -> list[HostEntry]:
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if len(words) != 2:
            raise ConfigError(
                f"line {number}: {line!r} is not 'NODE [USER@]HOST[:PORT]' (two words); per-host "
                "options need the YAML form (a list of {node: ..., ssh: ...})",
                file=name,
            )
        entries.append(_entry(words[0], words[1], number, {}, name))
    return entries


def _from_yaml(text: str, name: str) -> list[HostEntry]:
    try:
        nodes = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"is not valid YAML ({exc}); fix it, or use plain lines", file=name
        ) from None
    if not isinstance(data, list) or nodes is None:
        raise ConfigError("must be a YAML list of {node: ..., ssh: ...} mappings", file=name)
    entries = []
    for item, node in zip(data, nodes.value, strict=True):
        number = node.start_mark.line + 1
        if not isinstance(item, dict):
            raise ConfigError(
                f"line {number}: each entry is a mapping with node and ssh, e.g. "
                "{node: gpu-01, ssh: root@10.0.0.11}",
                file=name,
            )
        missing = [k for k in ("node", "ssh") if not isinstance(item.get(k), str)]
        if missing:
            raise ConfigError(
                f"line {number}: the entry has no {' or '.join(missing)} (a string); every "
                "entry names its node and its [USER@]HOST[:PORT]",
                file=name,
            )
        settings = _settings(
            {k: v for k, v in item.items() if k not in ("node", "ssh")}, number, name
        )
        entries.append(_entry(item["node"], item["ssh"], number, settings, name))
    return entries


def _settings(given: Mapping[str, Any], number: int, name: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for key, value in given.items():
        if key in FACT_KEYS:
            if FACT_KEYS[key]:
                values = value if isinstance(value, list) else [value]
                if not all(isinstance(v, str) for v in values):
                    raise ConfigError(
                        f"line {number}: {key} takes strings (a list of them, or one)", file=name
                    )
                settings[key] = tuple(values)
            elif isinstance(value, str):
                settings[key] = value
            else:
                raise ConfigError(f"line {number}: {key} takes one string", file=name)
        elif key in HOST_KEYS:
            want = HOST_KEYS[key]
            if want is list:
                values = value if isinstance(value, list) else [value]
                if not all(isinstance(v, str) for v in values):
                    raise ConfigError(
                        f"line {number}: ssh_option takes K=V strings, e.g. [ConnectTimeout=20]",
                        file=name,
                    )
                settings[key] = tuple(values)
            elif isinstance(value, want) and not (want is int and isinstance(value, bool)):
                settings[key] = value
            else:
                raise ConfigError(
                    f"line {number}: {key} takes a {want.__name__}, got {value!r}", file=name
                )
        else:
            known = ", ".join(["node", "ssh", *HOST_KEYS, *FACT_KEYS])
            raise ConfigError(
                f"line {number}: unknown key {key!r}; an entry may have {known}", file=name
            )
    return settings


def _entry(node: str, ssh: str, number: int, settings: dict[str, Any], name: str) -> HostEntry:
    try:
        validate_node_id(node)
        user, host, port = parse_destination(ssh)
    except ConfigError as exc:
        raise ConfigError(f"line {number}: {exc}", file=name) from None
    if port is not None and "port" in settings and settings["port"] != port:
        raise ConfigError(
            f"line {number}: the port is given twice ({ssh} and port: {settings['port']}); "
            "give it once",
            file=name,
        )
    if "port" in settings:
        port = settings.pop("port")
        if not 1 <= port <= 65535:
            raise ConfigError(f"line {number}: port {port} is not from 1 to 65535", file=name)
    return HostEntry(node=node, user=user, host=host, port=port, line=number, settings=settings)
