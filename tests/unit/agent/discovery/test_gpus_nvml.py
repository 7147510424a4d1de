"""GPU discovery's NVML path, against a stand-in ``pynvml`` (tests/fixtures/nvml) that answers
like nvidia-ml-py: eight GPUs, one in MIG mode, one lost after an XID error, and a driver
whose kernel module does not match its library."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from llmgw.agent.discovery import NO_GPUS_VISIBLE, NVML_VERSION_MISMATCH, discover_gpus
from llmgw.agent.inventory import collect_inventory

from ..fake_nvml import STANDIN, FakeNvml, eight_gpus

SMI = Path(__file__).resolve().parents[3] / "fixtures" / "nvidia-smi"
LOST_HINT = "see 'dmesg | grep -i xid' and 'nvidia-smi -q -i 5'"


def test_the_stand_in_is_what_discovery_imports(fake_nvml: FakeNvml) -> None:
    fake_nvml(gpus=eight_gpus())
    import pynvml

    assert Path(pynvml.__file__).parent == STANDIN
    # Its errors are built like the real module's: one class per code, chosen by value.
    error = pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    assert type(error) is pynvml.NVMLError_LibRmVersionMismatch
    assert str(error) == "RM has detected an NVML/RM version mismatch."
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_eight_gpus_through_nvml(fake_nvml: FakeNvml, empty_path: Path) -> None:
    fake_nvml(gpus=eight_gpus())
    facts = discover_gpus(None)
    assert (facts.source, facts.status, facts.driver_version) == ("nvml", "", "550.54.15")
    assert facts.warnings == []
    assert [g.index for g in facts.gpus] == list(range(8))
    assert {g.name for g in facts.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_total_mib for g in facts.gpus} == {81559}
    assert [g.memory_used_mib for g in facts.gpus] == [0, 0, 0, 0, 74213, 74213, 74213, 74213]
    assert facts.gpus[7].uuid == "GPU-5f3c2b1a-8d4e-4f6a-9b2c-1d3e5f7a9b08"
    assert [g.utilization_percent for g in facts.gpus] == [0, 0, 0, 0, 94, 95, 96, 97]
    assert all(g.HasField("utilization_percent") for g in facts.gpus)  # idle is 0, known
    # NVML shut down again: what it opened is not held between looks.
    assert sys.modules["pynvml"]._state["initialised"] == 0


def test_nvml_and_nvidia_smi_agree_on_the_same_board(fake_nvml: FakeNvml) -> None:
    fake_nvml(gpus=eight_gpus())
    through_nvml = discover_gpus(None)
    through_smi = discover_gpus(SMI / "eight-h100")
    assert through_nvml.gpus == through_smi.gpus
    assert through_nvml.driver_version == through_smi.driver_version


@pytest.mark.parametrize("lost_at", ["handle", "query"])
def test_mig_on_one_gpu_and_an_xid_on_another_leave_the_other_six(
    fake_nvml: FakeNvml, empty_path: Path, lost_at: str
) -> None:
    gpus = eight_gpus()
    gpus[2]["mig"] = True
    gpus[5].update(xid=79, lost_at=lost_at)
    gpus[7]["mig_supported"] = False  # an older GPU on the board: MIG is not supported
    fake_nvml(gpus=gpus)
    facts = discover_gpus(None)
    assert facts.source == "nvml"
    assert facts.status == ""
    assert [g.index for g in facts.gpus] == [0, 1, 3, 4, 6, 7]
    assert facts.gpus[-1].uuid.endswith("9b08")
    mig, lost = facts.warnings
    assert mig.startswith(f"GPU 2 ({gpus[2]['uuid']}) is left out: it is in MIG mode")
    assert "nvidia-smi -i 2 -mig 0" in mig
    assert lost.startswith("GPU 5 is left out: NVML says 'GPU is lost'")
    assert LOST_HINT in lost


def test_a_gpu_that_cannot_tell_its_utilisation_is_kept_with_it_unknown(
    fake_nvml: FakeNvml, empty_path: Path
) -> None:
    gpus = eight_gpus()[:2]
    gpus[1]["utilization_gpu"] = None  # NVML answers Not Supported (vGPU, some boards)
    fake_nvml(gpus=gpus)
    facts = discover_gpus(None)
    assert (facts.status, facts.warnings) == ("", [])
    assert [g.index for g in facts.gpus] == [0, 1]
    assert [g.HasField("utilization_percent") for g in facts.gpus] == [True, False]
    assert facts.gpus[0].utilization_percent == 0


def test_the_inventory_carries_the_left_out_gpus_as_warnings(fake_nvml: FakeNvml) -> None:
    gpus = eight_gpus()
    gpus[5]["xid"] = 79
    fake_nvml(gpus=gpus)
    inv = collect_inventory()
    assert (len(inv.gpus), inv.gpu_status, inv.gpu_source) == (7, "", "nvml")
    assert [w for w in inv.warnings if "GPU 5 is left out" in w] != []


def test_every_gpu_left_out_says_why_in_the_status(fake_nvml: FakeNvml, empty_path: Path) -> None:
    gpus = eight_gpus()[:2]
    gpus[0]["mig"] = True
    gpus[1]["xid"] = 48
    fake_nvml(gpus=gpus)
    facts = discover_gpus(None)
    assert facts.gpus == []
    assert facts.source == "nvml"
    assert facts.status.startswith("GPU 0 (")
    assert (
        "MIG mode" in facts.status and "GPU 1 is left out: NVML says 'GPU is lost'" in facts.status
    )


def test_driver_without_gpus(fake_nvml: FakeNvml, empty_path: Path) -> None:
    fake_nvml(gpus=[])
    facts = discover_gpus(None)
    assert (facts.gpus, facts.status, facts.source) == ([], NO_GPUS_VISIBLE, "nvml")


def test_driver_library_version_mismatch_says_what_to_do(
    fake_nvml: FakeNvml, empty_path: Path
) -> None:
    fake_nvml(init_error="LIB_RM_VERSION_MISMATCH", gpus=eight_gpus())
    facts = discover_gpus(None)
    assert facts.gpus == []
    assert facts.status == f"{NVML_VERSION_MISMATCH}; no nvidia-smi on PATH to fall back to"
    assert "reboot the node" in facts.status
    # nvidia-smi fails the same way on such a node: both reasons are kept.
    shutil.copy(SMI / "driver-failed", empty_path / "nvidia-smi")
    facts = discover_gpus(None)
    assert facts.status.startswith(f"{NVML_VERSION_MISMATCH}; nvidia-smi failed")
    # NVML knows the driver is there (only mismatched): installing one is not the fix,
    # whatever nvidia-smi's words suggest.
    assert not facts.no_driver


def test_other_nvml_errors_are_named(fake_nvml: FakeNvml, empty_path: Path) -> None:
    fake_nvml(init_error="NO_PERMISSION")
    facts = discover_gpus(None)
    assert facts.status == (
        "NVML error: Insufficient Permissions; no nvidia-smi on PATH to fall back to"
    )
    assert not facts.no_driver
    assert facts.gpus == [] and facts.source == ""
