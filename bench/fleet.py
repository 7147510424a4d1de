#!/usr/bin/env python3
"""Benchmark: one control plane holding a fleet of N agents.

For each N (``--agents 100,500,2000``) it starts a real ``llmgw server`` (SQLite, or with
``--database postgresql`` a throwaway PostgreSQL cluster made as the tests make theirs:
tests/pg.py) at its default heartbeat and loss settings, and N simulated agents
(bench/fleetsim.py: real clients of the real protocol, many per process, in ``--procs``
processes). Each agent gets a one-time join token that requires approval, enrols through
``POST /enroll`` with its own key, connects its own mTLS Connect stream with an 8-GPU
inventory (two fabrics across the fleet), and the bench approves each pending node by its
fingerprint through the admin API, as an operator's script would. Then, in order:

1. **join**: the time until all N are connected and approved;
2. **placement**: ``--replicas`` replicas (1 GPU each, over 10 sim models; fewer when the
   fleet has too few GPUs for half of them) deployed at once: the time until all are placed
   and until all are routable (every agent "runs" its shards in-process, READY after 0.2 s);
3. **steady state** over ``--steady`` seconds: the control plane's CPU (% of one core, from
   /proc) and RSS, the heartbeat round trip as the agents see it (p50/p99), and the
   database's growth per hour (SQLite pages in use, or pg_database_size);
4. **gateway**: a second control plane with no fleet runs beside it, each with one real
   agent and a sim engine serving model ``probe``; ``--rounds`` alternating rounds of
   ``--requests`` unary requests through each gateway and straight to each engine give the
   added p99 (gateway minus direct) with N agents connected vs with none, per round and its
   spread;
5. **node loss**: a simulated agent holding replicas drops its stream (a machine that died);
   the time until the control plane marks it lost and until its replicas serve elsewhere;
6. **reconnect storm**: the control plane is stopped (SIGTERM) and started again on the same
   state; the time until all N have reattached, the StartShard orders sent meanwhile (none:
   no shard restarted), and the control plane's peak CPU and RSS while they come back.

It prints a table (or ``--json``) with the issue's targets beside the figures; it is not a
pass/fail test. Everything shares this machine's CPUs: the control plane's own CPU is
reported apart from the simulated agents'.

Usage: python bench/fleet.py [--agents 100,500,2000] [--database sqlite|postgresql]
       [--procs N] [--steady S] [--rounds N] [--requests N] [--replicas N] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.integration.harness import (  # noqa: E402
    LLMGW,
    Server,
    free_port,
    make_agent,
    start_agent,
    stop_process,
    wait_for,
)

FABRICS = ("ib-a", "ib-b")
MODELS = 10
PROBE = "probe"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

TARGET_CPU_PCT = 50.0
TARGET_RSS_MIB = 1024.0
TARGET_ADDED_RATIO = 1.1
TARGET_LOST_S = 15.0
TARGET_SERVING_S = 20.0
TARGET_REATTACH_S = 60.0


def say(msg: str) -> None:
    print(f"[fleet] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the control plane's process -------------------------------------------------------------


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler(threading.Thread):
    """CPU (% of one core over each interval) and RSS of one process, until stopped."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.cpu: list[float] = []
        self.rss: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            last_t, last = time.monotonic(), cpu_ticks(self.pid)
            while not self.stop.wait(self.interval):
                now_t, now = time.monotonic(), cpu_ticks(self.pid)
                self.cpu.append(100.0 * (now - last) / CLK_TCK / (now_t - last_t))
                self.rss.append(rss_mib(self.pid))
                last_t, last = now_t, now
        except OSError:
            return


@dataclass
class ControlPlane:
    name: str
    tmp: Path
    config: Path
    server: Server
    enroll_port: int
    database: str  # "sqlite" or a libpq URL (no password)

    @property
    def pid(self) -> int:
        return self.server.proc.pid


def server_argv(config: Path, name: str) -> list[str]:
    """``llmgw server``, under cProfile when LLMGW_BENCH_PROFILE names a directory (the
    profile of the fleet's control plane is written there when it stops)."""
    out = os.environ.get("LLMGW_BENCH_PROFILE")
    if out and name == "fleet":
        prof = Path(out) / f"{name}-{time.time_ns()}.prof"
        return [
            sys.executable,
            "-m",
            "cProfile",
            "-o",
            str(prof),
            *LLMGW[1:],
            "server",
            "--config",
            str(config),
        ]
    return [*LLMGW, "server", "--config", str(config)]


def server_env(name: str) -> dict[str, str] | None:
    """The environment of ``llmgw server``: with LLMGW_BENCH_ASYNCIO_DEBUG set, the fleet's
    runs in asyncio's debug mode, which logs every callback that holds the loop for 0.1 s."""
    if name == "fleet" and os.environ.get("LLMGW_BENCH_ASYNCIO_DEBUG"):
        return {**os.environ, "PYTHONASYNCIODEBUG": "1"}
    return None


def write_config(tmp: Path, name: str, database: dict[str, str] | None) -> tuple[Path, Server, int]:
    state = tmp / name / "state"
    state.mkdir(parents=True)
    http_port, grpc_port, enroll_port = free_port(), free_port(), free_port()
    cfg: dict[str, Any] = {
        "state_dir": str(state),
        "http_listen": f"127.0.0.1:{http_port}",
        "grpc_listen": f"127.0.0.1:{grpc_port}",
        "enroll_listen": f"127.0.0.1:{enroll_port}",
        # The restart measured is the control plane's own: no load balancer waits on /healthz.
        "drain_grace": 0,
        # Every simulated agent enrols from 127.0.0.1: the cap per source is raised, as the
        # config's comment says a fleet behind one NAT does.
        "listeners": {"enroll_connections_per_source": 1024},
    }
    if database is not None:
        cfg["database"] = database
        cfg["instance_id"] = name
    path = tmp / name / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log_path = tmp / name / "server.log"
    proc = subprocess.Popen(
        server_argv(path, name),
        env=server_env(name),
        stdout=open(log_path, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return path, Server(state, http_port, grpc_port, proc, log_path), enroll_port


def healthy(server: Server) -> bool:
    if server.proc.poll() is not None:
        raise SystemExit(
            f"the control plane exited with {server.proc.returncode}:\n{server.log()[-3000:]}"
        )
    try:
        with urllib.request.urlopen(server.url + "/healthz", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_control_plane(tmp: Path, name: str, pg: Any | None) -> ControlPlane:
    database = None
    tmp.mkdir(parents=True, exist_ok=True)
    if pg is not None:
        dbname = pg.fresh_database()
        database = {
            "url": pg.url(dbname, password=False),
            "password_file": str(pg.password_file(tmp)),
        }
    path, server, enroll_port = write_config(tmp, name, database)
    wait_for(lambda: healthy(server), timeout=120, what=f"{name} /healthz")
    return ControlPlane(
        name, tmp, path, server, enroll_port, database["url"] if database else "sqlite"
    )


def restart(cp: ControlPlane) -> float:
    """Stop the control plane (SIGTERM) and start it again on the same state; the seconds it
    took to stop."""
    t = time.monotonic()
    stop_process(cp.server.proc, timeout=60)
    stopped = time.monotonic() - t
    proc = subprocess.Popen(
        server_argv(cp.config, cp.name),
        env=server_env(cp.name),
        stdout=open(cp.server.log_path, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    cp.server = Server(
        cp.server.state_dir, cp.server.http_port, cp.server.grpc_port, proc, cp.server.log_path
    )
    return stopped


def db_bytes(cp: ControlPlane, pg: Any | None) -> int:
    if pg is None:
        path = cp.server.state_dir / "llmgw.db"
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            pages = con.execute("PRAGMA page_count").fetchone()[0]
            free = con.execute("PRAGMA freelist_count").fetchone()[0]
            size = con.execute("PRAGMA page_size").fetchone()[0]
        finally:
            con.close()
        return int((pages - free) * size)
    dbname = cp.database.rsplit("/", 1)[1].split("?")[0]
    return int(pg.psql(f"SELECT pg_database_size('{dbname}')", database=dbname).strip())


# -- the probe: one real agent and its sim engine, for the gateway's latency -------------------


@dataclass
class Probe:
    cp: ControlPlane
    key: str
    engine_port: int
    agent: Any


def start_probe(cp: ControlPlane) -> Probe:
    cp.server.api("POST", "/api/models", {"name": PROBE, "engine": "sim", "replicas": 1})
    agent = start_agent(make_agent(cp.tmp / cp.name, cp.server, f"{cp.name}-probe"))
    wait_for(
        lambda: any(n["connected"] for n in cp.server.nodes()), timeout=60, what="the probe agent"
    )
    cp.server.approve_pending(1)
    rep = wait_for(
        lambda: next((r for r in cp.server.replicas(PROBE) if r["routable"]), None),
        timeout=60,
        what="the probe replica",
    )
    return Probe(cp, cp.server.api_key("bench"), int(rep["port"]), agent)


CHAT = json.dumps(
    {"model": PROBE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
).encode()


class Timer:
    """Unary chat completions over one keep-alive connection; milliseconds each."""

    def __init__(self, port: int, key: str | None) -> None:
        self.port = port
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def once(self) -> float:
        t = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body=CHAT, headers=self.headers)
        resp = self.conn.getresponse()
        body = resp.read()
        ms = (time.perf_counter() - t) * 1000
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from :{self.port}: {body[:300]!r}")
        return ms


def latency_rounds(fleet: Probe, none: Probe, rounds: int, requests: int) -> dict[str, Any]:
    targets = {
        "fleet_gw": Timer(fleet.cp.server.http_port, fleet.key),
        "fleet_direct": Timer(fleet.engine_port, None),
        "none_gw": Timer(none.cp.server.http_port, none.key),
        "none_direct": Timer(none.engine_port, None),
    }
    for t in targets.values():
        for _ in range(50):  # warm: connections, caches
            t.once()
    out: list[dict[str, float]] = []
    for _ in range(rounds):
        samples: dict[str, list[float]] = {k: [] for k in targets}
        for _ in range(requests):
            for name, t in targets.items():  # interleaved: the same machine conditions
                samples[name].append(t.once())
        p99 = {k: percentile(v, 0.99) for k, v in samples.items()}
        out.append(
            {
                "fleet_added_p99_ms": p99["fleet_gw"] - p99["fleet_direct"],
                "none_added_p99_ms": p99["none_gw"] - p99["none_direct"],
                "fleet_gw_p99_ms": p99["fleet_gw"],
                "none_gw_p99_ms": p99["none_gw"],
            }
        )
    fleet_added = [r["fleet_added_p99_ms"] for r in out]
    none_added = [r["none_added_p99_ms"] for r in out]
    ratios = [
        f / n if n > 0 else float("nan") for f, n in zip(fleet_added, none_added, strict=True)
    ]
    return {
        "rounds": out,
        "fleet_added_p99_ms": statistics.median(fleet_added),
        "none_added_p99_ms": statistics.median(none_added),
        "ratio": statistics.median(fleet_added) / statistics.median(none_added),
        "ratio_spread": [min(ratios), max(ratios)],
    }


# -- the simulated fleet ---------------------------------------------------------------------


class Worker:
    """One bench/fleetsim.py process and its share of the fleet."""

    def __init__(self, cp: ControlPlane, nodes: list[dict[str, Any]], path: Path) -> None:
        path.write_text(json.dumps(nodes))
        self.nodes = {n["node_id"] for n in nodes}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "fleetsim.py"),
                "--nodes",
                str(path),
                "--grpc",
                f"127.0.0.1:{cp.server.grpc_port}",
                "--enroll",
                f"127.0.0.1:{cp.enroll_port}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()

    def read(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"a simulated fleet process exited ({self.proc.poll()})")
            msg = json.loads(line)
            if msg.get("event") == event:
                return msg  # type: ignore[no-any-return]

    def ask(self, cmd: dict[str, Any], event: str) -> dict[str, Any]:
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self.read(event)

    def quit(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@dataclass
class Fleet:
    workers: list[Worker] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            parts = list(pool.map(lambda w: w.ask({"cmd": "stats"}, "stats"), self.workers))
        total: dict[str, Any] = {"rtts_ms": []}
        for p in parts:
            for k, v in p.items():
                if k == "rtts_ms":
                    total[k].extend(v)
                elif isinstance(v, int):
                    total[k] = total.get(k, 0) + v
        return total

    def kill(self, node: str) -> None:
        worker = next(w for w in self.workers if node in w.nodes)
        worker.ask({"cmd": "kill", "node": node}, "killed")

    def quit(self) -> None:
        for w in self.workers:
            w.quit()


def approve_pending(cp: ControlPlane, pool: ThreadPoolExecutor) -> int:
    """Approve every connected pending node by its fingerprint; how many were."""
    pending = [n for n in cp.server.nodes() if n["state"] == "pending" and n["connected"]]

    def one(node: dict[str, Any]) -> None:
        cp.server.api(
            "POST", f"/api/nodes/{node['id']}/approve", {"fingerprint": node["fingerprint"]}
        )

    list(pool.map(one, pending))
    return len(pending)


def join_fleet(cp: ControlPlane, n: int, procs: int, tmp: Path) -> tuple[Fleet, dict[str, Any]]:
    say(f"{n} join tokens")
    with ThreadPoolExecutor(8) as pool:
        ids = [f"sim{i:05d}" for i in range(n)]
        tokens = list(
            pool.map(
                lambda node: cp.server.api(
                    "POST", "/api/join-tokens", {"node": node, "require_approval": True}
                )["token"],
                ids,
            )
        )
    nodes = [
        {"node_id": node, "index": i, "fabric": FABRICS[i % len(FABRICS)], "token": tok}
        for i, (node, tok) in enumerate(zip(ids, tokens, strict=True))
    ]
    say(f"{n} agents enrol and connect ({procs} processes)")
    t0 = time.monotonic()
    fleet = Fleet()
    for k in range(procs):
        share = nodes[k::procs]
        if share:
            fleet.workers.append(Worker(cp, share, tmp / f"nodes-{k}.json"))
    enrolled = [w.read("enrolled") for w in fleet.workers]
    failed = [f for e in enrolled for f in e["failed"]]
    if failed:
        raise SystemExit(f"enrolment failed: {failed[:5]}")
    enrol_s = time.monotonic() - t0
    approved = 0
    with ThreadPoolExecutor(8) as pool:
        while True:
            approved += approve_pending(cp, pool)
            s = fleet.stats()
            if s["approved"] >= n:
                break
            if time.monotonic() - t0 > 1800:
                raise SystemExit(f"only {s['approved']} of {n} agents approved after 30 min")
            time.sleep(0.5)
    return fleet, {"enrol_s": enrol_s, "join_s": time.monotonic() - t0, "approved": approved}


def place(cp: ControlPlane, fleet: Fleet, replicas: int) -> dict[str, Any]:
    per_model = [replicas // MODELS + (1 if i < replicas % MODELS else 0) for i in range(MODELS)]
    t0 = time.monotonic()
    for i, count in enumerate(per_model):
        cp.server.api(
            "POST",
            "/api/models",
            {"name": f"fleet-{i}", "engine": "sim", "replicas": count, "gpus": 1},
        )
    placed_s = None
    while True:
        s = fleet.stats()
        if placed_s is None and s["starts"] >= replicas:
            placed_s = time.monotonic() - t0
        routable = sum(1 for r in cp.server.replicas() if r["routable"] and r["model"] != PROBE)
        if routable >= replicas:
            break
        if time.monotonic() - t0 > 900:
            raise SystemExit(f"only {routable} of {replicas} replicas routable after 15 min")
        time.sleep(0.5)
    return {"replicas": replicas, "placed_s": placed_s, "routable_s": time.monotonic() - t0}


def steady(cp: ControlPlane, fleet: Fleet, seconds: float, pg: Any | None) -> dict[str, Any]:
    fleet.stats()  # drop the round trips measured so far
    b0, t0, c0 = db_bytes(cp, pg), time.monotonic(), cpu_ticks(cp.pid)
    sampler = Sampler(cp.pid, 1.0)
    sampler.start()
    time.sleep(seconds)
    sampler.stop.set()
    sampler.join()
    elapsed = time.monotonic() - t0
    cpu = 100.0 * (cpu_ticks(cp.pid) - c0) / CLK_TCK / elapsed
    growth = (db_bytes(cp, pg) - b0) / elapsed * 3600
    s = fleet.stats()
    return {
        "cpu_pct": cpu,
        "cpu_peak_pct": max(sampler.cpu, default=0.0),
        "rss_mib": rss_mib(cp.pid),
        "heartbeats": len(s["rtts_ms"]),
        "heartbeat_p50_ms": percentile(s["rtts_ms"], 0.5),
        "heartbeat_p99_ms": percentile(s["rtts_ms"], 0.99),
        "db_growth_mib_per_h": growth / (1 << 20),
        "db_mib": db_bytes(cp, pg) / (1 << 20),
        "ended_by_server": s["ended_by_server"],
        "refused": s["refused"],
    }


def node_loss(cp: ControlPlane, fleet: Fleet) -> dict[str, Any]:
    replicas = cp.server.replicas()
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in replicas:
        if r["model"] != PROBE:
            by_node.setdefault(r["node"], []).append(r)
    victim = max(sorted(by_node), key=lambda node: len(by_node[node]))
    lost_replicas = {r["replica"] for r in by_node[victim]}
    want = {m: sum(1 for r in replicas if r["model"] == m) for m in {r["model"] for r in replicas}}
    say(f"node loss: {victim} (holding {len(lost_replicas)} replicas) drops its stream")
    t0 = time.monotonic()
    fleet.kill(victim)
    lost_s = None
    while True:
        if lost_s is None and cp.server.api("GET", f"/api/nodes/{victim}").get("lost"):
            lost_s = time.monotonic() - t0
        if lost_s is not None:
            now = cp.server.replicas()
            serving = {m: 0 for m in want}
            for r in now:
                if r["routable"] and r["node"] != victim:
                    serving[r["model"]] += 1
            if all(serving[m] >= want[m] for m in want):
                break
        if time.monotonic() - t0 > 300:
            raise SystemExit(f"{victim}'s replicas not serving elsewhere after 5 min")
        time.sleep(0.1)
    return {
        "victim": victim,
        "replicas": len(lost_replicas),
        "lost_s": lost_s,
        "serving_s": time.monotonic() - t0,
    }


def reconnect_storm(cp: ControlPlane, fleet: Fleet, n: int) -> dict[str, Any]:
    before = fleet.stats()
    say(f"reconnect storm: the control plane restarts under {n} agents")
    stopped_s = restart(cp)
    t0 = time.monotonic()
    sampler = Sampler(cp.pid, 0.5)
    sampler.start()
    wait_for(lambda: healthy(cp.server), timeout=120, interval=0.1, what="the restarted /healthz")
    up_s = time.monotonic() - t0
    while True:
        s = fleet.stats()
        if s["approved"] >= n:
            break
        if time.monotonic() - t0 > 600:
            break
        time.sleep(0.25)
    reattach_s = time.monotonic() - t0
    time.sleep(5)  # orders the reconnect may still cause
    after = fleet.stats()
    sampler.stop.set()
    sampler.join()
    return {
        "stop_s": stopped_s,
        "up_s": up_s,
        "reattached": s["approved"],
        "reattach_s": reattach_s,
        "starts_after": after["starts"] - before["starts"],
        "stops_after": after["stops"] - before["stops"],
        "peak_cpu_pct": max(sampler.cpu, default=0.0),
        "peak_rss_mib": max(sampler.rss, default=0.0),
    }


# -- one run per N ----------------------------------------------------------------------------


def run_one(
    n: int, args: argparse.Namespace, none: Probe, pg: Any | None, tmp: Path
) -> dict[str, Any]:
    cp = start_control_plane(tmp / f"n{n}", "fleet", pg)
    probe = start_probe(cp)
    fig: dict[str, Any] = {"agents": n}
    fleet = Fleet()
    try:
        fleet, fig["join"] = join_fleet(cp, n, min(args.procs, max(1, n // 50)), tmp / f"n{n}")
        say(f"joined in {fig['join']['join_s']:.1f} s")
        replicas = min(args.replicas, n * 8 // 2)
        fig["placement"] = place(cp, fleet, replicas)
        say(
            f"placed in {fig['placement']['placed_s']:.1f} s, routable in {fig['placement']['routable_s']:.1f} s"
        )
        time.sleep(5)
        fig["steady"] = steady(cp, fleet, args.steady, pg)
        say(f"steady: {fig['steady']['cpu_pct']:.1f} % CPU, {fig['steady']['rss_mib']:.0f} MiB")
        fig["gateway"] = latency_rounds(probe, none, args.rounds, args.requests)
        say(f"gateway: added p99 ratio {fig['gateway']['ratio']:.2f}")
        fig["loss"] = node_loss(cp, fleet)
        say(
            f"loss: lost after {fig['loss']['lost_s']:.1f} s, serving after {fig['loss']['serving_s']:.1f} s"
        )
        time.sleep(3)
        fig["storm"] = reconnect_storm(cp, fleet, n - 1)
        say(f"storm: reattached in {fig['storm']['reattach_s']:.1f} s")
    except (OSError, RuntimeError, SystemExit) as exc:
        # Where it breaks is a figure too: the phases measured so far, and what failed.
        phase = next(
            (
                p
                for p in ("join", "placement", "steady", "gateway", "loss", "storm")
                if p not in fig
            ),
            "?",
        )
        fig["failed"] = {"phase": phase, "error": f"{type(exc).__name__}: {exc}"[:500]}
        say(f"{n} agents: {phase} failed: {fig['failed']['error']}")
    finally:
        fleet.quit()
        if probe.agent.proc is not None:
            stop_process(probe.agent.proc)
        stop_process(cp.server.proc, timeout=60)
    return fig


def met(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def render(figs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"python {meta['python']} on {meta['machine']}, {meta['cpus']} CPUs; database {meta['database']}; "
        f"heartbeat and loss timeout at their defaults",
        "",
    ]
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("connected + approved (s)", lambda f: f"{f['join']['join_s']:.1f}"),
        ("  of which enrolment (s)", lambda f: f"{f['join']['enrol_s']:.1f}"),
        ("replicas placed", lambda f: f"{f['placement']['replicas']}"),
        ("  all ordered (s)", lambda f: f"{f['placement']['placed_s']:.1f}"),
        ("  all routable (s)", lambda f: f"{f['placement']['routable_s']:.1f}"),
        (
            "steady CPU, % of a core",
            lambda f: (
                f"{f['steady']['cpu_pct']:.1f} {met(f['steady']['cpu_pct'] <= TARGET_CPU_PCT)}"
            ),
        ),
        ("  peak over 1 s", lambda f: f"{f['steady']['cpu_peak_pct']:.0f}"),
        (
            "RSS (MiB)",
            lambda f: (
                f"{f['steady']['rss_mib']:.0f} {met(f['steady']['rss_mib'] <= TARGET_RSS_MIB)}"
            ),
        ),
        ("heartbeat round trip p50 (ms)", lambda f: f"{f['steady']['heartbeat_p50_ms']:.2f}"),
        ("heartbeat round trip p99 (ms)", lambda f: f"{f['steady']['heartbeat_p99_ms']:.2f}"),
        ("database growth (MiB/h)", lambda f: f"{f['steady']['db_growth_mib_per_h']:.2f}"),
        ("database size (MiB)", lambda f: f"{f['steady']['db_mib']:.1f}"),
        (
            "streams ended by the server",
            lambda f: (
                f"{f['steady']['ended_by_server']} {met(f['steady']['ended_by_server'] == 0)}"
            ),
        ),
        ("gateway added p99, fleet (ms)", lambda f: f"{f['gateway']['fleet_added_p99_ms']:.2f}"),
        ("gateway added p99, none (ms)", lambda f: f"{f['gateway']['none_added_p99_ms']:.2f}"),
        (
            "  ratio (median of rounds)",
            lambda f: (
                f"{f['gateway']['ratio']:.2f} {met(f['gateway']['ratio'] <= TARGET_ADDED_RATIO)}"
            ),
        ),
        ("  ratio spread", lambda f: "{:.2f}-{:.2f}".format(*f["gateway"]["ratio_spread"])),
        (
            "node loss: marked lost (s)",
            lambda f: f"{f['loss']['lost_s']:.1f} {met(f['loss']['lost_s'] <= TARGET_LOST_S)}",
        ),
        (
            "  replicas serving again (s)",
            lambda f: (
                f"{f['loss']['serving_s']:.1f} {met(f['loss']['serving_s'] <= TARGET_SERVING_S)}"
            ),
        ),
        (
            "restart: all reattached (s)",
            lambda f: (
                f"{f['storm']['reattach_s']:.1f} {met(f['storm']['reattach_s'] <= TARGET_REATTACH_S)}"
            ),
        ),
        ("  /healthz up after (s)", lambda f: f"{f['storm']['up_s']:.1f}"),
        (
            "  shards started again",
            lambda f: f"{f['storm']['starts_after']} {met(f['storm']['starts_after'] == 0)}",
        ),
        ("  peak CPU, % of a core", lambda f: f"{f['storm']['peak_cpu_pct']:.0f}"),
        ("  peak RSS (MiB)", lambda f: f"{f['storm']['peak_rss_mib']:.0f}"),
    ]
    failed = [f for f in figs if "failed" in f]
    figs = [f for f in figs if "failed" not in f]
    width = max(len(r[0]) for r in rows) + 2
    lines.append("agents".ljust(width) + "".join(f"{f['agents']:>16}" for f in figs))
    for label, cell in rows:
        lines.append(label.ljust(width) + "".join(f"{cell(f):>16}" for f in figs))
    lines.append("")
    for f in failed:
        lines.append(
            f"{f['agents']} agents: the {f['failed']['phase']} phase failed: {f['failed']['error']}"
        )
    lines.append(
        f"targets at 2,000: CPU <= {TARGET_CPU_PCT:g} %, RSS <= {TARGET_RSS_MIB:g} MiB, added p99 "
        f"<= {TARGET_ADDED_RATIO:g}x none, lost <= {TARGET_LOST_S:g} s, serving <= "
        f"{TARGET_SERVING_S:g} s, reattached <= {TARGET_REATTACH_S:g} s with no shard restarted"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="100,500,2000", help="comma-separated fleet sizes")
    parser.add_argument("--database", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--procs", type=int, default=4, help="simulated-agent processes")
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady state")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="per target and round")
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.agents.split(",") if x.strip()]

    pg = None
    if args.database == "postgresql":
        from tests.pg import start_cluster

        pg = start_cluster()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-fleet-"))
    figs: list[dict[str, Any]] = []
    none_cp = start_control_plane(tmp, "none", pg)
    none = start_probe(none_cp)
    try:
        for n in sizes:
            say(f"--- {n} agents ---")
            figs.append(run_one(n, args, none, pg, tmp))
    finally:
        if none.agent.proc is not None:
            stop_process(none.agent.proc)
        stop_process(none_cp.server.proc, timeout=60)
        if pg is not None:
            pg.destroy()
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "database": args.database,
    }
    if args.json:
        print(json.dumps({"meta": meta, "runs": figs}, indent=2))
    else:
        print(render(figs, meta))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
