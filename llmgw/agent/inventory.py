"""What this node has: CPUs, memory, architecture, engines, and why it has no GPUs if so."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

from llmgw.engines.launch import AVAILABLE_ENGINES
from llmgw.proto import control_pb2 as pb

__all__ = ["collect_inventory", "meminfo"]


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


def _gpu_status() -> str:
    # Full NVML discovery arrives with the node-service work; until then the inventory still
    # says why there are no GPUs rather than reporting a silent zero.
    if not Path("/proc/driver/nvidia").exists():
        return "no NVIDIA driver loaded (/proc/driver/nvidia is missing)"
    return "NVIDIA driver present; GPU discovery is not enabled in this agent version"


def collect_inventory() -> pb.Inventory:
    mem = meminfo()
    return pb.Inventory(
        hostname=socket.gethostname(),
        arch=platform.machine(),
        cpus=os.cpu_count() or 0,
        memory_total_bytes=mem.get("MemTotal", 0),
        memory_available_bytes=mem.get("MemAvailable", 0),
        gpu_status=_gpu_status(),
        engines=list(AVAILABLE_ENGINES),
    )
