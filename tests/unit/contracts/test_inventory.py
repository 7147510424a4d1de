"""An inventory as the control plane stores it: every field of the proto by its name, nested
messages as lists of dicts, and nothing JSON cannot carry."""

from __future__ import annotations

import json

import pytest
from google.protobuf.descriptor import Descriptor

from llmgw.contracts.inventory import (
    NOT_STORED,
    DegradedCode,
    DegradedReason,
    degraded_reasons,
    inventory_dict,
    multinode_ports,
)
from llmgw.contracts.ports import DEFAULT_MULTINODE_PORTS, PortRange
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb


def _field_names(descriptor: Descriptor, data: dict[str, object]) -> None:
    stored = [f for f in descriptor.fields if f"{descriptor.name}.{f.name}" not in NOT_STORED]
    assert set(data) == {f.name for f in stored}
    for f in stored:
        if f.message_type is not None:
            value = data[f.name]
            items = value if f.is_repeated else [value]
            assert isinstance(items, list) and items, f.name
            for item in items:
                assert isinstance(item, dict)
                _field_names(f.message_type, item)


def full_inventory() -> pb.Inventory:
    """An inventory with every field set, nested messages included."""
    return pb.Inventory(
        hostname="gpu-1",
        arch="x86_64",
        cpus=32,
        memory_total_bytes=64 << 30,
        memory_available_bytes=40 << 30,
        gpus=[
            pb.Gpu(
                index=0,
                uuid="GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c",
                name="NVIDIA GeForce RTX 4090",
                memory_total_mib=24564,
                memory_used_mib=1093,
                utilization_percent=37,
                health="XID 79: GPU has fallen off the bus",
            )
        ],
        gpu_status="",
        engines=["sim", "llamacpp"],
        driver_version="550.54.14",
        gpu_source="nvidia-smi",
        disk_total_bytes=2 << 40,
        disk_free_bytes=1 << 40,
        engine_details=[
            pb.EngineInfo(name="sim", path="/usr/bin/llmgw", version="0.1.0", ok=True),
            pb.EngineInfo(name="vllm", path="/opt/vllm", ok=False, problem="libcudart missing"),
        ],
        ib_adapters=[
            pb.IbAdapter(
                name="mlx5_0",
                ports=[
                    pb.IbPort(
                        port=1,
                        state="4: ACTIVE",
                        link_layer="InfiniBand",
                        rate="200 Gb/sec (4X HDR)",
                        gids=["fe80:0000:0000:0000:0002:c903:0000:0001"],
                    )
                ],
            )
        ],
        fabrics=[pb.Fabric(name="ib-a", hcas=["mlx5_0", "mlx5_9"], healthy=False)],
        warnings=["fabric ib-a: adapter mlx5_9 is missing"],
        sources=pb.ModelSources(
            models_root="/srv/llmgw/models",
            entries=[pb.ModelSource(name="llama", size_bytes=5 << 30, dir=True)],
            listed_depth=3,
            fetch_prefixes=["file:///srv/share/"],
            cached=["ab" * 32],
            problem="",
        ),
        degraded=[
            pb.DegradedReason(
                code="engine", message="engine vllm will not run", engine="vllm", fabric=""
            ),
            pb.DegradedReason(code="fabric", message="fabric ib-a is down", fabric="ib-a"),
        ],
        multinode_ports="40000-40099",
        warm=[
            pb.WarmStatus(
                source="llama",
                state="warm",
                reason="",
                bytes=5 << 30,
                pass_seconds=20.5,
                last_pass_at=1.7e9,
            )
        ],
    )


def test_what_is_not_stored_names_fields_that_exist() -> None:
    for name in NOT_STORED:
        message, _, field_name = name.partition(".")
        descriptor = pb.DESCRIPTOR.message_types_by_name[message]
        assert field_name in descriptor.fields_by_name, name


def test_inventory_dict_has_every_field() -> None:
    data = inventory_dict(full_inventory())
    _field_names(pb.Inventory.DESCRIPTOR, data)
    assert json.loads(json.dumps(data)) == data
    assert data["gpus"] == [
        {
            "index": 0,
            "uuid": "GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c",
            "name": "NVIDIA GeForce RTX 4090",
            "memory_total_mib": 24564,
            "memory_used_mib": 1093,
            "health": "XID 79: GPU has fallen off the bus",
        }
    ]  # its utilisation (37) is not stored: it is old by the time anyone reads it
    assert data["engine_details"][1] == {
        "name": "vllm",
        "path": "/opt/vllm",
        "version": "",
        "ok": False,
        "problem": "libcudart missing",
    }
    assert data["ib_adapters"] == [
        {
            "name": "mlx5_0",
            "ports": [
                {
                    "port": 1,
                    "state": "4: ACTIVE",
                    "link_layer": "InfiniBand",
                    "rate": "200 Gb/sec (4X HDR)",
                    "gids": ["fe80:0000:0000:0000:0002:c903:0000:0001"],
                }
            ],
        }
    ]
    assert data["fabrics"] == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_9"], "healthy": False}]
    assert data["sources"] == {
        "models_root": "/srv/llmgw/models",
        "entries": [{"name": "llama", "size_bytes": 5 << 30, "dir": True}],
        "listed_depth": 3,
        "fetch_prefixes": ["file:///srv/share/"],
        "cached": ["ab" * 32],
        "problem": "",
    }
    assert (data["engines"], data["warnings"]) == (
        ["sim", "llamacpp"],
        ["fabric ib-a: adapter mlx5_9 is missing"],
    )
    assert data["degraded"] == [
        {"code": "engine", "message": "engine vllm will not run", "engine": "vllm", "fabric": ""},
        {"code": "fabric", "message": "fabric ib-a is down", "engine": "", "fabric": "ib-a"},
    ]
    assert data["multinode_ports"] == "40000-40099"


def test_degraded_reasons_read_back_from_the_stored_form() -> None:
    data = inventory_dict(full_inventory())
    assert degraded_reasons(data) == (
        DegradedReason(DegradedCode.ENGINE, "engine vllm will not run", engine="vllm"),
        DegradedReason(DegradedCode.FABRIC, "fabric ib-a is down", fabric="ib-a"),
    )
    # A node whose agent predates the reasons, or a stored form that is not a list, is
    # healthy as far as placement can tell; entries that are not objects are skipped.
    assert degraded_reasons({}) == ()
    assert degraded_reasons({"degraded": "gpus"}) == ()
    assert degraded_reasons({"degraded": {"code": "gpus"}}) == ()
    assert degraded_reasons({"degraded": ["gpus", {"code": "docker", "message": "m"}]}) == (
        DegradedReason("docker", "m"),
    )


def test_an_empty_inventory_is_all_defaults() -> None:
    data = inventory_dict(pb.Inventory())
    assert data["hostname"] == "" and data["cpus"] == 0
    assert data["gpus"] == data["engine_details"] == data["ib_adapters"] == data["fabrics"] == []
    assert data["degraded"] == []
    # An agent that reports no sources (older than the check) is told apart from an empty
    # models_root: placement does not filter it.
    assert data["sources"] is None
    # Nor does it report its multi-node ports: it uses the default range.
    assert data["multinode_ports"] == ""
    assert multinode_ports(data) == DEFAULT_MULTINODE_PORTS
    assert json.loads(json.dumps(data)) == data


def test_multinode_ports_read_back_from_the_stored_form() -> None:
    assert multinode_ports(inventory_dict(full_inventory())) == PortRange(40000, 40099)
    # Stored before the field existed (no key), or by an agent that predates it (""/null).
    assert multinode_ports({}) == DEFAULT_MULTINODE_PORTS
    assert multinode_ports({"multinode_ports": None}) == DEFAULT_MULTINODE_PORTS
    # What no agent of ours sends is refused, not taken for the default: placement must not
    # put a port where the node's firewall may be closed.
    with pytest.raises(ConfigError, match="'29500' is not a port range"):
        multinode_ports({"multinode_ports": "29500"})
    with pytest.raises(ConfigError, match="is reversed"):
        multinode_ports({"multinode_ports": "30000-29500"})
