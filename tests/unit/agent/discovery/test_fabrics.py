"""InfiniBand discovery from sysfs-shaped trees, and the fabrics' health."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from llmgw.agent.config import FabricConfig, load_agent_config
from llmgw.agent.discovery import (
    discover_ib,
    fabric_status,
)
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
IB = FIXTURES / "ib"


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
