"""The agent's compose file (packaging/compose/compose.yaml) read as ``docker compose`` would
run it, for the tests: ``docker compose`` is not installed here (Debian 12 has no
docker-compose-plugin, and the Python docker-compose 1.x is deprecated), so a service is
turned into the ``docker run`` command line it stands for. Every key the file uses must be
one :data:`KNOWN` translates (test_agent_compose.py checks), so the container the tests run is
the one the file describes; the tests change only what this machine must (volume names,
folders, no GPU), through :class:`Overrides`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .pkgcheck import ROOT

__all__ = ["COMPOSE", "KNOWN", "TOP_KEYS", "Overrides", "interpolate", "load", "run_argv"]

COMPOSE = ROOT / "packaging" / "compose" / "compose.yaml"
TOP_KEYS = {"name", "services", "volumes"}
# Service keys and what each becomes on docker run's command line (see run_argv).
KNOWN = {
    "image",
    "command",
    "init",
    "restart",
    "stop_grace_period",
    "network_mode",
    "read_only",
    "cap_drop",
    "security_opt",
    "tmpfs",
    "ulimits",
    "environment",
    "volumes",
    "deploy",
    "profiles",
    "user",
    "group_add",
}
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def load(path: Path = COMPOSE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise AssertionError(f"{path}: not a mapping")
    return data


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """``${NAME}`` and ``${NAME:-default}`` as compose fills them (unset or empty: default)."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def _seconds(duration: str) -> int:
    m = re.fullmatch(r"(\d+)(s|m)", duration)
    if m is None:
        raise AssertionError(f"stop_grace_period {duration!r}: expected e.g. 45s or 1m")
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


@dataclass
class Overrides:
    """What a test changes: named volumes -> the test's own, bind sources (as written in the
    file) -> folders of the test, variables, whether GPUs and ulimits are asked for, the
    security options, the command; and what it adds: labels, environment."""

    volumes: dict[str, str] = field(default_factory=dict)
    binds: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    gpus: bool = True
    ulimits: bool = True
    security_opt: list[str] | None = None
    command: list[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # None: the value comes from docker's own environment (-e NAME), out of its argv.
    environment: dict[str, str | None] = field(default_factory=dict)


def _volume(spec: str, project: str, base: Path, over: Overrides) -> str:
    source, _, rest = spec.partition(":")
    if source.startswith(("/", ".")):
        if source in over.binds:
            source = over.binds[source]
        elif source.startswith("."):
            source = str((base / source).resolve())
    else:
        source = over.volumes.get(source, f"{project}_{source}")
    return f"{source}:{rest}"


def _security_opt(opt: str, base: Path) -> str:
    key, sep, value = opt.partition("=")
    # Compose v2 reads a seccomp profile relative to the project folder, as done here.
    if key == "seccomp" and sep and value != "unconfined" and not value.startswith("/"):
        return f"seccomp={(base / value).resolve()}"
    return opt


def _ulimit(name: str, value: Any) -> str:
    if isinstance(value, dict):
        return f"{name}={value['soft']}:{value['hard']}"
    return f"{name}={value}:{value}"


def run_argv(
    service: str,
    *,
    name: str,
    overrides: Overrides | None = None,
    oneoff: bool = False,
    path: Path = COMPOSE,
) -> list[str]:
    """``docker run -d --name NAME ...`` for ``service`` of the compose file at ``path``;
    ``oneoff``: ``docker run --rm`` in the foreground, as ``docker compose run --rm`` (which
    leaves out the restart policy)."""
    over = overrides or Overrides()
    data = load(path)
    spec = data["services"][service]
    unknown = set(spec) - KNOWN
    if unknown:
        raise AssertionError(f"{path}: {service} uses {sorted(unknown)}, which run_argv cannot run")
    env = {**os.environ, **over.env}
    base = path.parent
    project = data.get("name", base.name)
    argv = ["docker", "run", "--rm" if oneoff else "-d", "--name", name]
    for label, value in over.labels.items():
        argv += ["--label", f"{label}={value}"]
    if spec.get("init"):
        argv.append("--init")
    if "restart" in spec and not oneoff:
        argv += ["--restart", spec["restart"]]
    if "stop_grace_period" in spec:
        argv += ["--stop-timeout", str(_seconds(spec["stop_grace_period"]))]
    if "network_mode" in spec:
        argv += ["--network", spec["network_mode"]]
    if spec.get("read_only"):
        argv.append("--read-only")
    if "user" in spec:
        argv += ["--user", spec["user"]]
    for group in spec.get("group_add", []):
        argv += ["--group-add", interpolate(str(group), env)]
    for cap in spec.get("cap_drop", []):
        argv += ["--cap-drop", cap]
    security = over.security_opt if over.security_opt is not None else spec.get("security_opt", [])
    for opt in security:
        argv += ["--security-opt", _security_opt(opt, base)]
    for mount in spec.get("tmpfs", []):
        argv += ["--tmpfs", mount]
    if over.ulimits:
        for limit, value in spec.get("ulimits", {}).items():
            argv += ["--ulimit", _ulimit(limit, value)]
    for key, value in spec.get("environment", {}).items():
        argv += ["-e", f"{key}={interpolate(str(value), env)}"]
    for key, value in over.environment.items():
        argv += ["-e", key if value is None else f"{key}={value}"]
    for volume in spec.get("volumes", []):
        argv += ["-v", _volume(volume, project, base, over)]
    devices = spec.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if over.gpus:
        for device in devices:
            count = device.get("count", "all")
            argv += ["--gpus", "all" if count == "all" else str(count)]
    argv.append(interpolate(spec["image"], env))
    argv += over.command if over.command is not None else list(spec.get("command", []))
    return argv
