"""Control-plane HA on PostgreSQL, for the tests and bench/failover.py: instances on one
database (their server.yaml, state directory and ports), the CA exported from the first and
imported into the others, a fleet of two agents listing every instance, what each
instance's /healthz says, and an instance's own certificates: their serials, and a request
made with its client certificate straight to an agent's data plane."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw import pki
from tests.integration.harness import (
    LLMGW,
    Server,
    free_port,
    make_agent,
    start_agent,
    stop_process,
    wait_for,
)

PASSPHRASE = "integration passphrase"
LEASE = 4.0  # short, so that the tests wait less; bench/failover.py takes the default (10 s)


@dataclass
class Instance:
    name: str
    server: Server
    config: Path


def clean_env(tmp: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    return env | more


def config(
    tmp: Path,
    name: str,
    database: dict[str, str],
    *,
    lease: float = LEASE,
    heartbeat: float = 1.0,
    renew: float = 1.0,
    drain_grace: float = 0,
    drain_timeout: float = 120,
    extra: dict[str, Any] | None = None,
) -> tuple[Path, Path, int, int]:
    """An instance's server.yaml (no drain grace unless given: no load balancer checks
    /healthz but the drain's own tests'), its state directory and its two ports."""
    state = tmp / name / "state"
    state.mkdir(parents=True)
    http_port, grpc_port = free_port(), free_port()
    cfg = tmp / name / "server.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(state),
                "http_listen": f"127.0.0.1:{http_port}",
                "grpc_listen": f"127.0.0.1:{grpc_port}",
                "enroll_listen": "127.0.0.1:0",
                "heartbeat_interval": heartbeat,
                "loss_timeout": 30.0,
                "database": database,
                "instance_id": name,
                "lease": f"{lease}s",
                "lease_renew": f"{renew}s",
                "drain_grace": drain_grace,
                "drain_timeout": drain_timeout,
                **(extra or {}),
            }
        )
    )
    return cfg, state, http_port, grpc_port


def start(tmp: Path, name: str, cfg: Path, state: Path, http: int, grpc: int) -> Instance:
    log = tmp / name / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*LLMGW, "server", "--config", str(cfg)],
            stdout=out,
            stderr=out,
            env=clean_env(tmp),
            start_new_session=True,
        )
    return Instance(name, Server(state, http, grpc, proc, log), cfg)


def health(server: Server) -> tuple[int, dict[str, Any]]:
    """/healthz in full: with the admin token (a stranger sees its status and role only)."""
    token = server.state_dir / "admin.token"
    headers = {"Authorization": f"Bearer {token.read_text().strip()}"} if token.exists() else {}
    request = urllib.request.Request(server.url + "/healthz", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def run(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, *args],
        env=clean_env(tmp, **env),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def cluster(
    tmp: Path,
    pg: Any,
    count: int = 3,
    *,
    lease: float = LEASE,
    heartbeat: float = 1.0,
    renew: float = 1.0,
    extra: dict[str, Any] | None = None,
    **drain: float,
) -> list[Instance]:
    """*count* instances on one fresh database; the first leads, the CA imported by the rest
    (*heartbeat*: the agents' heartbeat interval, short here so that the tests wait less;
    bench/failover.py takes the defaults, 5 s and a renewal every 2 s, as what an agent
    notices of a paused leader scales with them; *drain*: drain_grace, drain_timeout for
    :func:`config`; *extra*: more server.yaml keys, e.g. bench/routing.py's queue_timeout)."""
    name = pg.fresh_database()
    database = {
        "url": pg.url(name, password=False),
        "password_file": str(pg.password_file(tmp)),
    }
    first_cfg = config(
        tmp, "cp1", database, lease=lease, heartbeat=heartbeat, renew=renew, extra=extra, **drain
    )
    first = start(tmp, "cp1", *first_cfg)
    wait_for(lambda: role(first) == "leader", timeout=60, what="cp1 leads")
    export = tmp / "ca.llmgw"
    done = run(
        tmp,
        "ctl",
        "cert",
        "export-ca",
        "--out",
        str(export),
        LLMGW_SERVER=first.server.url,
        LLMGW_TOKEN=first.server.admin_token,
        LLMGW_ADMIN_PASSWORD=(first.server.state_dir / "admin.password").read_text().strip(),
        LLMGW_CA_PASSPHRASE=PASSPHRASE,
    )
    assert done.returncode == 0, done.stderr
    instances = [first]
    for i in range(2, count + 1):
        cfg = config(
            tmp,
            f"cp{i}",
            database,
            lease=lease,
            heartbeat=heartbeat,
            renew=renew,
            extra=extra,
            **drain,
        )
        imported = run(
            tmp, "server", "--config", str(cfg[0]), "--import-ca", str(export),
            LLMGW_CA_PASSPHRASE=PASSPHRASE,
        )  # fmt: skip
        assert imported.returncode == 0, imported.stderr
        inst = start(tmp, f"cp{i}", *cfg)
        body = wait_for(
            lambda inst=inst: (h := health(inst.server))[1].get("role") == "standby" and h[1],
            timeout=60,
            what=f"cp{i} a standby",
        )
        assert body["leader"].endswith(f":{first.server.http_port}")
        instances.append(inst)
    return instances


def models(inst: Instance) -> list[str]:
    return list(health(inst.server)[1].get("models", []))


def role(inst: Instance) -> str:
    return str(health(inst.server)[1].get("role", ""))


def leader(instances: list[Instance]) -> Instance | None:
    for inst in instances:
        if inst.server.proc.poll() is None and role(inst) == "leader":
            return inst
    return None


def engine_pids(agent: Any) -> dict[str, int]:
    return {sid: int(rec["pid"]) for sid, rec in agent.shard_records().items()}


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_process(proc)


def fleet(
    tmp: Path,
    instances: list[Instance],
    procs: list[subprocess.Popen[bytes]],
    *,
    params: dict[str, str] | None = None,
) -> list[Any]:
    servers = [f"127.0.0.1:{i.server.grpc_port}" for i in instances]
    leader = instances[0].server
    agents = []
    for n in ("gpu-a", "gpu-b"):
        agent = make_agent(tmp, leader, n, extra={"servers": servers})
        start_agent(agent)
        assert agent.proc is not None
        procs.append(agent.proc)
        agents.append(agent)
    wait_for(
        lambda: sum(1 for n in leader.nodes() if n["connected"]) == 2,
        timeout=60,
        what="both agents on the leader",
    )
    leader.approve_pending(expected=2)
    model: dict[str, Any] = {"name": "m", "engine": "sim", "replicas": 2}
    if params:
        model["params"] = params
    leader.api("POST", "/api/models", model)
    wait_for(
        lambda: [r["state"] for r in leader.replicas("m")] == ["ready", "ready"],
        timeout=90,
        what="two ready replicas",
    )
    return agents


def serials(pki_dir: Path) -> tuple[str, str]:
    """The serials of an instance's own server and client certificates."""
    return tuple(  # type: ignore[return-value]
        pki.serial_hex(pki.load_cert(pki_dir / f"{name}.crt")) for name in ("server", "client")
    )


def learnt(agent: Any) -> dict[str, Any]:
    """The agent's STATE/servers.json ({} until it has one)."""
    try:
        return json.loads((agent.dir / "state" / "servers.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def dataplane_get(agent: Any, pki_dir: Path, path: str) -> tuple[int, dict[str, Any]]:
    """GET *path* on the agent's data plane with the control-plane client certificate in
    *pki_dir* (client.crt and client.key: an instance's own), the agent's certificate
    verified against the cluster CA as its node id."""
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(pki_dir / "client.crt"), str(pki_dir / "client.key"))
    with (
        socket.create_connection(("127.0.0.1", agent.dataplane_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=agent.node_id) as tls,
    ):
        conn = http.client.HTTPConnection("127.0.0.1", agent.dataplane_port, timeout=10)
        conn.sock = tls
        try:
            conn.request("GET", path, headers={"Host": agent.node_id})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.sock = None
