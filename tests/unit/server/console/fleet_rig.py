"""The console rig with what Add node, Approve and Update now need besides: the cluster CA,
the listeners' ports and the agent bundles a join command and an update order are made from,
and the real :class:`llmgw.server.fleet.updates.Updates` (signing with that CA, behind the
accounts' passwords)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from llmgw import pki
from llmgw.proto import control_pb2 as pb
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.fleet.updates import Updates
from llmgw.server.joining.bundles import BundleStore
from llmgw.server.store import Store
from tests.oneliner import make_bundle
from tests.unit.clock import Clock
from tests.unit.server.console.rig import ConsoleRig

FINGERPRINT = "sha256:" + "ab" * 32
SERVER_VERSION = "1.0.0"


class FleetRig(ConsoleRig):
    """:class:`ConsoleRig` with a CA, bundles in ``bundle_dir`` (none until :meth:`bundle`)
    and the real update orders."""

    def __init__(self, store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority) -> None:
        super().__init__(store, clock, tmp_path)
        self.ca = ca
        self.bundle_dir = tmp_path / "bundles"
        self.bundle_dir.mkdir()
        bundles = BundleStore(self.bundle_dir)
        self.updates = Updates(
            store,
            accounts=OperatorAccounts(store),
            ca=ca,
            epoch=1,
            sessions=self.sessions,
            served=bundles.bundles,
            download_base=lambda: "http://cp.example.net:8080",
            bundle_dir=self.bundle_dir,
            server_version=SERVER_VERSION,
        )
        ctx = self.ctx
        for name, value in (
            ("ca", ca),
            ("listening", SimpleNamespace(http_port=8080, enroll_port=8443)),
            ("bundles", bundles),
            ("tls", None),
            ("advertise", ("cp.example.net",)),
            ("enroll_loopback_only", False),
            ("control_plane_names", frozenset({"cp.example.net"})),
            ("updates", self.updates),
        ):
            setattr(ctx, name, value)

    def bundle(self, version: str, rid: str = "linux-x64") -> Path:
        return make_bundle(self.bundle_dir, version, rid)

    def add_x64_node(self, node_id: str, **kw: object) -> None:
        """An approved, connected node of architecture x86_64 (updates need one)."""
        self.add_node(node_id, **kw)  # type: ignore[arg-type]
        node = self.store.get_node(node_id)
        self.store.upsert_node(
            node_id,
            dataplane_addr=node.dataplane_addr,
            agent_version=node.agent_version,
            inventory={**node.inventory, "arch": "x86_64"},
            connected=node_id in self.sessions,
        )

    def enrol(
        self, node_id: str, *, fingerprint: str = FINGERPRINT, degraded: str = ""
    ) -> NodeSession:
        """A node that ran its join command: pending, connected, its inventory held (with a
        degraded reason when ``degraded`` is given)."""
        self.store.enrol_node(
            node_id, fingerprint=fingerprint, rekey=False, node_uid=None, require_approval=True
        )
        held = pb.Inventory(
            hostname=node_id,
            cpus=8,
            gpus=[
                pb.Gpu(index=0, uuid=f"GPU-{node_id}-0", name="NVIDIA L4", memory_total_mib=23034)
            ],
        )
        if degraded:
            held.degraded.append(pb.DegradedReason(code="engine", message=degraded))
        session = NodeSession(
            node_id=node_id, dataplane_addr="10.0.0.9:9443", epoch=1, engines=frozenset()
        )
        session.held_inventory = held
        self.sessions[node_id] = session
        return session
