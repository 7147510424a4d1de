"""What a node finds out by looking (DESIGN §5): its GPUs (:mod:`.gpus`: NVML, else
``nvidia-smi``; the NVIDIA GPUs on its PCI bus), whether its Docker daemon answers
(:mod:`.docker`, for ``runtime: docker``), its InfiniBand adapters and fabrics (:mod:`.fabrics`: sysfs), and the
engines it can run (:mod:`.engines`: by running them, through :mod:`.probe`).

Nothing here raises for what it finds: a missing driver, a broken binary or an absent
adapter becomes a status, a ``problem`` or a warning in operator words. This package's
public face is what the agent's inventory and ``llmgw engine-check`` use.
"""

from __future__ import annotations

from llmgw.agent.discovery.engines import (
    ENGINE_MANIFEST,
    EngineCandidate,
    check_candidate,
    check_engine_binary,
    check_engines,
    engine_candidates,
    missing_libraries,
    sim_engine,
)
from llmgw.agent.discovery.fabrics import discover_ib, fabric_status
from llmgw.agent.discovery.gpus import (
    DEFAULT_PCI_ROOT,
    DRIVER_FIX,
    NO_GPUS_VISIBLE,
    NVML_VERSION_MISMATCH,
    GpuFacts,
    discover_gpus,
    each_source,
    nvidia_pci_gpus,
    parse_nvidia_smi,
)

__all__ = [
    "DEFAULT_PCI_ROOT",
    "DRIVER_FIX",
    "ENGINE_MANIFEST",
    "NO_GPUS_VISIBLE",
    "NVML_VERSION_MISMATCH",
    "EngineCandidate",
    "GpuFacts",
    "check_candidate",
    "check_engine_binary",
    "check_engines",
    "discover_gpus",
    "discover_ib",
    "each_source",
    "engine_candidates",
    "fabric_status",
    "missing_libraries",
    "nvidia_pci_gpus",
    "parse_nvidia_smi",
    "sim_engine",
]
