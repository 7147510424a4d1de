"""Model sources end to end: two real agents, each listing its own models_root; a model lands
on the one node that has its source, a URL source is fetched into the cache of a node that
may fetch it before the engine starts, and `ctl models` says why a model whose source no
node has is not placed."""

from __future__ import annotations

import hashlib
import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

WEIGHTS = b"GGUF tiny weights for the sim, which reads none of them\n" * 100


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Server, dict[str, Agent]]]:
    server = start_server(tmp_path)
    share = tmp_path / "share"
    share.mkdir()
    (share / "tiny.gguf").write_bytes(WEIGHTS)
    roots = {"a": tmp_path / "models-a", "b": tmp_path / "models-b"}
    (roots["b"] / "org" / "tiny").mkdir(parents=True)
    (roots["b"] / "org" / "tiny" / "config.json").write_text("{}")
    roots["a"].mkdir()
    agents = {}
    for name, root in roots.items():
        extra = {"models_root": str(root), "cache_root": str(tmp_path / f"cache-{name}")}
        if name == "a":  # only a may fetch from the share
            extra["install_sources"] = [f"file://{share}/"]
        agents[name] = start_agent(make_agent(tmp_path, server, name, extra=extra))
    try:
        wait_for(
            lambda: sum(n["connected"] for n in server.nodes()) == 2, what="both agents", timeout=30
        )
        server.approve_pending(2)
        yield server, agents
    finally:
        for agent in agents.values():
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        LLMGW_SERVER=server.url, LLMGW_TOKEN=server.admin_token, XDG_CONFIG_HOME=str(tmp / "xdg")
    )
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_models_land_where_their_source_is_and_ctl_says_why_not(
    fleet: tuple[Server, dict[str, Agent]], tmp_path: Path
) -> None:
    server, _agents = fleet
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(
        textwrap.dedent(
            f"""\
            models:
              here:
                profiles:
                  default: {{engine: sim, source: org/tiny}}
              fetched:
                profiles:
                  default:
                    engine: sim
                    source: {{url: "file://{tmp_path}/share/tiny.gguf", sha256: {sha}}}
              nowhere:
                profiles:
                  default: {{engine: sim, source: org/missing}}
            """
        )
    )
    applied = ctl(server, tmp_path, "models", "apply", "-f", str(catalog))
    assert applied.returncode == 0, applied.stderr
    for model in ("here", "fetched", "nowhere"):
        deployed = ctl(server, tmp_path, "deploy", model, "--replicas", "1")
        assert deployed.returncode == 0, deployed.stderr

    def ready(model: str) -> str | None:
        reps = server.replicas(model)
        return reps[0]["node"] if reps and reps[0]["state"] == "ready" else None

    # Only b has org/tiny under its models_root; only a may fetch from the share.
    assert wait_for(lambda: ready("here"), what="'here' ready", timeout=30) == "b"
    assert wait_for(lambda: ready("fetched"), what="'fetched' ready", timeout=30) == "a"
    assert (tmp_path / "cache-a" / "sources" / sha / "tiny.gguf").read_bytes() == WEIGHTS
    assert not (tmp_path / "cache-b" / "sources").exists()

    why = (
        "no node has source org/missing under models_root; nodes checked: a, b (copy the "
        "weights under a node's models_root, or fix the profile's source)"
    )
    wait_for(
        lambda: any(m["unplaceable"] == why for m in server.api("GET", "/api/models")),
        what="the reason",
        timeout=30,
    )
    listed = ctl(server, tmp_path, "models")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("nowhere "))
    assert row.split(None, 9)[9] == why  # after ROUTING and CACHED
    assert server.replicas("nowhere") == []

    # The weights arrive on a: the next inventory offers them, and the model is placed there.
    (tmp_path / "models-a" / "org" / "missing").mkdir(parents=True)
    (tmp_path / "models-a" / "org" / "missing" / "w.bin").write_bytes(b"w")
    assert wait_for(lambda: ready("nowhere"), what="'nowhere' ready", timeout=60) == "a"
