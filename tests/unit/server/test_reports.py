"""What a node's new inventory is worth in the events (llmgw.server.fleet.reports): the first one
in full, then only what changed in words an operator reads ("engines: +vllm 0.33.0", "GPU 1
lost"); volatile figures (free disk and memory, GPU memory in use) are never an event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.reports import inventory_changes, store_inventory
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import Store

GIB = 2**30


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "llmgw.db")
    s.upsert_node(
        "gpu-1", dataplane_addr="127.0.0.1:1", agent_version="0.1.0", inventory={}, connected=True
    )
    yield s
    s.close()


@pytest.fixture
def session() -> NodeSession:
    return NodeSession(
        node_id="gpu-1", dataplane_addr="127.0.0.1:1", epoch=1, engines=frozenset(), serial="01"
    )


def _gpu(index: int, used: int = 0) -> pb.Gpu:
    return pb.Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA H100",
        memory_total_mib=81559,
        memory_used_mib=used,
    )


def _inventory(
    disk_free: int = 500 * GIB, mem_free: int = 900 * GIB, used: int = 0, **extra: object
) -> pb.Inventory:
    fields: dict[str, object] = {
        "hostname": "gpu-1",
        "arch": "x86_64",
        "cpus": 96,
        "memory_total_bytes": 1024 * GIB,
        "memory_available_bytes": mem_free,
        "disk_total_bytes": 2048 * GIB,
        "disk_free_bytes": disk_free,
        "gpus": [_gpu(0, used), _gpu(1, used)],
        "driver_version": "550.54.15",
        "gpu_source": "nvml",
        "engines": ["sim"],
        "engine_details": [
            pb.EngineInfo(name="sim", path="/usr/bin/llmgw", version="0.1.0", ok=True)
        ],
        **extra,
    }
    return pb.Inventory(**fields)  # type: ignore[arg-type]


def _told(store: Store) -> list[str]:
    """The inventory events' messages, oldest first."""
    events = reversed(store.list_events(limit=1000))
    return [e.message for e in events if e.kind == "inventory_changed"]


def test_an_hour_of_drifting_free_space_records_no_event(
    store: Store, session: NodeSession
) -> None:
    store_inventory(store, session, _inventory())
    assert len(_told(store)) == 1  # the first inventory, in full
    # An agent that reports every 30 s for an hour, free disk, free memory and GPU memory
    # in use moving each time: stored (placement reads them), never an event.
    for step in range(120):
        store_inventory(
            store,
            session,
            _inventory(disk_free=(500 - step) * GIB, mem_free=(900 - 3 * step) * GIB, used=step),
        )
    assert len(_told(store)) == 1
    assert store.get_node("gpu-1").inventory["disk_free_bytes"] == 381 * GIB


def test_what_changed_is_said_in_the_event(store: Store, session: NodeSession) -> None:
    store_inventory(store, session, _inventory())
    details = [
        pb.EngineInfo(name="sim", path="/usr/bin/llmgw", version="0.1.0", ok=True),
        pb.EngineInfo(name="vllm", path="/opt/vllm/bin/vllm", version="0.33.0", ok=True),
    ]
    store_inventory(
        store,
        session,
        _inventory(gpus=[_gpu(0)], engines=["sim", "vllm"], engine_details=details),
    )
    assert _told(store)[-1] == "GPU 1 lost; engines: +vllm 0.33.0"


def test_each_kind_of_change_in_words() -> None:
    def stored(**extra: object) -> dict[str, object]:
        from llmgw.contracts.inventory import inventory_dict

        return inventory_dict(_inventory(**extra))

    before = stored()
    assert inventory_changes(before, stored(disk_free=1, mem_free=2, used=70000)) == []
    assert inventory_changes(before, stored(driver_version="560.28.03")) == [
        "driver: 550.54.15 -> 560.28.03"
    ]
    assert inventory_changes(before, stored(gpus=[_gpu(0), _gpu(1), _gpu(2)])) == [
        "GPU 2 found (NVIDIA H100)"
    ]
    upgraded = [pb.EngineInfo(name="sim", path="/usr/bin/llmgw", version="0.2.0", ok=True)]
    assert inventory_changes(before, stored(engine_details=upgraded)) == [
        "engines: sim 0.1.0 -> 0.2.0"
    ]
    assert inventory_changes(before, stored(warnings=["adapter mlx5_1 missing"])) == [
        "warnings: +adapter mlx5_1 missing"
    ]
    port = pb.IbPort(port=1, state="ACTIVE", link_layer="InfiniBand", rate="400 Gb/sec")
    down = pb.IbPort(port=1, state="DOWN", link_layer="InfiniBand", rate="400 Gb/sec")
    with_port = stored(ib_adapters=[pb.IbAdapter(name="mlx5_0", ports=[port])])
    port_down = stored(ib_adapters=[pb.IbAdapter(name="mlx5_0", ports=[down])])
    assert inventory_changes(with_port, port_down) == ["mlx5_0 port 1: ACTIVE -> DOWN"]
    assert inventory_changes(before, stored(memory_total_bytes=512 * GIB)) == [
        "memory: 1024.0 GiB -> 512.0 GiB"
    ]
