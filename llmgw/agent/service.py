"""The agent daemon: validate, load identity, open the data plane, keep the stream, serve.

Start-up is straight-line (STYLE 10), one named step after another in :meth:`Agent.run`;
configuration was validated before we get here. Each step gets what it needs from the steps
before it and fails as a :class:`~llmgw.errors.StartupError` that names it ("agent start-up
failed at 'data plane listener': ..."). Readiness is announced only after the data plane
listens and the stream to a control plane is up. What started is stopped in the reverse
order, whether the agent is stopped or a later step failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

from llmgw.agent.address import DataplaneAddress
from llmgw.agent.bwrap import Bubblewrap
from llmgw.agent.config import AgentConfig, TLSConfig
from llmgw.agent.dataplane import DataPlane, server_ssl_context
from llmgw.agent.discovery.xid import XidWatch
from llmgw.agent.gpu_sampler import GpuSampler
from llmgw.agent.installs import download_ssl_context, install_engine, remove_leftovers
from llmgw.agent.inventory import InventoryWatcher
from llmgw.agent.kvevents import KvEventsHub
from llmgw.agent.models_dir import SourceStore
from llmgw.agent.oplog import OperationLog
from llmgw.agent.renewal import Renewer, recover_identity
from llmgw.agent.runtimes import Launch, Runtime, get_runtime
from llmgw.agent.runtimes.containers import launch_for
from llmgw.agent.sandbox import Sandboxes, SandboxLayout
from llmgw.agent.servers import KnownServers
from llmgw.agent.shards import Shard, ShardManager, ShardSpec
from llmgw.agent.stream import Credentials, StreamClient, StreamState
from llmgw.agent.traffic import ShardTraffic
from llmgw.agent.update_spool import CONTAINER_ENV, IN_CONTAINER, Spooler
from llmgw.agent.warming import Warmer
from llmgw.errors import CertificateError, LlmgwError, StartupError
from llmgw.fsutil import make_dir
from llmgw.log import kv
from llmgw.loop import run as run_loop
from llmgw.netaddr import format_hostport
from llmgw.notify import Notifier
from llmgw.proto import control_pb2 as pb

__all__ = ["Agent", "NodeIdentity", "run_agent"]

log = logging.getLogger("llmgw.agent")

# How long in-flight data-plane requests may take to finish when the agent stops.
DRAIN_TIMEOUT = 30.0


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Run one start-up step: its failure becomes a StartupError naming it."""
    try:
        yield
    except StartupError:
        raise
    except (LlmgwError, OSError) as exc:
        raise StartupError("agent", name, exc) from exc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(
            f"the node's {what} {path} does not exist; join the node first "
            f"('llmgw agent join') or set tls.{what} in agent.yaml"
        ) from None
    except OSError as exc:
        raise CertificateError(
            f"cannot read the node's {what} {path}: {exc.strerror}; it must be readable by the "
            "agent's user"
        ) from exc


def bundle_download_ssl_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """TLS for downloads from the control plane's :8080 (update bundles): its certificate is
    the cluster CA's (``tls: cluster``) or the operator's (a public or company CA, in the
    system trust store), so both are trusted (the same trust as engine downloads); the
    bundle's signed SHA-256 is what makes it safe to install."""
    ctx = download_ssl_context(ca)
    ctx.load_cert_chain(cert, key)
    return ctx


class NodeIdentity:
    """The node's certificate, key and CA on disk, and the data plane's TLS context that
    presents them. A renewal, a rekey or a CA rotation's trust bundle replaces the files;
    :meth:`reload` makes new data-plane handshakes present the new certificate and trust
    exactly the CAs in the file now (open connections are untouched)."""

    def __init__(self, tls: TLSConfig) -> None:
        self.tls = tls
        # Each is read first so that a missing one is named with the fix.
        _read(tls.cert, "cert"), _read(tls.key, "key"), _read(tls.ca, "ca")
        # A renewal interrupted by a crash is rolled back before anything uses the key.
        recover_identity(tls)
        self.ssl_context = server_ssl_context(tls.cert, tls.key, tls.ca)
        # The context new handshakes switch to (from the listener's, in its ClientHello
        # callback): a fresh one per reload, since a CA can be added to a context but never
        # removed, and a CA the control plane dropped must stop being trusted.
        self._current = self.ssl_context
        self.ssl_context.sni_callback = self._on_client_hello
        self._loaded = _read(tls.cert, "cert")

    def credentials(self) -> Credentials:
        """The files as they are now, for the next stream."""
        tls = self.tls
        current = Credentials(
            cert=_read(tls.cert, "cert"), key=_read(tls.key, "key"), ca=_read(tls.ca, "ca")
        )
        if current.cert != self._loaded:
            # A rekey or renewal replaced the identity: new data-plane handshakes present
            # it too, not only the next stream.
            recover_identity(tls)
            self.reload()
            self._loaded = current.cert
        return current

    def reload(self) -> None:
        self._current = server_ssl_context(self.tls.cert, self.tls.key, self.tls.ca)

    def _on_client_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        if self._current is not self.ssl_context:
            conn.context = self._current

    def download_ssl_context(self) -> ssl.SSLContext:
        """TLS for update-bundle downloads, presenting this identity."""
        return bundle_download_ssl_context(self.tls.cert, self.tls.key, self.tls.ca)


class Agent:
    """One node agent: :meth:`run` starts its parts in order, serves until
    :meth:`request_stop`, and stops them in the reverse order."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.notifier = Notifier()
        self.stopping = asyncio.Event()
        self.shards: ShardManager | None = None
        self.kv_events: KvEventsHub | None = None
        self.inventory: InventoryWatcher | None = None
        self.sources: SourceStore | None = None
        # Keeps the sources of models with prefetch: true in the page cache.
        self.warmer: Warmer | None = None
        self.xids = XidWatch()
        self._watching_xids = False
        self.dataplane: DataPlane | None = None
        self.stream: StreamClient | None = None
        self.address: DataplaneAddress | None = None
        self.spooler: Spooler | None = None
        # The requests in flight per shard: the data plane counts, a drained stop waits.
        self.traffic = ShardTraffic()
        self._ready_sent = False

    async def run(self) -> None:
        """Start, serve until asked to stop, stop; StartupError when a step fails."""
        cfg = self.cfg
        async with contextlib.AsyncExitStack() as running:
            with step("state directory"):
                make_dir(cfg.state_dir)
            with step("node identity"):
                identity = NodeIdentity(cfg.tls)
            with step("leftover engine installs"):
                self._remove_leftover_installs()
            with step("operation log"):
                oplog = OperationLog(cfg.state_dir / "oplog.json")
            with step("known control planes"):
                servers = KnownServers(cfg.servers, cfg.state_dir)
            with step("shard runtime"):
                runtime = get_runtime(
                    cfg.runtime, docker_network=cfg.docker.network, docker_host=cfg.docker.host
                )
            with step("shard adoption"):
                shards = await self._start_shards(runtime, running)
            with step("inventory"):
                inventory = await self._start_inventory(shards)
            with step("management address"):
                self.address = DataplaneAddress(cfg)
            with step("data plane listener"):
                dataplane = await self._start_dataplane(identity, shards, servers, running)
            with step("control-plane stream"):
                self._start_stream(identity, oplog, servers, shards, inventory, dataplane, running)
            log.info(
                "agent started",
                extra=kv(
                    node=cfg.node_id,
                    servers=",".join(servers.rotation()),
                    dataplane=f"{dataplane.host}:{dataplane.bound_port}",
                ),
            )
            await self.stopping.wait()

    def request_stop(self) -> None:
        self.stopping.set()

    # -- the start-up steps, in order ---------------------------------------------------

    def _remove_leftover_installs(self) -> None:
        for leftover in remove_leftovers(self.cfg.state_dir):
            log.warning(
                "removed an engine install a crash left behind", extra=kv(path=str(leftover))
            )

    async def _start_shards(
        self, runtime: Runtime, running: contextlib.AsyncExitStack
    ) -> ShardManager:
        """The shard supervisor, with the engines a previous agent left running: engines
        outlive the agent, and the next one takes them back."""
        cfg = self.cfg
        sources = self.sources = SourceStore(
            cfg.models_root,
            cfg.cache_root,
            install_sources=cfg.install_sources,
            ssl_context=lambda: download_ssl_context(cfg.tls.ca),
        )
        self.warmer = Warmer(
            sources,
            rate=cfg.prefetch_rate,
            interval=cfg.prefetch_interval,
            on_change=self._inventory_now,
        )
        kv_events = KvEventsHub(self._send, state_dir=cfg.state_dir, runtime=runtime.name)
        # Closed after the shards (the stack unwinds in reverse): their stop sends cleared.
        running.push_async_callback(kv_events.aclose)
        self.kv_events = kv_events
        shards = ShardManager(
            cfg.state_dir,
            runtime,
            kv_events=kv_events,
            make_launch=self._docker_launch if runtime.name == "docker" else None,
            # Docker engines are isolated by their containers; process engines by bubblewrap.
            sandboxes=self._sandboxes() if runtime.name == "process" else None,
            on_status=self._report_shard,
            traffic=self.traffic,
            multinode_ports=cfg.multinode_ports,
            sources=sources,
            # Every adapter of every fabric the node is on: the order names no fabric, and a
            # node's pools are placed on one.
            fabric_devices=tuple(hca for fabric in cfg.fabrics for hca in fabric.hcas),
        )
        await shards.open()
        running.push_async_callback(shards.close)
        if cfg.stop_shards_on_exit:
            running.push_async_callback(shards.stop_all, 10.0)
        self.shards = shards
        adopted, dead = await shards.adopt_all()
        if adopted or dead:
            log.info("shards after restart", extra=kv(adopted=len(adopted), dead=len(dead)))
        return shards

    def _sandboxes(self) -> Sandboxes:
        cfg = self.cfg
        layout = SandboxLayout.for_node(
            cfg.state_dir,
            config_file=cfg.source,
            key_file=cfg.tls.key,
            models_root=cfg.models_root,
            cache_root=cfg.cache_root,
        )
        return Sandboxes(layout, Bubblewrap(), required=cfg.sandbox == "required")

    async def _start_inventory(self, shards: ShardManager) -> InventoryWatcher:
        """What this node has; runs the engines' checks once, off the event loop. Its GPUs'
        XIDs are watched from now on (NVML's events), each GPU's health in the inventory."""
        self._watching_xids = await asyncio.to_thread(self.xids.start)
        if self.xids.problem:
            log.info("GPU XIDs", extra=kv(status=self.xids.problem))
        warmer = self.warmer
        watcher = await asyncio.to_thread(
            InventoryWatcher,
            self.cfg,
            self._send_inventory,
            gpu_health=self.xids.health,
            warm=lambda: warmer.status() if warmer is not None else [],
        )
        self.inventory = watcher
        # The engines this node runs are the ones discovery checked, at the paths it found.
        shards.binary_of = lambda engine: next(
            (e.path for e in watcher.current.engine_details if e.name == engine and e.ok), ""
        )
        return watcher

    async def _start_dataplane(
        self,
        identity: NodeIdentity,
        shards: ShardManager,
        servers: KnownServers,
        running: contextlib.AsyncExitStack,
    ) -> DataPlane:
        """The :9443 listener: the control plane's instances only, none that was retired
        (the serials the leader sent, kept by ``servers``)."""
        cfg = self.cfg
        dataplane = DataPlane(
            cfg.listen,
            identity.ssl_context,
            shards.ready_port,
            limits=cfg.listeners,
            max_request_body=cfg.max_request_body,
            max_inflight_body_bytes=cfg.max_inflight_body_bytes,
            max_response_body=cfg.max_response_body,
            upstream_idle_timeout=cfg.upstream_idle_timeout,
            retired=servers.is_retired,
            traffic=self.traffic,
        )
        await dataplane.start()
        running.push_async_callback(dataplane.stop)
        self.dataplane = dataplane
        return dataplane

    def _start_stream(
        self,
        identity: NodeIdentity,
        oplog: OperationLog,
        servers: KnownServers,
        shards: ShardManager,
        inventory: InventoryWatcher,
        dataplane: DataPlane,
        running: contextlib.AsyncExitStack,
    ) -> None:
        """The stream to the control planes, and what rides on it: engine installs, signed
        self-updates (spooled for the root helper's path unit, state_dir/update, whose
        verdict comes back through status.json), certificate renewal, and the GPUs'
        utilisation on each heartbeat (sampled once a heartbeat interval while the
        inventory has GPUs)."""
        cfg = self.cfg
        sampler = GpuSampler(
            cfg.discovery.nvidia_smi,
            lambda: bool(inventory.current.gpus),
            interval=lambda: stream.heartbeat_interval,
        )
        # Its requests ride on the stream, which hands it the answers: each is given the
        # other at construction (the stream is bound by the time the renewal runs).
        renewer = Renewer(
            cfg.tls, cfg.node_id, send=lambda msg: stream.send(msg), on_renewed=identity.reload
        )
        stream = StreamClient(
            node_id=cfg.node_id,
            servers=servers,
            credentials=identity.credentials,
            shards=shards,
            oplog=oplog,
            inventory=lambda: inventory.current,
            dataplane_addr=self._dataplane_addr,
            inflight=lambda: dataplane.inflight,
            gpu_utilization=lambda: sampler.latest,
            on_state=self._on_stream_state,
            installer=self._install,
            updater=self._update,
            on_renewal_answer=renewer.answer,
            on_trust_bundle=renewer.trust,
            on_warm=self.warmer.want if self.warmer is not None else lambda sources: None,
        )
        self.stream = stream
        self.spooler = Spooler(
            node_id=cfg.node_id,
            spool=cfg.state_dir / "update",
            report=self._send_update_status,
            ssl_context=identity.download_ssl_context,
            cluster_ca=cfg.tls.ca,
            refusal=IN_CONTAINER if os.environ.get(CONTAINER_ENV) else None,
        )
        tasks = [
            asyncio.create_task(renewer.run(), name="renewal"),
            asyncio.create_task(inventory.run(), name="inventory"),
            asyncio.create_task(sampler.run(), name="gpu-utilization"),
            asyncio.create_task(self.spooler.run(), name="update-status"),
            asyncio.create_task(stream.run(), name="stream"),
            asyncio.create_task(self.notifier.watchdog_loop(), name="watchdog"),
            asyncio.create_task(self._watch_parent(), name="parent"),
        ]
        if self.warmer is not None:
            tasks.append(asyncio.create_task(self.warmer.run(), name="prefetch"))
        if self._watching_xids:
            tasks.append(asyncio.create_task(self.xids.run(self._gpus_changed), name="gpu-xids"))
        running.push_async_callback(stream.close)
        running.push_async_callback(_cancel, tasks)
        running.push_async_callback(self._drain, stream, dataplane)

    # -- stopping ---------------------------------------------------------------------------

    async def _drain(self, stream: StreamClient, dataplane: DataPlane) -> None:
        """Drain on stop: the control plane stops routing here first, then the requests in
        flight finish; the engines keep running for the next agent to adopt."""
        self.notifier.stopping()
        told = stream.send(pb.AgentMessage(draining=pb.Draining(deadline_s=DRAIN_TIMEOUT)))
        log.info(
            "agent stopping; draining",
            extra=kv(node=self.cfg.node_id, inflight=dataplane.inflight, control_plane_told=told),
        )
        if told:
            await stream.flushed(timeout=2.0)
        await dataplane.drain(timeout=DRAIN_TIMEOUT)

    async def _watch_parent(self) -> None:
        """Under 'llmgw up' the agent stops when its parent is gone, whatever killed it."""
        parent = os.environ.get("LLMGW_PARENT_PID", "")
        if not parent.isdigit():
            return
        while os.getppid() == int(parent):  # noqa: ASYNC110 - polling is the point
            await asyncio.sleep(1.0)
        log.warning("parent 'llmgw up' is gone; stopping", extra=kv(parent=parent))
        self.request_stop()

    # -- what the parts tell each other ---------------------------------------------------
    # Shards and inventory start before the stream (adoption and discovery come first, so
    # that the first Hello carries them); until the stream exists, that Hello is their news.

    def _report_shard(self, shard: Shard) -> None:
        if self.stream is not None:
            self.stream.report_shard(shard)

    def _send_inventory(self, inventory: pb.Inventory) -> bool:
        return self._send(pb.AgentMessage(inventory=inventory))

    def _send(self, msg: pb.AgentMessage) -> bool:
        return self.stream is not None and self.stream.send(msg)

    def _docker_launch(self, spec: ShardSpec, port: int, log_path: Path) -> Launch:
        cfg = self.cfg
        return launch_for(
            spec,
            port=port,
            log_path=log_path,
            node_id=cfg.node_id,
            cluster_id=self.stream.cluster_id if self.stream is not None else "",
            images=cfg.docker.images,
            gpus=spec.gpus,
            gpu_mode=cfg.docker.gpus,
        )

    def _dataplane_addr(self, server: str) -> str:
        assert self.dataplane is not None and self.address is not None
        if self.cfg.advertise:
            return self.cfg.advertise
        host = self.address.host(self.dataplane.host, server)
        return format_hostport(host, self.dataplane.bound_port)

    def _on_stream_state(self, state: StreamState, server: str | None) -> None:
        count = len(self.shards.shards) if self.shards else 0
        if state == "connected":
            if self.spooler is not None:
                self.spooler.connected()
            self.notifier.status(f"connected to {server}, {count} shards")
            if self.kv_events is not None:
                # After the Hello (its shard reports): the whole set of every shard's blocks.
                self.kv_events.resync()
            if not self._ready_sent:
                self._ready_sent = True
                self.notifier.ready()
        else:
            self.notifier.status(f"disconnected from {server}; reconnecting, {count} shards")

    async def _install(self, order: pb.InstallEngine) -> None:
        assert self.inventory is not None
        cfg = self.cfg
        # https:// publishers are verified against the system trust store and the cluster
        # CA (a control plane serving builds over :8080 with TLS).
        info = await install_engine(
            order,
            state_dir=cfg.state_dir,
            sources=cfg.install_sources,
            ssl_context=await asyncio.to_thread(download_ssl_context, cfg.tls.ca),
        )
        log.info(
            "engine installed", extra=kv(engine=info.name, version=info.version, path=info.path)
        )
        # Offer it now rather than at the next periodic look.
        watcher = self.inventory
        watcher.update(await asyncio.to_thread(watcher.collect))

    async def _inventory_now(self) -> None:
        """A source turned warm (or was skipped): the control plane is told now."""
        watcher = self.inventory
        if watcher is not None:
            watcher.update(await asyncio.to_thread(watcher.collect))

    async def _gpus_changed(self) -> None:
        """A GPU turned unhealthy: the control plane is told now, not at the next look."""
        watcher = self.inventory
        if watcher is not None:
            watcher.update(await asyncio.to_thread(watcher.collect))

    async def _update(self, order: pb.UpdateOrder) -> None:
        assert self.spooler is not None
        await self.spooler.handle(order.meta.op_id, order.order, order.signature)

    def _send_update_status(
        self, op_id: str, counter: int, version: str, state: str, message: str
    ) -> bool:
        if self.stream is None:
            return False
        return self.stream.send(
            pb.AgentMessage(
                update_status=pb.UpdateStatus(
                    op_id=op_id, counter=counter, version=version, state=state, message=message
                )
            )
        )


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def run_agent(cfg: AgentConfig) -> None:
    """Run the agent until SIGTERM or SIGINT; raise LlmgwError when it cannot start."""

    async def main() -> None:
        agent = Agent(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        await agent.run()

    run_loop(main(), process="agent")
