#!/usr/bin/env python3
"""Benchmark: what a client sees of a fault mid-answer (issue 40), with resume off and on.

Faults on a fleet (tests/integration/continuity.py: a control plane, three agents on this
machine, a sim model of three replicas, one on each): under 64 concurrent streams (40
tokens at 40 tokens/s, about a second each), each fault in turn, dealt once every stream
has its first token:

- ``engine``: one engine killed (SIGKILL);
- ``agent``: one agent killed (its engine lives on, and is adopted when it starts again);
- ``node``: an agent and its engine killed together.

Each fault runs twice: first with a key whose policy says ``resume: false`` (the baseline:
the gateway as before issue 40), then with a key that leaves it to the profile (resume on).
For each it reports the streams that broke (the client got an error event), the streams
resumed, whether every text was the uninterrupted one for its seed, and the pause a client
saw at the resume point: p50 / p99 over the resumed streams of the largest gap between two
tokens (the one that spans the break), next to the gap between tokens of every stream.

Then a rolling restart (tests/integration/rolling.py): three instances on a throwaway
PostgreSQL (tests/pg.py), two agents, Debian's haproxy in front health-checking /healthz,
each instance in turn stopped with SIGTERM (it drains: 2 s grace, 30 s timeout) and started
again, under 32 clients of each key sending one request after another (streamed and not,
alternately). It reports the requests served and failed for each key.

It prints a table (or ``--json``); it is not a pass/fail test. On a 2-core machine it takes
about two minutes. ``--reps N`` deals each fault N times (default 1); ``--no-rolling``
leaves out the rolling restart (it needs PostgreSQL and haproxy). Usage:
python bench/continuity.py [--reps N] [--no-rolling] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.continuity import (  # noqa: E402
    FAULTS,
    Fleet,
    deal,
    expected,
    recover,
    resumed_ids,
    run_streams,
    start_fleet,
)
from tests.integration.ha import Instance, cluster, fleet, leader, start, stop_all  # noqa: E402
from tests.integration.harness import Client, wait_for  # noqa: E402
from tests.integration.rolling import haproxy_binary, rolling_restart, start_haproxy  # noqa: E402

STREAMS = 64
TOKENS = 40
TPS = 40


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _key(server: Any, name: str, resume: bool) -> str:
    return str(server.api("POST", "/api/keys", {"name": name, "resume": resume})["key"])


def _faults(tmp: Path, reps: int) -> list[dict[str, Any]]:
    tmp.mkdir()
    fl: Fleet = start_fleet(tmp, tps=TPS)
    rows: list[dict[str, Any]] = []
    try:
        keys = {
            "off": _key(fl.server, "resume-off", False),
            "on": _key(fl.server, "resume-on", True),
        }
        turn = 0
        for fault in FAULTS:
            for mode in ("off", "on"):
                broken = resumed = wrong = 0
                pauses: list[float] = []
                gaps: list[float] = []
                for _ in range(reps):
                    agent = fl.agents[turn % len(fl.agents)]
                    turn += 1
                    logged = len(fl.server.log())
                    streams = run_streams(
                        fl.server.url + "/v1",
                        keys[mode],
                        STREAMS,
                        TOKENS,
                        lambda agent=agent, fault=fault: deal(fl, fault, agent),
                    )
                    # The sim's ids are its seed's, the same in every round: this round's log.
                    ids = resumed_ids(fl.server.log()[logged:])
                    broken += sum(1 for s in streams if s.error is not None)
                    wrong += sum(
                        1 for s in streams if s.error is None and s.text != expected(s.i, TOKENS)
                    )
                    for s in streams:
                        if s.ids & ids:
                            resumed += 1
                            pauses.append(s.largest_gap())
                        gaps += [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
                    recover(fl, fault, agent)
                rows.append(
                    {
                        "fault": fault,
                        "resume": mode,
                        "streams": STREAMS * reps,
                        "broken": broken,
                        "resumed": resumed,
                        "wrong_text": wrong,
                        "pause_p50_ms": round(statistics.median(pauses) * 1000, 1)
                        if pauses
                        else None,
                        "pause_p99_ms": round(_percentile(pauses, 0.99) * 1000, 1)
                        if pauses
                        else None,
                        "gap_p50_ms": round(statistics.median(gaps) * 1000, 1) if gaps else None,
                    }
                )
    finally:
        fl.stop()
    return rows


def _rolling(tmp: Path) -> dict[str, Any]:
    from tests.pg import start_cluster

    pg = start_cluster()
    procs: list[subprocess.Popen[bytes]] = []
    proxy = None
    try:
        instances = cluster(tmp, pg, drain_grace=2.0, drain_timeout=30.0)
        procs.extend(i.server.proc for i in instances)
        fleet(tmp, instances, procs, params={"tps": str(TPS)})
        proxy = start_haproxy(tmp, instances)
        first = leader(instances)
        assert first is not None
        keys = {
            "off": _key(first.server, "resume-off", False),
            "on": _key(first.server, "resume-on", True),
        }
        full = {"ignore_eos": True}
        clients = {
            mode: [
                Client(proxy.url + "/v1", key, "m", max_tokens=TOKENS, extra_body=full)
                for _ in range(STREAMS // 2)
            ]
            for mode, key in keys.items()
        }
        every = [c for cs in clients.values() for c in cs]
        for c in every:
            c.start()
        try:
            wait_for(lambda: all(c.ok >= 1 for c in every), timeout=120, what="requests served")
            served = {mode: sum(c.ok for c in cs) for mode, cs in clients.items()}

            def again(inst: Instance) -> Instance:
                s = inst.server
                new = start(tmp, inst.name, inst.config, s.state_dir, s.http_port, s.grpc_port)
                procs.append(new.server.proc)  # for stop_all
                return new

            began = time.monotonic()
            done = rolling_restart(list(instances), proxy, again, stop_timeout=90)
            took = time.monotonic() - began
        finally:
            for c in every:
                c.stop.set()
            for c in every:
                c.join(timeout=60)
        return {
            "restart_s": round(took, 1),
            "exit_codes": [t.exit_code for t in done.turns],
            **{
                mode: {
                    "during": sum(c.ok for c in cs) - served[mode],
                    "failed": sum(len(c.failures) for c in cs),
                    "first_failures": [f for c in cs for f in c.failures][:3],
                }
                for mode, cs in clients.items()
            },
        }
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(procs)
        pg.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1, help="times each fault is dealt")
    parser.add_argument("--no-rolling", action="store_true", help="leave out the rolling restart")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-continuity-") as tmp:
        rows = _faults(Path(tmp) / "faults", max(1, args.reps))
        rolling = None
        if not args.no_rolling and haproxy_binary() is not None:
            (Path(tmp) / "rolling").mkdir()
            rolling = _rolling(Path(tmp) / "rolling")
    took = round(time.monotonic() - began)
    if args.json:
        print(json.dumps({"faults": rows, "rolling_restart": rolling, "took_s": took}, indent=2))
        return 0
    print(
        f"{STREAMS} concurrent streams of {TOKENS} tokens at {TPS} tokens/s, 3 sim replicas on "
        f"3 nodes; each fault dealt {max(1, args.reps)} time(s)"
    )
    head = (
        "fault",
        "resume",
        "streams",
        "broken",
        "resumed",
        "wrong text",
        "pause p50",
        "pause p99",
        "gap p50",
    )
    print("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            r["fault"], r["resume"], r["streams"], r["broken"], r["resumed"], r["wrong_text"],
            _ms(r["pause_p50_ms"]), _ms(r["pause_p99_ms"]), _ms(r["gap_p50_ms"]),
        )  # fmt: skip
        print("  ".join(f"{c!s:>10}" for c in cells))
    if rolling is None:
        print("rolling restart: left out (--no-rolling, or haproxy missing)")
    else:
        print(
            f"rolling restart of 3 instances behind haproxy ({rolling['restart_s']} s, exit codes "
            f"{rolling['exit_codes']}), {STREAMS} clients:"
        )
        for mode in ("off", "on"):
            r = rolling[mode]
            print(
                f"  resume {mode}: {r['during']} requests during it, {r['failed']} failed {r['first_failures']}"
            )
    print(f"took {took} s")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value} ms"


if __name__ == "__main__":
    sys.exit(main())
