"""The instances' registry (PostgreSQL): this process's row among the instances sharing the
database (one process per instance id), the cluster's one CA checked, where this instance
is reached, the instances alive (each enforces its share of every key's rate limits), and
the list of control planes agents are told of."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from llmgw import __version__
from llmgw.contracts.control_planes import MAX_RETIRED_SERIALS, ControlPlaneList
from llmgw.errors import CertificateError, ConfigError, StoreError
from llmgw.log import kv
from llmgw.netaddr import RESERVED_NAMES, is_ip_address
from llmgw.pki import (
    CA_CERT,
    Identity,
    control_plane_names,
    ensure_ca,
    load_ca,
    load_cert,
    serial_hex,
)
from llmgw.server.common.config import ServerConfig
from llmgw.server.fleet.sessions import Sessions
from llmgw.server.store import Store
from llmgw.server.store.instances import process_gone, process_name
from llmgw.server.store.states import NodeState

__all__ = ["Instances", "own_names", "warn_of_nodes_named_like_the_control_plane"]

log = logging.getLogger("llmgw.server")

CLUSTER_CA_META = "cluster_ca_hash"
# An instance silent this long (seconds) is no longer named to agents: its machine is gone.
INSTANCE_KEPT = 3600.0


def serial(cert: Path) -> str:
    """The serial of the certificate in *cert* (its leaf); "" when there is none yet, or
    none that can be read (ensure_server_identity issues one in its place)."""
    if not cert.exists():
        return ""
    try:
        return serial_hex(load_cert(cert))
    except CertificateError:
        return ""


def own_names(identity: Identity | None) -> list[str]:
    """The host names of this instance's server certificate (host name, FQDN,
    ``advertise``): those no node may take, recorded for the other instances."""
    if identity is None:
        return []
    names = control_plane_names(load_cert(identity.cert)) - RESERVED_NAMES
    return sorted(n for n in names if not is_ip_address(n) and n != "localhost")


def warn_of_nodes_named_like_the_control_plane(
    store: Store, own: Iterable[str], instance: str, *, others: bool = True
) -> None:
    """Nodes that joined under a name this instance (*own*) or, with *others*, another
    registered one answers to (before such ids were refused, or before that instance was
    registered) keep their certificates, which do not pass for a control plane's; the
    operator should still rename them."""
    names = dict.fromkeys(own, "")
    if others:
        with contextlib.suppress(StoreError):
            names.update(store.instance_names())
    for node in store.list_nodes():
        if node.id in names and node.state != NodeState.REVOKED:
            log.warning(
                "a node has the control plane's name as its id; it can no longer pose as "
                "the control plane, but give it another id",
                extra=kv(
                    node=node.id,
                    instance=names[node.id] or instance,
                    hint=f"llmgw ctl revoke {node.id}, then join the machine under another node id",
                ),
            )


class Instances:
    """This instance in the registry of those sharing the database."""

    def __init__(self, store: Store, cfg: ServerConfig, *, reshare: Callable[[], None]) -> None:
        self.store = store
        self.cfg = cfg
        self.pki_dir = cfg.state_dir / "pki"
        # Told when the count of instances serving changed (the key limits' shares).
        self.reshare = reshare
        self.serving = 1
        self.process = ""
        self.cluster_ca_hash = ""

    def register(self) -> None:
        """This process as the instance's one (ConfigError when another runs it, or when
        this instance's CA is not the cluster's)."""
        self.process = process_name()
        self.store.register_instance(
            self.cfg.instance,
            self.process,
            stale_after=self.cfg.instance_stale_after,
            version=__version__,
            gone=process_gone,
            # A retired instance's certificates left on this machine are refused here.
            serials=[serial(self.pki_dir / f"{n}.crt") for n in ("server", "client")],
            pki_dir=str(self.pki_dir),
        )
        self._check_cluster_ca()

    def _check_cluster_ca(self) -> None:
        """Every instance signs with the one cluster CA: the first records its hash in the
        database; the others must hold the same CA (imported with --import-ca)."""
        local = load_ca(self.pki_dir).ca_hash() if (self.pki_dir / CA_CERT).exists() else None
        recorded = self.store.get_meta(CLUSTER_CA_META)
        if recorded is None and local is None:
            local = ensure_ca(self.pki_dir).ca_hash()
        if recorded is None:
            assert local is not None
            recorded = self.store.claim_meta(CLUSTER_CA_META, local)
        if local is None:
            raise ConfigError(
                f"this instance has no CA, and the cluster's is {recorded}; export it from a "
                "running instance ('llmgw ctl cert export-ca --out ca.llmgw') and import it "
                "here ('llmgw server --config server.yaml --import-ca ca.llmgw') before "
                "starting",
                key="database",
            )
        if local != recorded:
            raise ConfigError(
                f"this instance's CA ({local}, in {self.pki_dir}) is not the cluster's "
                f"({recorded}); it belongs to another cluster: move {self.pki_dir} aside and "
                "import the cluster's CA ('llmgw server --import-ca FILE'), or point database "
                "at this instance's own cluster",
                key="database",
            )
        self.cluster_ca_hash = recorded

    def control_planes(self, own: list[str]) -> ControlPlaneList:
        """Every instance's stream address, this one's (*own*) first (what agents dial and
        keep), and the certificate serials of the retired instances (what their data
        planes refuse). StoreError when the database cannot say: a list of this instance
        alone would have the agents forget the others and the retired serials, so none is
        sent (the agents keep what they know)."""
        now = self.store.database.server_time()
        others = [
            i.stream_addr
            for i in self.store.list_instances()
            if i.id != self.cfg.instance and i.stream_addr and now - i.seen_at < INSTANCE_KEPT
        ]
        retired = self.store.retired_serials(MAX_RETIRED_SERIALS)
        return ControlPlaneList(tuple(own + [a for a in others if a not in own]), retired)

    async def keep(
        self, own: Callable[[], list[str]], agents: Callable[[], Sessions | None]
    ) -> None:
        """Tell the other instances this one is alive (its row's seen_at); while leading
        (*agents* gives the leader's sessions), tell the agents when the instances
        changed."""
        told: ControlPlaneList | None = None
        while True:
            await asyncio.sleep(self.cfg.lease_renew)
            sessions = agents()
            if sessions is not None:
                with contextlib.suppress(StoreError):  # told at a later round
                    current = self.control_planes(own())
                    if current != told:
                        if told is not None:
                            sessions.broadcast_control_planes(current)
                        told = current
            try:
                if not self.store.touch_instance(self.cfg.instance, self.process):
                    log.error(
                        "another process has taken this instance's id; give each instance its "
                        "own instance_id",
                        extra=kv(instance=self.cfg.instance),
                    )
                self._count_serving()
            except StoreError:
                continue

    def _count_serving(self) -> None:
        """How many instances serve the gateway now (those seen within three leases, this
        one included): each enforces that share of every key's rate limits."""
        now = time.time()
        alive = sum(
            1
            for i in self.store.list_instances()
            if i.id == self.cfg.instance or now - i.seen_at <= 3 * self.cfg.lease
        )
        if max(alive, 1) != self.serving:
            self.serving = max(alive, 1)
            self.reshare()
            log.info(
                "the key limits are shared among the instances serving",
                extra=kv(instances=self.serving),
            )

    def record_addresses(
        self,
        *,
        stream: str,
        http: str,
        enroll: str,
        server: Identity | None,
        client: Identity | None,
        leading: bool,
    ) -> None:
        """Where agents, clients and the other instances reach this instance, the serials of
        its own certificates (those its retirement would have agents refuse), and the names
        it answers to (which no node id may take; a node that took one already is named)."""
        names = own_names(server)
        with contextlib.suppress(StoreError):
            self.store.set_instance_addresses(
                self.cfg.instance,
                stream=stream,
                http=http,
                enroll=enroll,
                ca_hash=self.cluster_ca_hash,
                client_serial=serial(client.cert) if client else "",
                server_serial=serial(server.cert) if server else "",
                names=names,
            )
        if not leading:  # the leader's start named them already
            with contextlib.suppress(StoreError):
                warn_of_nodes_named_like_the_control_plane(
                    self.store, names, self.cfg.instance, others=False
                )
