"""Tests for the desired_engines and node_engines tables: one version per scope and engine
(another replaces, the same adds architectures), forgetting, each node's last install and
the answer to it, and the migration that made them on a database of the previous version."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from llmgw.errors import StoreError
from llmgw.server.store import ALL_NODES, MIGRATIONS, DesiredBuild, NodeEngine, Store
from llmgw.server.store.schema import split_sql
from llmgw.server.store.states import InstallState
from tests.unit.clock import Clock

A, B = "a" * 64, "b" * 64


def test_desired_builds_merge_by_arch_within_a_version(store: Store, clock: Clock) -> None:
    first = store.set_desired_engine(ALL_NODES, "llamacpp", "b1", [("x86_64", "https://h/x", A)])
    assert first is False
    clock.advance()
    replaced = store.set_desired_engine(
        ALL_NODES, "llamacpp", "b1", [("aarch64", "https://h/a", B), ("x86_64", "https://h/y", B)]
    )
    assert replaced is False
    assert store.list_desired_engines() == [
        DesiredBuild(ALL_NODES, "llamacpp", "b1", "aarch64", "https://h/a", B, 1001.0),
        DesiredBuild(ALL_NODES, "llamacpp", "b1", "x86_64", "https://h/y", B, 1001.0),
    ]


def test_another_version_replaces_every_build_of_the_scope_only(store: Store) -> None:
    store.set_desired_engine(ALL_NODES, "vllm", "0.8", [("x86_64", "https://h/x", A)])
    store.set_desired_engine(ALL_NODES, "vllm", "0.8", [("aarch64", "https://h/a", A)])
    store.set_desired_engine("gpu1", "vllm", "0.7", [("", "https://h/any", A)])
    assert store.set_desired_engine(ALL_NODES, "vllm", "0.9", [("x86_64", "https://h/9", B)])
    rows = [(r.scope, r.version, r.arch) for r in store.list_desired_engines()]
    assert rows == [(ALL_NODES, "0.9", "x86_64"), ("gpu1", "0.7", "")]
    assert [r.scope for r in store.list_desired_engines("gpu1")] == ["gpu1"]


def test_forget_removes_one_arch_or_the_whole_entry(store: Store) -> None:
    store.set_desired_engine(
        ALL_NODES, "sglang", "0.4", [("x86_64", "https://h/x", A), ("aarch64", "https://h/a", A)]
    )
    assert store.forget_desired_engine(ALL_NODES, "sglang", "aarch64") == 1
    assert [r.arch for r in store.list_desired_engines()] == ["x86_64"]
    assert store.forget_desired_engine("gpu1", "sglang") == 0  # another scope: untouched
    assert store.forget_desired_engine(ALL_NODES, "sglang") == 1
    assert store.list_desired_engines() == []


def test_a_node_keeps_the_last_install_of_each_engine(store: Store, clock: Clock) -> None:
    first = store.put_node_engine(
        "gpu1", "vllm", version="0.8", sha256=A, state=InstallState.INSTALLING, op_id="op1"
    )
    assert first == NodeEngine("gpu1", "vllm", "0.8", A, InstallState.INSTALLING, "", "op1", 1000.0)
    clock.advance()
    store.put_node_engine(
        "gpu1", "vllm", version="0.9", sha256=B, state=InstallState.INSTALLING, op_id="op2"
    )
    # The answer to the replaced order changes nothing; the answer to the last one does.
    assert store.finish_node_engine("gpu1", "op1", InstallState.INSTALLED) is None
    assert store.finish_node_engine("gpu2", "op2", InstallState.INSTALLED) is None
    clock.advance()
    done = store.finish_node_engine("gpu1", "op2", InstallState.FAILED, "x" * 5000)
    assert done is not None
    assert (done.version, done.state, len(done.error), done.updated_at) == (
        "0.9",
        InstallState.FAILED,
        2000,
        1002.0,
    )
    assert store.list_node_engines() == [done]
    assert store.list_node_engines("gpu2") == []
    assert store.node_engines_by_op(["op1", "op2", "nope"]) == [done]
    assert store.node_engines_by_op([]) == []


def test_an_unknown_install_state_is_refused_by_the_database(store: Store) -> None:
    with pytest.raises(StoreError):
        store.put_node_engine(
            "gpu1",
            "vllm",
            version="1",
            sha256=A,
            state="done",
            op_id="op",  # type: ignore[arg-type]
        )


def test_the_migration_adds_both_tables_to_a_previous_database(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    for number, script in enumerate(MIGRATIONS[:5], 1):
        for statement in split_sql(script):
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version={number}")
    conn.commit()
    conn.close()
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS) >= 6
        s.set_desired_engine(ALL_NODES, "vllm", "1", [("", "https://h/v", A)])
        assert len(s.list_desired_engines()) == 1
