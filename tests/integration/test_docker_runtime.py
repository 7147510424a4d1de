"""The docker runtime against a real dockerd and a real ``sim`` engine in a container.

The image is ``$LLMGW_TEST_DOCKER_IMAGE`` (``.ci/run`` builds it), else it is built here with
``scripts/docker-test-image.sh``. Without a reachable dockerd these tests skip, saying why,
except under ``CI=true``, where they fail: CI must run them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.runtimes.base import Handle, Launch, ShardRecord
from llmgw.agent.runtimes.containers import (
    CONTAINER_PORT,
    LABEL_CLUSTER,
    LABEL_NODE,
    LABEL_REPLICA,
    LABEL_SHARD,
    launch_for,
)
from llmgw.agent.runtimes.docker import DockerRuntime
from llmgw.agent.shards import ShardSpec, pick_port
from llmgw.errors import ShardError
from tests.ci import unavailable
from tests.integration.docker_engine import (
    CLUSTER,
    NODE,
    WAIT_S,
    gone,
    health,
    serve_one_replica,
    sim_launch,
    wait_adopted,
    wait_healthy,
)

# The first test may build the image (debootstrap, about 1.5 min) when nothing is cached.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_sim_in_a_container_is_published_on_loopback_only(
    api: Any, image: str, tmp_path: Path
) -> None:
    launch = sim_launch(tmp_path, image, "s-health")

    async def main() -> None:
        runtime = DockerRuntime()
        handle = await runtime.start(launch)
        assert isinstance(handle.ref, str) and handle.container_id == handle.ref
        assert handle.port == launch.port
        attrs = api.inspect_container(handle.ref)
        assert handle.pid == attrs["State"]["Pid"] > 0
        assert runtime.alive(handle)

        await asyncio.to_thread(wait_healthy, launch.port)

        # Published on 127.0.0.1 only: no binding on 0.0.0.0 or any other address.
        expected = [{"HostIp": "127.0.0.1", "HostPort": str(launch.port)}]
        assert attrs["HostConfig"]["PortBindings"] == {f"{CONTAINER_PORT}/tcp": expected}
        assert attrs["NetworkSettings"]["Ports"] == {f"{CONTAINER_PORT}/tcp": expected}
        assert api.port(handle.ref, CONTAINER_PORT) == expected

        labels = attrs["Config"]["Labels"]
        assert labels[LABEL_CLUSTER] == CLUSTER
        assert labels[LABEL_NODE] == NODE
        assert labels[LABEL_REPLICA] == "r1"
        assert labels[LABEL_SHARD] == "s-health"
        assert attrs["HostConfig"]["RestartPolicy"]["Name"] in ("", "no")
        assert attrs["Config"]["Cmd"] == list(launch.argv)
        assert attrs["Config"]["Image"] == image
        assert attrs["Name"] == f"/llmgw-{NODE}-s-health"

        waiting = asyncio.create_task(runtime.wait(handle))
        await runtime.stop(handle, grace=10)
        # The sim ends on SIGTERM by itself, with 0; the container is removed.
        assert await asyncio.wait_for(waiting, WAIT_S) == 0
        assert gone(api, handle.ref)
        assert not runtime.alive(handle)
        assert health(launch.port) is None
        # What the engine wrote is in the shard's log, copied from the container.
        assert "sim engine listening on 0.0.0.0:8000" in launch.log_path.read_text()

    asyncio.run(main())


def test_container_killed_from_outside_reports_137(api: Any, image: str, tmp_path: Path) -> None:
    launch = sim_launch(tmp_path, image, "s-kill")

    async def main() -> None:
        runtime = DockerRuntime()
        handle = await runtime.start(launch)
        try:
            await asyncio.to_thread(wait_healthy, launch.port)
            waiting = asyncio.create_task(runtime.wait(handle))
            await asyncio.sleep(0.2)
            api.kill(handle.ref)  # docker kill: SIGKILL
            assert await asyncio.wait_for(waiting, WAIT_S) == 137
            assert not runtime.alive(handle)
        finally:
            await runtime.stop(handle, grace=1)
        assert gone(api, str(handle.ref))

    asyncio.run(main())


def test_engine_that_fails_leaves_its_output_in_the_log(
    api: Any, image: str, tmp_path: Path
) -> None:
    launch = Launch(
        shard_id="s-fail",
        argv=("python3", "-c", "import sys; print('loading model'); sys.exit('no such model')"),
        port=pick_port(),
        log_path=tmp_path / "s-fail.log",
        image=image,
        labels={LABEL_NODE: NODE},
        container_port=CONTAINER_PORT,
    )

    async def main() -> None:
        runtime = DockerRuntime()
        handle = await runtime.start(launch)
        try:
            assert await asyncio.wait_for(runtime.wait(handle), WAIT_S) == 1
        finally:
            await runtime.stop(handle, grace=1)
        text = launch.log_path.read_text()
        assert "loading model" in text and "no such model" in text

    asyncio.run(main())


def test_adopted_by_label_after_the_runtime_is_gone(api: Any, image: str, tmp_path: Path) -> None:
    launch = sim_launch(tmp_path, image, "s-adopt")

    async def main() -> None:
        first = DockerRuntime()
        handle = await first.start(launch)
        await asyncio.to_thread(wait_healthy, launch.port)
        first.close()
        del first

        # A new agent: a new runtime, knowing only the record (here without the container id).
        runtime = DockerRuntime()
        record = ShardRecord(
            shard_id="s-adopt", replica_id="r1", model="sim-model", engine="sim", port=0
        )
        adopted = await runtime.adopt(record)
        assert adopted is not None
        assert adopted.ref == adopted.container_id == handle.ref
        assert adopted.pid == handle.pid
        assert adopted.port == launch.port  # read from the container's port binding
        assert runtime.alive(adopted)

        # And by the container id the record keeps.
        by_id = await runtime.adopt(
            ShardRecord(
                shard_id="s-adopt",
                replica_id="r1",
                model="sim-model",
                engine="sim",
                port=launch.port,
                container_id=str(handle.ref),
            )
        )
        assert by_id is not None and by_id.ref == handle.ref

        found = await runtime.find_by_labels(NODE)
        assert [(c.shard_id, c.container_id, c.running) for c in found] == [
            ("s-adopt", handle.ref, True)
        ]
        assert found[0].port == launch.port and found[0].log_path == launch.log_path
        assert await runtime.find_by_labels(NODE, cluster_id="other") == []

        # Waiting on an adopted container still gets its exit code.
        waiting = asyncio.create_task(runtime.wait(adopted))
        await runtime.stop(adopted, grace=10)
        assert await asyncio.wait_for(waiting, WAIT_S) == 0

        assert await runtime.adopt(record) is None
        assert await runtime.find_by_labels(NODE) == []

    asyncio.run(main())


def test_exited_container_is_not_adopted_and_a_new_start_replaces_it(
    api: Any, image: str, tmp_path: Path
) -> None:
    launch = sim_launch(tmp_path, image, "s-left")

    async def main() -> None:
        runtime = DockerRuntime()
        handle = await runtime.start(launch)
        api.kill(handle.ref)
        assert await asyncio.wait_for(runtime.wait(handle), WAIT_S) == 137
        # Left behind, exited (as after a crash): not adopted, but listed.
        record = ShardRecord(shard_id="s-left", replica_id="r1", model="sim-model", engine="sim")
        assert await DockerRuntime().adopt(record) is None
        (left,) = await runtime.find_by_labels(NODE)
        assert (left.container_id, left.running, left.exit_code) == (handle.ref, False, 137)

        # Starting the shard again removes the leftover of the same name.
        again = await runtime.start(sim_launch(tmp_path, image, "s-left"))
        try:
            assert again.ref != handle.ref
            assert gone(api, str(handle.ref))
        finally:
            await runtime.stop(again, grace=1)

    asyncio.run(main())


def test_missing_image_says_to_load_it(api: Any, tmp_path: Path) -> None:
    missing = f"llmgw-test-no-such-image:{uuid.uuid4().hex[:8]}"
    launch = sim_launch(tmp_path, missing, "s-noimage")
    with pytest.raises(ShardError) as info:
        asyncio.run(DockerRuntime().start(launch))
    assert str(info.value).startswith(f"image {missing} is not on this node; load or pull it")
    assert "docker images" in str(info.value)
    assert api.containers(all=True, filters={"label": [f"{LABEL_SHARD}=s-noimage"]}) == []


def test_missing_network_says_to_create_it(api: Any, image: str, tmp_path: Path) -> None:
    network = f"llmgw-test-no-net-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ShardError) as info:
        asyncio.run(DockerRuntime(network=network).start(sim_launch(tmp_path, image, "s-nonet")))
    # dockerd 20.10 refuses at start, newer ones at create: either way, nothing is left.
    assert "the container for shard s-nonet: network " in str(info.value)
    assert str(info.value).startswith("dockerd refused to ")
    assert f"not found; create the network (docker network create {network})" in str(info.value)
    assert api.containers(all=True, filters={"label": [f"{LABEL_SHARD}=s-nonet"]}) == []


def test_gpus_become_a_device_request(api: Any, image: str, tmp_path: Path) -> None:
    # Created, not started: this machine has no GPU (starting fails in dockerd with
    # 'could not select device driver').
    runtime = DockerRuntime()
    with_gpus = sim_launch(tmp_path, image, "s-gpu", gpus=("GPU-0b1c", "3"))
    without = sim_launch(tmp_path, image, "s-nogpu")
    created = [asyncio.run(runtime.create(launch)) for launch in (with_gpus, without)]
    try:
        requests = [api.inspect_container(c)["HostConfig"]["DeviceRequests"] for c in created]
        assert requests[0] == [
            {
                "Driver": "",
                "Count": 0,
                "DeviceIDs": ["GPU-0b1c", "3"],
                "Capabilities": [["gpu"]],
                "Options": {},
            }
        ]
        assert not requests[1]
    finally:
        for c in created:
            api.remove_container(c, force=True)


def test_gpu_start_without_a_driver_explains(api: Any, image: str, tmp_path: Path) -> None:
    info = api.info()
    if "nvidia" in json.dumps(info.get("Runtimes", {})):
        unavailable("this dockerd has the NVIDIA runtime: starting would succeed")
    launch = sim_launch(tmp_path, image, "s-gpustart", gpus=("0",))
    with pytest.raises(ShardError) as error:
        asyncio.run(DockerRuntime().start(launch))
    message = str(error.value)
    assert "dockerd refused to start the container for shard s-gpustart" in message
    assert "NVIDIA Container Toolkit" in message
    # Nothing is left behind.
    assert api.containers(all=True, filters={"label": [f"{LABEL_SHARD}=s-gpustart"]}) == []


def test_stop_of_a_container_already_gone_is_quiet(api: Any, image: str, tmp_path: Path) -> None:
    launch = sim_launch(tmp_path, image, "s-gone")

    async def main() -> None:
        runtime = DockerRuntime()
        handle = await runtime.start(launch)
        api.remove_container(handle.ref, force=True)
        await runtime.stop(handle, grace=1)
        assert not runtime.alive(handle)
        stale = Handle(shard_id="x", pid=0, port=1, ref="f" * 64, container_id="f" * 64)
        await runtime.stop(stale, grace=1)

    asyncio.run(main())


def test_agent_with_the_docker_runtime_serves_through_the_gateway(
    api: Any, image: str, tmp_path: Path
) -> None:
    """The whole path: gateway -> agent data plane -> engine in a container, then adoption."""

    from tests.integration.harness import make_agent, start_agent, start_server, stop_process

    server = start_server(tmp_path)
    node = f"dock-{uuid.uuid4().hex[:6]}"
    agent = make_agent(
        tmp_path,
        server,
        node,
        extra={
            "runtime": "docker",
            "docker": {"images": {"sim": image}},
            "stop_shards_on_exit": False,
        },
    )
    try:
        serve_one_replica(server, agent)
        (container,) = api.containers(filters={"label": [f"{LABEL_NODE}={node}"]})
        labels = container["Labels"]
        assert labels["llmgw.shard"] == server.replicas("boxed")[0]["shard"]
        assert labels["llmgw.cluster"] == server.api("GET", "/api/status")["cluster_id"]
        # A new agent adopts the running container instead of starting another one.
        assert agent.proc is not None
        stop_process(agent.proc, signal.SIGKILL)
        start_agent(agent)
        wait_adopted(server, agent)
        assert [c["Id"] for c in api.containers(filters={"label": [f"{LABEL_NODE}={node}"]})] == [
            container["Id"]
        ]
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)
        for c in api.containers(all=True, filters={"label": [f"{LABEL_NODE}={node}"]}):
            api.remove_container(c["Id"], force=True)


def test_multi_node_sim_replica_in_host_network_containers(
    api: Any, image: str, tmp_path: Path
) -> None:
    """Rank 0 and a worker of a two-node sim replica, each in a container in the host's
    network: rank 0 binds the dist-init port on the host and serves nothing until the worker
    joined; killing the worker's container ends rank 0."""
    dist_init = f"127.0.0.1:{pick_port()}"
    launches = [
        launch_for(
            ShardSpec(
                shard_id=f"s-mn{rank}",
                replica_id="r-mn",
                model="sim-model",
                engine="sim",
                nodes=2,
                rank=rank,
                dist_init_addr=dist_init,
            ),
            port=pick_port(),
            log_path=tmp_path / "logs" / f"s-mn{rank}.log",
            node_id=NODE,
            cluster_id=CLUSTER,
            images={"sim": image},
        )
        for rank in (0, 1)
    ]
    rank0_launch, worker_launch = launches

    def logged(path: Path, words: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if path.exists() and words in path.read_text(errors="replace"):
                return
            time.sleep(0.1)
        pytest.fail(f"{path.name} never said {words!r}: {path.read_text(errors='replace')!r}")

    async def main() -> None:
        runtime = DockerRuntime()
        rank0 = await runtime.start(rank0_launch)
        worker: Handle | None = None
        try:
            attrs = api.inspect_container(rank0.ref)
            assert attrs["HostConfig"]["NetworkMode"] == "host"
            assert not attrs["HostConfig"]["PortBindings"]
            await asyncio.to_thread(
                logged, rank0_launch.log_path, f"waiting for 1 worker(s) on {dist_init}"
            )
            assert health(rank0_launch.port) is None  # nothing served before the worker joins

            worker = await runtime.start(worker_launch)
            assert api.inspect_container(worker.ref)["HostConfig"]["NetworkMode"] == "host"
            await asyncio.to_thread(logged, worker_launch.log_path, "joined rank 0 at")
            # The engine itself listens on the host's loopback port the agent chose.
            await asyncio.to_thread(wait_healthy, rank0_launch.port)

            ended = asyncio.create_task(runtime.wait(rank0))
            api.kill(worker.ref)
            code = await asyncio.wait_for(ended, WAIT_S)
            assert code not in (0, None), code
            assert not runtime.alive(rank0)
        finally:
            for handle in (rank0, worker):
                if handle is not None:
                    await runtime.stop(handle, grace=1)

    asyncio.run(main())


def test_two_docker_agents_serve_a_two_node_replica_through_the_gateway(
    api: Any, image: str, tmp_path: Path
) -> None:
    """Two agents with the docker runtime, each on fabric ib-a with its own loopback address:
    a ``nodes: 2`` sim replica comes up in host-network containers and answers the official
    openai client through the gateway."""
    import openai

    from tests.integration.harness import (
        free_port,
        make_agent,
        start_agent,
        start_server,
        stop_process,
    )

    fixtures = ROOT / "tests" / "fixtures"
    server = start_server(tmp_path)
    agents = []
    nodes = [f"dmn{i}-{uuid.uuid4().hex[:6]}" for i in (1, 2)]
    try:
        for i, node in enumerate(nodes):
            host = f"127.0.0.{i + 2}"
            agents.append(
                start_agent(
                    make_agent(
                        tmp_path,
                        server,
                        node,
                        extra={
                            "runtime": "docker",
                            # The fake GPUs cannot be device-requested from this dockerd;
                            # the env mode hands them over as NVIDIA_VISIBLE_DEVICES.
                            "docker": {"images": {"sim": image}, "gpus": "env"},
                            "listen": f"{host}:{free_port()}",
                            "mgmt_addr": host,
                            "discovery": {
                                "nvidia_smi": str(fixtures / "nvidia-smi" / "one-gpu"),
                                "ib_root": str(fixtures / "ib"),
                            },
                            "fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"]}],
                        },
                    )
                )
            )
        deadline = time.monotonic() + WAIT_S
        while sum(n["connected"] for n in server.nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        server.approve_pending(2)
        profile = {"engine": "sim", "gpus": 1, "nodes": 2}
        server.api("PUT", "/api/catalog", {"models": {"wide": {"profiles": {"two": profile}}}})
        server.api("POST", "/api/models", {"name": "wide", "profile": "two", "replicas": 1})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = server.replicas("wide")
            if len(rows) == 2 and all(r["state"] == "ready" for r in rows):
                break
            time.sleep(0.2)
        else:
            logs = "\n".join(a.log()[-2000:] for a in agents)
            raise AssertionError(f"no ready replica: {server.replicas('wide')}\n{logs}")
        assert {r["node"] for r in rows} == set(nodes)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key())
        out = client.completions.create(model="wide", prompt="hi", max_tokens=4)
        assert out.choices[0].text
        for node in nodes:
            (container,) = api.containers(filters={"label": [f"{LABEL_NODE}={node}"]})
            inspected = api.inspect_container(container["Id"])
            assert inspected["HostConfig"]["NetworkMode"] == "host"
            # The shard's GPU (the fixture's one UUID), and no device request.
            assert not inspected["HostConfig"].get("DeviceRequests")
            (visible,) = [
                e for e in inspected["Config"]["Env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")
            ]
            assert visible.split("=", 1)[1].startswith("GPU-")
    finally:
        for agent in agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)
        # Engines outlive a stopped agent (a restarted one adopts them): remove this test's,
        # which once left an exited worker shard behind per run.
        for node in nodes:
            for c in api.containers(all=True, filters={"label": [f"{LABEL_NODE}={node}"]}):
                api.remove_container(c["Id"], force=True)
