"""The Docker socket proxy (``llmgw agent docker-proxy``) in front of the real dockerd: the docker
runtime runs, adopts and stops a ``sim`` shard through it, and the docker CLI pointed at its
socket cannot start a privileged container, mount /, exec, or touch a container not llmgw's.

Like test_docker_runtime.py (whose ``api`` and ``image`` fixtures these tests use), they skip
without a reachable dockerd, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import asyncio
import grp
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.runtimes.base import ShardRecord
from llmgw.agent.runtimes.containers import LABEL_NODE, LABEL_SHARD
from llmgw.agent.runtimes.docker import DockerRuntime
from tests.ci import unavailable
from tests.integration.docker_engine import (
    NODE,
    WAIT_S,
    gone,
    serve_one_replica,
    sim_launch,
    wait_adopted,
    wait_healthy,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def proxy(api: Any, tmp_path: Path) -> Iterator[Path]:
    """The proxy's socket, served by ``llmgw agent docker-proxy`` in a process of its own."""
    listen = tmp_path / "proxy" / "docker.sock"
    listen.parent.mkdir()
    log = tmp_path / "proxy.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMGW_LOG_STDERR": "1"}
    group = grp.getgrgid(os.getegid()).gr_name
    command = [sys.executable, "-m", "llmgw", "agent", "docker-proxy", "--listen", str(listen)]
    command += ["--log-level", "debug"]  # a line per forwarded call
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command, "--group", group],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + WAIT_S
        while not listen.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the proxy did not listen: {log.read_text()}")
            time.sleep(0.05)
        yield listen
    finally:
        proc.terminate()
        proc.wait(10)
        print(log.read_text())


def docker_cli(listen: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker") is None:
        unavailable("no docker CLI; apt-get install -y docker.io")
    return subprocess.run(
        ["docker", *args],
        env={**os.environ, "DOCKER_HOST": f"unix://{listen}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_docker_runtime_runs_a_shard_through_the_proxy(
    api: Any, image: str, proxy: Path, tmp_path: Path
) -> None:
    launch = sim_launch(tmp_path, image, "s-proxied")

    async def main() -> None:
        runtime = DockerRuntime(base_url=f"unix://{proxy}")
        handle = await runtime.start(launch)
        assert runtime.alive(handle)
        await asyncio.to_thread(wait_healthy, launch.port)
        attrs = api.inspect_container(handle.ref)
        assert attrs["HostConfig"]["PortBindings"] == {
            "8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(launch.port)}]
        }
        assert not attrs["HostConfig"]["Privileged"]
        # Listing and adoption (list + inspect) through the proxy.
        (found,) = await runtime.find_by_labels(NODE)
        assert (found.shard_id, found.container_id, found.running) == (
            "s-proxied",
            handle.ref,
            True,
        )
        other = DockerRuntime(base_url=f"unix://{proxy}")
        record = ShardRecord(shard_id="s-proxied", replica_id="r1", model="sim-model", engine="sim")
        adopted = await other.adopt(record)
        assert adopted is not None and adopted.ref == handle.ref
        other.close()
        # Wait, stop and remove; the followed logs streamed through into the shard's log.
        waiting = asyncio.create_task(runtime.wait(handle))
        await runtime.stop(handle, grace=10)
        assert await asyncio.wait_for(waiting, WAIT_S) == 0
        assert gone(api, str(handle.ref))
        assert "sim engine listening on 0.0.0.0:8000" in launch.log_path.read_text()
        runtime.close()

    asyncio.run(main())


def test_a_multi_node_shard_in_the_host_network_through_the_proxy(
    api: Any, image: str, proxy: Path, tmp_path: Path
) -> None:
    from llmgw.agent.runtimes.containers import launch_for
    from llmgw.agent.shards import ShardSpec, pick_port

    launch = launch_for(
        ShardSpec(
            shard_id="s-proxied-mn",
            replica_id="r-mn",
            model="sim-model",
            engine="sim",
            nodes=2,
            rank=0,
            dist_init_addr=f"127.0.0.1:{pick_port()}",
        ),
        port=pick_port(),
        log_path=tmp_path / "logs" / "mn.log",
        node_id=NODE,
        cluster_id="test-cluster",
        images={"sim": image},
    )

    async def main() -> None:
        runtime = DockerRuntime(base_url=f"unix://{proxy}")
        handle = await runtime.start(launch)
        try:
            host_config = api.inspect_container(handle.ref)["HostConfig"]
            assert host_config["NetworkMode"] == "host"
            # No raw sockets or ports below 1024 on the host's interfaces.
            assert set(host_config["CapDrop"]) >= {"NET_RAW", "NET_BIND_SERVICE"}
        finally:
            await runtime.stop(handle, grace=1)
        assert gone(api, str(handle.ref))

    asyncio.run(main())


def test_the_cli_cannot_reach_the_host_through_the_proxy(api: Any, image: str, proxy: Path) -> None:
    labels = ["--label", f"{LABEL_NODE}={NODE}", "--label", f"{LABEL_SHARD}=s-evil"]
    attempts = {
        "privileged, / mounted": (
            ["run", "--rm", "--privileged", "-v", "/:/h", image, "true"],
            "a container needs llmgw's labels",
        ),
        "labelled, privileged": (
            ["run", "--rm", *labels, "--privileged", image, "true"],
            "HostConfig.Privileged: a privileged container is root on the host",
        ),
        "labelled, / mounted": (
            ["run", "--rm", *labels, "-v", "/:/h", image, "true"],
            "HostConfig.Binds",
        ),
        "labelled, host pid": (
            ["run", "--rm", *labels, "--pid", "host", image, "true"],
            "HostConfig.PidMode",
        ),
        "labelled, published on every address": (
            ["run", "--rm", *labels, "-p", "18999:8000", image, "true"],
            "only 127.0.0.1 is allowed",
        ),
        "labelled, a capability": (
            ["run", "--rm", *labels, "--cap-add", "SYS_ADMIN", image, "true"],
            "HostConfig.CapAdd",
        ),
        "every container listed": (["ps", "-a"], "label filter on llmgw.shard"),
        "a volume": (["volume", "create", "evil"], "is not a call llmgw's docker runtime makes"),
        "swarm": (["swarm", "init"], "is not a call llmgw's docker runtime makes"),
    }
    for what, (args, words) in attempts.items():
        result = docker_cli(proxy, *args)
        assert result.returncode != 0, f"{what}: {result.stdout}"
        assert words in result.stderr, f"{what}: {result.stderr}"
    assert api.containers(all=True, filters={"label": [f"{LABEL_SHARD}=s-evil"]}) == []

    # A container that is not llmgw's: neither inspected, stopped, removed nor copied from.
    other = api.create_container(image, "true", name=f"not-llmgw-{uuid.uuid4().hex[:8]}")["Id"]
    try:
        for args in (
            ["inspect", other],
            ["rm", "-f", other],
            ["stop", other],
            ["logs", other],
            ["cp", f"{other}:/etc/hostname", "-"],
        ):
            result = docker_cli(proxy, *args)
            assert result.returncode != 0, f"{args}: {result.stdout}"
            assert (
                "403" in result.stderr
                or "not llmgw's" in result.stderr
                or ("not a call" in result.stderr)
            ), f"{args}: {result.stderr}"
        assert api.inspect_container(other)["Id"] == other
    finally:
        api.remove_container(other, force=True)

    # An llmgw container exists, but exec into it is refused all the same.
    ours = api.create_container(
        image, "sleep 30", labels={LABEL_NODE: NODE, LABEL_SHARD: "s-exec"}
    )["Id"]
    try:
        api.start(ours)
        result = docker_cli(proxy, "exec", ours, "id")
        assert result.returncode != 0
        assert "is not a call llmgw's docker runtime makes" in result.stderr
        assert docker_cli(proxy, "inspect", ours).returncode == 0  # its own, it may see
    finally:
        api.remove_container(ours, force=True)


def test_an_agent_with_docker_host_serves_through_the_proxy(
    api: Any, image: str, proxy: Path, tmp_path: Path
) -> None:
    """The whole path with agent.yaml's docker.host on the proxy: gateway -> agent -> engine in
    a container the agent created through the proxy, adopted through it after a restart, and
    not one of the agent's calls refused."""
    import signal

    from tests.integration.harness import make_agent, start_agent, start_server, stop_process

    server = start_server(tmp_path)
    node = f"dprox-{uuid.uuid4().hex[:6]}"
    agent = make_agent(
        tmp_path,
        server,
        node,
        extra={
            "runtime": "docker",
            "docker": {"images": {"sim": image}, "host": f"unix://{proxy}"},
            "stop_shards_on_exit": False,
        },
    )
    try:
        serve_one_replica(server, agent)
        (container,) = api.containers(filters={"label": [f"{LABEL_NODE}={node}"]})
        assert agent.proc is not None
        stop_process(agent.proc, signal.SIGKILL)
        agent_restarted = "ts=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        start_agent(agent)
        wait_adopted(server, agent)
        assert [c["Id"] for c in api.containers(filters={"label": [f"{LABEL_NODE}={node}"]})] == [
            container["Id"]
        ]
        proxy_log = (tmp_path / "proxy.log").read_text()
        assert "refused a docker call" not in proxy_log, proxy_log
        # The agent's calls went through the proxy (agent.yaml's docker.host), not docker.sock.
        forwarded = [line for line in proxy_log.splitlines() if "forwarding a docker call" in line]
        for call in ("POST target=/v1.", "/containers/create?name=", "/start", "/logs?"):
            assert any(call in line for line in forwarded), (call, proxy_log)
        # After the restart, the adoption inspected the container through the proxy too.
        adopted = [x for x in forwarded if x > agent_restarted and x.endswith("/json")]
        assert adopted, proxy_log
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)
        for c in api.containers(all=True, filters={"label": [f"{LABEL_NODE}={node}"]}):
            api.remove_container(c["Id"], force=True)
