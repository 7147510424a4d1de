"""Engine discovery: by running fake (and one real, broken) program, and finding
installed releases. No mocks: the fakes are the seam."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import llmgw
from llmgw.agent.config import AgentConfig, parse_agent_config
from llmgw.agent.discovery import (
    ENGINE_MANIFEST,
    check_engine_binary,
    check_engines,
    engine_candidates,
    missing_libraries,
)
from llmgw.proto import control_pb2 as pb
from tests.ci import require_tools

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
ENGINES = FIXTURES / "engines"


def test_engine_with_version() -> None:
    info = check_engine_binary("llamacpp", [str(ENGINES / "works")])
    assert info == pb.EngineInfo(
        name="llamacpp", path=str(ENGINES / "works"), version="version: 4500 (4b0c638b)", ok=True
    )


def test_engine_with_only_help() -> None:
    info = check_engine_binary("vllm", [str(ENGINES / "help-only")])
    assert info.ok
    assert info.version == ""  # --help's first line is usage, not a version
    assert info.problem == ""


def test_engine_missing_shared_library_message() -> None:
    info = check_engine_binary("llamacpp", [str(ENGINES / "missing-lib")])
    assert not info.ok
    assert info.problem.startswith(f"'{ENGINES / 'missing-lib'} --version' failed (exit 127): ")
    assert (
        "error while loading shared libraries: libcudart.so.12: cannot open shared object file"
        in info.problem
    )


def test_engine_not_executable() -> None:
    info = check_engine_binary("vllm", [str(ENGINES / "not-executable")])
    assert not info.ok
    assert "permission denied (is it executable? chmod +x)" in info.problem


def test_engine_bad_interpreter() -> None:
    info = check_engine_binary("vllm", [str(ENGINES / "bad-interpreter")])
    assert not info.ok
    assert "its program interpreter is missing" in info.problem


def test_engine_absent(tmp_path: Path, empty_path: Path) -> None:
    assert check_engine_binary("vllm", [str(tmp_path / "vllm")]).problem == (
        f"{tmp_path / 'vllm'} does not exist"
    )
    assert check_engine_binary("vllm", ["vllm"]).problem == "vllm is not on PATH"


def test_engine_hang_times_out() -> None:
    start = time.monotonic()
    info = check_engine_binary("vllm", [str(ENGINES / "hangs")], timeout=0.5)
    assert time.monotonic() - start < 5
    assert not info.ok
    assert info.problem.endswith("--version' did not finish within 0.5 s")


def test_engine_not_an_executable_format(tmp_path: Path) -> None:
    blob = tmp_path / "llama-server"
    blob.write_bytes(b"\x00\x01garbage" * 8)
    blob.chmod(0o755)
    info = check_engine_binary("llamacpp", [str(blob)])
    assert not info.ok
    assert "not an executable for this machine" in info.problem


@pytest.fixture
def broken_elf(tmp_path: Path) -> Path:
    """A real ELF program linked against a library that is then deleted."""
    require_tools("gcc")
    gcc = shutil.which("gcc")
    assert gcc is not None
    lib = tmp_path / "libllmgwfake.so"
    subprocess.run(
        [gcc, "-x", "c", "-", "-shared", "-fPIC", "-o", str(lib)],
        input=b"int llmgw_fake(void) { return 0; }\n",
        check=True,
    )
    program = tmp_path / "llama-server"
    subprocess.run(
        [gcc, "-x", "c", "-", "-o", str(program), f"-L{tmp_path}", "-lllmgwfake"],
        input=b"int llmgw_fake(void);\nint main(void) { return llmgw_fake(); }\n",
        check=True,
    )
    lib.unlink()
    return program


def test_elf_with_missing_library_shows_ldd_line(broken_elf: Path) -> None:
    info = check_engine_binary("llamacpp", [str(broken_elf)])
    assert not info.ok
    assert "exit 127" in info.problem
    assert "libllmgwfake.so: cannot open shared object file" in info.problem
    assert info.problem.endswith("; ldd: libllmgwfake.so => not found")
    assert missing_libraries(str(broken_elf)) == ["libllmgwfake.so => not found"]


def test_script_whose_interpreter_lacks_a_library(broken_elf: Path, tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text(f"#!{broken_elf}\nprint('hello')\n")
    script.chmod(0o755)
    info = check_engine_binary("vllm", [str(script)])
    assert not info.ok
    assert info.problem.endswith("; ldd: libllmgwfake.so => not found")


def test_ldd_lines_only_for_elf() -> None:
    assert missing_libraries(str(ENGINES / "missing-lib")) == []  # /bin/sh has its libraries


def config(tmp_path: Path, **engines: dict[str, str]) -> AgentConfig:
    return parse_agent_config(
        {
            "server": "cp1",
            "node_id": "gpu-1",
            "state_dir": str(tmp_path / "state"),
            "models_root": str(tmp_path / "models"),
            "engines": engines or None,
        }
    )


def install(state_dir: Path, engine: str, version: str, source: Path, installed_at: str) -> Path:
    release = state_dir / "engines" / engine / version
    (release / "bin").mkdir(parents=True)
    binary = release / "bin" / "llama-server"
    shutil.copy(source, binary)
    (release / ENGINE_MANIFEST).write_text(
        json.dumps(
            {
                "engine": engine,
                "version": version,
                "binary": "bin/llama-server",
                "sha256": "0" * 64,
                "installed_at": installed_at,
            }
        )
    )
    return binary


def test_only_sim_when_nothing_is_installed(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path)
    assert engine_candidates(cfg) == []
    (sim,) = check_engines(cfg)
    assert (sim.name, sim.ok, sim.version) == ("sim", True, llmgw.__version__)
    assert os.path.exists(sim.path)


def test_newest_installed_release_is_checked(tmp_path: Path, empty_path: Path) -> None:
    state = tmp_path / "state"
    install(state, "llamacpp", "b4400", ENGINES / "missing-lib", "2025-01-01T10:00:00Z")
    newest = install(state, "llamacpp", "b4500", ENGINES / "help-only", "2025-03-01T10:00:00+00:00")
    (state / "engines" / "vllm" / "0.6.0").mkdir(parents=True)
    (state / "engines" / "vllm" / "0.6.0" / ENGINE_MANIFEST).write_text("{not json")
    engines = {e.name: e for e in check_engines(config(tmp_path))}
    assert set(engines) == {"sim", "llamacpp", "vllm"}
    llamacpp = engines["llamacpp"]
    assert llamacpp.ok
    assert llamacpp.path == str(newest)
    assert llamacpp.version == "b4500"  # --help gave none; the manifest's
    vllm = engines["vllm"]
    assert not vllm.ok
    assert "llmgw-engine.json cannot be read" in vllm.problem
    assert vllm.problem.endswith("reinstall the vllm engine")


def test_manifest_binary_must_stay_in_its_release(tmp_path: Path, empty_path: Path) -> None:
    release = tmp_path / "state" / "engines" / "llamacpp" / "b1"
    release.mkdir(parents=True)
    (release / ENGINE_MANIFEST).write_text(json.dumps({"engine": "llamacpp", "binary": "../../x"}))
    (info,) = [e for e in check_engines(config(tmp_path)) if e.name == "llamacpp"]
    assert not info.ok
    assert "points outside" in info.problem


def test_configured_engines_win_over_path_and_installs(tmp_path: Path, empty_path: Path) -> None:
    shutil.copy(ENGINES / "works", empty_path / "llama-server")
    shutil.copy(ENGINES / "works", empty_path / "vllm")
    install(tmp_path / "state", "llamacpp", "b4500", ENGINES / "works", "2025-03-01T10:00:00Z")
    cfg = config(
        tmp_path,
        llamacpp={"bin": str(ENGINES / "missing-lib")},
        sglang={"python": str(ENGINES / "help-only")},
    )
    candidates = {c.name: c for c in engine_candidates(cfg)}
    assert candidates["llamacpp"].origin == "engines.llamacpp.bin"
    assert candidates["vllm"].origin == "PATH"
    assert candidates["vllm"].argv == (str(empty_path / "vllm"),)
    engines = {e.name: e for e in check_engines(cfg)}
    assert not engines["llamacpp"].ok
    assert engines["vllm"].ok
    # sglang is checked by importing it, not with --version: help-only refuses "-c ...".
    assert not engines["sglang"].ok
    assert "-c 'import sglang, sys; print(sglang.__version__)'' failed (exit 2)" in (
        engines["sglang"].problem
    )


def test_sglang_import_check(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-c" ] && [ "$2" = "import sglang, sys; print(sglang.__version__)" ] '
        "&& [ $# -eq 2 ] && { echo 0.4.1; exit 0; }\n"
        "exit 1\n"
    )
    python.chmod(0o755)
    engines = check_engines(config(tmp_path, sglang={"python": str(python)}))
    (sglang,) = [e for e in engines if e.name == "sglang"]
    assert (sglang.ok, sglang.version, sglang.path) == (True, "0.4.1", str(python))


def test_sglang_missing_module_shows_the_import_error(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        "echo 'Traceback (most recent call last):' >&2\n"
        "echo '  File \"<string>\", line 1, in <module>' >&2\n"
        "echo \"ModuleNotFoundError: No module named 'sglang'\" >&2\n"
        "exit 1\n"
    )
    python.chmod(0o755)
    engines = check_engines(config(tmp_path, sglang={"python": str(python)}))
    (sglang,) = [e for e in engines if e.name == "sglang"]
    assert not sglang.ok
    assert sglang.problem.endswith("(exit 1): ModuleNotFoundError: No module named 'sglang'")


def test_sglang_is_not_looked_for_on_path(tmp_path: Path, empty_path: Path) -> None:
    """The python3 on PATH rarely has SGLang: sglang is found only where agent.yaml says."""
    for program in ("python3", "python", "sglang"):
        shutil.copy(ENGINES / "works", empty_path / program)
    assert engine_candidates(config(tmp_path)) == []
    shutil.copy(ENGINES / "works", empty_path / "llama-server")
    assert [c.name for c in engine_candidates(config(tmp_path))] == ["llamacpp"]


def test_the_configured_sglang_python_is_probed_by_importing_sglang(tmp_path: Path) -> None:
    python = str(ENGINES / "works")
    (candidate,) = engine_candidates(config(tmp_path, sglang={"python": python}))
    assert (candidate.name, candidate.argv, candidate.origin) == (
        "sglang",
        (python,),
        "engines.sglang.python",
    )
    assert candidate.probes == (("-c", "import sglang, sys; print(sglang.__version__)"),)
