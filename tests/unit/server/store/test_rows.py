"""Tests for the rows the store hands out and the checks on the values it writes."""

from __future__ import annotations

import enum
import json
from dataclasses import fields
from typing import Any

import pytest

from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow
from llmgw.server.store import Store
from llmgw.server.store import rows as rows_module
from llmgw.server.store.rows import (
    ApiKey,
    Certificate,
    DesiredBuild,
    Event,
    FromRow,
    Model,
    Node,
    NodeEngine,
    NodeUpdate,
    Operator,
    Replica,
    RowMap,
    Shard,
    StoredLogin,
    check_state,
    dump_json,
    join_token_from_row,
    policy_columns,
    usage_from_row,
)
from llmgw.server.store.states import InstallState, NodeState, ReplicaState, ShardState, TokenKind
from llmgw.server.store.tokens import JoinToken


def test_state_columns_come_back_as_the_enums_and_equal_their_names(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    store.put_model("m", engine="sim", params={}, replicas=1)
    replica = store.add_replica("m")
    shard = store.add_shard(replica.id, "gpu-1")
    token, _ = store.create_join_token("gpu-2", ttl=60)
    assert node.state is NodeState.PENDING and node.state == "pending"
    assert replica.state is ReplicaState.PENDING
    assert shard.state is ShardState.PENDING and f"{shard.state}" == "pending"
    assert token.kind is TokenKind.JOIN
    store.update_shard(shard.id, state="ready")
    assert store.get_shard(shard.id).state is ShardState.READY


def test_check_state() -> None:
    assert check_state("ready", ShardState, "shard") is ShardState.READY
    with pytest.raises(ValueError) as info:
        check_state("banned", NodeState, "node")
    assert str(info.value) == "'banned' is not a node state; use one of approved, pending, revoked"


def test_dump_json() -> None:
    assert dump_json({"b": 1, "a": [1, 2]}, "params") == '{"a":[1,2],"b":1}'
    with pytest.raises(ValueError, match="params must be a mapping, not list"):
        dump_json([1], "params")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="params must be JSON-serialisable"):
        dump_json({"x": object()}, "params")


# ------------------------------------------------------------------------ each row type


class DictRow(dict[str, Any]):
    """A row as both drivers hand one out: by column name, with ``keys()``."""

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(super().keys())


def columns_of(value: Any, rows: RowMap) -> DictRow:
    """What the store writes for ``value``: each field in its column (``rows.columns``'
    name where it differs), as the database holds it (enums as their names, flags as 0/1,
    mappings and lists as JSON); a derived field in the columns it is made of."""
    row = DictRow()
    for f in fields(value):
        v = getattr(value, f.name)
        if isinstance(v, KeyPolicy):
            row.update(policy_columns(v))
            continue
        if f.name == "active" and isinstance(value, StoredLogin):
            row["removed_at"] = None if v else 1234.5
            continue
        if isinstance(v, enum.Enum):
            v = v.value
        elif isinstance(v, bool):
            v = int(v)
        elif isinstance(v, dict | tuple):
            v = json.dumps(list(v) if isinstance(v, tuple) else v)
        elif isinstance(v, bytes):
            v = memoryview(v)  # what psycopg hands out for a bytea
        row[rows.columns.get(f.name, f.name)] = v
    return row


SAMPLES: list[Any] = [
    Node(
        "gpu-1",
        "u-1",
        NodeState.APPROVED,
        True,
        "10.0.0.1:7443",
        "1.2.3",
        {"gpus": [1]},
        "sha256:f",
        False,
        12.5,
        1.0,
        lost=True,
        lost_at=13.0,
    ),
    NodeUpdate("gpu-1", 3, "1.2.4", "done", "ok", "op-1", b"{}", b"sig", 99.0, 2.0, 3.0),
    NodeUpdate("gpu-1", 1, "1.2.4", "pending", "", "op-2", None, None, None, None, 3.0),
    DesiredBuild("*", "llamacpp", "b1", "x86_64", "https://h/x.tgz", "a" * 64, 4.0),
    NodeEngine("gpu-1", "llamacpp", "b1", "a" * 64, InstallState.FAILED, "no", "op-3", 5.0),
    Model("m", "sim", {"seed": 1}, 2, 1.0, 2.0, profiles={"default": {}}, profile="fast"),
    Replica("r-1", "m", ReplicaState.READY, 1.0, 2.0, profile=None),
    Shard(
        "s-1",
        "r-1",
        "gpu-1",
        0,
        ShardState.READY,
        8001,
        42,
        None,
        "",
        1,
        "op-4",
        6.0,
        gpus=("GPU-a", "GPU-b"),
        dist_init_addr="10.0.0.1:29500",
    ),
    ApiKey(
        "k-1",
        "ci",
        "llmgw_ab",
        "h",
        1.0,
        None,
        KeyPolicy(
            models=("m",),
            rpm=60,
            tpm=None,
            max_concurrent=2,
            budget=Budget(1000, "day"),
            priority=1,
            expires_at=9.0,
        ),
        updated_at=2.0,
    ),
    ApiKey("k-2", "old", "llmgw_cd", "h2", 1.0, 3.0, KeyPolicy()),
    Event(7, 1.5, "node_joined", "gpu-1", "joined", actor="alice"),
    Operator(1, "alice", "admin", "scrypt$x", 1.0, "token", 2.0, None),
    StoredLogin("th", 1, "alice", "viewer", False, "cli", "c", 1.0, 2.0, 3.0, "::1", "curl"),
    Certificate("ab01", "gpu-1", "sha256:f", 1.0, 2.0, 1.0, None, ""),
    UsageRow("2026-12-07", "k-1", "m", 3, 10, 20, 5, 1, key_name="ci"),
    JoinToken(
        "t-1",
        "h",
        "llmgw_j",
        "gpu-2",
        TokenKind.REKEY,
        "u-2",
        True,
        1.0,
        2.0,
        None,
        None,
        lost_state=True,
        auto_approve=False,
        approved_fingerprint="sha256:f",
    ),
]


def _read(value: Any) -> Any:
    """``value`` written as columns, then read back the way the store reads its type."""
    if isinstance(value, UsageRow):
        return usage_from_row(columns_of(value, rows_module._USAGE_ROW))
    if isinstance(value, JoinToken):
        return join_token_from_row(columns_of(value, rows_module._JOIN_TOKEN_ROW), as_of=7.0)
    return type(value).from_row(columns_of(value, type(value).ROW))


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_each_row_type_round_trips(value: Any) -> None:
    back = _read(value)
    assert back == value
    for f in fields(value):  # the fields compare= leaves out, too, and the types
        got, want = getattr(back, f.name), getattr(value, f.name)
        if f.name != "as_of":
            assert got == want and type(got) is type(want), f.name


def test_every_row_type_is_sampled() -> None:
    row_types = {
        cls
        for cls in vars(rows_module).values()
        if isinstance(cls, type) and issubclass(cls, FromRow) and cls is not FromRow
    }
    assert row_types | {UsageRow, JoinToken} == {type(v) for v in SAMPLES}
    assert len(row_types) == 12


def test_a_join_token_is_read_at_the_store_clock_and_a_usage_row_without_its_key_name() -> None:
    token = next(v for v in SAMPLES if isinstance(v, JoinToken))
    assert _read(token).as_of == 7.0
    usage = next(v for v in SAMPLES if isinstance(v, UsageRow))
    row = columns_of(usage, rows_module._USAGE_ROW)
    del row["key_name"]
    assert usage_from_row(row).key_name == ""


def test_a_node_takes_its_inventory_already_parsed() -> None:
    node = SAMPLES[0]
    shared = {"gpus": [1]}
    assert Node.from_row(columns_of(node, Node.ROW), shared).inventory is shared
