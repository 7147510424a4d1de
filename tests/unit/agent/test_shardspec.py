"""A disaggregated shard's order on the agent: read from a StartShard, checked before anything
starts (its role, its engine, its shape, its transfer port inside multinode_ports), kept in
shards.json so that an adopted shard keeps its pool, and handed to the engine's builder with
the node's fabric adapters."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.records import ShardRecords, parse_record, record_json
from llmgw.agent.runtimes import Launch
from llmgw.agent.runtimes.containers import launch_for
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import Shard, ShardManager, ShardSpec, ShardState
from llmgw.contracts.ports import PortRange
from llmgw.errors import ShardError
from llmgw.proto import control_pb2 as pb

NODE_PORTS = PortRange(30000, 30099)
ADDR = "10.1.0.5:30010"


def _pool(engine: str = "vllm", role: str = "prefill", **kw: Any) -> ShardSpec:
    fields: dict[str, Any] = {"disagg_role": role, "transfer_addr": ADDR, **kw}
    return ShardSpec(shard_id="r3-s0", replica_id="r3", model="llama", engine=engine, **fields)


# --------------------------------------------------------------------------- the order


def test_a_start_shard_order_carries_its_role_and_transfer_addr() -> None:
    order = pb.StartShard(
        shard_id="r3-s0",
        replica_id="r3",
        model="llama",
        engine="sglang",
        disagg_role="decode",
        transfer_addr=ADDR,
    )
    spec = ShardSpec.from_order(order)
    assert (spec.disagg_role, spec.transfer_addr) == ("decode", ADDR)


def test_an_order_of_a_control_plane_before_disaggregation_is_aggregated() -> None:
    spec = ShardSpec.from_order(
        pb.StartShard(shard_id="s", replica_id="r", model="m", engine="sim")
    )
    assert (spec.disagg_role, spec.transfer_addr) == ("", "")


# --------------------------------------------------------------------------- shards.json


def test_the_record_keeps_role_and_transfer_addr_for_adoption(tmp_path: Path) -> None:
    spec = _pool("sglang", "decode")
    record = Shard(spec=spec, state=ShardState.READY, port=41000, pid=5).record()
    assert (record.disagg_role, record.transfer_addr) == ("decode", ADDR)
    # Through the file as it is written and read.
    entry = json.loads(json.dumps(record_json(record)))
    assert parse_record(spec.shard_id, entry) == record
    assert ShardSpec.from_record(parse_record(spec.shard_id, entry)) == spec


def test_a_record_of_an_agent_before_disaggregation_is_aggregated() -> None:
    entry = record_json(Shard(spec=_pool()).record())
    del entry["disagg_role"], entry["transfer_addr"]
    record = parse_record("r3-s0", entry)
    assert (record.disagg_role, record.transfer_addr) == ("", "")


def test_a_record_whose_role_is_not_text_is_refused() -> None:
    entry = {**record_json(Shard(spec=_pool()).record()), "disagg_role": 1}
    with pytest.raises(ValueError, match="'disagg_role' is a int"):
        parse_record("r3-s0", entry)


def test_an_engine_that_died_while_no_agent_watched_is_reported_with_its_pool(
    tmp_path: Path,
) -> None:
    # Its record as the previous agent left it, its pid long gone.
    record = dataclasses.replace(
        Shard(spec=_pool("vllm", "decode"), state=ShardState.READY, port=41000).record(),
        pid=2**22 + 17,
        start_time=1,
    )
    ShardRecords(tmp_path).save([record])

    async def main() -> list[Shard]:
        manager = ShardManager(tmp_path, ProcessRuntime(), lambda shard: None)
        await manager.open()
        try:
            await manager.adopt_all()
            manager._save_records()
            return manager.snapshot()
        finally:
            await manager.close()

    (shard,) = asyncio.run(main())
    assert shard.state == ShardState.FAILED
    assert (shard.spec.disagg_role, shard.spec.transfer_addr) == ("decode", ADDR)
    (again,) = ShardRecords(tmp_path).load()
    assert (again.disagg_role, again.transfer_addr) == ("decode", ADDR)


# --------------------------------------------------------------------------- the checks


class Launched(Exception):
    """What the stand-in launcher raises: the order got past every check before it."""


def _checked(tmp_path: Path) -> tuple[ShardManager, list[Any], list[str]]:
    launched: list[str] = []
    events: list[Any] = []

    def launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        launched.append(spec.shard_id)
        raise Launched

    manager = ShardManager(
        tmp_path, ProcessRuntime(), events.append, make_launch=launch, multinode_ports=NODE_PORTS
    )
    return manager, events, launched


def _start(manager: ShardManager, order: ShardSpec) -> None:
    async def main() -> None:
        await manager.start(order)

    with contextlib.suppress(Launched):
        asyncio.run(main())


@pytest.mark.parametrize(
    "order",
    [
        _pool("vllm", "prefill"),
        _pool("sglang", "decode", transfer_addr="[fd00::5]:30099"),
        _pool("sim", "decode", transfer_addr="10.1.0.5:30000"),
        ShardSpec("agg", "r4", "m", "sim"),  # no role, no address: aggregated
    ],
    ids=["vllm-prefill", "sglang-decode-v6", "sim-decode", "aggregated"],
)
def test_a_pool_shard_inside_the_range_goes_ahead(tmp_path: Path, order: ShardSpec) -> None:
    manager, _, launched = _checked(tmp_path)
    _start(manager, order)
    assert launched == [order.shard_id]


OUTSIDE = (
    "shard r3-s0: its KV transfer address (transfer_addr, a prefill shard's) 10.1.0.5:29600 "
    "is outside this node's multinode_ports 30000-30099, the only ports its firewall opens to "
    "the fabric's peers; the control plane places inside the range a node reports, so restart "
    "the agent if agent.yaml changed since it started (or upgrade a control plane that "
    "predates the range), or widen multinode_ports in agent.yaml to hold it and re-run "
    "install-agent.sh so that the firewall follows"
)


@pytest.mark.parametrize(
    ("order", "message"),
    [
        (_pool("vllm", "prefill", transfer_addr="10.1.0.5:29600"), OUTSIDE),
        (
            _pool("vllm", "both"),
            "shard r3-s0: disaggregation role 'both' is not one llmgw knows; use prefill or "
            "decode (or none for an aggregated replica)",
        ),
        (
            _pool("llamacpp", "decode"),
            "shard r3-s0: llama.cpp cannot disaggregate prefill and decode; use vllm, sglang "
            "or sim (or deploy the model without prefill and decode pools)",
        ),
        (
            _pool("sglang", "prefill", transfer_addr=""),
            "shard r3-s0: a prefill shard needs transfer_addr (host:port where its engine binds "
            "its KV transfer side channel); the control plane sends one with every role, so "
            "upgrade a control plane that does not",
        ),
        (
            _pool("sim", ""),
            f"shard r3-s0: transfer_addr {ADDR} is given without a disaggregation role; an "
            "aggregated shard transfers no KV cache: give a role (prefill or decode) or no "
            "transfer_addr",
        ),
        (
            _pool("vllm", "decode", nodes=2, dist_init_addr="10.1.0.5:30001"),
            "shard r3-s0: a decode shard of a 2-node replica: disaggregated pools are "
            "single-node replicas in this release; deploy the pools with nodes 1",
        ),
        (
            _pool("vllm", "decode", transfer_addr="10.1.0.5"),
            "shard r3-s0: transfer_addr '10.1.0.5' is not host:port (e.g. 10.0.0.1:29500, "
            "[fd00::1]:29500): ",
        ),
    ],
    ids=["outside", "unknown-role", "llamacpp", "no-addr", "addr-no-role", "multi-node", "no-port"],
)
def test_a_pool_shard_that_cannot_run_is_refused_before_anything(
    tmp_path: Path, order: ShardSpec, message: str
) -> None:
    manager, events, launched = _checked(tmp_path)
    with pytest.raises(ShardError) as info:
        _start(manager, order)
    assert str(info.value).startswith(message)
    # Refused before anything: no launch, no status, no shard, no record to adopt.
    assert launched == [] and events == []
    assert manager.get(order.shard_id) is None
    assert manager.records.load() == []


# --------------------------------------------------------------------------- the engine


def test_the_process_engine_gets_the_role_and_the_nodes_fabric_adapters(tmp_path: Path) -> None:
    manager = ShardManager(
        tmp_path, ProcessRuntime(), lambda shard: None, fabric_devices=("mlx5_0", "mlx5_1")
    )
    launch = manager._process_launch(_pool("vllm", "decode"), 41000, tmp_path / "s.log")
    assert "--kv-transfer-config" in launch.argv
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.0.5"
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "30010"
    assert launch.env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    # An aggregated shard on the same node: nothing of it.
    plain = manager._process_launch(ShardSpec("a", "r", "m", "vllm"), 41001, tmp_path / "a.log")
    assert "--kv-transfer-config" not in plain.argv
    assert set(plain.env) == {"CUDA_VISIBLE_DEVICES"}


class Sandboxes:
    """A stand-in for the agent's sandboxes: remembers what each shard's was asked for."""

    def __init__(self) -> None:
        self.fabric: dict[str, bool] = {}

    async def prepare(self, shard_id: str, policy: object, **kw: Any) -> None:
        self.fabric[shard_id] = kw["multi_node"]
        raise Launched


@pytest.mark.parametrize(
    ("order", "fabric"),
    [(_pool("vllm", "decode"), True), (ShardSpec("agg", "r4", "m", "vllm"), False)],
    ids=["pool", "aggregated"],
)
def test_a_pool_shards_sandbox_sees_the_fabrics_adapters(
    tmp_path: Path, order: ShardSpec, fabric: bool
) -> None:
    def launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        return Launch(shard_id=spec.shard_id, argv=("vllm",), port=port, log_path=log_path)

    sandboxes = Sandboxes()
    manager = ShardManager(
        tmp_path,
        ProcessRuntime(),
        lambda shard: None,
        make_launch=launch,
        multinode_ports=NODE_PORTS,
    )
    manager.sandboxes = sandboxes  # type: ignore[assignment]
    _start(manager, order)
    assert sandboxes.fabric == {order.shard_id: fabric}


def test_a_docker_node_refuses_a_pool_shard(tmp_path: Path) -> None:
    with pytest.raises(ShardError) as info:
        launch_for(
            _pool("vllm", "prefill"),
            port=41000,
            log_path=tmp_path / "s.log",
            node_id="n",
            cluster_id="",
            images={"vllm": "llmgw-vllm:0.1"},
        )
    assert str(info.value) == (
        "shard r3-s0 is a prefill shard of a disaggregated model, which runs as a process "
        "engine only in this release; set runtime: process in agent.yaml for the nodes of its "
        "pools, or deploy the model without prefill and decode pools"
    )
