"""GPU discovery through fake nvidia-smi programs (the NVML path: test_gpus_nvml.py).
No mocks: the fakes are the seam."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from llmgw.agent.discovery import (
    NO_GPUS_VISIBLE,
    discover_gpus,
    gpus,
    nvidia_pci_gpus,
    parse_nvidia_smi,
)
from llmgw.proto import control_pb2 as pb

from ..fake_nvml import FakeNvml

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
SMI = FIXTURES / "nvidia-smi"


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
    assert [g.utilization_percent for g in facts.gpus] == [0, 0, 0, 0, 94, 95, 96, 97]
    # An idle GPU says 0: known, not the unknown of a GPU that cannot tell.
    assert all(g.HasField("utilization_percent") for g in facts.gpus)


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
            utilization_percent=37,
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
    # "[N/A]" and "[Not Supported]": the utilisation is unknown (unset), not 0 (idle).
    assert [g.HasField("utilization_percent") for g in facts.gpus] == [False, False]


@pytest.mark.parametrize("fake", ["zero-gpus", "no-devices"])
def test_driver_without_gpus(fake: str) -> None:
    facts = discover_gpus(SMI / fake)
    assert facts.gpus == []
    assert facts.status == NO_GPUS_VISIBLE
    assert facts.status.startswith("driver loaded, 0 GPUs visible (check CUDA_VISIBLE_DEVICES")
    assert facts.source == "nvidia-smi"
    assert not facts.no_driver


def test_failed_driver_says_what_nvidia_smi_said() -> None:
    facts = discover_gpus(SMI / "driver-failed")
    assert facts.gpus == []
    assert facts.source == ""
    assert facts.status == (
        "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate "
        "with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    )
    assert facts.no_driver  # the fix is to install it, which the degraded reason says


def test_malformed_line_is_a_status_not_an_exception() -> None:
    facts = discover_gpus(SMI / "malformed")
    assert facts.gpus == []
    assert facts.source == ""
    assert "nvidia-smi output line 2 is not understood (1 fields)" in facts.status
    assert "Unable to determine the device handle" in facts.status
    assert (
        "index, uuid, name, memory.total, memory.used, driver_version, utilization.gpu"
        in facts.status
    )


def test_hung_nvidia_smi_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "NVIDIA_SMI_TIMEOUT", 0.5)
    start = time.monotonic()
    facts = discover_gpus(SMI / "hangs")
    assert time.monotonic() - start < 5
    assert facts.gpus == []
    assert facts.status.startswith("nvidia-smi did not answer within 0.5 s")
    assert not facts.no_driver  # a hung driver is there: installing one is not the fix


def test_configured_nvidia_smi_missing(tmp_path: Path) -> None:
    facts = discover_gpus(tmp_path / "nvidia-smi")
    assert facts.status == f"{tmp_path / 'nvidia-smi'} does not exist"
    assert facts.no_driver  # nvidia-smi comes with the driver


def _pci_device(root: Path, address: str, vendor: str, pci_class: str) -> None:
    device = root / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(pci_class + "\n")


def test_nvidia_gpus_on_the_pci_bus(tmp_path: Path) -> None:
    root = tmp_path / "devices"
    _pci_device(root, "0000:c1:00.0", "0x10de", "0x030200")  # an H100: a 3D controller
    _pci_device(root, "0000:41:00.0", "0x10de", "0x030000")  # a workstation board: VGA
    _pci_device(root, "0000:41:00.1", "0x10de", "0x040300")  # its HDMI audio function
    _pci_device(root, "0000:07:00.0", "0x10de", "0x068000")  # an NVSwitch
    _pci_device(root, "0000:03:00.0", "0x1a03", "0x030000")  # the BMC's VGA
    _pci_device(root, "0000:81:00.0", "0x15b3", "0x020700")  # a ConnectX adapter
    (root / "0000:00:1f.0").mkdir()  # a device whose files cannot be read
    assert nvidia_pci_gpus(root) == ["0000:41:00.0", "0000:c1:00.0"]


def test_no_pci_bus_to_read_is_no_gpus(tmp_path: Path) -> None:
    assert nvidia_pci_gpus(tmp_path / "absent") == []
    assert nvidia_pci_gpus(tmp_path) == []


def test_no_nvml_and_no_nvidia_smi_names_both(fake_nvml: FakeNvml, empty_path: Path) -> None:
    # NVML's library is missing, as on a machine without the driver, whatever this one has.
    fake_nvml(init_error="LIBRARY_NOT_FOUND")
    facts = discover_gpus(None)
    assert facts.gpus == []
    assert facts.source == ""
    assert "NVML library not found (libnvidia-ml.so.1)" in facts.status
    assert "no nvidia-smi on PATH" in facts.status
    assert facts.status.startswith("no NVIDIA driver: ")
    assert facts.no_driver


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
    assert facts.no_driver


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
        "3, GPU-x, Vendor GPU, Rev 2, 1024 MiB, [Not Supported], 560.1, 12 %\n\n"
    )
    assert problem == ""
    assert driver == "560.1"
    assert gpus == [
        pb.Gpu(
            index=3,
            uuid="GPU-x",
            name="Vendor GPU, Rev 2",
            memory_total_mib=1024,
            utilization_percent=12,
        )
    ]


@pytest.mark.parametrize(
    "value", ["[N/A]", "[Not Supported]", "[Unknown Error]", "", "lots", "101"]
)
def test_a_utilisation_that_is_not_a_percent_is_unknown_and_keeps_the_gpu(value: str) -> None:
    gpus, _, problem = parse_nvidia_smi(f"0, GPU-x, A, 1024, 1, 560.1, {value}\n")
    assert problem == ""
    assert [g.uuid for g in gpus] == ["GPU-x"]
    assert not gpus[0].HasField("utilization_percent")


def test_an_idle_gpu_is_zero_not_unknown() -> None:
    gpus, _, _ = parse_nvidia_smi("0, GPU-x, A, 1024, 1, 560.1, 0\n")
    assert gpus[0].HasField("utilization_percent")
    assert gpus[0].utilization_percent == 0


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("x, GPU-x, A, 1, 1, 1, 0\n", "GPU index 'x' is not a number"),
        ("0, GPU-x, A, lots, 1, 1, 0\n", "memory 'lots'/'1' is not a number of MiB"),
        ("0, GPU-x\n", "2 fields"),
        # What an agent of before utilization.gpu was asked, from a wrapper that ignores it.
        ("0, GPU-x, A, 1024, 1, 560.1\n", "6 fields"),
    ],
)
def test_parse_refusals(text: str, reason: str) -> None:
    gpus, driver, problem = parse_nvidia_smi(text)
    assert (gpus, driver) == ([], "")
    assert f"line 1 is not understood ({reason})" in problem
