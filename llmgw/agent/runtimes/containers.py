"""A shard as a container: the image, command, environment, labels, GPUs and ports the
docker runtime creates it with (:func:`launch_for`), and, read back from ``docker inspect``,
the labels and port by which a restarted agent finds it again (:class:`ShardContainer`).

No Docker SDK here (it costs every command about 70 ms to load): the agent builds launches
without importing it; :mod:`llmgw.agent.runtimes.docker` talks to the daemon.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmgw.agent.runtimes.base import Launch
from llmgw.engines.launch import build_argv, build_command, self_argv
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError, ShardError

__all__ = [
    "CONTAINER_PORT",
    "LABEL_CLUSTER",
    "LABEL_LOG",
    "LABEL_NODE",
    "LABEL_REPLICA",
    "LABEL_SHARD",
    "ShardContainer",
    "container_name",
    "launch_for",
]

CONTAINER_PORT = 8000
"""The port every engine listens on inside its container (on all of the container's addresses)."""

LABEL_CLUSTER = "llmgw.cluster"
LABEL_NODE = "llmgw.node"
LABEL_REPLICA = "llmgw.replica"
LABEL_SHARD = "llmgw.shard"
LABEL_LOG = "llmgw.log"
"""The shard's log file on the host, so that an agent adopting the container goes on copying
its output to the same file."""

_NAME_INVALID = re.compile(r"[^a-zA-Z0-9_.-]")


class _SpecLike(Protocol):
    """The fields of ``ShardSpec`` (or ``ShardRecord``) a launch is built from."""

    @property
    def shard_id(self) -> str: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def params(self) -> dict[str, str]: ...
    @property
    def extra_args(self) -> tuple[str, ...]: ...
    @property
    def rank(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def dist_init_addr(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def gpus(self) -> tuple[str, ...]: ...
    @property
    def worker_addrs(self) -> tuple[str, ...]: ...
    @property
    def listen_addr(self) -> str: ...
    @property
    def disagg_role(self) -> str: ...


def container_name(shard_id: str, node_id: str | None = None) -> str:
    """``llmgw-NODE-SHARD``: readable in ``docker ps``, unique per node on a shared daemon."""
    parts = ["llmgw", *([node_id] if node_id else []), shard_id]
    return _NAME_INVALID.sub("_", "-".join(parts))


def _in_container(argv: Sequence[str], *, host_network: bool = False) -> list[str]:
    """The engine's argv as run inside its image: ``llmgw`` from the image's PATH rather than
    this agent's own interpreter, listening on every address of the container (the port is
    published on the host's loopback only). In the host's network namespace the addresses
    stay as built: 127.0.0.1 is then the host's loopback."""
    args = list(argv)
    prefix = self_argv()
    if args[: len(prefix)] == prefix:
        args = ["llmgw", *args[len(prefix) :]]
    if not host_network and "--host" in args[:-1]:
        args[args.index("--host") + 1] = "0.0.0.0"
    return args


def launch_for(
    spec: _SpecLike,
    *,
    port: int,
    log_path: Path,
    node_id: str,
    cluster_id: str,
    images: Mapping[str, str],
    gpus: Sequence[str] = (),
    gpu_mode: str = "request",
) -> Launch:
    """The :class:`Launch` of a shard in a container: the image ``images`` names for its engine,
    the engine on :data:`CONTAINER_PORT` inside, published on 127.0.0.1:``port``."""
    image = images.get(spec.engine)
    if not image:
        raise ShardError(
            f"no image for engine {spec.engine!r} on this node; set docker.images.{spec.engine} "
            f"in agent.yaml (e.g. {spec.engine}: llmgw-{spec.engine}:0.1) and load the image "
            "(docker load -i FILE)"
        )
    if spec.disagg_role:
        # Its KV cache moves over the fabric's adapters (/dev/infiniband), which a container
        # is not given, from a side channel its peers dial on the host's address.
        raise ShardError(
            f"shard {spec.shard_id} is a {spec.disagg_role} shard of a disaggregated model, "
            "which runs as a process engine only in this release; set runtime: process in "
            "agent.yaml for the nodes of its pools, or deploy the model without prefill and "
            "decode pools"
        )
    multi_node = spec.nodes > 1
    env: dict[str, str] = {}
    try:
        if multi_node:
            # The whole shard, as the process runtime builds it, on the host's port.
            command = build_command(
                EngineSpec(
                    engine=spec.engine,
                    model=spec.model,
                    port=port,
                    source=spec.source,
                    gpus=spec.gpus,
                    nodes=spec.nodes,
                    rank=spec.rank,
                    dist_init_addr=spec.dist_init_addr,
                    params=spec.params,
                    extra_args=spec.extra_args,
                    peers=spec.worker_addrs,
                    listen_addr=spec.listen_addr,
                    # No KV events: a container cannot reach the agent's private socket
                    # directory (llmgw.agent.kvevents).
                )
            )
            argv, env = command.argv, command.env
        else:
            argv = build_argv(
                spec.engine,
                model=spec.model,
                port=CONTAINER_PORT,
                params=spec.params,
                extra_args=spec.extra_args,
            )
    except EngineError as exc:
        raise ShardError(str(exc)) from exc
    requested: tuple[str, ...] = tuple(gpus)
    if gpus and gpu_mode == "env":
        # The nvidia runtime hands the container these GPUs itself; no device request.
        env = {**env, "NVIDIA_VISIBLE_DEVICES": ",".join(gpus)}
        requested = ()
    labels = {LABEL_NODE: node_id, LABEL_REPLICA: spec.replica_id, LABEL_SHARD: spec.shard_id}
    if cluster_id:
        labels[LABEL_CLUSTER] = cluster_id
    return Launch(
        shard_id=spec.shard_id,
        argv=tuple(_in_container(argv, host_network=multi_node)),
        port=port,
        log_path=log_path,
        env=env,
        image=image,
        labels=labels,
        gpus=requested,
        container_port=port if multi_node else CONTAINER_PORT,
        host_network=multi_node,
    )


@dataclass(frozen=True)
class ShardContainer:
    """One llmgw container as Docker describes it."""

    container_id: str
    name: str
    shard_id: str
    replica_id: str
    node_id: str
    cluster_id: str
    image: str
    running: bool
    pid: int  # the engine's pid on the host; 0 when it is not running
    port: int  # the host port published on 127.0.0.1; 0 when none
    exit_code: int | None  # None while it runs
    log_path: Path | None

    @classmethod
    def from_inspect(cls, attrs: Mapping[str, Any]) -> ShardContainer:
        config = attrs.get("Config") or {}
        labels = config.get("Labels") or {}
        state = attrs.get("State") or {}
        running = bool(state.get("Running"))
        log_label = labels.get(LABEL_LOG)
        return cls(
            container_id=str(attrs["Id"]),
            name=str(attrs.get("Name", "")).lstrip("/"),
            shard_id=labels.get(LABEL_SHARD, ""),
            replica_id=labels.get(LABEL_REPLICA, ""),
            node_id=labels.get(LABEL_NODE, ""),
            cluster_id=labels.get(LABEL_CLUSTER, ""),
            image=str(config.get("Image", "")),
            running=running,
            pid=int(state.get("Pid") or 0) if running else 0,
            port=_loopback_port(attrs),
            exit_code=None if running else int(state.get("ExitCode") or 0),
            log_path=Path(log_label) if log_label else None,
        )


def _loopback_port(attrs: Mapping[str, Any]) -> int:
    bindings = (attrs.get("HostConfig") or {}).get("PortBindings") or {}
    for binds in bindings.values():
        for bind in binds or ():
            if bind.get("HostIp") == "127.0.0.1" and str(bind.get("HostPort", "")).isdigit():
                return int(bind["HostPort"])
    return 0
