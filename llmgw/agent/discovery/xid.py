"""XID errors of this node's GPUs, as NVML reports them while the agent runs: an event set
(``nvmlEventSetCreate``) with each GPU registered for ``nvmlEventTypeXidCriticalError``
(``nvmlDeviceRegisterEvents``), waited on off the event loop (``nvmlEventSetWait_v2``).

A GPU that reports an XID other than the application errors (13, 31, 43, 45, 68: a program's
fault, the GPU is fine; the list NVIDIA's Kubernetes device plugin skips) is unhealthy for
as long as the agent runs: the inventory carries why in ``Gpu.health`` and the control
plane takes it out of placement. It is never marked healthy again here: an XID that needs
attention needs a GPU reset or a reboot, after which the agent starts afresh. NVML reports
only XIDs after registration; one from before (in the kernel log) shows as a GPU that NVML
calls lost, which the control plane marks unhealthy when it vanishes from the inventory.

Never raises: without NVML, or on a GPU that cannot report XIDs, it watches what it can and
says what it cannot in :attr:`XidWatch.problem`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from llmgw.log import kv

__all__ = ["APPLICATION_XIDS", "XidWatch", "xid_text"]

log = logging.getLogger("llmgw.agent.discovery")

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
_XID_NAMES = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
_XID_EVENT = 0x0000000000000008  # nvmlEventTypeXidCriticalError, where pynvml lacks the name


def xid_text(xid: int) -> str:
    """``XID 79: GPU has fallen off the bus``: how ``Gpu.health`` says it."""
    name = _XID_NAMES.get(xid)
    return f"XID {xid}: {name}" if name else f"XID {xid}"


class XidWatch:
    """One NVML event set for this node's GPUs. :meth:`start` (blocking) registers them;
    :meth:`run` waits for events until cancelled; :meth:`health` is each unhealthy GPU's
    reason by uuid."""

    def __init__(self, wait_ms: int = 1000) -> None:
        self.wait_ms = wait_ms
        self.problem = ""
        self._nvml: Any = None
        self._set: Any = None
        self._uuids: list[str] = []
        self._lock = threading.Lock()
        self._health: dict[str, str] = {}

    def health(self) -> dict[str, str]:
        with self._lock:
            return dict(self._health)

    def start(self) -> bool:
        """Open NVML and register every GPU it lists for XID events; False (and
        :attr:`problem`) when none can be watched."""
        try:
            import pynvml
        except ImportError:
            self.problem = "XIDs not watched: nvidia-ml-py is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            self.problem = f"XIDs not watched: NVML: {exc}"
            return False
        self._nvml = pynvml
        xid_event = getattr(pynvml, "nvmlEventTypeXidCriticalError", _XID_EVENT)
        skipped: list[str] = []
        try:
            self._set = pynvml.nvmlEventSetCreate()
            for index in range(pynvml.nvmlDeviceGetCount()):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                    if not pynvml.nvmlDeviceGetSupportedEventTypes(handle) & xid_event:
                        skipped.append(f"GPU {index}: cannot report XIDs")
                        continue
                    pynvml.nvmlDeviceRegisterEvents(handle, xid_event, self._set)
                except pynvml.NVMLError as exc:
                    skipped.append(f"GPU {index}: {exc}")
                    continue
                self._uuids.append(uuid)
        except Exception as exc:
            self.problem = f"XIDs not watched: NVML: {exc}"
            self.close()
            return False
        if skipped:
            self.problem = "XIDs not watched on " + "; ".join(skipped)
        if not self._uuids:
            self.close()
            return False
        return True

    def poll(self, wait_ms: int) -> list[str]:
        """Wait up to ``wait_ms`` for events and take every one pending (blocking); the
        uuids of the GPUs that turned unhealthy."""
        pynvml = self._nvml
        if pynvml is None or self._set is None:
            return []
        turned: list[str] = []
        timeout = wait_ms
        while True:
            try:
                event = pynvml.nvmlEventSetWait_v2(self._set, timeout)
            except pynvml.NVMLError_Timeout:
                return turned
            timeout = 0  # the rest already pending
            xid = int(event.eventData)
            if xid in APPLICATION_XIDS:
                log.info("GPU XID of an application; the GPU stays healthy", extra=kv(xid=xid))
                continue
            try:
                uuids = [_text(pynvml.nvmlDeviceGetUUID(event.device))]
            except pynvml.NVMLError:
                # NVML cannot say which GPU (it is lost): as NVIDIA's device plugin does,
                # every GPU watched is suspect rather than none.
                uuids = list(self._uuids)
            with self._lock:
                for uuid in uuids:
                    if uuid not in self._health:
                        self._health[uuid] = xid_text(xid)
                        turned.append(uuid)
                        log.warning("GPU unhealthy", extra=kv(gpu=uuid, reason=self._health[uuid]))

    async def run(self, on_change: Callable[[], object]) -> None:
        """Wait for XIDs until cancelled; ``on_change()`` after a GPU turned unhealthy."""
        while True:
            try:
                turned = await asyncio.to_thread(self.poll, self.wait_ms)
            except Exception:
                log.exception("waiting for GPU XID events failed; watching stops")
                return
            if turned:
                result = on_change()
                if asyncio.iscoroutine(result):
                    await result

    def close(self) -> None:
        pynvml, self._nvml = self._nvml, None
        if pynvml is None:
            return
        if self._set is not None:
            with contextlib.suppress(Exception):
                pynvml.nvmlEventSetFree(self._set)
            self._set = None
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
