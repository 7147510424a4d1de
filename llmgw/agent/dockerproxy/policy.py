"""What the Docker socket proxy lets through: the calls llmgw's docker runtime makes, and no
container that could reach the host.

Membership of the ``docker`` group is root on the host (``docker run --privileged -v /:/h``).
The proxy hands the agent a socket of its own on which only these calls pass (any
``/v1.NN`` prefix first taken off):

    GET|HEAD /_ping, GET /version            the API version the SDK asks for
    POST     /containers/create              only a body this module accepts (below)
    GET      /containers/json                only with a label filter on llmgw.shard
    GET      /containers/{id}/json           \\
    GET      /containers/{id}/logs            |
    POST     /containers/{id}/start|stop|kill|wait  only for a container that carries the
    DELETE   /containers/{id}                /  llmgw.shard label (checked by the relay)

A container may be created when it carries llmgw's labels (``llmgw.node``, ``llmgw.shard``) and
nothing that reaches the host: not privileged, no added capabilities, no devices but GPUs by a
device request, no host PID/IPC/UTS/user/cgroup namespace, no security option but
no-new-privileges, no sysctls, ports published on 127.0.0.1 only (1024 and up), the host's
network only when allowed (multi-node shards run there) and with NET_RAW and NET_BIND_SERVICE
dropped, and bind mounts only read-only under a configured root whose parents only root can
change. Everything else is refused with the reason.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl

__all__ = [
    "LABEL_NODE",
    "LABEL_SHARD",
    "Policy",
    "Refused",
    "Route",
    "check_create",
    "check_list",
    "is_llmgw_container",
    "load_body",
    "route",
]

# The labels of llmgw's docker runtime (llmgw.agent.runtimes.containers), copied so that the
# proxy, which holds dockerd's socket, imports nothing of the agent's.
# tests/unit/agent/test_dockerproxy.py checks they agree.
LABEL_NODE = "llmgw.node"
LABEL_SHARD = "llmgw.shard"

_VERSION_PREFIX = re.compile(r"/v[0-9]+\.[0-9]+(?=/)")
_REF = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_NETWORK_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")
_CONTAINER_OPS = {
    ("GET", "json"),
    ("GET", "logs"),
    ("POST", "start"),
    ("POST", "stop"),
    ("POST", "kill"),
    ("POST", "wait"),
}
_LOOPBACK = "127.0.0.1"
_HEX = re.compile(r"[0-9a-f]+")
_HOST_NETWORK_DROPS = {"NET_RAW", "NET_BIND_SERVICE"}
# The query parameters each call may carry (what the docker SDK and CLI send); any other, e.g.
# start's checkpoint-dir (a host path), is refused.
_QUERY: dict[str, set[str]] = {
    "pass": set(),
    "create": {"name", "platform"},
    "list": {"all", "filters", "limit", "size", "trunc_cmd", "before", "since"},
    "json": {"size"},
    "logs": {"follow", "stdout", "stderr", "since", "until", "timestamps", "tail", "details"},
    "start": set(),
    "stop": {"t", "signal"},
    "kill": {"signal"},
    "wait": {"condition"},
    "remove": {"v", "force", "link"},
}
_DEVICE_REQUEST_KEYS = {"Driver", "Count", "DeviceIDs", "Capabilities", "Options"}
_GPU_CAPABILITIES = {"gpu", "compute", "utility", "graphics", "video", "display", "compat32"}


class Refused(Exception):
    """A call the proxy does not forward; the message says what was refused and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Policy:
    """What a node allows beyond the default: the roots bind mounts may come from (none: no
    bind mount), and whether containers may use the host's network (multi-node shards do)."""

    bind_roots: tuple[Path, ...] = ()
    host_network: bool = True


@dataclass(frozen=True)
class Route:
    """An allowed call: ``kind`` is "pass" (forwarded as it is), "create", "list", or
    "container" (an operation on ``container``, which must be llmgw's); ``path`` is the path
    without its version prefix."""

    kind: str
    path: str
    container: str | None = None
    operation: str = ""


def route(method: str, target: str) -> Route:
    """The route of a request line's method and target (path and query), or :class:`Refused`."""
    found = _route(method, target)
    path, _, query = target.partition("?")
    if ";" in query:  # Go's query parser drops such a pair where Python's keeps it
        raise Refused(f"{method} {path}: a ';' in the query is refused; separate with '&'")
    names = [name for name, _ in parse_qsl(query, keep_blank_values=True)]
    unknown = set(names) - _QUERY[found.operation or found.kind]
    if unknown:
        raise Refused(
            f"{method} {path}: the parameter(s) {', '.join(sorted(unknown))} "
            "are not allowed on this socket"
        )
    # dockerd reads the first of a repeated parameter, where a check may have read another
    # (a blank 'filters' first, the label filter second, listed every container).
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise Refused(
            f"{method} {path}: the parameter(s) {', '.join(repeated)} are given more than once; "
            "give each once"
        )
    return found


def _route(method: str, target: str) -> Route:
    path = target.split("?", 1)[0]
    bare = _VERSION_PREFIX.sub("", path, count=1) if _VERSION_PREFIX.match(path) else path
    if (
        "%" in bare
        or "//" in bare
        or "/./" in bare
        or "/../" in bare
        or bare.endswith(("/.", "/.."))
    ):
        raise Refused(f"{method} {path}: an encoded or unnormalised path is refused")
    if method in ("GET", "HEAD") and bare == "/_ping":
        return Route("pass", bare)
    if method == "GET" and bare == "/version":
        return Route("pass", bare)
    if method == "POST" and bare == "/containers/create":
        return Route("create", bare)
    if method == "GET" and bare == "/containers/json":
        return Route("list", bare)
    match = re.fullmatch(rf"/containers/({_REF})(?:/([a-z]+))?", bare)
    if match:
        ref, operation = match.group(1), match.group(2)
        if operation is None and method == "DELETE":
            return Route("container", bare, container=ref, operation="remove")
        if operation is not None and (method, operation) in _CONTAINER_OPS:
            return Route("container", bare, container=ref, operation=operation)
    raise Refused(
        f"{method} {path} is not a call llmgw's docker runtime makes; this socket allows only "
        "ping, version, and create/start/stop/kill/wait/logs/inspect/list/remove of llmgw's "
        "containers"
    )


def check_list(target: str) -> None:
    """A container list must ask for llmgw's containers only (a label filter on llmgw.shard)."""
    query = target.split("?", 1)[1] if "?" in target else ""
    # Blank values kept: a blank 'filters' is one dockerd reads (and ignores) all the same.
    raw = parse_qs(query, keep_blank_values=True).get("filters", [])
    # dockerd reads the first 'filters' only: one more could hide the label filter from it.
    for text in raw[:1] if len(raw) == 1 else ():
        try:
            filters = json.loads(text)
        except ValueError:
            break
        labels = filters.get("label") if isinstance(filters, dict) else None
        if isinstance(labels, dict):  # the older {"label": {"k=v": true}} form
            labels = [k for k, v in labels.items() if v]
        if isinstance(labels, list) and any(
            isinstance(x, str) and (x == LABEL_SHARD or x.startswith(LABEL_SHARD + "="))
            for x in labels
        ):
            return
    raise Refused(
        f"listing containers needs a label filter on {LABEL_SHARD} (filters="
        f'{{"label": ["{LABEL_SHARD}"]}}): this socket shows llmgw\'s containers only'
    )


def is_llmgw_container(attrs: Mapping[str, Any]) -> bool:
    """Whether an inspected container carries llmgw's shard label."""
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return bool(labels.get(LABEL_SHARD))


# ------------------------------------------------------------------------------ create


def _empty(value: object) -> bool:
    return (
        value is None or value is False or value == 0 or value == "" or value == [] or value == {}
    )


def _refuse(key: str, why: str) -> Refused:
    return Refused(f"container create refused: HostConfig.{key} {why}")


def _must_be_empty(why: str) -> Callable[[object, Mapping[str, Any], Policy], None]:
    def check(value: object, host: Mapping[str, Any], policy: Policy) -> None:
        if not _empty(value):
            raise Refused(why)

    return check


def _one_of(
    key: str, allowed: Iterable[str]
) -> Callable[[object, Mapping[str, Any], Policy], None]:
    accepted = set(allowed)

    def check(value: object, host: Mapping[str, Any], policy: Policy) -> None:
        if value is None or (isinstance(value, str) and value in accepted):
            return
        raise _refuse(key, f"{value!r} is not allowed (allowed: {', '.join(sorted(accepted))})")

    return check


def _anything(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    return None


def _absent(key: str, why: str) -> Callable[[object, Mapping[str, Any], Policy], None]:
    # Present even as an empty list it changes what dockerd does (an empty MaskedPaths unmasks
    # /proc/kcore; an empty ReadonlyPaths makes /proc/sysrq-trigger writable).
    def check(value: object, host: Mapping[str, Any], policy: Policy) -> None:
        if value is not None:
            raise _refuse(key, why)

    return check


def _network_mode(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    _check_network("NetworkMode", value, host, policy)


def _check_network(key: str, value: object, host: Mapping[str, Any], policy: Policy) -> None:
    if value is None or value in ("", "default", "bridge", "none"):
        return
    if not isinstance(value, str):
        raise _refuse(key, f"must be a network name, not {value!r}")
    if value == "host":
        if not policy.host_network:
            raise _refuse(
                key,
                "'host' is not allowed on this node (the proxy runs with --no-host-network); "
                "multi-node shards need it: drop that option",
            )
        if not _empty(host.get("PortBindings")) or host.get("PublishAllPorts"):
            raise _refuse(key, "'host' goes without published ports")
        # In the host's network namespace these would sniff or spoof the host's traffic and
        # take its ports below 1024; engines need neither.
        dropped = {
            str(c).upper().removeprefix("CAP_") for c in _items("CapDrop", host.get("CapDrop"))
        }
        if "ALL" not in dropped and not _HOST_NETWORK_DROPS <= dropped:
            raise _refuse(
                key,
                f"'host' needs CapDrop {sorted(_HOST_NETWORK_DROPS)} (raw sockets and low ports "
                "on the host's own interfaces)",
            )
        return
    if value.startswith("container:") or not _NETWORK_NAME.fullmatch(value):
        raise _refuse(key, f"{value!r} is not allowed: another container's or no network name")
    if _HEX.fullmatch(value):
        # dockerd takes a network id prefix too, and one could be the host network's.
        raise _refuse(key, f"{value!r} could be a network id; name the network by its name")


def _exact_keys(where: str, value: object, allowed: set[str]) -> None:
    """Only these exact keys in ``value`` (dockerd would read 'hostip' as HostIp too)."""
    if isinstance(value, Mapping):
        for key in value:
            if key not in allowed:
                raise Refused(f"container create refused: {where}.{key} is not allowed")


def _port_bindings(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    if _empty(value):
        return
    if not isinstance(value, Mapping):
        raise _refuse("PortBindings", f"must be a mapping, not {value!r}")
    for port, binds in value.items():
        for bind in _items("PortBindings", binds):
            if not isinstance(bind, Mapping):
                raise _refuse("PortBindings", f"has {bind!r}, not a binding")
            _exact_keys("HostConfig.PortBindings", bind, {"HostIp", "HostPort"})
            address = bind.get("HostIp")
            if address != _LOOPBACK:
                raise _refuse(
                    "PortBindings",
                    f"publishes {port} on {address or 'every address'!r}: only {_LOOPBACK} is "
                    "allowed (the agent's data plane is the way in from other hosts)",
                )
            host_port = str(bind.get("HostPort") or "")
            if not host_port.isdigit() or not 1024 <= int(host_port) <= 65535:
                raise _refuse(
                    "PortBindings",
                    f"publishes {port} on host port {host_port or '(any)'!r}: give one from 1024 "
                    "to 65535",
                )


def _restart_policy(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    _exact_keys("HostConfig.RestartPolicy", value, {"Name", "MaximumRetryCount"})
    name = value.get("Name") if isinstance(value, Mapping) else value
    if not _empty(name) and name != "no":
        raise _refuse("RestartPolicy", f"{name!r} is not allowed: the agent restarts its engines")


def _device_requests(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    if _empty(value):
        return
    if not isinstance(value, list):
        raise _refuse("DeviceRequests", f"must be a list, not {value!r}")
    for request in value:
        if not isinstance(request, Mapping):
            raise _refuse("DeviceRequests", f"has {request!r}, not a device request")
        _exact_keys("HostConfig.DeviceRequests", request, _DEVICE_REQUEST_KEYS)
        capabilities = request.get("Capabilities") or []
        flat = {
            c if isinstance(c, str) else repr(c)
            for group in capabilities
            if isinstance(group, list)
            for c in group
        }
        if (
            not capabilities
            or not all(isinstance(g, list) and "gpu" in g for g in capabilities)
            or not flat <= _GPU_CAPABILITIES
        ):
            raise _refuse("DeviceRequests", f"asks for {capabilities!r}: only GPUs (['gpu'])")
        if request.get("Driver") not in (None, "", "nvidia"):
            raise _refuse("DeviceRequests", f"names the driver {request.get('Driver')!r}")
        if not _empty(request.get("Options")):
            raise _refuse("DeviceRequests", "carries driver options")


def _items(key: str, value: object) -> list[object]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _refuse(key, f"must be a list, not {value!r}")
    return value


def _security_opt(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    for option in _items("SecurityOpt", value):
        if option not in ("no-new-privileges", "no-new-privileges:true", "no-new-privileges=true"):
            raise _refuse(
                "SecurityOpt",
                f"{option!r} is not allowed (only no-new-privileges); "
                "seccomp, AppArmor and SELinux stay as dockerd sets them",
            )


def _oom_score(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    if isinstance(value, int) and value < 0:
        raise _refuse("OomScoreAdj", f"{value} would protect the container over the host")


def _log_config(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    _exact_keys("HostConfig.LogConfig", value, {"Type", "Config"})
    kind = value.get("Type") if isinstance(value, Mapping) else None
    if kind not in (None, "", "json-file", "local", "journald"):
        raise _refuse("LogConfig", f"the log driver {kind!r} is not allowed")


def _binds(value: object, host: Mapping[str, Any], policy: Policy) -> None:
    for bind in _items("Binds", value):
        if not isinstance(bind, str):
            raise _refuse("Binds", f"has {bind!r}, not SOURCE:TARGET[:OPTIONS]")
        reason = bind_problem(bind, policy.bind_roots)
        if reason:
            raise _refuse("Binds", f"{bind!r}: {reason}")


def bind_problem(bind: str, roots: Iterable[Path]) -> str | None:
    """Why ``bind`` (SOURCE:TARGET[:OPTIONS]) may not be mounted, or None when it may: read-only,
    from under one of ``roots``, with no symbolic link on its path and every directory above
    it root's and writable by nobody else (or sticky, above an entry of root's), so that what
    was checked is what dockerd mounts when the container starts."""
    roots = tuple(roots)
    parts = bind.split(":")
    source = parts[0]
    options = parts[2].split(",") if len(parts) > 2 else []
    if not roots:
        return "bind mounts are not allowed on this node (the proxy has no --bind-root)"
    if not source.startswith("/"):
        return "named volumes are not allowed; only a host directory under " + _roots(roots)
    if os.path.normpath(source) != source:
        return "the source path is not normalised"
    if "ro" not in options or "rw" in options:
        return "must be read-only (add ':ro', and no 'rw')"
    path = Path(source)
    if not any(path == root or root in path.parents for root in roots):
        return f"{source} is not under {_roots(roots)}"
    current = Path("/")
    try:
        info = current.lstat()
    except OSError as exc:
        return f"cannot check /: {exc.strerror}"
    for name in path.parts[1:]:
        child = current / name
        try:
            child_info = child.lstat()
        except OSError as exc:
            return f"cannot check {child}: {exc.strerror}"
        if stat.S_ISLNK(child_info.st_mode):
            return f"{child} is a symbolic link"
        # Others may write a sticky directory (/tmp) but not rename or remove root's entries.
        shared = info.st_mode & 0o022 and not (
            info.st_mode & stat.S_ISVTX and child_info.st_uid == 0
        )
        if info.st_uid != 0 or shared:
            return (
                f"{current} can be changed by another user than root (owner uid {info.st_uid}, "
                f"mode {stat.filemode(info.st_mode)}): a link swapped in there would be mounted; "
                "bind the directory itself or make its parents root's"
            )
        current, info = child, child_info
    return None


def _roots(roots: tuple[Path, ...]) -> str:
    return ", ".join(str(r) for r in roots)


_HARMLESS = (
    "ContainerIDFile", "AutoRemove", "Init", "ReadonlyRootfs", "ShmSize", "Tmpfs",
    "Dns", "DnsOptions", "DnsSearch", "ExtraHosts", "Ulimits", "ConsoleSize", "CapDrop",
    "OomKillDisable", "Memory", "MemoryReservation", "MemorySwap", "MemorySwappiness",
    "KernelMemory", "KernelMemoryTCP", "NanoCpus", "CpuShares", "CpuPeriod", "CpuQuota",
    "CpuRealtimePeriod", "CpuRealtimeRuntime", "CpusetCpus", "CpusetMems", "CpuCount",
    "CpuPercent", "PidsLimit", "BlkioWeight", "BlkioWeightDevice", "BlkioDeviceReadBps",
    "BlkioDeviceWriteBps", "BlkioDeviceReadIOps", "BlkioDeviceWriteIOps",
    "IOMaximumIOps", "IOMaximumBandwidth",
)  # fmt: skip

_HOST_RULES: dict[str, Callable[[object, Mapping[str, Any], Policy], None]] = {
    "Privileged": _must_be_empty(
        "container create refused: HostConfig.Privileged: a privileged container is root on the "
        "host"
    ),
    "CapAdd": _must_be_empty(
        "container create refused: HostConfig.CapAdd: no capability may be added"
    ),
    "Devices": _must_be_empty(
        "container create refused: HostConfig.Devices: no device nodes; GPUs come by a device "
        "request (DeviceRequests)"
    ),
    "DeviceCgroupRules": _must_be_empty(
        "container create refused: HostConfig.DeviceCgroupRules: no device access rules"
    ),
    "DeviceRequests": _device_requests,
    "PidMode": _must_be_empty(
        "container create refused: HostConfig.PidMode: no host or shared PID namespace"
    ),
    "IpcMode": _one_of("IpcMode", ("", "private", "shareable", "none")),
    "UTSMode": _must_be_empty(
        "container create refused: HostConfig.UTSMode: no host UTS namespace"
    ),
    "UsernsMode": _must_be_empty(
        "container create refused: HostConfig.UsernsMode: no host user namespace"
    ),
    "CgroupnsMode": _one_of("CgroupnsMode", ("", "private")),
    "NetworkMode": _network_mode,
    "PortBindings": _port_bindings,
    "PublishAllPorts": _must_be_empty(
        "container create refused: HostConfig.PublishAllPorts: it publishes on every address"
    ),
    "Binds": _binds,
    "Mounts": _must_be_empty(
        "container create refused: HostConfig.Mounts: no mounts; read-only Binds under a "
        "--bind-root only"
    ),
    "VolumesFrom": _must_be_empty("container create refused: HostConfig.VolumesFrom: not allowed"),
    "VolumeDriver": _must_be_empty(
        "container create refused: HostConfig.VolumeDriver: not allowed"
    ),
    "Links": _must_be_empty("container create refused: HostConfig.Links: not allowed"),
    "SecurityOpt": _security_opt,
    "Sysctls": _must_be_empty("container create refused: HostConfig.Sysctls: not allowed"),
    "CgroupParent": _must_be_empty(
        "container create refused: HostConfig.CgroupParent: not allowed"
    ),
    "Cgroup": _must_be_empty("container create refused: HostConfig.Cgroup: not allowed"),
    "Runtime": _one_of("Runtime", ("", "runc", "nvidia")),
    "LogConfig": _log_config,
    "MaskedPaths": _absent("MaskedPaths", "must be left out: it would unmask /proc paths"),
    "ReadonlyPaths": _absent("ReadonlyPaths", "must be left out: it would make /proc writable"),
    "OomScoreAdj": _oom_score,
    "GroupAdd": _must_be_empty("container create refused: HostConfig.GroupAdd: not allowed"),
    "RestartPolicy": _restart_policy,
    "Isolation": _one_of("Isolation", ("", "default")),
    "Annotations": _must_be_empty("container create refused: HostConfig.Annotations: not allowed"),
    # What cannot reach the host: limits, the container's own files, names and addresses.
    **dict.fromkeys(_HARMLESS, _anything),
}

_CONFIG_KEYS = {
    "Hostname", "Domainname", "User", "AttachStdin", "AttachStdout", "AttachStderr",
    "ExposedPorts", "Tty", "OpenStdin", "StdinOnce", "Env", "Cmd", "Healthcheck", "ArgsEscaped",
    "Image", "Volumes", "WorkingDir", "Entrypoint", "NetworkDisabled", "MacAddress", "OnBuild",
    "Labels", "StopSignal", "StopTimeout", "Shell", "HostConfig", "NetworkingConfig",
}  # fmt: skip


def load_body(raw: bytes) -> object:
    """A create body parsed as dockerd will read it, or :class:`Refused`. A key twice in one
    object is refused: Python keeps the last value, but Go's encoding/json decodes a repeated
    object into the struct it already filled, so '"HostConfig": {"Privileged": true, ...},
    "HostConfig": {}' would pass the checks below (which see only {}) and reach dockerd as a
    privileged container. Keys that differ only in case are refused too (Go matches field
    names case-insensitively)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            folded = key.casefold()
            if folded in seen:
                raise Refused(
                    f"container create refused: the key {key!r} appears twice in one object "
                    "(dockerd would merge the two)"
                )
            seen.add(folded)
        return dict(items)

    try:
        return json.loads(raw or b"null", object_pairs_hook=pairs)
    except ValueError as exc:
        raise Refused("container create refused: the body is not JSON") from exc


def check_create(body: object, policy: Policy) -> None:
    """Accept a container-create body, or raise :class:`Refused` saying what is not allowed."""
    if not isinstance(body, Mapping):
        raise Refused("container create refused: the body is not a JSON object")
    # dockerd decodes JSON keys case-insensitively, the last of two spellings winning: every
    # key must be one of the exact names checked here, so that none is read past.
    for key in body:
        if key not in _CONFIG_KEYS:
            raise Refused(f"container create refused: {key} is not allowed on this socket")
    labels = body.get("Labels") or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(labels.get(k), str) and labels.get(k) for k in (LABEL_NODE, LABEL_SHARD)
    ):
        raise Refused(
            f"container create refused: a container needs llmgw's labels ({LABEL_NODE}, "
            f"{LABEL_SHARD}); this socket creates llmgw's engine containers only"
        )
    host = body.get("HostConfig") or {}
    if not isinstance(host, Mapping):
        raise Refused("container create refused: HostConfig is not a JSON object")
    for key, value in host.items():
        rule = _HOST_RULES.get(key)
        if rule is None:
            raise _refuse(key, "is not allowed on this socket")
        rule(value, host, policy)
    networking = body.get("NetworkingConfig") or {}
    _exact_keys("NetworkingConfig", networking, {"EndpointsConfig"})
    endpoints = networking.get("EndpointsConfig") if isinstance(networking, Mapping) else None
    for name in endpoints or {}:
        _check_network("NetworkingConfig.EndpointsConfig", name, host, policy)
