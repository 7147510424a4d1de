"""What this node has (CPUs, memory, disk, GPUs, engines, fabrics, model sources) as one
:class:`pb.Inventory`, what it cannot run although it is configured to (``degraded``, with
reasons), and a watcher that tells the control plane when that changes in a way worth telling.

A node is **degraded** (DESIGN §5) when it declares GPUs (agent.yaml names ``nvidia-smi``, or
NVIDIA GPUs are on its PCI bus) and none is usable, when an engine it has will not run, when
a fabric it is stated to be on is down, or when its runtime is docker and dockerd cannot be
reached. Each reason says what to install or fix; the control plane keeps the node from what
a reason names (llmgw.server.fleet.placement) and places the rest there as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery import (
    DEFAULT_PCI_ROOT,
    DRIVER_FIX,
    GpuFacts,
    check_candidate,
    check_engines,
    discover_gpus,
    discover_ib,
    engine_candidates,
    fabric_status,
    nvidia_pci_gpus,
    sim_engine,
)
from llmgw.agent.discovery.docker import docker_problem
from llmgw.agent.models_dir import SourceStore
from llmgw.contracts.inventory import DegradedCode
from llmgw.engines.registry import AVAILABLE_ENGINES, ENGINES
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "InventoryWatcher",
    "collect_inventory",
    "degraded_reasons",
    "disk_usage",
    "meminfo",
    "worth_telling",
]

log = logging.getLogger("llmgw.agent.inventory")

GIB = 1024**3


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """Bytes for each /proc/meminfo line given in kB."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[name] = int(fields[0]) * (1024 if len(fields) > 1 and fields[1] == "kB" else 1)
    except OSError:
        pass
    return out


def disk_usage(path: Path) -> tuple[int, int]:
    """``(total, free)`` bytes of the file system holding ``path``, or of its nearest
    existing parent (models_root may not be created yet). Free is what a non-root user
    may use. Raises OSError when nothing on the way can be read."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def collect_inventory(
    cfg: AgentConfig | None = None,
    *,
    engines: Sequence[pb.EngineInfo] | None = None,
    pci_root: Path = DEFAULT_PCI_ROOT,
    gpu_health: Mapping[str, str] | None = None,
    warm: Sequence[pb.WarmStatus] = (),
) -> pb.Inventory:
    """Look at the node now. ``engines`` are engine checks already made (the watcher reuses
    them while the programs are unchanged); without them the engines are run here. Without
    ``cfg`` only what needs no configuration is reported (default GPU discovery, sim), and
    nothing is called degraded. ``pci_root`` is where the PCI bus is read (sysfs).
    ``gpu_health``: why GPUs are unhealthy, by uuid (llmgw.agent.discovery.xid); ``warm``:
    the sources kept in the page cache (llmgw.agent.warming)."""
    mem = meminfo()
    gpus = discover_gpus(cfg.discovery.nvidia_smi if cfg is not None else None)
    for gpu in gpus.gpus:
        gpu.health = (gpu_health or {}).get(gpu.uuid, "")
    inv = pb.Inventory(
        hostname=socket.gethostname(),
        arch=platform.machine(),
        cpus=os.cpu_count() or 0,
        memory_total_bytes=mem.get("MemTotal", 0),
        memory_available_bytes=mem.get("MemAvailable", 0),
        gpus=gpus.gpus,
        gpu_status=gpus.status,
        driver_version=gpus.driver_version,
        gpu_source=gpus.source,
    )
    if gpus.gpus:
        inv.warnings.extend(gpus.warnings)  # with no GPUs, the status says it all
    if cfg is None:
        details = list(engines) if engines is not None else [sim_engine()]
    else:
        details = list(engines) if engines is not None else check_engines(cfg)
        try:
            inv.disk_total_bytes, inv.disk_free_bytes = disk_usage(cfg.models_root)
        except OSError as exc:
            inv.warnings.append(f"cannot read disk space of models_root {cfg.models_root}: {exc}")
        inv.ib_adapters.extend(discover_ib(cfg.discovery.ib_root))
        fabrics, warnings = fabric_status(
            cfg.fabrics, list(inv.ib_adapters), ib_root=cfg.discovery.ib_root
        )
        inv.fabrics.extend(fabrics)
        inv.warnings.extend(warnings)
        _add_sources(inv, cfg)
        inv.multinode_ports = str(cfg.multinode_ports)
    inv.engine_details.extend(details)
    inv.warm.extend(warm)
    inv.engines.extend(e.name for e in details if e.ok and e.name in AVAILABLE_ENGINES)
    inv.warnings.extend(
        f"engine {e.name}{f' ({e.path})' if e.path else ''} will not run: {e.problem}"
        for e in details
        if not e.ok
    )
    if cfg is not None:
        inv.degraded.extend(
            degraded_reasons(
                cfg,
                inv,
                gpus,
                pci_gpus=nvidia_pci_gpus(pci_root),
                docker=docker_problem(cfg.docker.host) if cfg.runtime == "docker" else "",
            )
        )
    return inv


def _add_sources(inv: pb.Inventory, cfg: AgentConfig) -> None:
    """The model sources under models_root, where it may fetch others from, and what it
    fetched already (:mod:`llmgw.agent.models_dir`); placement checks profiles against them."""
    store = SourceStore(cfg.models_root, cfg.cache_root, install_sources=cfg.install_sources)
    sources, warnings = store.listing()
    inv.sources.CopyFrom(sources)
    inv.warnings.extend(warnings)


def _gpus_declared(cfg: AgentConfig, pci_gpus: Sequence[str]) -> str:
    """What says this node has GPUs, in words; '' when nothing does."""
    if pci_gpus:
        shown = ", ".join(pci_gpus[:4]) + (", ..." if len(pci_gpus) > 4 else "")
        count = f"{len(pci_gpus)} NVIDIA GPU" + ("s are" if len(pci_gpus) > 1 else " is")
        return f"{count} on the PCI bus ({shown})"
    if cfg.discovery.nvidia_smi is not None:
        return f"agent.yaml names nvidia-smi ({cfg.discovery.nvidia_smi}) in discovery.nvidia_smi"
    return ""


def _engine_fix(cfg: AgentConfig, engine: str) -> str:
    setting = ENGINES[engine].program_setting if engine in ENGINES else None
    where = (
        f"point engines.{engine}.{setting} in {cfg.source or 'agent.yaml'} at one that runs, or "
        if setting
        else ""
    )
    return (
        f"install what it lacks, {where}reinstall it (llmgw ctl engines install {cfg.node_id} "
        f"{engine} VERSION --url URL --sha256 SUM); models on {engine} are not placed on this "
        "node until it runs"
    )


def degraded_reasons(
    cfg: AgentConfig,
    inv: pb.Inventory,
    gpus: GpuFacts,
    *,
    pci_gpus: Sequence[str],
    docker: str,
) -> list[pb.DegradedReason]:
    """Why this node cannot run all it is configured to, from what was just found: the
    inventory (engines, fabrics, GPUs), the GPU facts behind it, the NVIDIA GPUs on the PCI
    bus, and why dockerd cannot be reached (``docker``; '' when it can, or is not used)."""
    reasons: list[pb.DegradedReason] = []
    if docker:
        reasons.append(pb.DegradedReason(code=DegradedCode.DOCKER, message=docker))
    declared = _gpus_declared(cfg, pci_gpus)
    if declared and not inv.gpus:
        message = f"{declared}, but no GPU is usable: {gpus.status or 'none was found'}"
        if gpus.no_driver:
            message += f"; {DRIVER_FIX}"
        message += "; models that need GPUs are not placed on this node until then"
        reasons.append(pb.DegradedReason(code=DegradedCode.GPUS, message=message))
    for engine in inv.engine_details:
        if engine.ok:
            continue
        at = f" ({engine.path})" if engine.path else ""
        reasons.append(
            pb.DegradedReason(
                code=DegradedCode.ENGINE,
                engine=engine.name,
                message=f"engine {engine.name}{at} will not run: {engine.problem}; "
                + _engine_fix(cfg, engine.name),
            )
        )
    for fabric in inv.fabrics:
        if fabric.healthy:
            continue
        prefix = f"fabric {fabric.name}: "
        problems = [w.removeprefix(prefix) for w in inv.warnings if w.startswith(prefix)]
        why = "; ".join(problems) or f"adapters {', '.join(fabric.hcas)} are not all active"
        reasons.append(
            pb.DegradedReason(
                code=DegradedCode.FABRIC,
                fabric=fabric.name,
                message=f"fabric {fabric.name} is down: {why}; multi-node replicas over "
                f"{fabric.name} are not placed on this node until it is back",
            )
        )
    return reasons


def _coarse(inv: pb.Inventory) -> pb.Inventory:
    # Free memory, free disk and GPU memory in use move all the time; only a whole GiB counts.
    # A GPU's utilisation moves every second and counts not at all: the heartbeat carries it
    # (llmgw.agent.gpu_sampler), so that it never costs an inventory and a store write.
    copy = pb.Inventory()
    copy.CopyFrom(inv)
    copy.memory_available_bytes = inv.memory_available_bytes // GIB
    copy.disk_free_bytes = inv.disk_free_bytes // GIB
    for gpu in copy.gpus:
        gpu.memory_used_mib //= 1024
        gpu.ClearField("utilization_percent")
    return copy


def worth_telling(old: pb.Inventory, new: pb.Inventory) -> bool:
    """Whether ``new`` differs from ``old`` by more than churn: any change of GPUs, engines,
    fabrics, warnings or status, or a whole GiB of free memory, free disk or GPU memory used.
    A change of GPU utilisation alone is never worth it (the heartbeat carries that)."""
    return _coarse(old) != _coarse(new)


def _changed_fields(old: pb.Inventory, new: pb.Inventory) -> list[str]:
    a, b = _coarse(old), _coarse(new)
    return [
        f.name for f in pb.Inventory.DESCRIPTOR.fields if getattr(a, f.name) != getattr(b, f.name)
    ]


def _log_degraded(old: pb.Inventory, new: pb.Inventory) -> None:
    """Say on the node (its journal) each reason to be degraded that is new, and when the
    last one is gone: the operator on the node reads what to fix there too."""
    before = {(d.code, d.engine, d.fabric, d.message) for d in old.degraded}
    for reason in new.degraded:
        if (reason.code, reason.engine, reason.fabric, reason.message) not in before:
            log.warning(
                "node degraded",
                extra=kv(code=reason.code, reason=reason.message),
            )
    if old.degraded and not new.degraded:
        log.info("node no longer degraded")


class InventoryWatcher:
    """Re-collects the inventory every ``interval`` seconds and calls ``send`` with it when it
    changed in a way worth telling. ``current`` is always the last one collected (a Hello
    carries it). Engines are run again only when their programs change, when one failed,
    or every ``engine_interval`` seconds: ``vllm --version`` alone takes seconds of CPU."""

    def __init__(
        self,
        cfg: AgentConfig,
        send: Callable[[pb.Inventory], bool],
        *,
        interval: float = 30.0,
        engine_interval: float = 600.0,
        pci_root: Path = DEFAULT_PCI_ROOT,
        gpu_health: Callable[[], Mapping[str, str]] = dict,
        warm: Callable[[], Sequence[pb.WarmStatus]] = tuple,
    ) -> None:
        self.cfg = cfg
        self.gpu_health = gpu_health
        # The sources kept warm (llmgw.agent.warming), read at each look.
        self.warm = warm
        self.send = send
        self.interval = interval
        self.engine_interval = engine_interval
        self.pci_root = pci_root
        self._engines: list[pb.EngineInfo] = []
        self._engine_key: tuple[object, ...] | None = None
        self._engines_at = 0.0
        # Collected now, so that the first Hello has it.
        self.current: pb.Inventory = self.collect()
        self._told = self.current
        _log_degraded(pb.Inventory(), self.current)

    def collect(self) -> pb.Inventory:
        """Look at the node now (blocking: it runs programs)."""
        candidates = engine_candidates(self.cfg)
        key = tuple(c.fingerprint() for c in candidates)
        now = time.monotonic()
        if (
            key != self._engine_key
            or now - self._engines_at >= self.engine_interval
            or not all(e.ok for e in self._engines)
        ):
            self._engines = [sim_engine(), *(check_candidate(c) for c in candidates)]
            self._engine_key, self._engines_at = key, now
        return collect_inventory(
            self.cfg,
            engines=self._engines,
            pci_root=self.pci_root,
            gpu_health=self.gpu_health(),
            warm=self.warm(),
        )

    def update(self, inv: pb.Inventory) -> bool:
        """Take a fresh inventory; send it when worth telling. True when it was."""
        self.current = inv
        if not worth_telling(self._told, inv):
            return False
        changed = _changed_fields(self._told, inv)
        _log_degraded(self._told, inv)
        self._told = inv  # not connected: the next Hello carries it, so it counts as told
        try:
            sent = self.send(inv)
        except Exception:
            log.exception("could not send the inventory")
            sent = False
        log.info("inventory changed", extra=kv(changed=",".join(changed), sent=str(sent).lower()))
        return True

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                inv = await asyncio.to_thread(self.collect)
            except Exception:
                log.exception("collecting the inventory failed; trying again next time")
                continue
            self.update(inv)
