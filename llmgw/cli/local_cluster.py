"""LocalCluster: the whole cluster ``llmgw up`` runs on this machine, for trying llmgw and
for its tests (the command itself, its options and logging, is ``llmgw.cli.up``).

The control plane runs in this process; one agent runs as a child process with its own
node certificate, exactly as on a real node; the agent runs a ``sim`` engine for the model
``llmgw-sim``. Stopping (SIGINT/SIGTERM) stops the engines, the agent and the server, and
checks that no engine it started is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmgw.agent.records import ShardRecords
from llmgw.cli.common import typed_command
from llmgw.client import default_up_state_dir, write_ctl_config
from llmgw.contracts.endpoints import PATHS
from llmgw.contracts.ports import (
    DEFAULT_DATA_PORT,
    DEFAULT_ENROLL_PORT,
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
)
from llmgw.engines.launch import self_argv
from llmgw.errors import CertificateError, ConfigError, LlmgwError, NotFound
from llmgw.fsutil import write_private
from llmgw.log import kv
from llmgw.netaddr import format_hostport
from llmgw.pki import issue_node_cert, load_ca, load_cert
from llmgw.procutil import process_start_time
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import ServerConfig, load_server_config
from llmgw.server.leader import Leader
from llmgw.server.store import hash_api_key

__all__ = ["UP_MODEL", "LocalCluster", "UpOptions"]

log = logging.getLogger("llmgw.up")

UP_MODEL = "llmgw-sim"
UP_NODE = "local"
UP_ACTOR = "llmgw up"
"""Who the events ``llmgw up`` causes name as their actor."""


@dataclass(frozen=True)
class UpOptions:
    state_dir: Path
    host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    agent_port: int = DEFAULT_DATA_PORT
    enroll_port: int = DEFAULT_ENROLL_PORT
    # None: not given. A fresh state directory gets one replica and no simulated delays; a
    # reused one keeps what it has, whatever an operator changed since (console, ctl).
    replicas: int | None = None
    ttft_ms: float | None = None
    tps: float | None = None
    ready_timeout: float = 120.0


def server_config(opts: UpOptions) -> ServerConfig:
    """The control plane of ``llmgw up``: on loopback unless ``--host`` says otherwise (plain
    HTTP beyond loopback carries the admin password and tokens in clear; the control plane
    warns of it at start)."""
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(opts.state_dir / "server"),
            "http_listen": format_hostport(opts.host, opts.http_port),
            "grpc_listen": format_hostport("127.0.0.1", opts.grpc_port),
            "enroll_listen": format_hostport(opts.host, opts.enroll_port),
            "heartbeat_interval": 2.0,
            "loss_timeout": 10.0,
        },
    )
    # The gateway's hints name ctl as the banner does: as this llmgw can be typed.
    return dataclasses.replace(cfg, ctl_command=f"{typed_command()} ctl")


class LocalCluster:
    """A control plane in this process and one agent child with its own certificate, the model
    llmgw-sim deployed on it: ``start``, print ``banner``, ``stop``."""

    def __init__(self, opts: UpOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.cp: ControlPlane | None = None
        self.agent: asyncio.subprocess.Process | None = None
        self._lock_fd: int | None = None
        self.api_key = ""

    @property
    def agent_dir(self) -> Path:
        return self.opts.state_dir / "agent"

    def _lock(self) -> None:
        path = self.opts.state_dir / "up.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another 'llmgw up' is running on {self.opts.state_dir}; stop it (Ctrl-C) or "
                "pass --state-dir for a second cluster"
            ) from None
        self._lock_fd = fd

    async def start(self) -> None:
        opts = self.opts
        try:
            opts.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(opts.state_dir, 0o700)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the state directory {opts.state_dir}: {exc.strerror}; pass --state-dir"
            ) from exc
        self._lock()
        # 1. control plane
        cfg = server_config(opts)
        self.cp = ControlPlane(cfg)
        await self.cp.start()
        # 2. the local node's identity and configuration
        agent_config = self._agent_identity_and_config()
        # 3. the agent; the model is deployed once it has connected, so that the first
        # placement finds it rather than reporting an empty cluster
        await self._spawn_agent(agent_config)
        await self._wait_connected()
        self._approve_local_node()
        # 4. the model and an API key
        self._deploy()
        self.api_key = self._api_key()
        write_ctl_config(
            opts.state_dir / "ctl.yaml", f"http://{self.cp.http_addr}", cfg.admin_token_file
        )
        # 5. wait for the replica
        await self._wait_ready()

    def _agent_identity_and_config(self) -> Path:
        assert self.cp is not None
        ca = load_ca(self.cp.pki_dir)
        d = self.agent_dir
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        cert, key = d / "node.crt", d / "node.key"
        reuse = False
        if cert.exists() and key.exists():
            with contextlib.suppress(CertificateError):
                current = load_cert(cert)
                reuse = (
                    current.issuer == ca.cert.subject
                    and current.not_valid_after_utc.timestamp() > time.time() + 86400
                )
        if not reuse:
            issue_node_cert(ca, UP_NODE, d)
        config = {
            "server": format_hostport("127.0.0.1", self.cp.grpc_port),
            "node_id": UP_NODE,
            "listen": format_hostport("127.0.0.1", self.opts.agent_port),
            "state_dir": str(d),
            "tls": {"cert": str(cert), "key": str(key), "ca": str(d / "ca.crt")},
            "stop_shards_on_exit": True,
            # A developer's machine may lack bubblewrap: the sim runs there all the same.
            "sandbox": "if-available",
        }
        path = d / "agent.yaml"
        write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
        return path

    async def _spawn_agent(self, config: Path) -> None:
        logs = self.opts.state_dir / "logs"
        logs.mkdir(exist_ok=True, mode=0o700)
        with open(logs / "agent.log", "ab") as out:
            env = dict(os.environ, LLMGW_PARENT_PID=str(os.getpid()))
            if getattr(sys, "frozen", False):
                env["PYINSTALLER_RESET_ENVIRONMENT"] = "1"  # see ProcessRuntime.start
            self.agent = await asyncio.create_subprocess_exec(
                *self_argv(),
                "agent",
                "--config",
                str(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )
        log.info("agent started", extra=kv(pid=self.agent.pid))

    def _deploy(self) -> None:
        """Deploy llmgw-sim; on a reused state directory change only what was given on the
        command line, and record what changed as ``llmgw up``'s doing."""
        assert self.cp is not None
        store = self.cp.store
        opts = self.opts
        try:
            existing = store.get_model(UP_MODEL)
        except NotFound:
            existing = None
        params: dict[str, object] = dict(existing.params) if existing is not None else {}
        for name, value in (("ttft_ms", opts.ttft_ms), ("tps", opts.tps)):
            if value is not None:
                params.pop(name, None)
                if value:
                    params[name] = value
        if existing is None:
            replicas = opts.replicas or 1
            store.put_model(UP_MODEL, engine="sim", params=params, replicas=replicas)
            what = f"sim, {replicas} replicas"
        elif existing.params != params:
            for replica in store.list_replicas(UP_MODEL):
                self._leader().scheduler.remove_replica(
                    replica.id, why="llmgw up with other engine settings", actor=UP_ACTOR
                )
            replicas = existing.replicas if opts.replicas is None else opts.replicas
            store.put_model(UP_MODEL, engine="sim", params=params, replicas=replicas)
            what = f"sim with {params or 'no simulated delays'}, {replicas} replicas"
        elif opts.replicas is not None and opts.replicas != existing.replicas:
            store.deploy_model(UP_MODEL, profile=existing.profile, replicas=opts.replicas)
            what = f"{opts.replicas} replicas (was {existing.replicas})"
        else:
            return  # as it was left: nothing to deploy, nothing to record
        store.add_event("model_deployed", UP_MODEL, what, UP_ACTOR)
        self.cp.serving.refresh_models()
        self._leader().scheduler.kick()

    def _leader(self) -> Leader:
        """The control plane's leader parts (on its own state directory it always leads)."""
        assert self.cp is not None and self.cp.leader is not None
        return self.cp.leader

    def _api_key(self) -> str:
        assert self.cp is not None
        path = self.opts.state_dir / "api-key"
        with contextlib.suppress(OSError):
            secret = path.read_text().strip()
            if secret and hash_api_key(secret) in self.cp.store.active_key_hashes():
                return secret
        # A key's name is unique among the active ones: when an earlier llmgw-up key is
        # still active but its secret file is gone, this one is llmgw-up-2 (the old one is
        # left alone: whoever copied its secret may use it).
        taken = {k.name for k in self.cp.store.active_api_keys()}
        name = next(n for n in _key_names() if n not in taken)
        _key, secret = self.cp.store.create_api_key(name)
        self.cp.serving.refresh_keys()
        write_private(path, (secret + "\n").encode())
        return secret

    def _approve_local_node(self) -> None:
        """The local node's key was made by this very command: approve it without asking."""
        assert self.cp is not None
        node = self.cp.store.get_node(UP_NODE)
        if node.state == "pending":
            self._leader().membership.approve(UP_NODE, node.fingerprint or "", actor=UP_ACTOR)

    async def _wait_connected(self) -> None:
        assert self.cp is not None and self.agent is not None
        deadline = time.monotonic() + self.opts.ready_timeout
        while UP_NODE not in self.cp.live:
            if self.agent.returncode is not None:
                raise LlmgwError(
                    f"the local agent exited with code {self.agent.returncode}; see "
                    f"{self.opts.state_dir / 'logs' / 'agent.log'}"
                )
            if time.monotonic() > deadline:
                raise LlmgwError(
                    f"the local agent did not connect within {self.opts.ready_timeout:.0f}s; see "
                    f"{self.opts.state_dir / 'logs' / 'agent.log'}"
                )
            await asyncio.sleep(0.05)

    async def _wait_ready(self) -> None:
        assert self.cp is not None and self.agent is not None
        deadline = time.monotonic() + self.opts.ready_timeout
        # The count deployed, which an operator may have set to 0 on a reused state directory.
        wanted = min(1, self.cp.store.get_model(UP_MODEL).replicas)
        while time.monotonic() < deadline:
            if len(self.cp.router.endpoints(UP_MODEL)) >= wanted:
                return
            if self.agent.returncode is not None:
                raise LlmgwError(
                    f"the local agent exited with code {self.agent.returncode} before the model was "
                    f"ready; see {self.opts.state_dir / 'logs' / 'agent.log'}"
                )
            await asyncio.sleep(0.05)
        raise LlmgwError(
            f"model {UP_MODEL} was not ready after {self.opts.ready_timeout:.0f}s; see "
            f"{self.opts.state_dir / 'logs'} and '{typed_command()} ctl replicas'"
        )

    def banner(self) -> str:
        """What ``llmgw up`` prints once the cluster serves; every command in it pastes
        into a shell as it is (each value quoted)."""
        assert self.cp is not None
        q = shlex.quote
        base = f"http://{self.cp.http_addr}/v1"
        body = json.dumps({"model": UP_MODEL, "messages": [{"role": "user", "content": "Hello!"}]})
        # ctl finds this cluster's ctl.yaml by itself in the default state directory only; and
        # the llmgw that 'make run' started is in .venv/bin, which is not on the PATH.
        ctl = f"{typed_command()} ctl"
        if self.opts.state_dir != default_up_state_dir().expanduser().absolute():
            ctl = f"LLMGW_STATE_DIR={q(str(self.opts.state_dir))} {ctl}"
        return "\n".join(
            [
                "llmgw is up: control plane, one agent, model llmgw-sim.",
                "",
                f"  OpenAI base URL: {base}",
                f"  API key:         {self.api_key}",
                f"  Web console:     http://{self.cp.http_addr}/ui/   (account admin, the "
                "admin password)",
                "",
                "  Try it:",
                f"    curl -s {q(base + '/chat/completions')} -H "
                f"{q('Authorization: Bearer ' + self.api_key)} \\",
                f"      -H 'Content-Type: application/json' -d {q(body)}",
                f"  {UP_MODEL} answers every endpoint: {self._endpoints()}",
                "",
                f"  Operator view:   {ctl} nodes   (also: models, replicas, events)",
                f"  State:           {self.opts.state_dir}",
                *self._password_line(ctl),
                "  Press Ctrl-C to stop everything.",
            ]
        )

    def _endpoints(self) -> str:
        """The paths the deployed model serves (sim: all of them), as the gateway routes them."""
        assert self.cp is not None
        served = self.cp.serving.models.get(UP_MODEL)
        paths = served.paths if served is not None else frozenset()
        return ", ".join(p for p in PATHS if p in paths) or "none"

    def _password_line(self, ctl: str) -> list[str]:
        """Where the first admin password is (``ctl update`` asks for it), while it is there."""
        assert self.cp is not None
        path = self._leader().password.password_file
        if not path.exists():
            return []
        return [
            f"  Admin password:  in {path} ({ctl} update asks for it; change it with "
            f"{ctl} admin password)"
        ]

    async def stop(self) -> None:
        if self._lock_fd is None:
            # Never started: the state directory may be another 'llmgw up''s, whose engines
            # and agent are not ours to stop.
            return
        if self.agent is not None and self.agent.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.agent.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.agent.wait(), timeout=45)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.agent.kill()
                await self.agent.wait()
        self._kill_leftover_engines()
        if self.cp is not None:
            await self.cp.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _kill_leftover_engines(self) -> None:
        """An engine the agent could not stop (it was killed) must not outlive ``llmgw up``."""
        for record in ShardRecords(self.agent_dir).load():
            pid, start = record.pid, record.start_time
            if pid <= 0 or start is None or process_start_time(pid) != start:
                continue
            log.warning(
                "stopping an engine the agent left behind",
                extra=kv(shard=record.shard_id, pid=pid),
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def run_up(opts: UpOptions, say: Callable[[str], None] = print) -> None:
    cluster = LocalCluster(opts, say)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.create_task(cluster.start())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            starting.result()
            say(cluster.banner())
            sys.stdout.flush()
            await stop.wait()
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, LlmgwError):
                await starting
        stopper.cancel()
        say("stopping: engines, agent, control plane ...")
    finally:
        await cluster.stop()
    say("stopped.")


def _key_names() -> Iterator[str]:
    """``llmgw-up``, ``llmgw-up-2``, ``llmgw-up-3``, ..."""
    yield "llmgw-up"
    yield from (f"llmgw-up-{n}" for n in itertools.count(2))
