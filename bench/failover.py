#!/usr/bin/env python3
"""Benchmark: control-plane take-over on PostgreSQL, and a standby's gateway vs the leader's.

Starts a throwaway PostgreSQL cluster (initdb + pg_ctl, as the tests do: tests/pg.py), three
control-plane instances on it with the default lease (8 s, renewed every 2 s), two agents
listing all three, and a sim model with two replicas. Then, ``--kills`` times:

1. a client thread per surviving instance sends requests through its gateway;
2. the leader is killed (``kill -9``);
3. it measures the time until a standby leads (its /healthz says ``leader``) and until both
   agents have accepted the new leader's epoch (their operation log's fence: from then on
   they take its orders and refuse the old one's), and counts the requests that failed
   through the surviving gateways meanwhile;
4. the killed instance is started again (it joins as a standby).

With ``--pause`` the leader is paused (``SIGSTOP``) instead of killed: its TCP connections
stay open, so the agents must notice its silence themselves; once both agents are on the new
leader it is woken (``SIGCONT``) and steps down to a standby on its own. Instances and agents
run with the defaults (heartbeat every 5 s, lease 8 s renewed every 2 s).

Last, unary latency at concurrency 1 (non-streamed, 8 tokens) through the leader's gateway
and a standby's, alternating, so that both see the same machine conditions.

It prints figures (a table, or ``--json``); it is not a pass/fail test. Usage:
python bench/failover.py [--kills N] [--pause] [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from tests.integration.ha import (  # noqa: E402
    cluster,
    fleet,
    leader,
    role,
    start,
    stop_all,
)
from tests.integration.harness import Client, wait_for  # noqa: E402
from tests.pg import start_cluster  # noqa: E402

# The defaults of server.yaml (llmgw.server.common.config).
DEFAULT_LEASE = 8.0
DEFAULT_RENEW = 2.0
DEFAULT_HEARTBEAT = 5.0


def _fence(agent: Any) -> int:
    try:
        return int(json.loads((agent.dir / "state" / "oplog.json").read_text())["max_epoch"])
    except (OSError, ValueError, KeyError):
        return 0


def _epoch(inst: Any) -> int:
    return int(inst.server.api("GET", "/api/status")["epoch"])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency(url: str, key: str, n: int) -> list[float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    out = []
    for i in range(n):
        t = time.perf_counter()
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8
        )
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument(
        "--pause", action="store_true", help="pause the leader (SIGSTOP) instead of killing it"
    )
    parser.add_argument("--requests", type=int, default=300, help="per gateway, for latency")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    pg = start_cluster()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-failover-"))
    procs: list[Any] = []
    rounds: list[dict[str, Any]] = []
    try:
        instances = cluster(
            tmp, pg, 3, lease=DEFAULT_LEASE, heartbeat=DEFAULT_HEARTBEAT, renew=DEFAULT_RENEW
        )
        procs.extend(i.server.proc for i in instances)
        agents = fleet(tmp, instances, procs)
        key = instances[0].server.api_key("bench")
        for round_no in range(args.kills):
            old = wait_for(lambda: leader(instances), timeout=60, what="a leader")
            epoch = _epoch(old)
            others = [i for i in instances if i is not old]
            clients = [Client(i.server.url + "/v1", key, "m", streams=False) for i in others]
            for c in clients:
                c.start()
            wait_for(
                lambda clients=clients: all(c.ok >= 3 for c in clients),
                timeout=30,
                what="requests",
            )
            killed = time.monotonic()
            os.kill(old.server.proc.pid, signal.SIGSTOP if args.pause else signal.SIGKILL)
            if not args.pause:
                old.server.proc.wait()
            new = wait_for(
                lambda others=others: leader(others), timeout=60, interval=0.02, what="leader"
            )
            elected = time.monotonic() - killed
            wait_for(
                lambda epoch=epoch: all(_fence(a) > epoch for a in agents),
                timeout=60,
                interval=0.02,
                what="the agents on the new epoch",
            )
            accepted = time.monotonic() - killed
            if args.pause:
                os.kill(old.server.proc.pid, signal.SIGCONT)
            time.sleep(1.0)
            for c in clients:
                c.stop.set()
            for c in clients:
                c.join(timeout=60)
            rounds.append(
                {
                    "round": round_no + 1,
                    "killed": old.name,
                    "fault": "paused" if args.pause else "killed",
                    "new_leader": new.name,
                    "elected_s": round(elected, 2),
                    "agents_accepted_s": round(accepted, 2),
                    "requests": sum(c.ok for c in clients),
                    "failed": sum(len(c.failures) for c in clients),
                    "failures": [f for c in clients for f in c.failures][:3],
                }
            )
            if not args.json:
                r = rounds[-1]
                print(
                    f"{r['fault']} {r['round']:2d}: {r['killed']} -> {r['new_leader']}  elected "
                    f"{r['elected_s']:5.2f} s  agents on it {r['agents_accepted_s']:5.2f} s  "
                    f"requests {r['requests']:5d}  failed {r['failed']}",
                    flush=True,
                )
                for failure in r["failures"]:
                    print(f"    failed: {failure[:300]}", flush=True)
            if args.pause:  # the woken instance steps down on its own
                wait_for(lambda old=old: role(old) == "standby", timeout=60, what="a standby")
                continue
            # The killed instance comes back as a standby.
            again = start(tmp, old.name, old.config, *_ports(old))
            procs.append(again.server.proc)
            instances[instances.index(old)] = again
            wait_for(lambda again=again: role(again) == "standby", timeout=60, what="a standby")

        lead = wait_for(lambda: leader(instances), timeout=60, what="a leader")
        standby = next(i for i in instances if i is not lead)
        leader_ms: list[float] = []
        standby_ms: list[float] = []
        for _ in range(max(1, args.requests // 50)):
            leader_ms += _latency(lead.server.url, key, 50)
            standby_ms += _latency(standby.server.url, key, 50)
        latency = {
            name: {
                "p50_ms": round(statistics.median(v), 2),
                "p99_ms": round(_percentile(v, 0.99), 2),
            }
            for name, v in (("leader", leader_ms), ("standby", standby_ms))
        }
    finally:
        stop_all(procs)
        pg.destroy()

    elected = [r["elected_s"] for r in rounds]
    accepted = [r["agents_accepted_s"] for r in rounds]
    summary = {
        "lease_s": DEFAULT_LEASE,
        "fault": "paused" if args.pause else "killed",
        "kills": len(rounds),
        "elected_s": {"mean": round(statistics.mean(elected), 2), "max": max(elected)},
        "agents_accepted_s": {"mean": round(statistics.mean(accepted), 2), "max": max(accepted)},
        "failed_requests": sum(r["failed"] for r in rounds),
        "requests": sum(r["requests"] for r in rounds),
        "latency": latency,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print()
    print(
        f"lease {DEFAULT_LEASE:g} s, heartbeat {DEFAULT_HEARTBEAT:g} s, {len(rounds)} "
        f"{'pauses' if args.pause else 'kills'} of the leader (target: agents on the new "
        "leader within 15 s)"
    )
    print(
        f"  new leader elected:      mean {summary['elected_s']['mean']:.2f} s, "
        f"max {summary['elected_s']['max']:.2f} s"
    )
    print(
        f"  agents on the new epoch: mean {summary['agents_accepted_s']['mean']:.2f} s, "
        f"max {summary['agents_accepted_s']['max']:.2f} s"
    )
    print(
        f"  requests through the surviving gateways: {summary['requests']}, failed "
        f"{summary['failed_requests']}"
    )
    for name, figures in latency.items():
        print(
            f"  {name:8s} gateway: p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms"
            " (client -> gateway -> agent -> sim, 8 tokens)"
        )
    return 0


def _ports(inst: Any) -> tuple[Path, int, int]:
    return inst.server.state_dir, inst.server.http_port, inst.server.grpc_port


if __name__ == "__main__":
    sys.exit(main())
