"""The scheduler and a profile's task: the flags that run the engine for it reach the
shard's order ahead of the profile's own args, so an agent of any version starts it so."""

from __future__ import annotations

from typing import Any

from llmgw.proto import control_pb2 as pb
from tests.unit.server.scheduler_rig import SchedulerRig


def _join(cp: SchedulerRig, node_id: str, engine: str) -> None:
    inventory: dict[str, Any] = {
        "sources": {
            "models_root": "/srv/llmgw/models",
            "entries": [{"name": "weights.gguf", "size_bytes": 1, "dir": False}],
            "listed_depth": 3,
            "fetch_prefixes": [],
            "cached": [],
            "problem": "",
        }
    }
    cp.join(node_id, inventory, dataplane_addr=f"{node_id}:9443", engines=frozenset({engine}))


def _start(cp: SchedulerRig, profile: dict[str, Any]) -> pb.StartShard:
    cp.store.put_catalog_model("m", {"default": profile})
    cp.store.deploy_model("m", profile="default", replicas=1)
    cp.scheduler().reconcile()
    for session in cp.sessions.values():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            if msg is not None and msg.WhichOneof("msg") == "start_shard":
                return msg.start_shard
    raise AssertionError("no shard was started")


def test_an_embedding_profile_starts_llama_server_with_embedding(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llamacpp")
    start = _start(
        cp,
        {
            "engine": "llamacpp",
            "source": "weights.gguf",
            "gpus": 0,
            "task": "embed",
            "args": ["--pooling", "cls"],
        },
    )
    assert list(start.extra_args) == ["--embedding", "--pooling", "cls"]


def test_a_profile_without_a_task_starts_the_engine_as_before(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llamacpp")
    start = _start(
        cp, {"engine": "llamacpp", "source": "weights.gguf", "gpus": 0, "args": ["--jinja"]}
    )
    assert list(start.extra_args) == ["--jinja"]
