"""Discovery: GPUs through fake nvidia-smi programs, InfiniBand from sysfs-shaped trees,
engines by running fake (and one real, broken) program. No mocks: the fakes are the seam."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

import llmgw
from llmgw.agent import discovery
from llmgw.agent.config import AgentConfig, FabricConfig, load_agent_config, parse_agent_config
from llmgw.agent.discovery import (
    ENGINE_MANIFEST,
    NO_GPUS_VISIBLE,
    check_engine_binary,
    check_engines,
    discover_gpus,
    discover_ib,
    engine_candidates,
    fabric_status,
    missing_libraries,
    parse_nvidia_smi,
)
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb
from tests.ci import require_tools

from .fake_nvml import FakeNvml

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SMI = FIXTURES / "nvidia-smi"
ENGINES = FIXTURES / "engines"
IB = FIXTURES / "ib"


# -- GPUs -------------------------------------------------------------------------------------


def test_eight_h100s() -> None:
    facts = discover_gpus(SMI / "eight-h100")
    assert facts.source == "nvidia-smi"
    assert facts.status == ""
    assert facts.driver_version == "550.54.15"
    assert [g.index for g in facts.gpus] == list(range(8))
    assert {g.name for g in facts.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_total_mib for g in facts.gpus} == {81559}
    assert [g.memory_used_mib for g in facts.gpus] == [0, 0, 0, 0, 74213, 74213, 74213, 74213]
    assert facts.gpus[7].uuid == "GPU-5f3c2b1a-8d4e-4f6a-9b2c-1d3e5f7a9b08"


def test_one_gpu() -> None:
    facts = discover_gpus(SMI / "one-gpu")
    assert (facts.source, facts.status, facts.driver_version) == ("nvidia-smi", "", "550.54.15")
    assert facts.gpus == [
        pb.Gpu(
            index=0,
            uuid="GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c",
            name="NVIDIA GeForce RTX 4090",
            memory_total_mib=24564,
            memory_used_mib=1093,
        )
    ]


def test_na_values_spaces_and_blank_lines() -> None:
    facts = discover_gpus(SMI / "na-values")
    assert facts.status == ""
    assert [(g.index, g.uuid, g.memory_used_mib) for g in facts.gpus] == [
        (0, "GPU-0a1b2c3d-0000-4000-8000-000000000001", 0),
        (1, "GPU-0a1b2c3d-0000-4000-8000-000000000002", 4),
    ]
    assert facts.gpus[1].name == "NVIDIA A100-SXM4-80GB"
    assert facts.driver_version == "535.161.08"  # the first one nvidia-smi could tell


@pytest.mark.parametrize("fake", ["zero-gpus", "no-devices"])
def test_driver_without_gpus(fake: str) -> None:
    facts = discover_gpus(SMI / fake)
    assert facts.gpus == []
    assert facts.status == NO_GPUS_VISIBLE
    assert facts.status.startswith("driver loaded, 0 GPUs visible (check CUDA_VISIBLE_DEVICES")
    assert facts.source == "nvidia-smi"


def test_failed_driver_says_what_nvidia_smi_said() -> None:
    facts = discover_gpus(SMI / "driver-failed")
    assert facts.gpus == []
    assert facts.source == ""
    assert facts.status == (
        "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate "
        "with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    )


def test_malformed_line_is_a_status_not_an_exception() -> None:
    facts = discover_gpus(SMI / "malformed")
    assert facts.gpus == []
    assert facts.source == ""
    assert "nvidia-smi output line 2 is not understood (1 fields)" in facts.status
    assert "Unable to determine the device handle" in facts.status
    assert "index, uuid, name, memory.total, memory.used, driver_version" in facts.status


def test_hung_nvidia_smi_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "NVIDIA_SMI_TIMEOUT", 0.5)
    start = time.monotonic()
    facts = discover_gpus(SMI / "hangs")
    assert time.monotonic() - start < 5
    assert facts.gpus == []
    assert facts.status.startswith("nvidia-smi did not answer within 0.5 s")


def test_configured_nvidia_smi_missing(tmp_path: Path) -> None:
    facts = discover_gpus(tmp_path / "nvidia-smi")
    assert facts.status == f"{tmp_path / 'nvidia-smi'} does not exist"


def test_no_nvml_and_no_nvidia_smi_names_both(fake_nvml: FakeNvml, empty_path: Path) -> None:
    # NVML's library is missing, as on a machine without the driver, whatever this one has.
    fake_nvml(init_error="LIBRARY_NOT_FOUND")
    facts = discover_gpus(None)
    assert facts.gpus == []
    assert facts.source == ""
    assert "NVML library not found (libnvidia-ml.so.1)" in facts.status
    assert "no nvidia-smi on PATH" in facts.status
    assert facts.status.startswith("no NVIDIA driver: ")


def test_no_nvml_falls_back_to_nvidia_smi_on_path(fake_nvml: FakeNvml, empty_path: Path) -> None:
    # Runs on machines where NVML loads too: the stand-in answers as a driverless machine.
    fake_nvml(init_error="LIBRARY_NOT_FOUND")
    shutil.copy(SMI / "one-gpu", empty_path / "nvidia-smi")
    facts = discover_gpus(None)
    assert facts.source == "nvidia-smi"
    assert [g.name for g in facts.gpus] == ["NVIDIA GeForce RTX 4090"]
    assert facts.status == ""

    shutil.copy(SMI / "driver-failed", empty_path / "nvidia-smi")
    facts = discover_gpus(None)
    assert facts.status.startswith("NVML library not found (libnvidia-ml.so.1); nvidia-smi failed")


def test_kernel_driver_not_loaded_falls_back_too(fake_nvml: FakeNvml, empty_path: Path) -> None:
    fake_nvml(init_error="DRIVER_NOT_LOADED")
    facts = discover_gpus(None)
    assert facts.status == (
        "no NVIDIA driver: NVIDIA kernel driver not loaded (NVML: Driver Not Loaded) and no "
        "nvidia-smi on PATH"
    )
    shutil.copy(SMI / "one-gpu", empty_path / "nvidia-smi")
    assert discover_gpus(None).source == "nvidia-smi"


def test_parse_name_with_comma_and_units() -> None:
    gpus, driver, problem = parse_nvidia_smi(
        "3, GPU-x, Vendor GPU, Rev 2, 1024 MiB, [Not Supported], 560.1\n\n"
    )
    assert problem == ""
    assert driver == "560.1"
    assert gpus == [pb.Gpu(index=3, uuid="GPU-x", name="Vendor GPU, Rev 2", memory_total_mib=1024)]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("x, GPU-x, A, 1, 1, 1\n", "GPU index 'x' is not a number"),
        ("0, GPU-x, A, lots, 1, 1\n", "memory 'lots'/'1' is not a number of MiB"),
        ("0, GPU-x\n", "2 fields"),
    ],
)
def test_parse_refusals(text: str, reason: str) -> None:
    gpus, driver, problem = parse_nvidia_smi(text)
    assert (gpus, driver) == ([], "")
    assert f"line 1 is not understood ({reason})" in problem


# -- InfiniBand -------------------------------------------------------------------------------


def test_discover_ib_fixture_tree() -> None:
    adapters = discover_ib(IB)
    assert [a.name for a in adapters] == ["mlx5_0", "mlx5_1"]
    active = adapters[0].ports[0]
    assert active == pb.IbPort(
        port=1,
        state="4: ACTIVE",
        link_layer="InfiniBand",
        rate="400 Gb/sec (4X NDR)",
        gids=[
            "fe80:0000:0000:0000:a088:c203:0042:1a2c",
            "fec0:0000:0000:0001:a088:c203:0042:1a2c",
        ],
    )
    assert adapters[1].ports[0].state == "1: DOWN"
    assert list(adapters[1].ports[0].gids) == ["fe80:0000:0000:0000:a088:c203:0042:1a2d"]


def test_discover_ib_missing_root(tmp_path: Path) -> None:
    assert discover_ib(tmp_path / "infiniband") == []


def test_discover_ib_orders_and_caps(tmp_path: Path) -> None:
    for adapter in ("mlx5_10", "mlx5_2"):
        for port in ("2", "1"):
            gids = tmp_path / adapter / "ports" / port / "gids"
            gids.mkdir(parents=True)
            (gids.parent / "state").write_text("4: ACTIVE\n")
            for i in range(20):
                (gids / str(i)).write_text(f"fe80:0000:0000:0000:0000:0000:0000:{i:04x}\n")
    (tmp_path / "not-an-adapter").write_text("")
    adapters = discover_ib(tmp_path)
    assert [a.name for a in adapters] == ["mlx5_2", "mlx5_10"]
    assert [p.port for p in adapters[0].ports] == [1, 2]
    gids = adapters[0].ports[0].gids
    assert len(gids) == 16
    assert gids[-1].endswith(":000f")


def test_fabric_healthy_and_warnings() -> None:
    adapters = discover_ib(IB)
    fabrics, warnings = fabric_status(
        (
            FabricConfig(name="ib-a", hcas=("mlx5_0",)),
            FabricConfig(name="ib-b", hcas=("mlx5_1", "mlx5_3")),
        ),
        adapters,
    )
    assert fabrics == [
        pb.Fabric(name="ib-a", hcas=["mlx5_0"], healthy=True),
        pb.Fabric(name="ib-b", hcas=["mlx5_1", "mlx5_3"], healthy=False),
    ]
    assert warnings == [
        "fabric ib-b: adapter mlx5_1 has no ACTIVE port (port 1: 1: DOWN); check the cable "
        "and the switch port ('ibstat mlx5_1')",
        "fabric ib-b: adapter mlx5_3 is not in /sys/class/infiniband (present: mlx5_0, mlx5_1); "
        "check the name with 'ibstat -l'",
    ]


def test_fabric_without_subnet_manager(tmp_path: Path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("2: INIT\n")
    fabrics, warnings = fabric_status(
        (FabricConfig(name="ib-a", hcas=("mlx5_0",)),), discover_ib(tmp_path), ib_root=tmp_path
    )
    assert not fabrics[0].healthy
    assert warnings == [
        "fabric ib-a: adapter mlx5_0 has no ACTIVE port (port 1: 2: INIT): the link is up but "
        "not activated; is a subnet manager running on this fabric? (check with 'sminfo')"
    ]


def test_no_fabrics_no_warnings() -> None:
    assert fabric_status((), discover_ib(IB)) == ([], [])


def test_adapter_under_two_fabrics_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            server: cp1
            node_id: gpu-1
            discovery:
              ib_root: {IB}
            fabrics:
              - name: ib-a
                hcas: [mlx5_0, mlx5_1]
              - name: ib-b
                hcas: [mlx5_0]
            """
        )
    )
    assert {a.name for a in discover_ib(IB)} == {"mlx5_0", "mlx5_1"}  # both really exist
    with pytest.raises(ConfigError) as info:
        load_agent_config(config)
    message = str(info.value)
    assert "fabrics[1].hcas[0]" in message
    assert "adapter mlx5_0 is listed under fabrics ib-a and ib-b" in message
    assert str(config) in message


# -- engines ----------------------------------------------------------------------------------


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
