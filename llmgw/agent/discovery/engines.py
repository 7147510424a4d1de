"""The engines this node can run: where each is (configured in agent.yaml, on PATH, or
installed under the state directory) and whether it runs (``--version``, else ``--help``;
the ``ldd`` lines of missing libraries when it will not).

Never raises for what it finds: a broken binary or install manifest is a ``problem`` on
the engine's :class:`pb.EngineInfo`, in operator words.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import llmgw
from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery.probe import c_locale, cannot_run, exit_text, nonempty_lines, summary
from llmgw.engines.launch import self_argv
from llmgw.engines.registry import ENGINES, Engine, get_engine
from llmgw.procutil import Finished, run_to_end
from llmgw.proto import control_pb2 as pb

__all__ = [
    "ENGINE_MANIFEST",
    "VERSION_LIMIT",
    "EngineCandidate",
    "check_candidate",
    "check_engine_binary",
    "check_engines",
    "engine_candidates",
    "missing_libraries",
    "sim_engine",
]

ENGINE_MANIFEST = "llmgw-engine.json"
VERSION_LIMIT = 200


def _show(argv: Sequence[str]) -> str:
    return shlex.join(argv)


@dataclass(frozen=True)
class EngineCandidate:
    """An engine found on this node (configured, on PATH, or installed), not yet run."""

    name: str
    argv: tuple[str, ...]
    origin: str  # "engines.llamacpp.bin", "PATH", or the install manifest's path
    probes: tuple[tuple[str, ...], ...] = (("--version",), ("--help",))  # Engine.probes
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
        result = run_to_end([ldd, target], 10.0, env=c_locale())
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines: list[str] = []
    for line in result.stdout.splitlines():
        line = line.strip()
        if "not found" in line and line not in lines:
            lines.append(line)
    return lines


def _first_line(result: Finished) -> str:
    lines = nonempty_lines(result.stdout) or nonempty_lines(result.stderr)
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
            result = run_to_end([*command, *probe], timeout)
        except subprocess.TimeoutExpired:
            problem = problem or f"'{shown}' did not finish within {timeout:g} s"
            break
        except OSError as exc:
            problem = cannot_run(path, exc)
            break
        except ValueError as exc:  # e.g. a NUL byte in the configured path
            problem = f"cannot run {path!r}: {exc}"
            break
        if result.returncode == 0:
            info.ok = True
            # Only the first probe asks for a version; --help's first line is usage text.
            info.version = _first_line(result) if number == 0 else ""
            return info
        problem = problem or f"'{shown}' failed ({exit_text(result.returncode)}): {summary(result)}"
    missing = missing_libraries(path)
    if missing:
        problem += "; ldd: " + ", ".join(missing)
    info.problem = problem[:2000]
    return info


def check_engine_binary(engine: str, argv: list[str], timeout: float = 20.0) -> pb.EngineInfo:
    """Run ``argv`` with each of the engine's probes (llmgw.engines.registry: ``--version``,
    else ``--help``; SGLang's import check): ``ok`` when one exits 0. When the program exists
    but will not run, ``problem`` holds its error and the ``ldd`` lines of missing libraries.
    Never raises."""
    if not argv:
        return pb.EngineInfo(name=engine, ok=False, problem="no command to check")
    return _check(engine, argv, get_engine(engine).probes, timeout)


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


def _locate(engine: Engine, configured: str | None, state_dir: Path) -> EngineCandidate | None:
    probes = engine.probes
    if configured is not None:
        key = f"engines.{engine.name}.{engine.program_setting}"
        return EngineCandidate(engine.name, (configured,), origin=key, probes=probes)
    found = shutil.which(engine.module().PROGRAM) if engine.on_path else None
    if found is not None:
        return EngineCandidate(engine.name, (found,), origin="PATH", probes=probes)
    installed = _installed(engine.name, state_dir)
    if installed is None:
        return None
    if isinstance(installed, str):
        return EngineCandidate(engine.name, (), origin="install", probes=probes, problem=installed)
    binary, version, manifest = installed
    return EngineCandidate(
        engine.name, (binary,), origin=str(manifest), probes=probes, version=version
    )


def engine_candidates(cfg: AgentConfig) -> list[EngineCandidate]:
    """Where each engine of the registry is on this node: the program agent.yaml names, else
    on PATH (where the registry says to look), else the newest release installed under
    ``<state_dir>/engines/<engine>/``. Absent ones are left out; so is the built-in sim."""
    found = (
        _locate(engine, cfg.engines.program(engine.name), cfg.state_dir)
        for engine in ENGINES.values()
        if not engine.builtin
    )
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
