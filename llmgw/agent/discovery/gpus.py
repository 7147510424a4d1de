"""GPUs of this node: through NVML, else ``nvidia-smi`` (forced by ``discovery.nvidia_smi``);
and the NVIDIA GPUs on its PCI bus (sysfs), which are there whether a driver is or not.

Never raises for what it finds: a missing driver or a hung ``nvidia-smi`` is a ``status``
in operator words, a GPU left out (MIG mode, lost after an XID error) a warning.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmgw.agent.discovery.probe import c_locale, cannot_run, exit_text, summary
from llmgw.procutil import run_to_end
from llmgw.proto import control_pb2 as pb

__all__ = [
    "DEFAULT_PCI_ROOT",
    "DRIVER_FIX",
    "NO_GPUS_VISIBLE",
    "NVIDIA_SMI_ARGS",
    "NVIDIA_SMI_FIELDS",
    "NVIDIA_SMI_TIMEOUT",
    "NVML_VERSION_MISMATCH",
    "GpuFacts",
    "GpuSource",
    "discover_gpus",
    "each_source",
    "nvidia_pci_gpus",
    "parse_nvidia_smi",
]

log = logging.getLogger("llmgw.agent.discovery")

GpuSource = Literal["nvml", "nvidia-smi", ""]

NVIDIA_SMI_TIMEOUT = 10.0
NVIDIA_SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "driver_version",
    "utilization.gpu",
)
# The fields after the name: a name with a comma in it is what lies between uuid and these.
_AFTER_NAME = len(NVIDIA_SMI_FIELDS) - 3
NVIDIA_SMI_ARGS = (
    "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS),
    "--format=csv,noheader,nounits",
)
NVML_VERSION_MISMATCH = (
    "NVML: driver/library version mismatch (the NVIDIA driver was upgraded but the loaded "
    "kernel module is the old one); reboot the node, or reload the nvidia kernel modules"
)
NO_GPUS_VISIBLE = (
    "driver loaded, 0 GPUs visible (check CUDA_VISIBLE_DEVICES / container device requests)"
)

DRIVER_FIX = (
    "install the NVIDIA driver (Debian/Ubuntu: apt install nvidia-driver, or the CUDA "
    "repository's cuda-drivers; RHEL: dnf install cuda-drivers) and reboot; 'nvidia-smi' must "
    "then list the GPUs"
)
DEFAULT_PCI_ROOT = Path("/sys/bus/pci/devices")
NVIDIA_PCI_VENDOR = "0x10de"
# PCI classes of a GPU: VGA controller (0x0300) and 3D controller (0x0302, the data-centre
# boards); NVIDIA's audio, USB and NVSwitch functions are other classes.
_GPU_PCI_CLASSES = ("0x0300", "0x0302")
_NO_DRIVER_SMI = "couldn't communicate with the NVIDIA driver"

_MIB = 1024 * 1024


@dataclass
class GpuFacts:
    """The GPUs found, and when there are none, why (``status``); ``warnings`` name GPUs
    that are there but left out (MIG mode, lost after an XID error), in operator words."""

    gpus: list[pb.Gpu] = field(default_factory=list)
    driver_version: str = ""
    status: str = ""
    source: GpuSource = ""
    warnings: list[str] = field(default_factory=list)
    # No NVIDIA driver answers at all (not a hung or mismatched one): the fix is DRIVER_FIX.
    no_driver: bool = False


@dataclass(frozen=True)
class _NvmlFailure:
    text: str
    # The library or the kernel driver is missing (True), an NVML error (False), or NVML
    # could not be asked at all (None: nvidia-ml-py is not there; nvidia-smi decides).
    no_driver: bool | None


def discover_gpus(nvidia_smi: Path | None = None) -> GpuFacts:
    """GPUs through NVML, or through ``nvidia_smi`` when it is given or NVML fails.
    Never raises: what went wrong is in ``status``."""
    try:
        return _discover_gpus(nvidia_smi)
    except Exception as exc:  # a discovery bug must not take the agent down
        log.exception("GPU discovery failed")
        return GpuFacts(status=f"GPU discovery failed unexpectedly: {type(exc).__name__}: {exc}")


def _discover_gpus(nvidia_smi: Path | None) -> GpuFacts:
    if nvidia_smi is not None:
        return _from_nvidia_smi(str(nvidia_smi))
    nvml = _from_nvml()
    if isinstance(nvml, GpuFacts):
        return nvml
    found = shutil.which("nvidia-smi")
    if found is None:
        if nvml.no_driver:
            return GpuFacts(
                status=f"no NVIDIA driver: {nvml.text} and no nvidia-smi on PATH", no_driver=True
            )
        return GpuFacts(status=f"{nvml.text}; no nvidia-smi on PATH to fall back to")
    facts = _from_nvidia_smi(found)
    if facts.status and not facts.source:
        facts.status = f"{nvml.text}; {facts.status}"
        if nvml.no_driver is not None:  # NVML knows better than nvidia-smi's words
            facts.no_driver = nvml.no_driver
    return facts


def each_source(nvidia_smi: Path | None = None) -> dict[str, GpuFacts]:
    """What each way of looking sees, side by side (``llmgw agent inventory --sources``,
    scripts/gpu-check.sh): NVML, and ``nvidia_smi`` (else the one on PATH). Never raises."""
    nvml = _from_nvml()
    if not isinstance(nvml, GpuFacts):
        nvml = GpuFacts(status=nvml.text, no_driver=bool(nvml.no_driver))
    program = str(nvidia_smi) if nvidia_smi is not None else shutil.which("nvidia-smi")
    smi = (
        _from_nvidia_smi(program)
        if program is not None
        else GpuFacts(status="no nvidia-smi on PATH", no_driver=True)
    )
    return {"nvml": nvml, "nvidia-smi": smi}


def nvidia_pci_gpus(pci_root: Path = DEFAULT_PCI_ROOT) -> list[str]:
    """The PCI addresses of the NVIDIA GPUs in ``pci_root`` (``/sys/bus/pci/devices``),
    sorted; sysfs lists them with or without a driver. [] when it cannot be read."""
    found = []
    try:
        devices = sorted(pci_root.iterdir())
    except OSError:
        return []
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip().lower()
            pci_class = (device / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and pci_class.startswith(_GPU_PCI_CLASSES):
            found.append(device.name)
    return found


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _from_nvml() -> GpuFacts | _NvmlFailure:
    try:
        import pynvml
    except ImportError:
        return _NvmlFailure("NVML unavailable: nvidia-ml-py is not installed", no_driver=None)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return _NvmlFailure("NVML library not found (libnvidia-ml.so.1)", no_driver=True)
    except pynvml.NVMLError_DriverNotLoaded:
        return _NvmlFailure(
            "NVIDIA kernel driver not loaded (NVML: Driver Not Loaded)", no_driver=True
        )
    except pynvml.NVMLError_LibRmVersionMismatch:
        return _NvmlFailure(NVML_VERSION_MISMATCH, no_driver=False)
    except Exception as exc:
        return _NvmlFailure(f"NVML error: {exc}", no_driver=False)
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus: list[pb.Gpu] = []
        warnings: list[str] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                gpu = _nvml_gpu(pynvml, index)
            except pynvml.NVMLError as exc:
                # One GPU in trouble (lost after an XID error, say) hides not the others.
                warnings.append(_nvml_gpu_problem(pynvml, index, exc))
                continue
            if isinstance(gpu, str):
                warnings.append(gpu)
            else:
                gpus.append(gpu)
    except Exception as exc:
        return _NvmlFailure(f"NVML error: {exc}", no_driver=False)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    if not gpus:
        status = "; ".join(warnings) if warnings else NO_GPUS_VISIBLE
        return GpuFacts(driver_version=driver, status=status, source="nvml", warnings=warnings)
    return GpuFacts(gpus=gpus, driver_version=driver, source="nvml", warnings=warnings)


def _nvml_gpu(pynvml: Any, index: int) -> pb.Gpu | str:
    """GPU ``index`` as NVML sees it, or why it is left out (MIG mode)."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    try:
        mig_mode = pynvml.nvmlDeviceGetMigMode(handle)[0]
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        mig_mode = pynvml.NVML_DEVICE_MIG_DISABLE  # a GPU or driver without MIG
    if mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
        # CUDA sees a MIG-mode GPU only through its MIG instances: an engine given the whole
        # GPU would find no device.
        return (
            f"GPU {index} ({uuid}) is left out: it is in MIG mode, and llmgw places engines on "
            f"whole GPUs; to use it, disable MIG: nvidia-smi -i {index} -mig 0 (then reset it)"
        )
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return pb.Gpu(
        index=index,
        uuid=uuid,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_mib=int(memory.total) // _MIB,
        memory_used_mib=int(memory.used) // _MIB,
        utilization_percent=_nvml_utilization(pynvml, handle),
    )


def _nvml_utilization(pynvml: Any, handle: Any) -> int | None:
    """Percent of the last sample period a kernel ran on the GPU; None when it cannot tell
    (vGPU and some boards answer Not Supported). A figure to show, never a reason to leave
    the GPU out; only a lost GPU is (the caller says why)."""
    try:
        percent = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None
    return percent if 0 <= percent <= 100 else None


def _nvml_gpu_problem(pynvml: Any, index: int, exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError_GpuIsLost):
        return (
            f"GPU {index} is left out: NVML says 'GPU is lost' (it fell off the bus or needs "
            f"a reset after an XID error); see 'dmesg | grep -i xid' and 'nvidia-smi -q -i "
            f"{index}', then reset the GPU (nvidia-smi -r -i {index}) or reboot the node"
        )
    return f"GPU {index} is left out: NVML error: {exc}"


def _from_nvidia_smi(program: str) -> GpuFacts:
    try:
        result = run_to_end([program, *NVIDIA_SMI_ARGS], NVIDIA_SMI_TIMEOUT, env=c_locale())
    except subprocess.TimeoutExpired:
        return GpuFacts(
            status=f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT:g} s; the driver may "
            "be hung (check 'dmesg | grep -i nvrm')"
        )
    except OSError as exc:
        # nvidia-smi comes with the driver: where it is not, neither is the driver.
        return GpuFacts(
            status=cannot_run(program, exc), no_driver=isinstance(exc, FileNotFoundError)
        )
    output = result.stdout + "\n" + result.stderr
    if result.returncode == 6 or "No devices were found" in output:
        # Exit 6 is NVML_ERROR_NOT_FOUND: the driver answered and there is nothing to see.
        return GpuFacts(status=NO_GPUS_VISIBLE, source="nvidia-smi")
    if result.returncode != 0:
        return GpuFacts(
            status=f"nvidia-smi failed ({exit_text(result.returncode)}): {summary(result)}",
            no_driver=_NO_DRIVER_SMI in output,
        )
    gpus, driver, problem = parse_nvidia_smi(result.stdout)
    if problem:
        return GpuFacts(status=problem)
    if not gpus:
        return GpuFacts(driver_version=driver, status=NO_GPUS_VISIBLE, source="nvidia-smi")
    return GpuFacts(gpus=gpus, driver_version=driver, source="nvidia-smi")


def _unknown(value: str) -> bool:
    # nvidia-smi writes "[N/A]", "[Not Supported]", "[Unknown Error]" for what it cannot tell.
    return value == "" or value == "N/A" or (value.startswith("[") and value.endswith("]"))


def _mib(value: str) -> int | None:
    if _unknown(value):
        return 0
    value = value.removesuffix("MiB").strip()
    return int(value) if value.isdigit() else None


def _percent(value: str) -> int | None:
    # "[N/A]", "[Not Supported]": the GPU cannot tell (None, not 0: 0 is an idle GPU). A
    # figure to show: what is not a percent is unknown too, never a reason to lose the GPUs.
    value = value.removesuffix("%").strip()
    if not value.isdigit():
        return None
    percent = int(value)
    return percent if percent <= 100 else None


def parse_nvidia_smi(text: str) -> tuple[list[pb.Gpu], str, str]:
    """``(gpus, driver_version, problem)`` from the CSV of ``nvidia-smi --query-gpu``;
    ``problem`` says which line was not understood (and then there are no GPUs)."""
    gpus: list[pb.Gpu] = []
    driver = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        fields = [part.strip() for part in line.split(",")]
        if len(fields) > len(NVIDIA_SMI_FIELDS):  # a name with a comma in it
            name_parts = fields[2:-_AFTER_NAME]
            fields = [fields[0], fields[1], ", ".join(name_parts), *fields[-_AFTER_NAME:]]
        reason = ""
        if len(fields) < len(NVIDIA_SMI_FIELDS):
            reason = f"{len(fields)} fields"
        else:
            index, uuid, name, total, used, version, utilization = fields
            total_mib, used_mib = _mib(total), _mib(used)
            if not index.isdigit():
                reason = f"GPU index {index!r} is not a number"
            elif total_mib is None or used_mib is None:
                reason = f"memory {total!r}/{used!r} is not a number of MiB"
            else:
                gpus.append(
                    pb.Gpu(
                        index=int(index),
                        uuid="" if _unknown(uuid) else uuid,
                        name="" if _unknown(name) else name,
                        memory_total_mib=total_mib,
                        memory_used_mib=used_mib,
                        utilization_percent=_percent(utilization),
                    )
                )
                if not driver and not _unknown(version):
                    driver = version
        if reason:
            return (
                [],
                "",
                f"nvidia-smi output line {number} is not understood ({reason}): {line[:160]!r}; "
                f"expected {len(NVIDIA_SMI_FIELDS)} comma-separated fields: "
                + ", ".join(NVIDIA_SMI_FIELDS),
            )
    return gpus, driver, ""
