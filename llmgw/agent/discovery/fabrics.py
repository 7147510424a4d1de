"""InfiniBand/RoCE adapters of this node (sysfs, ``/sys/class/infiniband``) and the health
of the fabrics agent.yaml says it is on: every stated adapter present with an ACTIVE port.

Never raises: an absent directory is no adapters, an adapter not ready a warning that says
what to check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmgw.agent.config import DEFAULT_IB_ROOT, FabricConfig
from llmgw.proto import control_pb2 as pb

__all__ = ["MAX_GIDS", "ZERO_GID", "active_ib_adapters", "discover_ib", "fabric_status"]

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MAX_GIDS = 16

_ACTIVE = "ACTIVE"


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _gids(gids_dir: Path) -> list[str]:
    gids = []
    for index in range(MAX_GIDS):
        # On RoCE an unpopulated entry reads as an error (EINVAL): just skip it.
        gid = _read(gids_dir / str(index))
        if gid and gid != ZERO_GID:
            gids.append(gid)
    return gids


def discover_ib(ib_root: Path = DEFAULT_IB_ROOT) -> list[pb.IbAdapter]:
    """The adapters in ``ib_root`` (``/sys/class/infiniband``) with their ports; [] when the
    directory is absent (no RDMA driver loaded)."""
    try:
        entries = sorted(
            (entry for entry in ib_root.iterdir() if entry.is_dir()), key=lambda p: _natural(p.name)
        )
    except OSError:
        return []
    adapters = []
    for entry in entries:
        try:
            port_dirs = [p for p in (entry / "ports").iterdir() if p.name.isdigit()]
        except OSError:
            port_dirs = []
        ports = [
            pb.IbPort(
                port=int(port_dir.name),
                state=_read(port_dir / "state"),
                link_layer=_read(port_dir / "link_layer"),
                rate=_read(port_dir / "rate"),
                gids=_gids(port_dir / "gids"),
            )
            for port_dir in sorted(port_dirs, key=lambda p: int(p.name))
        ]
        adapters.append(pb.IbAdapter(name=entry.name, ports=ports))
    return adapters


def _state_name(state: str) -> str:
    # sysfs writes "4: ACTIVE"; keep the name.
    return state.partition(":")[2].strip().upper() if ":" in state else state.strip().upper()


def active_ib_adapters(ib_root: Path = DEFAULT_IB_ROOT) -> list[str]:
    """The adapters in ``ib_root`` with an ACTIVE InfiniBand port, in natural order: what a
    bare fabric name (``--fabric ib-b``) takes at install. RoCE adapters (an Ethernet link
    layer) are left out: they are on an Ethernet network, named with their adapters."""
    return [
        adapter.name
        for adapter in discover_ib(ib_root)
        if any(
            _state_name(port.state) == _ACTIVE and port.link_layer.lower() == "infiniband"
            for port in adapter.ports
        )
    ]


def _port_hint(adapter: pb.IbAdapter) -> str:
    states = ", ".join(f"port {port.port}: {port.state or 'unknown'}" for port in adapter.ports)
    names = {_state_name(port.state) for port in adapter.ports}
    if names & {"INIT", "ARMED"}:
        return (
            f"({states}): the link is up but not activated; is a subnet manager running on "
            "this fabric? (check with 'sminfo')"
        )
    return f"({states}); check the cable and the switch port ('ibstat {adapter.name}')"


def fabric_status(
    fabrics: Sequence[FabricConfig],
    adapters: Sequence[pb.IbAdapter],
    *,
    ib_root: Path = DEFAULT_IB_ROOT,
) -> tuple[list[pb.Fabric], list[str]]:
    """A :class:`pb.Fabric` for each stated fabric, healthy when every stated adapter is
    present with an ACTIVE port, and a warning for each adapter that is not."""
    by_name = {adapter.name: adapter for adapter in adapters}
    present = ", ".join(by_name) or "none"
    result: list[pb.Fabric] = []
    warnings: list[str] = []
    for fabric in fabrics:
        healthy = True
        for hca in fabric.hcas:
            adapter = by_name.get(hca)
            if adapter is None:
                healthy = False
                warnings.append(
                    f"fabric {fabric.name}: adapter {hca} is not in {ib_root} (present: "
                    f"{present}); check the name with 'ibstat -l'"
                )
            elif not adapter.ports:
                healthy = False
                warnings.append(
                    f"fabric {fabric.name}: adapter {hca} has no ports in {ib_root / hca / 'ports'}"
                )
            elif not any(_state_name(port.state) == _ACTIVE for port in adapter.ports):
                healthy = False
                warnings.append(
                    f"fabric {fabric.name}: adapter {hca} has no ACTIVE port {_port_hint(adapter)}"
                )
        result.append(pb.Fabric(name=fabric.name, hcas=list(fabric.hcas), healthy=healthy))
    return result, warnings
