"""The agent daemon: validate, load identity, open the data plane, keep the stream, serve.

Start-up is straight-line (STYLE 10): configuration was validated before we get here;
each step's error is wrapped with the step's name; readiness is announced only after the
data plane listens and the stream to a control plane is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import ssl
from pathlib import Path

from llmgw.agent.config import AgentConfig
from llmgw.agent.dataplane import DataPlane, server_ssl_context
from llmgw.agent.installs import download_ssl_context, install_engine, remove_leftovers
from llmgw.agent.inventory import InventoryWatcher
from llmgw.agent.oplog import OperationLog
from llmgw.agent.renewal import Renewer, recover_identity
from llmgw.agent.runtimes import Launch, get_runtime
from llmgw.agent.shards import ShardManager, ShardSpec
from llmgw.agent.stream import Credentials, StreamClient
from llmgw.agent.update_spool import Spooler
from llmgw.errors import CertificateError
from llmgw.log import kv
from llmgw.netaddr import format_hostport, parse_hostport
from llmgw.notify import Notifier
from llmgw.proto import control_pb2 as pb

__all__ = ["Agent", "run_agent"]

log = logging.getLogger("llmgw.agent")

# How long in-flight data-plane requests may take to finish when the agent stops.
DRAIN_TIMEOUT = 30.0


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(
            f"the node's {what} {path} does not exist; join the node first "
            "('llmgw agent join') or set tls.{what} in agent.yaml"
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


def _source_address_towards(server: str) -> str:
    """The local address this machine uses to reach ``server`` (no packet is sent)."""
    host, port = parse_hostport(server)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Agent:
    """One node agent."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.notifier = Notifier()
        self.stopping = asyncio.Event()
        self.shards: ShardManager | None = None
        self.dataplane: DataPlane | None = None
        self.stream: StreamClient | None = None
        self.spooler: Spooler | None = None
        self._ready_sent = False

    def _dataplane_addr(self, server: str) -> str:
        assert self.dataplane is not None
        if self.cfg.advertise:
            return self.cfg.advertise
        host = self.dataplane.host
        if self.cfg.mgmt_addr:
            host = self.cfg.mgmt_addr
        else:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(host).is_unspecified:
                    host = _source_address_towards(server)
        return format_hostport(host, self.dataplane.bound_port)

    def _on_stream_state(self, state: str, server: str | None) -> None:
        count = len(self.shards.shards) if self.shards else 0
        if state == "connected":
            if self.spooler is not None:
                self.spooler.connected()
            self.notifier.status(f"connected to {server}, {count} shards")
            if not self._ready_sent:
                self._ready_sent = True
                self.notifier.ready()
        else:
            self.notifier.status(f"disconnected from {server}; reconnecting, {count} shards")

    async def run(self) -> None:
        cfg = self.cfg
        cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # 1. identity (a renewal interrupted by a crash is rolled back first)
        tls = cfg.tls

        _read(tls.cert, "cert"), _read(tls.key, "key"), _read(tls.ca, "ca")
        recover_identity(tls)
        ssl_ctx = server_ssl_context(cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
        loaded = [_read(tls.cert, "cert")]

        def credentials() -> Credentials:
            current = Credentials(
                cert=_read(tls.cert, "cert"), key=_read(tls.key, "key"), ca=_read(tls.ca, "ca")
            )
            if current.cert != loaded[0]:
                # A rekey or renewal replaced the identity: new data-plane handshakes
                # present it too, not only the next stream.
                recover_identity(tls)
                ssl_ctx.load_cert_chain(tls.cert, tls.key)
                loaded[0] = current.cert
            return current

        for leftover in remove_leftovers(cfg.state_dir):
            log.warning(
                "removed an engine install a crash left behind", extra=kv(path=str(leftover))
            )
        # 2. fencing state
        oplog = OperationLog(cfg.state_dir / "oplog.json")
        # 3. shards
        stream_ref: list[StreamClient] = []
        runtime = get_runtime(
            cfg.runtime, docker_network=cfg.docker.network, docker_host=cfg.docker.host
        )
        make_launch = None
        if runtime.name == "docker":
            from llmgw.agent.runtimes.docker import launch_for as docker_launch

            def make_launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
                cluster = stream_ref[0].cluster_id if stream_ref else ""
                return docker_launch(
                    spec,
                    port=port,
                    log_path=log_path,
                    node_id=cfg.node_id,
                    cluster_id=cluster,
                    images=cfg.docker.images,
                    gpus=spec.gpus,
                    gpu_mode=cfg.docker.gpus,
                )

        self.shards = ShardManager(
            cfg.state_dir,
            runtime,
            make_launch=make_launch,
            on_status=lambda shard: stream_ref[0].report_shard(shard) if stream_ref else None,
        )
        await self.shards.open()
        # Engines outlive the agent: take back the ones the previous agent started.
        adopted, dead = await self.shards.adopt_all()
        if adopted or dead:
            log.info(
                "shards after restart",
                extra=kv(adopted=len(adopted), dead=len(dead)),
            )
        # 4. what this node has (runs the engines' checks once, off the event loop)
        watcher = await asyncio.to_thread(
            InventoryWatcher,
            cfg,
            lambda inv: stream_ref[0].send(pb.AgentMessage(inventory=inv)) if stream_ref else False,
        )
        # The engines this node runs are the ones discovery checked, at the paths it found.
        self.shards.binary_of = lambda engine: next(
            (e.path for e in watcher.current.engine_details if e.name == engine and e.ok), ""
        )
        # 5. data plane
        self.dataplane = DataPlane(
            cfg.listen,
            ssl_ctx,
            self.shards.ready_port,
            limits=cfg.listeners,
            max_request_body=cfg.max_request_body,
            max_inflight_body_bytes=cfg.max_inflight_body_bytes,
            max_response_body=cfg.max_response_body,
            upstream_idle_timeout=cfg.upstream_idle_timeout,
        )
        await self.dataplane.start()
        # 6. stream
        dataplane = self.dataplane
        self.stream = StreamClient(
            node_id=cfg.node_id,
            servers=cfg.servers,
            credentials=credentials,
            shards=self.shards,
            oplog=oplog,
            inventory=lambda: watcher.current,
            dataplane_addr=self._dataplane_addr,
            inflight=lambda: dataplane.inflight,
            on_state=self._on_stream_state,
        )
        stream_ref.append(self.stream)

        async def install(order: pb.InstallEngine) -> None:
            # https:// publishers are verified against the system trust store and the cluster
            # CA (a control plane serving builds over :8080 with TLS).
            info = await install_engine(
                order,
                state_dir=cfg.state_dir,
                sources=cfg.install_sources,
                ssl_context=await asyncio.to_thread(download_ssl_context, tls.ca),
            )
            log.info(
                "engine installed",
                extra=kv(engine=info.name, version=info.version, path=info.path),
            )
            # Offer it now rather than at the next periodic look.
            watcher.update(await asyncio.to_thread(watcher.collect))

        self.stream.installer = install
        stream = self.stream

        # Signed self-updates: the bundle and order go to the spool the root helper's path
        # unit watches (state_dir/update); its verdict comes back through status.json.
        def send_update_status(
            op_id: str, counter: int, version: str, state: str, message: str
        ) -> bool:
            return stream.send(
                pb.AgentMessage(
                    update_status=pb.UpdateStatus(
                        op_id=op_id, counter=counter, version=version, state=state, message=message
                    )
                )
            )

        def download_tls() -> ssl.SSLContext:
            return bundle_download_ssl_context(tls.cert, tls.key, tls.ca)

        spooler = Spooler(
            node_id=cfg.node_id,
            spool=cfg.state_dir / "update",
            report=send_update_status,
            ssl_context=download_tls,
            cluster_ca=tls.ca,
        )
        self.spooler = spooler

        async def update(order: pb.UpdateOrder) -> None:
            await spooler.handle(order.meta.op_id, order.order, order.signature)

        self.stream.updater = update

        def renewed() -> None:
            # New data-plane handshakes present the new certificate; open ones are untouched.
            ssl_ctx.load_cert_chain(tls.cert, tls.key)

        renewer = Renewer(tls, cfg.node_id, send=stream.send, on_renewed=renewed)
        stream.on_renewal_answer = renewer.answer
        renewal_task = asyncio.create_task(renewer.run(), name="renewal")
        inventory_task = asyncio.create_task(watcher.run(), name="inventory")
        update_task = asyncio.create_task(spooler.run(), name="update-status")
        stream_task = asyncio.create_task(self.stream.run(), name="stream")
        log.info(
            "agent started",
            extra=kv(
                node=cfg.node_id,
                servers=",".join(cfg.servers),
                dataplane=f"{dataplane.host}:{dataplane.bound_port}",
            ),
        )
        watchdog = asyncio.create_task(self.notifier.watchdog_loop())
        parent = asyncio.create_task(self._watch_parent())
        try:
            await self.stopping.wait()
        finally:
            self.notifier.stopping()
            # Drain on stop: the control plane stops routing here first, then the requests
            # in flight finish; the engines keep running for the next agent to adopt.
            told = self.stream.send(pb.AgentMessage(draining=pb.Draining(deadline_s=DRAIN_TIMEOUT)))
            log.info(
                "agent stopping; draining",
                extra=kv(node=cfg.node_id, inflight=dataplane.inflight, control_plane_told=told),
            )
            if told:
                await self.stream.flushed(timeout=2.0)
            await dataplane.drain(timeout=DRAIN_TIMEOUT)
            tasks = (stream_task, watchdog, parent, renewal_task, inventory_task, update_task)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stream.close()
            if cfg.stop_shards_on_exit:
                await self.shards.stop_all(grace=10.0)
            await dataplane.stop()
            await self.shards.close()

    async def _watch_parent(self) -> None:
        """Under 'llmgw up' the agent stops when its parent is gone, whatever killed it."""
        parent = os.environ.get("LLMGW_PARENT_PID", "")
        if not parent.isdigit():
            return
        while os.getppid() == int(parent):  # noqa: ASYNC110 - polling is the point
            await asyncio.sleep(1.0)
        log.warning("parent 'llmgw up' is gone; stopping", extra=kv(parent=parent))
        self.request_stop()

    def request_stop(self) -> None:
        self.stopping.set()


def run_agent(cfg: AgentConfig) -> None:
    """Run the agent until SIGTERM or SIGINT; raise LlmgwError when it cannot start."""

    async def main() -> None:
        agent = Agent(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        await agent.run()

    asyncio.run(main())
