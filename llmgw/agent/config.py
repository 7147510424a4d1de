"""The agent's configuration: ``agent.yaml`` (+ overrides) -> one frozen :class:`AgentConfig`.

It holds only what a node cannot find out itself (DESIGN §5). Every error names the dotted
key (``fabrics[1].hcas[0]``) and the file; nothing here touches the files it names.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from llmgw.agent.runtimes import RUNTIME_NAMES
from llmgw.bodies import (
    DEFAULT_MAX_INFLIGHT_BODY_BYTES,
    DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    parse_body_limits,
)
from llmgw.configfile import (
    Checker,
    apply_overrides,
    index_key,
    join_key,
    load_yaml,
    type_name,
    unknown_key_message,
)
from llmgw.contracts.paths import DEFAULT_AGENT_STATE_DIR
from llmgw.contracts.ports import (
    DEFAULT_DATA_PORT,
    DEFAULT_GRPC_PORT,
    DEFAULT_MULTINODE_PORTS,
    PortRange,
)
from llmgw.contracts.sources import SourcePrefix, parse_prefixes
from llmgw.engines.registry import ENGINES, engine_names
from llmgw.errors import ConfigError
from llmgw.listener import ListenerLimits, parse_listener_limits
from llmgw.netaddr import format_hostport, is_ip_address

DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_DATA_PORT}"
DEFAULT_MODELS_ROOT = Path("/srv/llmgw/models")
DEFAULT_CACHE_ROOT = Path("/srv/llmgw/cache")
DEFAULT_IB_ROOT = Path("/sys/class/infiniband")
DEFAULT_PREFETCH_RATE = 256 * 1024**2  # bytes a second
DEFAULT_PREFETCH_INTERVAL = 600.0
RESERVED_NODE_PREFIX = "llmgw-"
MAX_INTERFACE_NAME = 15  # IFNAMSIZ - 1

_NODE_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_FABRIC_NAME = re.compile(r"[a-z0-9_.-]+")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]+")

_TOP_KEYS = (
    "server",
    "servers",
    "tls",
    "node_id",
    "listen",
    "advertise",
    "mgmt_addr",
    "mgmt_interface",
    "fabrics",
    "discovery",
    "engines",
    "models_root",
    "cache_root",
    "state_dir",
    "stop_shards_on_exit",
    "sandbox",
    "runtime",
    "docker",
    "install_sources",
    "listeners",
    "max_request_body",
    "max_inflight_body_bytes",
    "max_response_body",
    "upstream_idle_timeout",
    "multinode_ports",
    "prefetch_rate",
    "prefetch_interval",
)
_TLS_KEYS = ("cert", "key", "ca")
_FABRIC_KEYS = ("name", "hcas")
_DISCOVERY_KEYS = ("nvidia_smi", "ib_root")
_ENGINE_KEYS = {e.name: (e.program_setting,) for e in ENGINES.values() if e.program_setting}
_DOCKER_KEYS = ("images", "network", "gpus", "host")
DOCKER_GPU_MODES = ("request", "env")
_IMAGE_ENGINES = engine_names()
# Docker's image reference grammar (distribution/reference): [host[:port]/]path[:tag][@digest].
_HOST_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE_REF = re.compile(rf"(?:{_DOMAIN}/)?{_PATH}(?:/{_PATH})*(?::{_TAG})?(?:@{_DIGEST})?")
_NETWORK_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


@dataclass(frozen=True)
class TLSConfig:
    """The node's identity: its certificate, its private key, and the cluster CA."""

    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class FabricConfig:
    """One InfiniBand/RoCE fabric this node is on, and the adapters that reach it."""

    name: str
    hcas: tuple[str, ...]


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where discovery looks: ``nvidia_smi`` forces the CLI over NVML when set."""

    nvidia_smi: Path | None = None
    ib_root: Path = DEFAULT_IB_ROOT


@dataclass(frozen=True)
class EnginesConfig:
    """Programs for the engines; a bare name is looked up in PATH, ``None`` means default."""

    llamacpp_bin: str | None = None
    vllm_bin: str | None = None
    sglang_python: str | None = None

    def program(self, engine: str) -> str | None:
        """The program set for ``engine`` (the field ``ENGINE_SETTING`` of its registry
        ``program_setting``); None when none is set, or the engine takes no settings."""
        setting = ENGINES[engine].program_setting
        return None if setting is None else cast(str | None, getattr(self, f"{engine}_{setting}"))


@dataclass(frozen=True)
class DockerConfig:
    """The docker runtime's settings: the image of each engine, and the network containers
    join (None: Docker's default bridge)."""

    images: dict[str, str] = field(default_factory=dict)
    network: str | None = None
    # How a shard's GPUs reach its container: "request" (a Docker device request, as
    # `docker run --gpus`; the NVIDIA Container Toolkit), or "env" (NVIDIA_VISIBLE_DEVICES,
    # for daemons whose default runtime is nvidia, e.g. nvidia-docker2 setups).
    gpus: str = "request"
    # The daemon's socket (unix:///PATH); None: DOCKER_HOST, else /var/run/docker.sock. The
    # installer's --docker points the agent at llmgw-docker-proxy's socket instead of
    # dockerd's, whose group is root on the host.
    host: str | None = None


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``agent.yaml`` says, validated; relative paths already made absolute."""

    servers: tuple[str, ...]
    tls: TLSConfig
    node_id: str
    listen: str
    advertise: str | None
    mgmt_addr: str | None
    mgmt_interface: str | None
    fabrics: tuple[FabricConfig, ...]
    discovery: DiscoveryConfig
    engines: EnginesConfig
    models_root: Path
    cache_root: Path
    state_dir: Path
    stop_shards_on_exit: bool = False
    # Process engines run in their bubblewrap sandbox: "required" (a node refuses to start an
    # engine where bubblewrap cannot run), or "if-available" (llmgw up on a developer's
    # machine: unconfined, with a warning that names the fix, where it cannot).
    sandbox: str = "required"
    runtime: str = "process"
    docker: DockerConfig = field(default_factory=DockerConfig)
    # Where engine installs may download from besides https:// (llmgw.contracts.sources).
    install_sources: tuple[SourcePrefix, ...] = ()
    # Slow clients on the data plane: header and TLS handshake timeouts.
    listeners: ListenerLimits = field(default_factory=ListenerLimits)
    # Data-plane bodies: the request limit when the gateway names none (it sends the model's
    # own), the body bytes held at once (over it: 503), the largest engine answer read whole,
    # and how long an engine may send nothing while an answer is due.
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES
    max_response_body: int = DEFAULT_MAX_RESPONSE_BODY
    upstream_idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT
    # Where this node's shards of a multi-node replica meet the other nodes' (rank 0's
    # dist-init port, a llama.cpp worker's rpc-server endpoint): reported in the inventory,
    # placed inside by the control plane, opened in the firewall by the installer.
    multinode_ports: PortRange = DEFAULT_MULTINODE_PORTS
    # Keeping the sources of models with prefetch: true in the page cache
    # (llmgw.agent.warming): bytes read a second at most, and how often each is read again.
    prefetch_rate: int = DEFAULT_PREFETCH_RATE
    prefetch_interval: float = DEFAULT_PREFETCH_INTERVAL
    source: Path | None = None


def node_id_problem(node_id: str) -> str | None:
    """Why ``node_id`` cannot be a node id, or ``None`` when it can."""
    rule = (
        "a node id is a DNS name: lowercase letters, digits, '-' and '.', labels of 1-63 "
        "characters that do not start or end with '-', at most 253 characters in all"
    )
    if not node_id:
        return f"must not be empty; {rule}"
    if len(node_id) > 253:
        return f"{node_id[:40]!r}... is {len(node_id)} characters; {rule}"
    if not all(_NODE_LABEL.fullmatch(label) for label in node_id.split(".")):
        return f"{node_id!r} is not a valid node id; {rule}"
    if node_id.startswith(RESERVED_NODE_PREFIX):
        return (
            f"{node_id!r} starts with {RESERVED_NODE_PREFIX!r}, which is reserved for "
            "llmgw's own certificates; choose another node id"
        )
    return None


def load_agent_config(
    path: Path | str, *, overrides: Mapping[str, object] | None = None
) -> AgentConfig:
    """Read ``path``, apply ``overrides`` (dotted keys allowed), validate, and return the
    config; every problem is a :class:`ConfigError` naming the key and the file."""
    source = Path(path).absolute()
    data = load_yaml(source, missing_hint="create it from agent.example.yaml or pass --config")
    return _parse(
        data, file=str(source), base_dir=source.parent, source=source, overrides=overrides
    )


def parse_agent_config(data: object, *, source: str = "<agent.yaml>") -> AgentConfig:
    """Validate already-parsed YAML data; relative paths resolve against the current
    directory and ``source`` only names the origin in errors."""
    return _parse(data, file=source, base_dir=Path.cwd(), source=None, overrides=None)


def _parse(
    data: object,
    *,
    file: str,
    base_dir: Path,
    source: Path | None,
    overrides: Mapping[str, object] | None,
) -> AgentConfig:
    check = Checker(file=file, base_dir=base_dir)
    if data is None:
        check.fail("", "is empty; it needs at least 'server: HOST:7443' (the control plane)")
    if not isinstance(data, Mapping):
        check.fail(
            "", f"must be a mapping of keys (server, tls, node_id, ...), got {type_name(data)}"
        )
    if overrides:
        data = apply_overrides(data, overrides, file=file)
    top = check.mapping(data, "", accepted=_TOP_KEYS)

    state_dir = _path(check, top, "state_dir", DEFAULT_AGENT_STATE_DIR)
    listen = top.get("listen")  # absent and null both mean "the default"
    listen_port = DEFAULT_DATA_PORT
    if listen is None:
        listen_text = DEFAULT_LISTEN
    else:
        host, listen_port = check.hostport_pair(
            listen, "listen", default_port=DEFAULT_DATA_PORT, allow_zero=True
        )
        listen_text = format_hostport(host, listen_port)
    mgmt_addr, mgmt_interface = _mgmt(check, top)
    runtime = _runtime(check, top.get("runtime"))

    return AgentConfig(
        servers=_servers(check, top),
        tls=_tls(check, top.get("tls"), state_dir),
        node_id=_node_id(check, top.get("node_id")),
        listen=listen_text,
        advertise=_advertise(check, top.get("advertise"), listen_port),
        mgmt_addr=mgmt_addr,
        mgmt_interface=mgmt_interface,
        fabrics=_fabrics(check, top.get("fabrics")),
        discovery=_discovery(check, top.get("discovery")),
        engines=_engines(check, top.get("engines")),
        models_root=_path(check, top, "models_root", DEFAULT_MODELS_ROOT),
        cache_root=_path(check, top, "cache_root", DEFAULT_CACHE_ROOT),
        state_dir=state_dir,
        stop_shards_on_exit=(
            False
            if top.get("stop_shards_on_exit") is None
            else check.boolean(top["stop_shards_on_exit"], "stop_shards_on_exit")
        ),
        sandbox=_sandbox(check, top.get("sandbox")),
        runtime=runtime,
        docker=_docker(check, top.get("docker"), runtime),
        install_sources=_install_sources(check, top.get("install_sources")),
        listeners=parse_listener_limits(check, top.get("listeners"), "listeners")[0],
        **parse_body_limits(check, top),
        multinode_ports=_multinode_ports(check, top.get("multinode_ports"), listen_port),
        **_prefetch(check, top),
        source=source,
    )


def _prefetch(check: Checker, top: Mapping[str, object]) -> dict[str, Any]:
    rate, every = top.get("prefetch_rate"), top.get("prefetch_interval")
    interval = DEFAULT_PREFETCH_INTERVAL
    if every is not None:
        interval = check.duration(every, "prefetch_interval")
        if not 60 <= interval <= 86400:
            check.fail(
                "prefetch_interval",
                "must be from 1m to 1d: how often a warm source is read again",
            )
    return {
        "prefetch_rate": (
            DEFAULT_PREFETCH_RATE
            if rate is None
            else check.size(rate, "prefetch_rate", minimum=1024**2)
        ),
        "prefetch_interval": interval,
    }


def _multinode_ports(check: Checker, value: object, listen_port: int) -> PortRange:
    if value is None:
        if listen_port in DEFAULT_MULTINODE_PORTS:
            check.fail(
                "multinode_ports",
                f"is not set, and its default {DEFAULT_MULTINODE_PORTS} holds {listen_port}, the "
                "data plane's own port (listen); move listen, or set multinode_ports to a "
                "range without it",
            )
        return DEFAULT_MULTINODE_PORTS
    if not isinstance(value, str):
        check.fail(
            "multinode_ports",
            f"must be a string 'A-B' of two port numbers (e.g. \"{DEFAULT_MULTINODE_PORTS}\", "
            f"quoted), got {type_name(value)} {value!r}",
        )
    try:
        ports = PortRange.parse(value)
    except ConfigError as exc:
        check.fail("multinode_ports", exc.message)
    if listen_port in ports:
        check.fail(
            "multinode_ports",
            f"{ports} holds {listen_port}, the data plane's own port (listen); give a range "
            f"without it, e.g. {DEFAULT_MULTINODE_PORTS}, or move listen",
        )
    return ports


def _path(check: Checker, table: Mapping[str, object], name: str, default: Path) -> Path:
    value = table.get(name)
    return default if value is None else check.path(value, name)


def _servers(check: Checker, top: Mapping[str, object]) -> tuple[str, ...]:
    has_one, has_list = "server" in top, "servers" in top
    if has_one and has_list:
        check.fail(
            "servers",
            "'server' and 'servers' are both set; keep one: 'server' for a single control "
            "plane, 'servers' for a list to fail over between",
        )
    if has_one:
        return (check.hostport(top["server"], "server", default_port=DEFAULT_GRPC_PORT),)
    if not has_list:
        check.fail(
            "server",
            "is required: the control plane's gRPC address host:port (port 7443), or "
            "'servers', a list of them to fail over between",
        )
    items = check.strings(top["servers"], "servers", non_empty=True)
    result: list[str] = []
    for index, item in enumerate(items):
        key = index_key("servers", index)
        address = check.hostport(item, key, default_port=DEFAULT_GRPC_PORT)
        if address in result:
            check.fail(key, f"{address} is listed twice (as servers[{result.index(address)}] too)")
        result.append(address)
    return tuple(result)


def _tls(check: Checker, value: object, state_dir: Path) -> TLSConfig:
    # A key left out (or the whole section) means the file `llmgw agent join` writes.
    defaults = {
        "cert": state_dir / "node.crt",
        "key": state_dir / "node.key",
        "ca": state_dir / "ca.crt",
    }
    table = {} if value is None else check.mapping(value, "tls", accepted=_TLS_KEYS)
    paths = {
        name: default if table.get(name) is None else check.path(table[name], join_key("tls", name))
        for name, default in defaults.items()
    }
    return TLSConfig(cert=paths["cert"], key=paths["key"], ca=paths["ca"])


def _node_id(check: Checker, value: object) -> str:
    if value is None:
        hostname = socket.gethostname().lower()
        problem = node_id_problem(hostname)
        if problem:
            check.fail(
                "node_id",
                f"is not set and the host name is no node id: {problem}; set node_id",
            )
        return hostname
    if not isinstance(value, str):
        check.fail("node_id", f"must be a string, got {type_name(value)}")
    problem = node_id_problem(value)
    if problem:
        check.fail("node_id", problem)
    return value


def _advertise(check: Checker, value: object, listen_port: int) -> str | None:
    if value is None:
        return None
    host, port = check.hostport_pair(value, "advertise", default_port=listen_port)
    if is_ip_address(host) and ipaddress.ip_address(host).is_unspecified:
        check.fail(
            "advertise",
            f"{host} is not an address the control plane can dial; give this node's host "
            "name or IP address",
        )
    return format_hostport(host, port)


def _mgmt(check: Checker, top: Mapping[str, object]) -> tuple[str | None, str | None]:
    addr, iface = top.get("mgmt_addr"), top.get("mgmt_interface")
    if addr is not None and iface is not None:
        check.fail(
            "mgmt_interface",
            "'mgmt_addr' and 'mgmt_interface' are both set; keep one: the address itself, "
            "or the interface to take it from",
        )
    mgmt_addr = None
    if addr is not None:
        if not isinstance(addr, str):
            check.fail("mgmt_addr", f"must be a string IP address, got {type_name(addr)}")
        try:
            mgmt_addr = str(ipaddress.ip_address(addr.strip()))
        except ValueError:
            check.fail("mgmt_addr", f"{addr!r} is not an IP address (e.g. 10.0.0.5 or fd00::5)")
    mgmt_interface = None
    if iface is not None:
        mgmt_interface = check.string(iface, "mgmt_interface")
        if len(mgmt_interface) > MAX_INTERFACE_NAME:
            check.fail(
                "mgmt_interface",
                f"{mgmt_interface!r} is {len(mgmt_interface)} characters; network interface "
                f"names have at most {MAX_INTERFACE_NAME}",
            )
        if "/" in mgmt_interface or any(c.isspace() for c in mgmt_interface):
            check.fail(
                "mgmt_interface",
                f"{mgmt_interface!r} is not an interface name (no '/' or spaces)",
            )
    return mgmt_addr, mgmt_interface


def _fabrics(check: Checker, value: object) -> tuple[FabricConfig, ...]:
    if value is None:
        return ()
    fabrics: list[FabricConfig] = []
    owner: dict[str, str] = {}  # adapter -> fabric name
    names: dict[str, int] = {}
    for index, item in enumerate(check.items(value, "fabrics")):
        key = index_key("fabrics", index)
        table = check.mapping(item, key, accepted=_FABRIC_KEYS)
        name_key = join_key(key, "name")
        if table.get("name") is None:
            check.fail(name_key, "is required: the fabric's name, e.g. ib-a")
        name = check.string(table["name"], name_key)
        if not _FABRIC_NAME.fullmatch(name):
            check.fail(
                name_key,
                f"{name!r} is not a fabric name: use lowercase letters, digits, '-', '_' and '.'",
            )
        if name in names:
            check.fail(
                name_key,
                f"fabric {name} is defined twice (fabrics[{names[name]}] and {key}); "
                "list all its adapters under one entry",
            )
        names[name] = index
        hcas_key = join_key(key, "hcas")
        if table.get("hcas") is None:
            check.fail(hcas_key, f"is required: the adapters on fabric {name}, e.g. [mlx5_0]")
        hcas = check.strings(table["hcas"], hcas_key, non_empty=True)
        for hca_index, hca in enumerate(hcas):
            hca_key = index_key(hcas_key, hca_index)
            if not _ADAPTER_NAME.fullmatch(hca):
                check.fail(
                    hca_key,
                    f"{hca!r} is not an adapter name (as in /sys/class/infiniband, e.g. mlx5_0)",
                )
            if hca in owner:
                if owner[hca] == name:
                    check.fail(hca_key, f"adapter {hca} is listed twice under fabric {name}")
                check.fail(
                    hca_key,
                    f"adapter {hca} is listed under fabrics {owner[hca]} and {name}; an "
                    "adapter belongs to one fabric",
                )
            owner[hca] = name
        fabrics.append(FabricConfig(name=name, hcas=hcas))
    return tuple(fabrics)


def _discovery(check: Checker, value: object) -> DiscoveryConfig:
    if value is None:
        return DiscoveryConfig()
    table = check.mapping(value, "discovery", accepted=_DISCOVERY_KEYS)
    nvidia_smi = table.get("nvidia_smi")
    ib_root = table.get("ib_root")
    return DiscoveryConfig(
        nvidia_smi=None
        if nvidia_smi is None
        else Path(check.command(nvidia_smi, "discovery.nvidia_smi")),
        ib_root=DEFAULT_IB_ROOT if ib_root is None else check.path(ib_root, "discovery.ib_root"),
    )


def _engines(check: Checker, value: object) -> EnginesConfig:
    if value is None:
        return EnginesConfig()
    if not isinstance(value, Mapping):
        check.fail("engines", f"must be a mapping, got {type_name(value)}")
    programs: dict[str, str | None] = {}
    for engine, settings in value.items():
        key = join_key("engines", str(engine))
        if engine in ENGINES and ENGINES[engine].builtin:
            check.fail(key, f"the {engine} engine is built in and takes no settings; remove it")
        if engine not in _ENGINE_KEYS:
            check.fail(
                key,
                unknown_key_message(str(engine), _ENGINE_KEYS, noun="engine"),
            )
        if settings is None:
            continue
        (setting,) = _ENGINE_KEYS[engine]
        table = check.mapping(settings, key, accepted=_ENGINE_KEYS[engine])
        if table.get(setting) is not None:
            programs[f"{engine}_{setting}"] = check.command(table[setting], join_key(key, setting))
    return EnginesConfig(
        llamacpp_bin=programs.get("llamacpp_bin"),
        vllm_bin=programs.get("vllm_bin"),
        sglang_python=programs.get("sglang_python"),
    )


def _install_sources(check: Checker, value: object) -> tuple[SourcePrefix, ...]:
    """Where engine builds may come from besides https:// (llmgw.contracts.sources)."""
    return parse_prefixes(
        check,
        value,
        "install_sources",
        example="https://releases.example.net/llama.cpp/, http://10.0.0.2:8000/engines/ or "
        "file:///srv/engines/",
    )


SANDBOX_MODES = ("required", "if-available")


def _sandbox(check: Checker, value: object) -> str:
    if value is None:
        return "required"
    mode = check.string(value, "sandbox")
    if mode not in SANDBOX_MODES:
        check.fail(
            "sandbox",
            f"must be required (the default: engines never run unconfined) or if-available "
            f"(unconfined, with a warning, where bubblewrap cannot run), not {mode!r}; a "
            "profile's own sandbox key (catalog) widens or turns off one model's",
        )
    return mode


def _runtime(check: Checker, value: object) -> str:
    if value is None:
        return "process"
    runtime = check.string(value, "runtime")
    if runtime not in RUNTIME_NAMES:
        check.fail("runtime", unknown_key_message(runtime, RUNTIME_NAMES, noun="runtime"))
    return runtime


def _docker(check: Checker, value: object, runtime: str) -> DockerConfig:
    table = {} if value is None else check.mapping(value, "docker", accepted=_DOCKER_KEYS)
    images: dict[str, str] = {}
    raw_images = table.get("images")
    if raw_images is not None:
        if not isinstance(raw_images, Mapping):
            check.fail(
                "docker.images",
                f"must be a mapping of engine to image (e.g. sim: llmgw-sim:0.1), got "
                f"{type_name(raw_images)}",
            )
        for engine, image in raw_images.items():
            key = join_key("docker.images", str(engine))
            if engine not in _IMAGE_ENGINES:
                check.fail(key, unknown_key_message(str(engine), _IMAGE_ENGINES, noun="engine"))
            image = check.string(image, key).strip()
            if not _IMAGE_REF.fullmatch(image):
                check.fail(
                    key,
                    f"{image!r} is not an image reference; give [registry/]name[:tag] in "
                    "lowercase, e.g. llmgw-sim:0.1 or registry.example.com/llmgw/vllm:0.6",
                )
            images[str(engine)] = image
    if runtime == "docker" and not images:
        check.fail(
            "docker.images",
            "is required when runtime is docker: the image of each engine this node runs, "
            "e.g. {sim: llmgw-sim:0.1} (the image must be on the node: docker load -i FILE)",
        )
    network = None
    if table.get("network") is not None:
        network = check.string(table["network"], "docker.network").strip()
        if network in ("host", "none"):
            check.fail(
                "docker.network",
                f"{network!r} cannot be used: engines are reached through a port published on "
                "127.0.0.1, which needs a bridge network; create one (docker network create "
                "llmgw) and name it, or remove the key for Docker's default bridge",
            )
        if not _NETWORK_NAME.fullmatch(network):
            check.fail(
                "docker.network",
                f"{network!r} is not a Docker network name (letters, digits, '_', '.', '-')",
            )
    gpus = "request"
    if table.get("gpus") is not None:
        gpus = check.string(table["gpus"], "docker.gpus").strip()
        if gpus not in DOCKER_GPU_MODES:
            check.fail(
                "docker.gpus",
                f"{gpus!r} is not a GPU mode; give 'request' (a device request, as docker run "
                "--gpus; needs the NVIDIA Container Toolkit) or 'env' (NVIDIA_VISIBLE_DEVICES, "
                "for a daemon whose default runtime is nvidia)",
            )
    host = None
    if table.get("host") is not None:
        host = check.string(table["host"], "docker.host").strip()
        if not host.startswith("unix:///") or "\x00" in host:
            check.fail(
                "docker.host",
                f"{host!r} is not a unix socket URL; give unix:///PATH, e.g. "
                "unix:///run/llmgw-docker-proxy/docker.sock (the proxy's socket)",
            )
    return DockerConfig(images=images, network=network, gpus=gpus, host=host)


__all__ = [
    "AgentConfig",
    "DiscoveryConfig",
    "DockerConfig",
    "EnginesConfig",
    "FabricConfig",
    "TLSConfig",
    "load_agent_config",
    "node_id_problem",
    "parse_agent_config",
]
