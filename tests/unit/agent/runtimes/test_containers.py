"""A shard as a container, without a daemon: the launch the docker runtime creates it with,
and what ``docker inspect`` tells of it back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llmgw.agent.runtimes.containers import (
    CONTAINER_PORT,
    LABEL_CLUSTER,
    LABEL_NODE,
    LABEL_REPLICA,
    LABEL_SHARD,
    ShardContainer,
    container_name,
    launch_for,
)
from llmgw.agent.shards import ShardSpec
from llmgw.errors import ShardError

IMAGES = {"sim": "llmgw-sim:0.1"}


def spec(engine: str = "sim", **params: str) -> ShardSpec:
    return ShardSpec(shard_id="r1-s0", replica_id="r1", model="m-1", engine=engine, params=params)


def test_launch_runs_llmgw_from_the_image_on_every_container_address(tmp_path: Path) -> None:
    launch = launch_for(
        spec(seed="7"),
        port=41234,
        log_path=tmp_path / "r1-s0.log",
        node_id="gpu-07",
        cluster_id="prod",
        images=IMAGES,
        gpus=("GPU-1234", "1"),
    )
    assert launch.argv == (
        "llmgw",
        "engine",
        "sim",
        "--host",
        "0.0.0.0",
        "--port",
        str(CONTAINER_PORT),
        "--model",
        "m-1",
        "--seed",
        "7",
    )
    assert launch.image == "llmgw-sim:0.1"
    assert launch.port == 41234 and launch.container_port == CONTAINER_PORT
    assert launch.gpus == ("GPU-1234", "1")
    assert launch.labels == {
        LABEL_CLUSTER: "prod",
        LABEL_NODE: "gpu-07",
        LABEL_REPLICA: "r1",
        LABEL_SHARD: "r1-s0",
    }
    assert launch.log_path == tmp_path / "r1-s0.log"


def test_launch_without_cluster_or_gpus(tmp_path: Path) -> None:
    launch = launch_for(
        spec(), port=1, log_path=tmp_path / "l", node_id="n", cluster_id="", images=IMAGES
    )
    assert LABEL_CLUSTER not in launch.labels
    assert launch.gpus == ()


def test_env_gpu_mode_names_the_gpus_in_the_environment_instead_of_a_request(
    tmp_path: Path,
) -> None:
    launch = launch_for(
        spec(),
        port=1,
        log_path=tmp_path / "l",
        node_id="n",
        cluster_id="",
        images=IMAGES,
        gpus=("GPU-1234", "GPU-5678"),
        gpu_mode="env",
    )
    assert launch.gpus == ()
    assert launch.env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1234,GPU-5678"


def test_multi_node_shards_run_in_the_host_network_on_the_hosts_port(tmp_path: Path) -> None:
    rank0 = ShardSpec(
        shard_id="r2-s0",
        replica_id="r2",
        model="m-2",
        engine="sim",
        nodes=2,
        rank=0,
        dist_init_addr="10.0.0.5:29500",
        gpus=("GPU-aaaa",),
    )
    launch = launch_for(
        rank0, port=41000, log_path=tmp_path / "l", node_id="n", cluster_id="", images=IMAGES
    )
    assert launch.host_network is True
    # Nothing to publish: the engine itself listens on the host's loopback port.
    assert launch.port == launch.container_port == 41000
    assert launch.argv == (
        "llmgw",
        "engine",
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        "41000",
        "--model",
        "m-2",
        "--nodes",
        "2",
        "--rank",
        "0",
        "--dist-init-addr",
        "10.0.0.5:29500",
    )
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}


def test_llamacpp_worker_in_a_container_binds_its_listen_addr(tmp_path: Path) -> None:
    worker = ShardSpec(
        shard_id="r3-s1",
        replica_id="r3",
        model="big",
        engine="llamacpp",
        nodes=2,
        rank=1,
        dist_init_addr="10.0.0.5:50052",
        listen_addr="10.0.0.6:50052",
    )
    images = {"llamacpp": "llama:1"}
    launch = launch_for(
        worker, port=41001, log_path=tmp_path / "l", node_id="n", cluster_id="", images=images
    )
    assert launch.host_network is True
    # The --host of rpc-server is the node's address, never rewritten.
    assert launch.argv == ("rpc-server", "--host", "10.0.0.6", "--port", "50052")
    # Without its endpoint the shard is refused, starting nothing.
    with pytest.raises(ShardError, match="listen_addr"):
        launch_for(
            replace(worker, listen_addr=""),
            port=41001,
            log_path=tmp_path / "l",
            node_id="n",
            cluster_id="",
            images=images,
        )


def test_engine_without_an_image_says_which_key_to_set(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"no image for engine 'vllm'.*docker\.images\.vllm"):
        launch_for(
            spec("vllm"),
            port=1,
            log_path=tmp_path / "l",
            node_id="n",
            cluster_id="c",
            images=IMAGES,
        )


def test_bad_engine_parameter_is_a_shard_error(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="sim engine has no parameter 'colour'"):
        launch_for(
            spec(colour="red"),
            port=1,
            log_path=tmp_path / "l",
            node_id="n",
            cluster_id="c",
            images=IMAGES,
        )


def test_container_name_is_readable_and_valid() -> None:
    assert container_name("r1-s0", "gpu-07.rack-3") == "llmgw-gpu-07.rack-3-r1-s0"
    assert container_name("r1/s0 x") == "llmgw-r1_s0_x"


def test_shard_container_from_inspect() -> None:
    attrs = {
        "Id": "c" * 64,
        "Name": "/llmgw-n-s1",
        "Config": {
            "Image": "llmgw-sim:0.1",
            "Labels": {
                LABEL_SHARD: "s1",
                LABEL_REPLICA: "r1",
                LABEL_NODE: "n",
                LABEL_CLUSTER: "c",
                "llmgw.log": "/var/lib/llmgw-agent/logs/s1.log",
            },
        },
        "State": {"Running": True, "Pid": 4242, "ExitCode": 0},
        "HostConfig": {
            "PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "41000"}]}
        },
    }
    found = ShardContainer.from_inspect(attrs)
    assert found == ShardContainer(
        container_id="c" * 64,
        name="llmgw-n-s1",
        shard_id="s1",
        replica_id="r1",
        node_id="n",
        cluster_id="c",
        image="llmgw-sim:0.1",
        running=True,
        pid=4242,
        port=41000,
        exit_code=None,
        log_path=Path("/var/lib/llmgw-agent/logs/s1.log"),
    )
    stopped = ShardContainer.from_inspect(
        {**attrs, "State": {"Running": False, "Pid": 0, "ExitCode": 137}}
    )
    assert (stopped.running, stopped.pid, stopped.exit_code) == (False, 0, 137)
