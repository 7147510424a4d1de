"""The node's inventory: collected from this machine and from fixtures, and
re-sent by the watcher only when it changed in a way worth telling."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.agent import inventory
from llmgw.agent.config import AgentConfig, parse_agent_config
from llmgw.agent.discovery import DRIVER_FIX, NO_GPUS_VISIBLE, nvidia_pci_gpus
from llmgw.agent.inventory import (
    GIB,
    InventoryWatcher,
    collect_inventory,
    disk_usage,
    meminfo,
    worth_telling,
)
from llmgw.contracts.inventory import DegradedCode, inventory_dict, multinode_ports
from llmgw.contracts.ports import PortRange
from llmgw.proto import control_pb2 as pb

from .fake_nvml import FakeNvml

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MIB = 1024 * 1024


def config(tmp_path: Path, **extra: object) -> AgentConfig:
    return parse_agent_config(
        {
            "server": "cp1",
            "node_id": "gpu-1",
            "state_dir": str(tmp_path / "state"),
            "models_root": str(tmp_path / "models" / "not" / "yet"),
            "discovery": {"ib_root": str(tmp_path / "no-infiniband")},
            **extra,
        }
    )


def test_this_machine(tmp_path: Path, empty_path: Path) -> None:
    inv = collect_inventory(config(tmp_path))
    assert inv.hostname == socket.gethostname()
    assert inv.arch == platform.machine()
    assert inv.cpus == os.cpu_count()
    assert 0 < inv.memory_available_bytes <= inv.memory_total_bytes
    assert 0 < inv.disk_free_bytes <= inv.disk_total_bytes  # of tmp_path, the nearest parent
    assert list(inv.engines) == ["sim"]
    assert [e.name for e in inv.engine_details] == ["sim"]
    assert list(inv.ib_adapters) == [] and list(inv.fabrics) == []
    assert list(inv.warnings) == []
    assert inv.multinode_ports == "29500-29999"  # agent.yaml's default
    if not inv.gpus and nvidia_pci_gpus():  # GPUs on the bus, no driver for them
        assert [d.code for d in inv.degraded] == [DegradedCode.GPUS]
    else:
        assert list(inv.degraded) == []
    if inv.gpus:  # a machine with a driver
        assert inv.gpu_source == "nvml" and inv.gpu_status == ""
    else:
        assert inv.gpu_status  # says why
        if inv.gpu_source == "":
            assert "no nvidia-smi on PATH" in inv.gpu_status


def test_without_config_is_minimal() -> None:
    inv = collect_inventory()
    assert inv.cpus > 0 and inv.memory_total_bytes > 0
    assert list(inv.engines) == ["sim"]
    assert inv.gpus or inv.gpu_status
    assert inv.disk_total_bytes == 0 and not inv.fabrics
    assert inv.multinode_ports == ""  # nothing configured to report: the default


def test_the_multinode_ports_of_agent_yaml_are_reported(tmp_path: Path, empty_path: Path) -> None:
    inv = collect_inventory(config(tmp_path, multinode_ports="41000-41063"))
    assert inv.multinode_ports == "41000-41063"
    # As the control plane stores and reads it back.
    assert multinode_ports(inventory_dict(inv)) == PortRange(41000, 41063)


def test_from_fixtures(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(
        tmp_path,
        discovery={
            "nvidia_smi": str(FIXTURES / "nvidia-smi" / "eight-h100"),
            "ib_root": str(FIXTURES / "ib"),
        },
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_1"]}],
        engines={
            "llamacpp": {"bin": str(FIXTURES / "engines" / "works")},
            "vllm": {"bin": str(FIXTURES / "engines" / "missing-lib")},
        },
    )
    inv = collect_inventory(cfg)
    assert len(inv.gpus) == 8
    assert (inv.gpu_source, inv.driver_version, inv.gpu_status) == ("nvidia-smi", "550.54.15", "")
    assert [a.name for a in inv.ib_adapters] == ["mlx5_0", "mlx5_1"]
    assert [(f.name, f.healthy) for f in inv.fabrics] == [("ib-a", True), ("ib-b", False)]
    details = {e.name: e for e in inv.engine_details}
    assert details["llamacpp"].ok and details["llamacpp"].version == "version: 4500 (4b0c638b)"
    assert not details["vllm"].ok
    # llamacpp runs and llmgw builds its command: offered; vllm does not run: not offered.
    assert list(inv.engines) == ["sim", "llamacpp"]
    assert len(inv.warnings) == 2
    assert inv.warnings[0].startswith("fabric ib-b: adapter mlx5_1 has no ACTIVE port")
    assert inv.warnings[1].startswith(
        f"engine vllm ({FIXTURES / 'engines' / 'missing-lib'}) will not run: "
    )
    assert "libcudart.so.12" in inv.warnings[1]


def test_disk_usage_nearest_existing_parent(tmp_path: Path) -> None:
    total, free = disk_usage(tmp_path / "a" / "b" / "c")
    st = os.statvfs(tmp_path)
    assert total == st.f_blocks * st.f_frsize
    assert 0 < free <= total


def test_meminfo(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384 kB\nHugePages_Total:       4\nbogus\n")
    assert meminfo(path) == {"MemTotal": 16384 * 1024, "HugePages_Total": 4}
    assert meminfo(tmp_path / "absent") == {}


def test_inventory_from_fixtures(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(
        tmp_path,
        discovery={
            "nvidia_smi": str(FIXTURES / "nvidia-smi" / "one-gpu"),
            "ib_root": str(FIXTURES / "ib"),
        },
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_9"]}],
    )
    inv = collect_inventory(cfg)
    assert [(g.index, g.uuid, g.name, g.memory_total_mib, g.memory_used_mib) for g in inv.gpus] == [
        (0, "GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c", "NVIDIA GeForce RTX 4090", 24564, 1093)
    ]
    assert [(f.name, list(f.hcas), f.healthy) for f in inv.fabrics] == [
        ("ib-a", ["mlx5_0", "mlx5_9"], False)
    ]
    assert inv.ib_adapters[0].ports[0].state == "4: ACTIVE"
    assert inv.engine_details[0].name == "sim"
    assert inv.disk_total_bytes > 0
    assert list(inv.warnings) == [
        "fabric ib-a: adapter mlx5_9 is not in "
        f"{FIXTURES / 'ib'} (present: mlx5_0, mlx5_1); check the name with 'ibstat -l'"
    ]


def _inv(**fields: object) -> pb.Inventory:
    base: dict[str, object] = {
        "hostname": "gpu-1",
        "memory_total_bytes": 64 * GIB,
        "memory_available_bytes": 40 * GIB + 100,
        "disk_free_bytes": 500 * GIB + 100,
        "gpus": [pb.Gpu(index=0, uuid="GPU-a", memory_total_mib=81559, memory_used_mib=10)],
        "engines": ["sim"],
    }
    return pb.Inventory(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "worth"),
    [
        ({}, False),
        ({"memory_available_bytes": 40 * GIB + 900 * MIB}, False),
        ({"memory_available_bytes": 39 * GIB}, True),
        ({"disk_free_bytes": 500 * GIB + 1023 * MIB}, False),
        ({"disk_free_bytes": 499 * GIB}, True),
        (
            {"gpus": [pb.Gpu(index=0, uuid="GPU-a", memory_total_mib=81559, memory_used_mib=900)]},
            False,
        ),
        (
            {"gpus": [pb.Gpu(index=0, uuid="GPU-a", memory_total_mib=81559, memory_used_mib=2048)]},
            True,
        ),
        (
            # Utilisation moves every second: the heartbeat carries it, never an inventory.
            {
                "gpus": [
                    pb.Gpu(
                        index=0,
                        uuid="GPU-a",
                        memory_total_mib=81559,
                        memory_used_mib=10,
                        utilization_percent=100,
                    )
                ]
            },
            False,
        ),
        ({"gpus": []}, True),
        ({"gpu_status": "nvidia-smi failed (exit 9): ..."}, True),
        ({"engines": ["sim", "vllm"]}, True),
        ({"fabrics": [pb.Fabric(name="ib-a", hcas=["mlx5_0"], healthy=True)]}, True),
        ({"warnings": ["fabric ib-a: adapter mlx5_3 is not in /sys/class/infiniband"]}, True),
    ],
)
def test_worth_telling(change: dict[str, object], worth: bool) -> None:
    assert worth_telling(_inv(), _inv(**change)) is worth


def _fake_smi(tmp_path: Path) -> tuple[Path, Path]:
    csv = tmp_path / "gpus.csv"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec /bin/cat {csv}\n")
    smi.chmod(0o755)
    return smi, csv


def _write(csv: Path, text: str) -> None:
    # Atomically: the watcher may read it at any moment, and a half-written file is news.
    part = csv.with_suffix(".part")
    part.write_text(text)
    os.replace(part, csv)


def _gpu_line(index: int = 0, used: int = 1, busy: str = "0") -> str:
    return f"{index}, GPU-{index:08d}-0000-4000-8000-000000000000, NVIDIA H100 80GB HBM3, 81559, {used}, 550.54.15, {busy}\n"


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the watcher"
        await asyncio.sleep(0.01)


def test_watcher_sends_only_meaningful_changes(
    tmp_path: Path, empty_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi, csv = _fake_smi(tmp_path)
    _write(csv, _gpu_line(used=1))
    # Memory and disk of the real machine move on their own; feed the watcher ours.
    mem = {"MemTotal": 64 * GIB, "MemAvailable": 40 * GIB + 5}
    disk = [1000 * GIB, 500 * GIB + 100 * MIB]
    monkeypatch.setattr(inventory, "meminfo", lambda path=None: dict(mem))
    monkeypatch.setattr(inventory, "disk_usage", lambda path: (disk[0], disk[1]))
    cfg = config(tmp_path, discovery={"nvidia_smi": str(smi)})
    sent: list[pb.Inventory] = []
    connected = [True]

    def send(inv: pb.Inventory) -> bool:
        sent.append(inv)
        return connected[0]

    async def scenario() -> None:
        watcher = InventoryWatcher(cfg, send, interval=0.02)
        assert watcher.current.gpus[0].memory_used_mib == 1  # ready for the first Hello
        task = asyncio.create_task(watcher.run())
        try:
            # Churn: MiBs of GPU memory, the GPU's utilisation, memory and disk.
            _write(csv, _gpu_line(used=300, busy="88"))
            mem["MemAvailable"] += 3 * MIB
            disk[1] -= 7 * MIB
            await _until(lambda: watcher.current.gpus[0].memory_used_mib == 300)
            assert watcher.current.gpus[0].utilization_percent == 88
            _write(csv, _gpu_line(used=300, busy="[N/A]"))  # known to unknown: churn too
            await _until(lambda: not watcher.current.gpus[0].HasField("utilization_percent"))
            await _until(lambda: watcher.current.disk_free_bytes == disk[1])
            await asyncio.sleep(0.1)
            assert sent == []

            _write(csv, _gpu_line(used=5000))  # a model loaded
            await _until(lambda: len(sent) == 1)
            assert sent[0].gpus[0].memory_used_mib == 5000

            # Not connected: the new one is current anyway (Hello carries it), not resent.
            connected[0] = False
            _write(csv, _gpu_line(used=5000) + _gpu_line(index=1))
            await _until(lambda: len(sent) == 2)
            assert len(watcher.current.gpus) == 2
            await asyncio.sleep(0.1)
            assert len(sent) == 2

            connected[0] = True
            _write(csv, "")  # GPUs gone
            await _until(lambda: len(sent) == 3)
            assert sent[2].gpus == [] and sent[2].gpu_status == NO_GPUS_VISIBLE

            mem["MemAvailable"] = 10 * GIB  # a GiB or more of memory
            await _until(lambda: len(sent) == 4)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


def _counting_engine(tmp_path: Path, ok: bool = True) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    program = tmp_path / "llama-server"
    program.write_text(f"#!/bin/sh\necho run >> {runs}\necho 'version: 1'\nexit {0 if ok else 1}\n")
    program.chmod(0o755)
    return program, runs


def _runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_watcher_reruns_engines_only_when_they_change(tmp_path: Path, empty_path: Path) -> None:
    program, runs = _counting_engine(tmp_path)
    cfg = config(tmp_path, engines={"llamacpp": {"bin": str(program)}})
    watcher = InventoryWatcher(cfg, lambda inv: True, interval=1)
    assert _runs(runs) == 1
    watcher.collect()
    watcher.collect()
    assert _runs(runs) == 1
    assert watcher.current.engine_details[1].version == "version: 1"

    program.write_text(program.read_text().replace("version: 1", "version: 2"))  # upgraded
    inv = watcher.collect()
    assert _runs(runs) == 2
    assert inv.engine_details[1].version == "version: 2"

    watcher.engine_interval = 0  # and after engine_interval, regardless
    watcher.collect()
    assert _runs(runs) == 3


def test_watcher_rechecks_failed_engines(tmp_path: Path, empty_path: Path) -> None:
    program, runs = _counting_engine(tmp_path, ok=False)
    cfg = config(tmp_path, engines={"llamacpp": {"bin": str(program)}})
    watcher = InventoryWatcher(cfg, lambda inv: True, interval=1)
    first = _runs(runs)  # --version and --help
    assert first == 2 and not watcher.current.engine_details[1].ok
    watcher.collect()
    assert _runs(runs) == 2 * first


def test_watcher_found_engine_on_path(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path)
    sent: list[pb.Inventory] = []
    watcher = InventoryWatcher(cfg, lambda inv: sent.append(inv) is None, interval=1)
    assert [e.name for e in watcher.current.engine_details] == ["sim"]
    shutil.copy(FIXTURES / "engines" / "works", empty_path / "llama-server")
    assert watcher.update(watcher.collect())
    assert [e.name for e in sent[0].engine_details] == ["sim", "llamacpp"]
    assert not watcher.update(watcher.collect())


# -- degraded: what the node cannot run although it is configured to ------------------------------


def _pci(root: Path, *addresses: str) -> Path:
    """A /sys/bus/pci/devices-shaped tree holding NVIDIA 3D controllers at ``addresses``
    and, whatever they are, a network adapter."""
    for address, vendor, pci_class in [
        *((a, "0x10de", "0x030200") for a in addresses),
        ("0000:81:00.0", "0x15b3", "0x020700"),
    ]:
        device = root / address
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
    return root


def _reasons(inv: pb.Inventory) -> list[tuple[str, str, str]]:
    return [(d.code, d.engine, d.fabric) for d in inv.degraded]


def test_a_healthy_node_is_not_degraded(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(
        tmp_path,
        discovery={
            "nvidia_smi": str(FIXTURES / "nvidia-smi" / "eight-h100"),
            "ib_root": str(FIXTURES / "ib"),
        },
        fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"]}],
        engines={"llamacpp": {"bin": str(FIXTURES / "engines" / "works")}},
    )
    inv = collect_inventory(cfg, pci_root=_pci(tmp_path / "pci", "0000:c1:00.0"))
    assert len(inv.gpus) == 8 and list(inv.degraded) == []


def test_a_cpu_node_without_a_driver_is_not_degraded(
    tmp_path: Path, empty_path: Path, fake_nvml: FakeNvml
) -> None:
    # Nothing declares GPUs: no nvidia-smi in agent.yaml, none on the PCI bus.
    fake_nvml(init_error="LIBRARY_NOT_FOUND")
    inv = collect_inventory(config(tmp_path), pci_root=_pci(tmp_path / "pci"))
    assert inv.gpus == [] and inv.gpu_status.startswith("no NVIDIA driver")
    assert list(inv.degraded) == []


def test_gpus_on_the_bus_without_a_driver(
    tmp_path: Path, empty_path: Path, fake_nvml: FakeNvml
) -> None:
    fake_nvml(init_error="LIBRARY_NOT_FOUND")
    pci = _pci(tmp_path / "pci", "0000:c1:00.0", "0000:41:00.0")
    inv = collect_inventory(config(tmp_path), pci_root=pci)
    assert _reasons(inv) == [("gpus", "", "")]
    assert inv.degraded[0].message == (
        "2 NVIDIA GPUs are on the PCI bus (0000:41:00.0, 0000:c1:00.0), but no GPU is usable: "
        "no NVIDIA driver: NVML library not found (libnvidia-ml.so.1) and no nvidia-smi on PATH; "
        f"{DRIVER_FIX}; models that need GPUs are not placed on this node until then"
    )
    assert "apt install nvidia-driver" in inv.degraded[0].message


def test_nvidia_smi_named_but_the_driver_failed(tmp_path: Path, empty_path: Path) -> None:
    smi = FIXTURES / "nvidia-smi" / "driver-failed"
    cfg = config(tmp_path, discovery={"nvidia_smi": str(smi)})
    inv = collect_inventory(cfg, pci_root=tmp_path / "no-pci")
    assert _reasons(inv) == [("gpus", "", "")]
    message = inv.degraded[0].message
    assert message.startswith(
        f"agent.yaml names nvidia-smi ({smi}) in discovery.nvidia_smi, but no GPU is usable: "
        "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate"
    )
    assert DRIVER_FIX in message


def test_a_driver_that_sees_no_gpus_says_where_to_look(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(tmp_path, discovery={"nvidia_smi": str(FIXTURES / "nvidia-smi" / "zero-gpus")})
    inv = collect_inventory(cfg, pci_root=_pci(tmp_path / "pci", "0000:c1:00.0"))
    assert _reasons(inv) == [("gpus", "", "")]
    message = inv.degraded[0].message
    assert f"but no GPU is usable: {NO_GPUS_VISIBLE}" in message
    assert DRIVER_FIX not in message  # the driver is there: installing one is not the fix


def test_an_engine_that_will_not_run(tmp_path: Path, empty_path: Path) -> None:
    broken = FIXTURES / "engines" / "missing-lib"
    cfg = config(
        tmp_path,
        engines={
            "llamacpp": {"bin": str(FIXTURES / "engines" / "works")},
            "vllm": {"bin": str(broken)},
        },
    )
    inv = collect_inventory(cfg, pci_root=tmp_path / "no-pci")
    assert list(inv.engines) == ["sim", "llamacpp"]
    assert _reasons(inv) == [("engine", "vllm", "")]
    message = inv.degraded[0].message
    assert message.startswith(f"engine vllm ({broken}) will not run: ")
    assert "libcudart.so.12" in message
    assert "point engines.vllm.bin in agent.yaml at one that runs" in message
    assert "llmgw ctl engines install gpu-1 vllm VERSION --url URL --sha256 SUM" in message
    assert message.endswith("models on vllm are not placed on this node until it runs")


def test_a_fabric_that_is_down(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(
        tmp_path,
        discovery={"ib_root": str(FIXTURES / "ib")},
        fabrics=[
            {"name": "ib-a", "hcas": ["mlx5_0"]},
            {"name": "ib-b", "hcas": ["mlx5_1"]},
            {"name": "ib-c", "hcas": ["mlx5_7"]},
        ],
    )
    inv = collect_inventory(cfg, pci_root=tmp_path / "no-pci")
    assert _reasons(inv) == [("fabric", "", "ib-b"), ("fabric", "", "ib-c")]
    down, missing = (d.message for d in inv.degraded)
    assert down.startswith("fabric ib-b is down: adapter mlx5_1 has no ACTIVE port (port 1: ")
    assert "ibstat mlx5_1" in down
    assert down.endswith(
        "multi-node replicas over ib-b are not placed on this node until it is back"
    )
    assert missing.startswith("fabric ib-c is down: adapter mlx5_7 is not in ")
    assert "check the name with 'ibstat -l'" in missing


def test_docker_that_cannot_be_reached(tmp_path: Path, empty_path: Path) -> None:
    host = f"unix://{tmp_path / 'no-docker.sock'}"
    cfg = config(tmp_path, runtime="docker", docker={"images": {"sim": "llmgw:1"}, "host": host})
    inv = collect_inventory(cfg, pci_root=tmp_path / "no-pci")
    assert _reasons(inv) == [("docker", "", "")]
    assert inv.degraded[0].message.startswith(
        f"runtime is docker but dockerd at {host} cannot be reached (No such file or directory)"
    )
    # The process runtime never asks dockerd.
    assert list(collect_inventory(config(tmp_path), pci_root=tmp_path / "no-pci").degraded) == []


def test_every_reason_at_once(tmp_path: Path, empty_path: Path) -> None:
    cfg = config(
        tmp_path,
        runtime="docker",
        docker={"images": {"sim": "llmgw:1"}, "host": f"unix://{tmp_path / 'none.sock'}"},
        discovery={
            "nvidia_smi": str(FIXTURES / "nvidia-smi" / "driver-failed"),
            "ib_root": str(FIXTURES / "ib"),
        },
        fabrics=[{"name": "ib-b", "hcas": ["mlx5_1"]}],
        engines={"vllm": {"bin": str(FIXTURES / "engines" / "missing-lib")}},
    )
    inv = collect_inventory(cfg, pci_root=tmp_path / "no-pci")
    assert _reasons(inv) == [
        ("docker", "", ""),
        ("gpus", "", ""),
        ("engine", "vllm", ""),
        ("fabric", "", "ib-b"),
    ]


def test_a_node_that_recovers_is_told(tmp_path: Path, empty_path: Path) -> None:
    program, _runs_file = _counting_engine(tmp_path, ok=False)
    cfg = config(tmp_path, engines={"llamacpp": {"bin": str(program)}})
    sent: list[pb.Inventory] = []
    watcher = InventoryWatcher(
        cfg, lambda inv: sent.append(inv) is None, interval=1, pci_root=tmp_path / "no-pci"
    )
    assert _reasons(watcher.current) == [("engine", "llamacpp", "")]
    program.write_text(program.read_text().replace("exit 1", "exit 0"))  # fixed
    assert watcher.update(watcher.collect())
    assert list(sent[0].degraded) == [] and list(sent[0].engines) == ["sim", "llamacpp"]
    assert not watcher.update(watcher.collect())


def test_the_node_says_in_its_log_what_makes_it_degraded(
    tmp_path: Path, empty_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    program, _runs_file = _counting_engine(tmp_path, ok=False)
    cfg = config(tmp_path, engines={"llamacpp": {"bin": str(program)}})
    with caplog.at_level("INFO", logger="llmgw.agent.inventory"):
        watcher = InventoryWatcher(cfg, lambda inv: True, interval=1, pci_root=tmp_path / "no")
        warned = [r for r in caplog.records if r.getMessage() == "node degraded"]
        assert len(warned) == 1 and warned[0].levelname == "WARNING"
        fields = getattr(warned[0], "fields", {})
        assert fields["code"] == "engine"
        assert fields["reason"].startswith(f"engine llamacpp ({program}) will not run")
        caplog.clear()
        watcher.update(watcher.collect())  # the same reason: said once
        assert [r for r in caplog.records if r.getMessage() == "node degraded"] == []
        program.write_text(program.read_text().replace("exit 1", "exit 0"))
        watcher.update(watcher.collect())
        assert "node no longer degraded" in [r.getMessage() for r in caplog.records]
