"""Control-plane HA on PostgreSQL (real PostgreSQL, the session's throwaway cluster): three
instances with their own state directories and ports on one database, the CA exported from
the first and imported into the others, two agents that list all three; the leader killed
(-9) or paused (SIGSTOP) past its lease, a standby taking over within 15 s, the agents
reattaching without restarting an engine, and a paused leader's writes fenced when it
wakes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import (
    LLMGW,
    Client,
    Server,
    free_port,
    make_agent,
    start_agent,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

PASSPHRASE = "integration passphrase"
LEASE = 4.0  # short, so that the tests wait less; the default (10 s) is measured in bench/


@dataclass
class Instance:
    name: str
    server: Server
    config: Path


def _env(tmp: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    return env | more


def _config(tmp: Path, name: str, database: dict[str, str]) -> tuple[Path, Path, int, int]:
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
                "heartbeat_interval": 1.0,
                "loss_timeout": 30.0,
                "database": database,
                "instance_id": name,
                "lease": f"{LEASE}s",
                "lease_renew": "1s",
            }
        )
    )
    return cfg, state, http_port, grpc_port


def _start(tmp: Path, name: str, cfg: Path, state: Path, http: int, grpc: int) -> Instance:
    log = tmp / name / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*LLMGW, "server", "--config", str(cfg)],
            stdout=out,
            stderr=out,
            env=_env(tmp),
            start_new_session=True,
        )
    return Instance(name, Server(state, http, grpc, proc, log), cfg)


def _health(server: Server) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(server.url + "/healthz", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def _run(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, *args],
        env=_env(tmp, **env),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def _cluster(tmp: Path, pg: Any, count: int = 3) -> list[Instance]:
    """*count* instances on one fresh database; the first leads, the CA imported by the rest."""
    name = pg.fresh_database()
    database = {
        "url": pg.url(name, password=False),
        "password_file": str(pg.password_file(tmp)),
    }
    first_cfg = _config(tmp, "cp1", database)
    first = _start(tmp, "cp1", *first_cfg)
    wait_for(lambda: _role(first) == "leader", timeout=60, what="cp1 leads")
    export = tmp / "ca.llmgw"
    done = _run(
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
        cfg = _config(tmp, f"cp{i}", database)
        imported = _run(
            tmp, "server", "--config", str(cfg[0]), "--import-ca", str(export),
            LLMGW_CA_PASSPHRASE=PASSPHRASE,
        )  # fmt: skip
        assert imported.returncode == 0, imported.stderr
        inst = _start(tmp, f"cp{i}", *cfg)
        body = wait_for(
            lambda inst=inst: (h := _health(inst.server))[1].get("role") == "standby" and h[1],
            timeout=60,
            what=f"cp{i} a standby",
        )
        assert body["leader"].endswith(f":{first.server.http_port}")
        instances.append(inst)
    return instances


def _models(inst: Instance) -> list[str]:
    return list(_health(inst.server)[1].get("models", []))


def _role(inst: Instance) -> str:
    return str(_health(inst.server)[1].get("role", ""))


def _leader(instances: list[Instance]) -> Instance | None:
    for inst in instances:
        if inst.server.proc.poll() is None and _role(inst) == "leader":
            return inst
    return None


def _engine_pids(agent: Any) -> dict[str, int]:
    return {sid: int(rec["pid"]) for sid, rec in agent.shard_records().items()}


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_process(proc)


def _fleet(tmp: Path, instances: list[Instance], procs: list[subprocess.Popen[bytes]]) -> list[Any]:
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
    leader.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 2})
    wait_for(
        lambda: [r["state"] for r in leader.replicas("m")] == ["ready", "ready"],
        timeout=90,
        what="two ready replicas",
    )
    return agents


def test_kill_the_leader_a_standby_leads_within_15s_and_no_engine_restarts(
    tmp_path: Path, pg_cluster: Any
) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = _cluster(tmp_path, pg_cluster)
        procs.extend(i.server.proc for i in instances)
        agents = _fleet(tmp_path, instances, procs)
        epoch1 = instances[0].server.api("GET", "/api/status")["epoch"]
        pids = {a.node_id: _engine_pids(a) for a in agents}
        assert all(pids.values())
        # A steady stream of requests through the two standbys' gateways; the admin API
        # through a standby reaches the leader (a key made there works everywhere).
        key = instances[1].server.api_key("steady")
        wait_for(
            lambda: all(_role(i) == "standby" and _models(i) == ["m"] for i in instances[1:]),
            timeout=30,
            what="the standbys route m",
        )
        clients = [Client(i.server.url + "/v1", key, "m") for i in instances[1:]]
        for c in clients:
            c.start()
        wait_for(lambda: all(c.ok >= 5 for c in clients), timeout=30, what="requests served")

        killed = time.monotonic()
        os.kill(instances[0].server.proc.pid, signal.SIGKILL)
        instances[0].server.proc.wait()
        new = wait_for(lambda: _leader(instances[1:]), timeout=30, what="a new leader")
        took = time.monotonic() - killed
        print(f"take-over after kill -9: {took:.1f} s (lease {LEASE:g} s)")
        assert took < 15
        assert new.server.api("GET", "/api/status")["epoch"] == epoch1 + 1
        wait_for(
            lambda: sum(1 for n in new.server.nodes() if n["connected"]) == 2,
            timeout=30,
            what="both agents on the new leader",
        )
        reattached = time.monotonic() - killed
        print(f"agents reattached after: {reattached:.1f} s")
        for agent in agents:
            oplog = json.loads((agent.dir / "state" / "oplog.json").read_text())
            wait_for(
                lambda agent=agent: (
                    json.loads((agent.dir / "state" / "oplog.json").read_text())["max_epoch"]
                    == epoch1 + 1
                ),
                what="the agent's fence at the new epoch",
            )
            del oplog
        wait_for(
            lambda: [r["state"] for r in new.server.replicas("m")] == ["ready", "ready"],
            timeout=30,
            what="the replicas ready under the new leader",
        )
        assert {a.node_id: _engine_pids(a) for a in agents} == pids  # no engine restarted
        served = [c.ok for c in clients]
        time.sleep(1)
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=60)
        print(
            f"requests through the two gateways: {sum(c.ok for c in clients)}, failed: "
            f"{sum(len(c.failures) for c in clients)}"
        )
        assert [c.failures for c in clients] == [[], []]
        assert all(c.ok > n for c, n in zip(clients, served, strict=True))
        key = new.server.api_key("after")
        req = urllib.request.Request(
            new.server.url + "/v1/chat/completions",
            data=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            ).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"]
        # The other standby now names the new leader.
        other = next(i for i in instances[1:] if i is not new)
        code, body = _health(other.server)
        assert code == 200 and body["role"] == "standby"
        assert body["leader"].endswith(f":{new.server.http_port}")
    finally:
        _stop_all(procs)


def test_a_paused_leader_is_fenced_and_steps_down(tmp_path: Path, pg_cluster: Any) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = _cluster(tmp_path, pg_cluster, count=2)
        procs.extend(i.server.proc for i in instances)
        agents = _fleet(tmp_path, instances, procs)
        old, standby = instances
        epoch1 = old.server.api("GET", "/api/status")["epoch"]
        pids = {a.node_id: _engine_pids(a) for a in agents}

        os.kill(old.server.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _role(standby) == "leader", timeout=30, what="take-over")
            wait_for(
                lambda: sum(1 for n in standby.server.nodes() if n["connected"]) == 2,
                timeout=60,
                what="the agents on the new leader",
            )
            # While the old leader sleeps, the cluster changes under the new one.
            standby.server.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 1})
        finally:
            os.kill(old.server.proc.pid, signal.SIGCONT)
        wait_for(
            lambda: "another instance leads now; stepping down" in old.server.log(),
            timeout=30,
            what="the old leader stepping down",
        )
        body = wait_for(
            lambda: (h := _health(old.server))[1].get("role") == "standby" and h[1],
            timeout=30,
            what="old is standby",
        )
        assert body["leader"].endswith(f":{standby.server.http_port}")
        assert standby.server.api("GET", "/api/status")["epoch"] == epoch1 + 1
        # No order of the old epoch was applied after the take-over: every agent's fence is
        # the new epoch, and the model is as the new leader set it.
        for agent in agents:
            oplog = json.loads((agent.dir / "state" / "oplog.json").read_text())
            assert oplog["max_epoch"] == epoch1 + 1
            assert "lower than" not in agent.log() or "refus" in agent.log()
        wait_for(
            lambda: [r["state"] for r in standby.server.replicas("m")] == ["ready"],
            timeout=60,
            what="one replica, as the new leader wants",
        )
        survivors = wait_for(
            lambda: (
                (now := {a.node_id: _engine_pids(a) for a in agents})
                and sum(len(p) for p in now.values()) == 1
                and now
            ),
            timeout=60,
            what="one engine left",
        )
        for node, engines in survivors.items():
            assert set(engines.items()) <= set(pids[node].items())  # kept, not restarted
        assert "fenced" in old.server.log() or "stepping down" in old.server.log()
    finally:
        _stop_all(procs)


def test_bad_configurations_are_refused_at_start(tmp_path: Path, pg_cluster: Any) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = _cluster(tmp_path, pg_cluster, count=1)
        procs.append(instances[0].server.proc)
        database = yaml.safe_load(instances[0].config.read_text())["database"]

        # Same instance id as a running instance.
        cfg = _config(tmp_path, "dup", database)[0]
        data = yaml.safe_load(cfg.read_text())
        data["instance_id"] = "cp1"
        cfg.write_text(yaml.safe_dump(data))
        dup = _run(tmp_path, "server", "--config", str(cfg))
        assert dup.returncode == 2
        assert "instance id 'cp1' is already used by a running control plane" in dup.stderr

        # No CA: told to import the cluster's.
        cfg = _config(tmp_path, "noca", database)[0]
        noca = _run(tmp_path, "server", "--config", str(cfg))
        assert noca.returncode == 2
        assert "this instance has no CA, and the cluster's is sha256:" in noca.stderr
        assert "--import-ca" in noca.stderr

        # Another cluster's CA.
        cfg, state, _h, _g = _config(tmp_path, "other", database)
        from llmgw import pki

        pki.init_ca(state / "pki")
        other = _run(tmp_path, "server", "--config", str(cfg))
        assert other.returncode == 2
        assert "is not the cluster's" in other.stderr

        # Wrong password; unreachable database (host and port named, no password printed).
        wrong = tmp_path / "wrong-pw"
        wrong.write_text("nope\n")
        cfg = _config(tmp_path, "wrongpw", {**database, "password_file": str(wrong)})[0]
        bad = _run(tmp_path, "server", "--config", str(cfg))
        assert bad.returncode == 2 and "refused the credentials of role llmgw" in bad.stderr
        port = free_port()
        cfg = _config(
            tmp_path,
            "away",
            {**database, "url": f"postgresql://llmgw@127.0.0.1:{port}/llmgw"},
        )[0]
        away = _run(tmp_path, "server", "--config", str(cfg))
        assert away.returncode != 0
        assert f"at 127.0.0.1:{port}" in away.stderr and "test-password" not in away.stderr

        # A database of a newer schema.
        name = database["url"].rsplit("/", 1)[1]
        pg_cluster.psql("UPDATE llmgw_schema SET version = version + 1", database=name)
        cfg = _config(tmp_path, "newer", database)[0]
        newer = _run(tmp_path, "server", "--config", str(cfg))
        assert newer.returncode != 0 and "newer than this llmgw" in newer.stderr
    finally:
        _stop_all(procs)


def test_postgresql_away_for_30s_under_load(tmp_path: Path, pg_cluster: Any) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = _cluster(tmp_path, pg_cluster, count=2)
        procs.extend(i.server.proc for i in instances)
        agents = _fleet(tmp_path, instances, procs)
        leader, standby = instances
        pids = {a.node_id: _engine_pids(a) for a in agents}
        key = leader.server.api_key("steady")
        wait_for(lambda: _models(standby) == ["m"], timeout=30, what="the standby routes m")
        clients = [Client(i.server.url + "/v1", key, "m") for i in instances]
        for c in clients:
            c.start()
        wait_for(lambda: all(c.ok >= 5 for c in clients), timeout=30, what="requests served")

        pg_cluster.stop()
        stopped = time.monotonic()
        try:
            for inst in instances:
                body = wait_for(
                    lambda inst=inst: "database" in (h := _health(inst.server)[1]) and h,
                    timeout=20,
                    what=f"{inst.name} saying the database is away",
                )
                assert body["database"].startswith("unreachable since ")
                assert "scheduling and admin writes pause" in body["database"]
            # The admin API says why it cannot answer (what ctl nodes prints).
            try:
                leader.server.nodes()
                raise AssertionError("the admin API answered without its database")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
                error = json.loads(exc.read())["error"]
                assert error["code"] == "database_unreachable"
                assert "unreachable since" in error["message"]
            during = [c.ok for c in clients]
            time.sleep(max(0.0, 30 - (time.monotonic() - stopped)))
            assert all(c.ok > n for c, n in zip(clients, during, strict=True))  # still served
        finally:
            pg_cluster.start()
        # All resumes: the database is no longer reported, writes and scheduling work again,
        # and the leader kept leading (nobody could take its lease meanwhile).
        for inst in instances:
            wait_for(
                lambda inst=inst: "database" not in _health(inst.server)[1],
                timeout=30,
                what=f"{inst.name} seeing the database again",
            )
        assert _role(leader) == "leader" and _role(standby) == "standby"
        leader.server.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 1})
        wait_for(
            lambda: [r["state"] for r in leader.server.replicas("m")] == ["ready"],
            timeout=60,
            what="scheduling again",
        )
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=60)
        print(
            f"requests during a 30 s database outage: {sum(c.ok for c in clients)}, failed: "
            f"{sum(len(c.failures) for c in clients)}"
        )
        assert [c.failures for c in clients] == [[], []]
        kept = {a.node_id: _engine_pids(a) for a in agents}
        for node, engines in kept.items():
            assert set(engines.items()) <= set(pids[node].items())  # none restarted
    finally:
        _stop_all(procs)
