"""The scheduler and model sources: the profile's source reaches placement and the order
(with its SHA-256 for a URL), and a model no node has the source of says why."""

from __future__ import annotations

from typing import Any

from llmgw.proto import control_pb2 as pb
from tests.unit.server.scheduler_rig import SchedulerRig

SHA = "ab" * 32


def _join(cp: SchedulerRig, node_id: str, *names: str, prefixes: tuple[str, ...] = ()) -> None:
    inventory: dict[str, Any] = {
        "sources": {
            "models_root": "/srv/llmgw/models",
            "entries": [{"name": n, "size_bytes": 1, "dir": True} for n in names],
            "listed_depth": 3,
            "fetch_prefixes": list(prefixes),
            "cached": [],
            "problem": "",
        }
    }
    cp.join(node_id, inventory, dataplane_addr=f"{node_id}:9443", engines=frozenset({"sim"}))


def _deploy(cp: SchedulerRig, name: str, source: Any) -> None:
    cp.store.put_catalog_model(name, {"default": {"engine": "sim", "source": source}})
    cp.store.deploy_model(name, profile="default", replicas=1)


def _starts(cp: SchedulerRig) -> dict[str, pb.StartShard]:
    out: dict[str, pb.StartShard] = {}
    for node_id, session in cp.sessions.items():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            if msg is not None and msg.WhichOneof("msg") == "start_shard":
                out[node_id] = msg.start_shard
    return out


def test_a_model_goes_to_the_node_with_its_source(cp: SchedulerRig) -> None:
    _join(cp, "n1", "other")
    _join(cp, "n2", "llama")
    _deploy(cp, "m", "llama")
    cp.scheduler().reconcile()
    starts = _starts(cp)
    assert list(starts) == ["n2"]
    assert (starts["n2"].source, starts["n2"].source_sha256) == ("llama", "")


def test_a_url_source_is_ordered_with_its_sha256(cp: SchedulerRig) -> None:
    _join(cp, "n1", prefixes=("http://10.0.0.2:8000/m/",))
    _deploy(cp, "m", {"url": "http://10.0.0.2:8000/m/w.gguf", "sha256": SHA})
    cp.scheduler().reconcile()
    start = _starts(cp)["n1"]
    assert (start.source, start.source_sha256) == ("http://10.0.0.2:8000/m/w.gguf", SHA)


def test_no_node_with_the_source_is_an_event_and_the_reason(cp: SchedulerRig) -> None:
    _join(cp, "n1", "other")
    _join(cp, "n2")
    _deploy(cp, "m", "llama")
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert _starts(cp) == {}
    reason = scheduler.unplaceable["m"].reason
    assert reason == (
        "no node has source llama under models_root; nodes checked: n1, n2 (copy the weights "
        "under a node's models_root, or fix the profile's source)"
    )
    events = [e for e in cp.store.list_events() if e.kind == "unplaceable"]
    assert [e.message for e in events] == [f"cannot place a replica: {reason}"]
