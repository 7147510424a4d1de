"""Engine installs ordered through the admin API: the order to each node and, as the op
results come back on the stream, what became of it (kept in memory since the start)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

from llmgw.proto import control_pb2 as pb
from llmgw.server.states import NodeState
from llmgw.server.store import Store
from llmgw.server.stream import NodeSession

__all__ = ["EngineInstalls"]


class EngineInstalls:
    """Engine installs ordered since start: op id -> {node, engine, version, state, error}."""

    def __init__(self, store: Store, *, sessions: Mapping[str, NodeSession], epoch: int) -> None:
        self.store = store
        self.sessions = sessions
        self.epoch = epoch
        self.records: dict[str, dict[str, object]] = {}

    def order(
        self, node_ids: list[str], *, engine: str, version: str, url: str, sha256: str, arch: str
    ) -> list[dict[str, object]]:
        """Order an engine install on connected, approved nodes; results arrive as op results."""
        out: list[dict[str, object]] = []
        for node_id in node_ids:
            node = self.store.get_node(node_id)
            session = self.sessions.get(node_id)
            if node.state != NodeState.APPROVED or session is None:
                why = "not connected" if session is None else node.state
                out.append({"node": node_id, "state": "skipped", "error": why, "op_id": None})
                continue
            meta = pb.OrderMeta(epoch=self.epoch, op_id=uuid.uuid4().hex)
            session.send(
                pb.ServerMessage(
                    install_engine=pb.InstallEngine(
                        meta=meta, engine=engine, version=version, url=url, sha256=sha256, arch=arch
                    )
                )
            )
            record: dict[str, object] = {
                "op_id": meta.op_id,
                "node": node_id,
                "engine": engine,
                "version": version,
                "state": "installing",
                "error": "",
                "started_at": time.time(),
                "finished_at": None,
            }
            self.records[meta.op_id] = record
            self.store.add_event("engine_install", node_id, f"{engine} {version} from {url}")
            out.append(record)
        return out

    def on_result(self, session: NodeSession, result: pb.OperationResult) -> bool:
        """Record the result of an install order; False when ``result`` is for another order."""
        install = self.records.get(result.op_id)
        if install is None:
            return False
        install.update(
            state="installed" if result.ok else "failed",
            error=result.error,
            finished_at=time.time(),
        )
        what = f"{install['engine']} {install['version']}"
        if result.ok:
            self.store.add_event("engine_installed", session.node_id, what)
        else:
            self.store.add_event(
                "engine_install_failed", session.node_id, f"{what}: {result.error}"
            )
        return True
