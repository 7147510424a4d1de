"""Node facts given when a node is installed or joined: the one parser of ``--fabric
NAME[:HCA,...]``, ``--engine NAME=PATH``, ``--node-address``/``--mgmt-interface`` and the path
and CIDR options that ``llmgw ctl join-command``, the control plane and ``llmgw agent join``
all accept, with the same syntax as ``install-agent.sh install``.

A bare fabric name (``--fabric ib-b``) means the node's active InfiniBand adapters, found on
the node itself when it is installed or joined (:meth:`NodeFacts.with_active_adapters`); what
was found is written down, never looked for again.

Each value is checked where it is given and again where it is used, and always by this module,
so that what ctl accepts the control plane accepts, and what ends up in the command an operator
pastes (as root) is what ``agent.yaml`` takes. Errors are :class:`~llmgw.errors.ConfigError`
naming the option.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.engines.registry import ENGINES
from llmgw.errors import ConfigError

__all__ = [
    "AGENT_FACTS",
    "FACT_OPTIONS",
    "INSTALLER_FACTS",
    "NONE",
    "FabricFact",
    "NodeFacts",
    "check_cidr",
    "check_interface",
    "check_ip",
    "check_path",
    "parse_engine",
    "parse_fabric",
]

# As agent.yaml's fabrics[].name and fabrics[].hcas[] (llmgw.agent.config): what is accepted
# here must pass 'llmgw agent --check'.
_FABRIC_NAME = re.compile(r"[a-z0-9_.-]+")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# A path that goes into agent.yaml, a unit's ReadWritePaths= and the installer's sed and awk:
# the characters install-agent.sh accepts (its FACT_PATH_RE), nothing that means something
# to YAML, a shell or a unit file.
_PATH = re.compile(r"/[A-Za-z0-9_./+-]*")
_CIDR = re.compile(r"[0-9A-Fa-f:.]+(/[0-9]{1,3})?")
# A network interface name as the installer writes it into agent.yaml (its IFACE_RE): at
# most 15 characters (IFNAMSIZ - 1), none that YAML, a shell or sed would read otherwise.
_INTERFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
MAX_VALUE = 4096
NONE = "none"
"""``--fabric none`` / ``--engine none``, alone: no fabric, no engine program (the installer
clears what an earlier install remembered)."""

FACT_OPTIONS: Mapping[str, str] = {
    "fabrics": "--fabric",
    "nvidia_smi": "--nvidia-smi",
    "ib_root": "--ib-root",
    "engines": "--engine",
    "models_root": "--models-root",
    "cache_root": "--cache-root",
    "firewall_from": "--firewall-from",
    "fabric_peers": "--fabric-peers",
    "node_address": "--node-address",
    "mgmt_interface": "--mgmt-interface",
}
"""Each fact, by its JSON key (the admin API's), and the option that gives it."""

AGENT_FACTS = ("fabrics", "nvidia_smi", "ib_root", "engines", "node_address", "mgmt_interface")
"""The facts ``llmgw agent join`` writes into agent.yaml itself (the node's own address,
``--node-address``, as ``mgmt_addr``; ``--mgmt-interface`` as ``mgmt_interface``)."""

INSTALLER_FACTS = ("models_root", "cache_root", "firewall_from", "fabric_peers")
"""The facts only the installer applies (the unit's drop-in, the firewall)."""


def _fail(option: str, value: str, why: str) -> ConfigError:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return ConfigError(f"{shown!r} {why}", key=option)


def _text(value: object, option: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {type(value).__name__}", key=option)
    if not value or len(value) > MAX_VALUE:
        raise ConfigError(f"must be 1-{MAX_VALUE} characters", key=option)
    return value


@dataclass(frozen=True)
class FabricFact:
    """``--fabric NAME:HCA[,HCA...]``: a fabric this node is on and its adapters (as
    agent.yaml's ``fabrics``); a bare ``NAME``: the node's active InfiniBand adapters, found
    on the node (:attr:`bare`); ``none``: no fabric."""

    name: str
    hcas: tuple[str, ...] = ()

    @property
    def bare(self) -> bool:
        """A name without adapters: they are the ones found active on the node."""
        return self.name != NONE and not self.hcas

    def __str__(self) -> str:
        return self.name + (":" + ",".join(self.hcas) if self.hcas else "")


def parse_fabric(value: object, option: str = "--fabric") -> FabricFact:
    """``NAME:HCA[,HCA...]``, a bare ``NAME`` or ``none``, as a :class:`FabricFact`;
    ConfigError says what is wrong."""
    text = _text(value, option)
    if text == NONE:
        return FabricFact(NONE)
    name, sep, rest = text.partition(":")
    if not _FABRIC_NAME.fullmatch(name):
        raise _fail(
            option,
            text,
            "does not start with a fabric name (lowercase letters, digits, '-', '_' and '.'); "
            "give NAME (the node's active InfiniBand adapters) or NAME:HCA,HCA, e.g. "
            "ib-b:mlx5_2,mlx5_3",
        )
    if not sep:
        return FabricFact(name=name)
    hcas: list[str] = []
    if sep:
        for hca in rest.split(","):
            if not _ADAPTER_NAME.fullmatch(hca):
                raise _fail(
                    option,
                    text,
                    f"names adapter {hca!r}, which is not an adapter name (as in "
                    "/sys/class/infiniband, e.g. mlx5_0); give NAME:HCA,HCA without spaces",
                )
            if hca in hcas:
                raise _fail(option, text, f"lists adapter {hca} twice")
            hcas.append(hca)
    return FabricFact(name=name, hcas=tuple(hcas))


def check_path(value: object, option: str) -> str:
    """An absolute path of letters, digits and ``_ . / + -`` only (it goes into agent.yaml,
    a unit file and a command run as root); a trailing '/' is dropped."""
    text = _text(value, option)
    if not text.startswith("/"):
        raise _fail(option, text, "is not an absolute path; give one starting with '/'")
    if not _PATH.fullmatch(text):
        raise _fail(
            option,
            text,
            "holds a character other than letters, digits and _ . / + - (white space, a "
            "quote, ':', '#', '$'...), which the installer cannot put into agent.yaml and the "
            "unit; use a path without them (a symlink to it)",
        )
    if "/../" in text + "/" or "/./" in text + "/":
        raise _fail(option, text, "holds '.' or '..' components; give the path itself")
    return text.rstrip("/") or "/"


def parse_engine(value: object, option: str = "--engine") -> tuple[str, str]:
    """``NAME=PATH``: an engine that takes a program (agent.yaml ``engines.NAME``) and the
    program's absolute path; ``none``: no engine program (``("none", "")``)."""
    text = _text(value, option)
    if text == NONE:
        return NONE, ""
    name, sep, path = text.partition("=")
    settable = sorted(e.name for e in ENGINES.values() if e.program_setting)
    if not sep:
        raise _fail(
            option,
            text,
            f"is not NAME=PATH; give e.g. vllm=/opt/vllm/bin/vllm ({', '.join(settable)})",
        )
    engine = ENGINES.get(name)
    if engine is None:
        raise _fail(option, text, f"names no engine llmgw knows; give one of {', '.join(settable)}")
    if engine.program_setting is None:
        raise _fail(
            option,
            text,
            f"names {name}, which is built in and takes no program; give one of "
            f"{', '.join(settable)}",
        )
    return name, check_path(path, f"{option} {name}")


def check_ip(value: object, option: str) -> str:
    """An IP address (``10.0.0.5``, ``fd00::5``), as agent.yaml's ``mgmt_addr`` takes it and
    the installer's own check (check_address) does."""
    text = _text(value, option)
    try:
        if not _CIDR.fullmatch(text) or "/" in text:
            raise ValueError(text)
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise _fail(option, text, "is not an IP address; give e.g. 10.0.0.5 or fd00::5") from None


def check_interface(value: object, option: str) -> str:
    """A network interface name (``eth1``, ``enp1s0f0np0``, ``bond0.100``)."""
    text = _text(value, option)
    if not _INTERFACE.fullmatch(text):
        raise _fail(
            option,
            text,
            "is not a network interface name: at most 15 letters, digits and _ . - (as 'ip "
            "-brief link' lists them)",
        )
    return text


def check_cidr(value: object, option: str) -> str:
    """An IP address or network (``10.0.0.5``, ``10.0.0.0/24``, ``fd00::/64``), as given."""
    text = _text(value, option)
    try:
        # The installer's own check (check_source) takes only these characters and a prefix
        # length in digits (no netmask, no zone).
        if not _CIDR.fullmatch(text):
            raise ValueError(text)
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise _fail(
            option,
            text,
            "is not an IP address or CIDR; give e.g. 10.0.0.5, 10.0.0.0/24 or fd00::/64",
        ) from None
    return text


def _parse_fabrics(values: Iterable[object]) -> tuple[FabricFact, ...]:
    """The --fabric options, each checked, and together: at most one bare name, ``none``
    alone, no fabric twice, no adapter on two fabrics."""
    parsed = tuple(parse_fabric(f) for f in values)
    bare = [f.name for f in parsed if f.bare]
    if len(bare) > 1:
        raise ConfigError(
            f"fabrics {bare[0]} and {bare[1]} both name no adapters, and a bare name takes "
            "all the node's active InfiniBand adapters; list the adapters of all but one "
            f"(--fabric {bare[1]}:HCA,HCA)",
            key="--fabric",
        )
    if len(parsed) > 1 and any(f.name == NONE for f in parsed):
        raise ConfigError(
            "--fabric none clears the fabrics: give it alone, not with other --fabric options",
            key="--fabric",
        )
    names: set[str] = set()
    owner: dict[str, str] = {}
    for fabric in parsed:
        if fabric.name in names:
            raise ConfigError(
                f"fabric {fabric.name} is given twice; give it once with all its adapters "
                f"({fabric.name}:HCA,HCA)",
                key="--fabric",
            )
        names.add(fabric.name)
        for hca in fabric.hcas:
            if hca in owner:
                raise ConfigError(
                    f"adapter {hca} is on fabrics {owner[hca]} and {fabric.name}; an "
                    "adapter belongs to one fabric",
                    key="--fabric",
                )
            owner[hca] = fabric.name
    return parsed


def _parse_engines(values: Iterable[object]) -> tuple[tuple[str, str], ...]:
    """The --engine options, each checked, and together: ``none`` alone, no engine twice."""
    engine_list = tuple(parse_engine(e) for e in values)
    if len(engine_list) > 1 and any(name == NONE for name, _ in engine_list):
        raise ConfigError(
            "--engine none clears the engine programs: give it alone, not with other "
            "--engine options",
            key="--engine",
        )
    seen = [name for name, _ in engine_list]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise ConfigError(
            f"engine {twice[0]} is given twice; give one program per engine", key="--engine"
        )
    return engine_list


@dataclass(frozen=True)
class NodeFacts:
    """Everything a node can be told at install time that it cannot find out itself."""

    fabrics: tuple[FabricFact, ...] = ()
    nvidia_smi: str | None = None
    ib_root: str | None = None
    engines: tuple[tuple[str, str], ...] = ()
    models_root: str | None = None
    cache_root: str | None = None
    firewall_from: tuple[str, ...] = ()
    fabric_peers: tuple[str, ...] = ()
    node_address: str | None = None
    mgmt_interface: str | None = None

    @classmethod
    def parse(
        cls,
        *,
        fabrics: Iterable[object] = (),
        nvidia_smi: object = None,
        ib_root: object = None,
        engines: Iterable[object] = (),
        models_root: object = None,
        cache_root: object = None,
        firewall_from: Iterable[object] = (),
        fabric_peers: Iterable[object] = (),
        node_address: object = None,
        mgmt_interface: object = None,
    ) -> NodeFacts:
        """The facts from option values (strings in the options' syntax), each checked, and
        checked together: a fabric or an engine given twice, an adapter on two fabrics, two
        bare fabric names, ``none`` beside another, the node's address and its interface."""
        parsed = _parse_fabrics(fabrics)
        if node_address is not None and mgmt_interface is not None:
            raise ConfigError(
                "--node-address and --mgmt-interface both say where the node is reached; give "
                "one: the address itself, or the interface to take it from",
                key="--mgmt-interface",
            )
        engine_list = _parse_engines(engines)
        return cls(
            fabrics=parsed,
            nvidia_smi=None if nvidia_smi is None else check_path(nvidia_smi, "--nvidia-smi"),
            ib_root=None if ib_root is None else check_path(ib_root, "--ib-root"),
            engines=engine_list,
            models_root=None if models_root is None else check_path(models_root, "--models-root"),
            cache_root=None if cache_root is None else check_path(cache_root, "--cache-root"),
            firewall_from=_unique(check_cidr(c, "--firewall-from") for c in firewall_from),
            fabric_peers=_unique(check_cidr(c, "--fabric-peers") for c in fabric_peers),
            node_address=None if node_address is None else check_ip(node_address, "--node-address"),
            mgmt_interface=None
            if mgmt_interface is None
            else check_interface(mgmt_interface, "--mgmt-interface"),
        )

    def with_active_adapters(self, active: Iterable[str], where: str) -> NodeFacts:
        """These facts with a bare fabric name's adapters filled in: ``active``, the node's
        active InfiniBand adapters (found in ``where``), less those another fabric lists.
        ConfigError when none is left."""
        fabric = next((f for f in self.fabrics if f.bare), None)
        if fabric is None:
            return self
        listed = {hca for f in self.fabrics for hca in f.hcas}
        found = tuple(hca for hca in active if hca not in listed)
        if not found:
            others = " not listed under another fabric" if listed else ""
            raise ConfigError(
                f"{fabric.name} names no adapters, so it takes this node's active InfiniBand "
                f"adapters, and {where} has none{others}; bring their links up (ibstat), or "
                f"list the adapters: --fabric {fabric.name}:HCA,HCA",
                key="--fabric",
            )
        filled = tuple(FabricFact(f.name, found) if f.bare else f for f in self.fabrics)
        return dataclasses.replace(self, fabrics=filled)

    @classmethod
    def from_json(cls, data: object) -> NodeFacts:
        """The facts as the admin API receives them: ``{fabrics: ["ib-b:mlx5_2"], nvidia_smi:
        "/usr/bin/nvidia-smi", engines: ["vllm=/opt/vllm/bin/vllm"], ...}`` (the options'
        syntax, lists for the repeatable ones); ConfigError names what is wrong."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError("must be an object of node facts", key="facts")
        unknown = sorted(str(k)[:40] for k in data if k not in FACT_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown fact(s) {', '.join(unknown)}; the facts are {', '.join(FACT_OPTIONS)}",
                key="facts",
            )
        lists = {}
        for key in ("fabrics", "engines", "firewall_from", "fabric_peers"):
            value = data.get(key, [])
            if not isinstance(value, list):
                raise ConfigError("must be a list of strings", key=FACT_OPTIONS[key])
            lists[key] = value
        return cls.parse(
            nvidia_smi=data.get("nvidia_smi"),
            ib_root=data.get("ib_root"),
            models_root=data.get("models_root"),
            cache_root=data.get("cache_root"),
            node_address=data.get("node_address"),
            mgmt_interface=data.get("mgmt_interface"),
            **lists,
        )

    def as_json(self) -> dict[str, object]:
        """What :meth:`from_json` reads back; facts not given are left out."""
        data: dict[str, object] = {}
        if self.fabrics:
            data["fabrics"] = [str(f) for f in self.fabrics]
        if self.nvidia_smi is not None:
            data["nvidia_smi"] = self.nvidia_smi
        if self.ib_root is not None:
            data["ib_root"] = self.ib_root
        if self.engines:
            data["engines"] = [_engine_text(name, path) for name, path in self.engines]
        for key in ("node_address", "mgmt_interface"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        for key in INSTALLER_FACTS:
            value = getattr(self, key)
            if value:
                data[key] = list(value) if isinstance(value, tuple) else value
        return data

    def agent_config(self) -> dict[str, object]:
        """The agent facts as agent.yaml keys (``fabrics``, ``discovery``, ``engines``), as
        ``llmgw agent join`` writes them into a fresh agent.yaml and ``install-agent.sh``
        into its managed block (through ``llmgw agent render-facts``); ``none`` and facts not
        given are left out. A bare fabric name must have been filled in first
        (:meth:`with_active_adapters`)."""
        data: dict[str, object] = {}
        bare = [f.name for f in self.fabrics if f.bare]
        if bare:
            raise ConfigError(
                f"{bare[0]} names no adapters and none were found for it on this node",
                key="--fabric",
            )
        fabrics = [f for f in self.fabrics if f.name != NONE]
        if fabrics:
            data["fabrics"] = [{"name": f.name, "hcas": list(f.hcas)} for f in fabrics]
        discovery: dict[str, str] = {}
        if self.nvidia_smi:
            discovery["nvidia_smi"] = self.nvidia_smi
        if self.ib_root:
            discovery["ib_root"] = self.ib_root
        if discovery:
            data["discovery"] = discovery
        engines = [(name, path) for name, path in self.engines if name != NONE]
        if engines:
            data["engines"] = {
                name: {str(ENGINES[name].program_setting): path} for name, path in engines
            }
        if self.node_address is not None:
            data["mgmt_addr"] = self.node_address
        if self.mgmt_interface is not None:
            data["mgmt_interface"] = self.mgmt_interface
        return data

    def given(self, keys: Iterable[str]) -> list[str]:
        """The options of *keys* (JSON keys) that carry a value, in :data:`FACT_OPTIONS` order."""
        wanted = set(keys)
        return [
            option for key, option in FACT_OPTIONS.items() if key in wanted and getattr(self, key)
        ]

    def args(self, keys: Iterable[str] = FACT_OPTIONS) -> list[str]:
        """The facts of *keys* as options of ``install-agent.sh install`` and ``llmgw agent
        join`` (one argument each; the caller quotes them for a shell)."""
        wanted = set(keys)
        out: list[str] = []
        for key, option in FACT_OPTIONS.items():
            if key not in wanted:
                continue
            value = getattr(self, key)
            if key == "fabrics":
                values = [str(f) for f in value]
            elif key == "engines":
                values = [_engine_text(name, path) for name, path in value]
            elif isinstance(value, tuple):
                values = list(value)
            else:
                values = [] if value is None else [value]
            for item in values:
                out += [option, item]
        return out


def _engine_text(name: str, path: str) -> str:
    return NONE if name == NONE else f"{name}={path}"


def _unique(values: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for value in values:
        if value not in out:
            out.append(value)
    return tuple(out)
