"""Serving by demand across instances on PostgreSQL: a request that waits at a standby's
gateway is demand the leader's planner sees (through the database), and a leader killed
mid-way hands over its scaling state: the new leader keeps the count, restarts no replica,
does not flap, and continues the scale-down window the first leader started (kept in the
database) rather than starting it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.server.store import Store
from llmgw.server.store.location import parse_location
from tests.integration.ha import cluster, engine_pids, fleet, leader, role, stop_all
from tests.integration.harness import wait_for

pytestmark = pytest.mark.integration


def _ask(url: str, key: str, model: str) -> str:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=90) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["content"])


def test_a_standbys_waiting_request_scales_from_zero_and_a_take_over_keeps_the_count(
    tmp_path: Path, pg_cluster: Any
) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = cluster(tmp_path, pg_cluster, count=2)
        procs.extend(i.server.proc for i in instances)
        agents = fleet(tmp_path, instances, procs)
        first, standby = instances
        first.server.api(
            "POST",
            "/api/models",
            {
                "name": "cold",
                "engine": "sim",
                "replicas": {"min": 0, "max": 1, "scale_down_after": "10m"},
                "params": {"load_s": 1},
            },
        )
        key = standby.server.api_key("demand")
        wait_for(
            lambda: role(standby) == "standby" and _knows(standby.server.url, key, "cold"),
            timeout=30,
            what="the standby knows cold",
        )
        # Through the standby: its gateway waits, its demand reaches the leader's planner.
        assert _ask(standby.server.url, key, "cold")
        events = first.server.api("GET", "/api/events?subject=cold&limit=50")
        up = [e["message"] for e in events if e["kind"] == "scaled_up"]
        assert up and "1 waiting for a replica" in up[0], up
        pids = {a.node_id: engine_pids(a) for a in agents}
        # Served, its demand gone: the leader's planner starts cold's 10m window, in the store.
        started = wait_for(
            lambda: _windows(standby).get("cold"),
            timeout=30,
            interval=0.5,
            what="cold's scale-down window",
        )

        os.kill(first.server.proc.pid, signal.SIGKILL)
        first.server.proc.wait()
        new = wait_for(lambda: leader([standby]), timeout=30, what="the standby leads")

        def cold() -> dict[str, Any]:
            return next(m for m in new.server.api("GET", "/api/models") if m["name"] == "cold")

        # The agents reattach to the new leader; its planner's passes change nothing (no
        # window has run out).
        wait_for(lambda: cold()["ready"] == 1, timeout=60, what="cold ready under the new leader")
        time.sleep(3)
        assert cold()["replicas"] == 1
        assert {a.node_id: engine_pids(a) for a in agents} == pids  # no replica restarted
        events = new.server.api("GET", "/api/events?subject=cold&limit=50")
        assert [e["kind"] for e in events].count("scaled_down") == 0
        assert _windows(new) == {"cold": started}  # continued, not started again
        assert _ask(new.server.url, key, "cold")
    finally:
        stop_all(procs)


def _windows(instance: Any) -> dict[str, float]:
    """The scale-down windows in the instances' database (model -> since, UNIX seconds)."""
    database = yaml.safe_load(instance.config.read_text())["database"]
    location = parse_location(database["url"], password_file=Path(database["password_file"]))
    with Store.open(location) as store:
        return store.scale_down_windows()


def _knows(url: str, key: str, model: str) -> bool:
    """Whether the instance's gateway lists ``model`` (deployed, at zero replicas too)."""
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return model in [m["id"] for m in json.loads(resp.read())["data"]]
    except OSError:
        return False
