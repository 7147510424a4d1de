"""Each GPU's utilisation, sampled about once a heartbeat interval for the heartbeat to carry.

Utilisation moves every second. The inventory is looked at every 30 s and sent only on a
change worth telling (:func:`llmgw.agent.inventory.worth_telling` ignores utilisation), and the
control plane stores every inventory it gets; the heartbeat goes every few seconds anyway and
the control plane keeps what it carries in the node's session, in memory. So the figure rides
on the heartbeat: fresh to within an interval or two, and never a store write.

Sampling is GPU discovery itself (NVML, else nvidia-smi: :func:`discover_gpus`), so that the
figure is read the way the inventory's GPUs are; it runs off the event loop, and only while the
inventory has GPUs (a node without them runs nothing for it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from llmgw.agent.discovery import GpuFacts, discover_gpus
from llmgw.contracts.inventory import MAX_GPU_UUID, MAX_HEARTBEAT_GPUS
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = ["GpuSampler", "utilization_of"]

log = logging.getLogger("llmgw.agent.gpu_sampler")


def utilization_of(facts: GpuFacts) -> list[pb.GpuUtilization]:
    """What a heartbeat carries of these GPU facts: each GPU's uuid and utilisation (unset
    where the GPU cannot tell), within what the control plane takes (the first
    MAX_HEARTBEAT_GPUS GPUs that have a uuid of at most MAX_GPU_UUID characters), so that a
    heartbeat is never over its size limit (a heartbeat dropped is a node lost)."""
    carried = [gpu for gpu in facts.gpus if gpu.uuid and len(gpu.uuid) <= MAX_GPU_UUID]
    return [
        pb.GpuUtilization(
            uuid=gpu.uuid,
            percent=gpu.utilization_percent if gpu.HasField("utilization_percent") else None,
        )
        for gpu in carried[:MAX_HEARTBEAT_GPUS]
    ]


class GpuSampler:
    """Samples every ``interval()`` seconds (the stream's heartbeat interval, read each time:
    the control plane's Welcome sets it) while ``has_gpus()``; :attr:`latest` is the last
    sample, [] before the first, without GPUs, and when a sample failed (an unknown figure
    rather than a stale one)."""

    def __init__(
        self,
        nvidia_smi: Path | None,
        has_gpus: Callable[[], bool],
        *,
        interval: Callable[[], float],
        discover: Callable[[Path | None], GpuFacts] = discover_gpus,
    ) -> None:
        self.nvidia_smi = nvidia_smi
        self.has_gpus = has_gpus
        self.interval = interval
        self._discover = discover
        self.latest: list[pb.GpuUtilization] = []
        self._said: str = ""  # the last failure logged, so that a lasting one is said once

    def sample(self) -> list[pb.GpuUtilization]:
        """Look now (blocking: NVML calls or an nvidia-smi run)."""
        if not self.has_gpus():
            return []
        facts = self._discover(self.nvidia_smi)
        if facts.status and not facts.gpus:
            if facts.status != self._said:
                log.warning(
                    "cannot sample GPU utilisation; it is shown as unknown until it can",
                    extra=kv(status=facts.status),
                )
            self._said = facts.status
        else:
            self._said = ""
        return utilization_of(facts)

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            await asyncio.sleep(self.interval())
            try:
                self.latest = await asyncio.to_thread(self.sample)
            except Exception:
                log.exception("sampling GPU utilisation failed; trying again next interval")
                self.latest = []
