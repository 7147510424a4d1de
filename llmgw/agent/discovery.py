"""What a node finds out by looking: its GPUs (NVML, else ``nvidia-smi``), its InfiniBand
adapters and fabrics (sysfs), and the engines it can run (by running them).

Nothing here raises for what it finds: a missing driver, a broken binary or an absent
adapter becomes a status, a ``problem`` or a warning in operator words (DESIGN §5).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import llmgw
from llmgw.agent.config import DEFAULT_IB_ROOT, AgentConfig, FabricConfig
from llmgw.engines.launch import self_argv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "ENGINE_MANIFEST",
    "EngineCandidate",
    "GpuFacts",
    "check_candidate",
    "check_engine_binary",
    "check_engines",
    "discover_gpus",
    "discover_ib",
    "engine_candidates",
    "fabric_status",
    "missing_libraries",
    "parse_nvidia_smi",
    "sim_engine",
]

log = logging.getLogger("llmgw.agent.discovery")

GpuSource = Literal["nvml", "nvidia-smi", ""]

NVIDIA_SMI_TIMEOUT = 10.0
NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "driver_version")
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
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MAX_GIDS = 16
ENGINE_MANIFEST = "llmgw-engine.json"
VERSION_LIMIT = 200
SGLANG_PROBE = "import sglang, sys; print(sglang.__version__)"

_MIB = 1024 * 1024
_ACTIVE = "ACTIVE"


# -- running programs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Result:
    returncode: int
    stdout: str
    stderr: str


def _run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> _Result:
    """Run ``argv`` to the end. Raises OSError when it cannot start, and TimeoutExpired
    after killing its whole process group (a hung engine may have forked helpers)."""
    with subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return _Result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def _c_locale() -> dict[str, str]:
    # Read the environment now, not at import: PATH may have changed since.
    return {**os.environ, "LC_ALL": "C"}


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def _nonempty(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _summary(result: _Result, limit: int = 3) -> str:
    """The lines that say what went wrong: a traceback's last line, else the first few."""
    lines = _nonempty(result.stderr) or _nonempty(result.stdout)
    if not lines:
        return "(no output)"
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1][:300]
    return "; ".join(line[:300] for line in lines[:limit])


def _show(argv: Sequence[str]) -> str:
    return shlex.join(argv)


# -- GPUs -----------------------------------------------------------------------------------------


@dataclass
class GpuFacts:
    """The GPUs found, and when there are none, why (``status``); ``warnings`` name GPUs
    that are there but left out (MIG mode, lost after an XID error), in operator words."""

    gpus: list[pb.Gpu] = field(default_factory=list)
    driver_version: str = ""
    status: str = ""
    source: GpuSource = ""
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _NvmlFailure:
    text: str
    no_driver: bool  # the library or the kernel driver is missing, not an NVML error


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
            return GpuFacts(status=f"no NVIDIA driver: {nvml.text} and no nvidia-smi on PATH")
        return GpuFacts(status=f"{nvml.text}; no nvidia-smi on PATH to fall back to")
    facts = _from_nvidia_smi(found)
    if facts.status and not facts.source:
        facts.status = f"{nvml.text}; {facts.status}"
    return facts


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _from_nvml() -> GpuFacts | _NvmlFailure:
    try:
        import pynvml
    except ImportError:
        return _NvmlFailure("NVML unavailable: nvidia-ml-py is not installed", no_driver=False)
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
    )


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
        result = _run([program, *NVIDIA_SMI_ARGS], NVIDIA_SMI_TIMEOUT, env=_c_locale())
    except subprocess.TimeoutExpired:
        return GpuFacts(
            status=f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT:g} s; the driver may "
            "be hung (check 'dmesg | grep -i nvrm')"
        )
    except OSError as exc:
        return GpuFacts(status=_os_error(program, exc))
    output = result.stdout + "\n" + result.stderr
    if result.returncode == 6 or "No devices were found" in output:
        # Exit 6 is NVML_ERROR_NOT_FOUND: the driver answered and there is nothing to see.
        return GpuFacts(status=NO_GPUS_VISIBLE, source="nvidia-smi")
    if result.returncode != 0:
        return GpuFacts(
            status=f"nvidia-smi failed ({_exit_text(result.returncode)}): {_summary(result)}"
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
            fields = [fields[0], fields[1], ", ".join(fields[2:-3]), *fields[-3:]]
        reason = ""
        if len(fields) < len(NVIDIA_SMI_FIELDS):
            reason = f"{len(fields)} fields"
        else:
            index, uuid, name, total, used, version = fields
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


# -- InfiniBand -----------------------------------------------------------------------------------


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


# -- engines --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineCandidate:
    """An engine found on this node (configured, on PATH, or installed), not yet run."""

    name: str
    argv: tuple[str, ...]
    origin: str  # "engines.llamacpp.bin", "PATH", or the install manifest's path
    probes: tuple[tuple[str, ...], ...] = (("--version",), ("--help",))
    version: str = ""  # from an install manifest, used when the probe prints none
    problem: str = ""  # when it cannot even be tried (a broken install manifest)

    def fingerprint(self) -> tuple[object, ...]:
        """Changes when the program that would be run changes (path, size, mtime)."""
        path = self.argv[0] if self.argv else ""
        try:
            st = os.stat(path)
            stamp: tuple[int, ...] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except (OSError, ValueError):
            stamp = ()
        return (self.name, self.argv, self.probes, self.version, self.problem, stamp)


def sim_engine() -> pb.EngineInfo:
    """The built-in sim engine: always there, it is llmgw itself."""
    return pb.EngineInfo(name="sim", path=self_argv()[0], version=llmgw.__version__, ok=True)


def _os_error(path: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        if os.path.lexists(path):
            return (
                f"cannot run {path}: its program interpreter is missing (the '#!' line of a "
                "script, or the ELF loader of a build for another architecture or libc)"
            )
        return f"{path} does not exist"
    if exc.errno == errno.ENOEXEC:
        return (
            f"cannot run {path}: not an executable for this machine ({platform.machine()}); "
            "is it built for another architecture?"
        )
    if exc.errno == errno.EACCES:
        return f"cannot run {path}: permission denied (is it executable? chmod +x)"
    return f"cannot run {path}: {exc.strerror or exc}"


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"\x7fELF"
    except (OSError, ValueError):
        return False


def _elf_target(path: str) -> str | None:
    """``path`` when it is an ELF file, or the interpreter of a ``#!`` script when that is."""
    if _is_elf(path):
        return path
    try:
        with open(path, "rb") as file:
            head = file.readline(512)
    except (OSError, ValueError):
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].decode(errors="replace").split()
    if not words:
        return None
    interpreter = words[0]
    if os.path.basename(interpreter) == "env":
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        found = shutil.which(names[0]) if names else None
        if found is None:
            return None
        interpreter = found
    return interpreter if _is_elf(interpreter) else None


def missing_libraries(path: str) -> list[str]:
    """The ``ldd`` lines of libraries that ``path`` (or its script's interpreter) lacks,
    e.g. ``libcudart.so.12 => not found``."""
    target = _elf_target(path)
    if target is None:
        return []
    ldd = shutil.which("ldd") or "/usr/bin/ldd"
    try:
        result = _run([ldd, target], 10.0, env=_c_locale())
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines: list[str] = []
    for line in result.stdout.splitlines():
        line = line.strip()
        if "not found" in line and line not in lines:
            lines.append(line)
    return lines


def _first_line(result: _Result) -> str:
    lines = _nonempty(result.stdout) or _nonempty(result.stderr)
    return lines[0][:VERSION_LIMIT] if lines else ""


def _check(
    engine: str,
    argv: Sequence[str],
    probes: Sequence[Sequence[str]],
    timeout: float,
) -> pb.EngineInfo:
    program = argv[0]
    path = program if "/" in program else shutil.which(program)
    if path is None:
        return pb.EngineInfo(
            name=engine, path=program, ok=False, problem=f"{program} is not on PATH"
        )
    info = pb.EngineInfo(name=engine, path=path)
    command = [path, *argv[1:]]
    problem = ""
    for number, probe in enumerate(probes):
        shown = _show([*command, *probe])
        try:
            result = _run([*command, *probe], timeout)
        except subprocess.TimeoutExpired:
            problem = problem or f"'{shown}' did not finish within {timeout:g} s"
            break
        except OSError as exc:
            problem = _os_error(path, exc)
            break
        except ValueError as exc:  # e.g. a NUL byte in the configured path
            problem = f"cannot run {path!r}: {exc}"
            break
        if result.returncode == 0:
            info.ok = True
            # Only the first probe asks for a version; --help's first line is usage text.
            info.version = _first_line(result) if number == 0 else ""
            return info
        problem = (
            problem or f"'{shown}' failed ({_exit_text(result.returncode)}): {_summary(result)}"
        )
    missing = missing_libraries(path)
    if missing:
        problem += "; ldd: " + ", ".join(missing)
    info.problem = problem[:2000]
    return info


def check_engine_binary(engine: str, argv: list[str], timeout: float = 20.0) -> pb.EngineInfo:
    """Run ``argv --version``, else ``argv --help``: ``ok`` when either exits 0. When the
    program exists but will not run, ``problem`` holds its error and the ``ldd`` lines of
    missing libraries. Never raises."""
    if not argv:
        return pb.EngineInfo(name=engine, ok=False, problem="no command to check")
    return _check(engine, argv, (("--version",), ("--help",)), timeout)


def _installed_at(data: Mapping[str, Any], manifest: Path) -> float:
    value = data.get("installed_at")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            when = datetime.fromisoformat(value)
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            return when.timestamp()
    try:
        return manifest.stat().st_mtime
    except OSError:
        return 0.0


def _manifest_binary(data: object, engine: str, manifest: Path) -> tuple[str, str] | str:
    """``(binary path, version)`` from one manifest, or why it is not usable."""
    if not isinstance(data, Mapping):
        return "is not a JSON object"
    if data.get("engine") not in (None, engine):
        return f"is for engine {data.get('engine')!r}, not {engine!r}"
    binary = data.get("binary")
    if not isinstance(binary, str) or not binary:
        return "has no 'binary'"
    release = manifest.parent
    if not (release / binary).resolve().is_relative_to(release.resolve()):
        return f"'binary' {binary!r} points outside {release}"
    version = data.get("version")
    return os.path.normpath(release / binary), version if isinstance(version, str) else ""


def _installed(engine: str, state_dir: Path) -> tuple[str, str, Path] | str | None:
    """The newest unpacked release of ``engine`` under the state directory:
    ``(binary, version, manifest)``, why none is usable, or None when none is installed."""
    newest: tuple[float, str, str, Path] | None = None
    problems = []
    for manifest in sorted((state_dir / "engines" / engine).glob(f"*/{ENGINE_MANIFEST}")):
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(f"{manifest} cannot be read: {exc}")
            continue
        found = _manifest_binary(data, engine, manifest)
        if isinstance(found, str):
            problems.append(f"{manifest} {found}")
            continue
        when = _installed_at(data, manifest)
        if newest is None or when > newest[0]:
            newest = (when, found[0], found[1], manifest)
    if newest is not None:
        return newest[1], newest[2], newest[3]
    if problems:
        return "; ".join(problems) + f"; reinstall the {engine} engine"
    return None


def _locate(
    engine: str,
    configured: str | None,
    key: str,
    program: str | None,
    state_dir: Path,
    command: tuple[str, ...] = (),
    probes: tuple[tuple[str, ...], ...] = (("--version",), ("--help",)),
) -> EngineCandidate | None:
    if configured is not None:
        return EngineCandidate(engine, (configured, *command), origin=key, probes=probes)
    found = shutil.which(program) if program else None
    if found is not None:
        return EngineCandidate(engine, (found, *command), origin="PATH", probes=probes)
    installed = _installed(engine, state_dir)
    if installed is None:
        return None
    if isinstance(installed, str):
        return EngineCandidate(engine, (), origin="install", probes=probes, problem=installed)
    binary, version, manifest = installed
    return EngineCandidate(
        engine, (binary, *command), origin=str(manifest), probes=probes, version=version
    )


def engine_candidates(cfg: AgentConfig) -> list[EngineCandidate]:
    """Where each engine is on this node: the configured program, else on PATH, else the
    newest release installed under ``<state_dir>/engines/<engine>/``. Absent ones are left out."""
    found = [
        _locate(
            "llamacpp",
            cfg.engines.llamacpp_bin,
            "engines.llamacpp.bin",
            "llama-server",
            cfg.state_dir,
        ),
        _locate("vllm", cfg.engines.vllm_bin, "engines.vllm.bin", "vllm", cfg.state_dir),
        _locate(
            "sglang",
            cfg.engines.sglang_python,
            "engines.sglang.python",
            None,
            cfg.state_dir,
            command=("-c", SGLANG_PROBE),
            probes=((),),
        ),
    ]
    return [candidate for candidate in found if candidate is not None]


def check_candidate(candidate: EngineCandidate, timeout: float = 20.0) -> pb.EngineInfo:
    """Run one found engine the way :func:`check_engine_binary` does."""
    if candidate.problem or not candidate.argv:
        return pb.EngineInfo(
            name=candidate.name, ok=False, problem=candidate.problem or "no command to check"
        )
    info = _check(candidate.name, candidate.argv, candidate.probes, timeout)
    if info.ok and not info.version:
        info.version = candidate.version
    return info


def check_engines(cfg: AgentConfig, timeout: float = 20.0) -> list[pb.EngineInfo]:
    """Every engine on this node, checked by running it; ``sim`` first and always ok."""
    return [sim_engine(), *(check_candidate(c, timeout) for c in engine_candidates(cfg))]
