"""The docker runtime without a daemon: what it says when dockerd is not there. The runtime
against a real dockerd: tests/integration/test_docker_runtime.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.agent.runtimes import DockerRuntime, ProcessRuntime, get_runtime
from llmgw.agent.runtimes.base import Handle, Launch
from llmgw.errors import ConfigError, ShardError


def test_get_runtime_by_name() -> None:
    runtime = get_runtime("docker", docker_network="llmgw-engines")
    assert isinstance(runtime, DockerRuntime) and runtime.network == "llmgw-engines"
    proxied = get_runtime("docker", docker_host="unix:///run/llmgw-docker-proxy/docker.sock")
    assert isinstance(proxied, DockerRuntime)
    assert proxied.address == "unix:///run/llmgw-docker-proxy/docker.sock"
    assert isinstance(get_runtime("process"), ProcessRuntime)
    with pytest.raises(ConfigError, match="unknown runtime 'dokcer'; choose one of docker, proc"):
        get_runtime("dokcer")


def test_unreachable_daemon_says_how_to_fix_it(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/no-docker.sock"
    runtime = DockerRuntime(base_url=address)
    launch = Launch(
        shard_id="s1",
        argv=("llmgw", "engine", "sim"),
        port=1,
        log_path=tmp_path / "s1.log",
        image="llmgw-sim:0.1",
    )
    with pytest.raises(ShardError) as info:
        asyncio.run(runtime.start(launch))
    message = str(info.value)
    assert message.startswith(f"cannot reach dockerd at {address} (")
    assert message.endswith(
        "is docker running (systemctl start docker), and may the agent use it? "
        "(install-agent.sh install --docker sets up llmgw-docker-proxy for it)"
    )
    # Through the proxy's socket, the message names the proxy.
    proxied = DockerRuntime(base_url="unix:///run/llmgw-docker-proxy/no-such.sock")
    with pytest.raises(ShardError) as info:
        asyncio.run(proxied.start(launch))
    assert "is the proxy running (systemctl start llmgw-docker-proxy" in str(info.value)
    # Not knowing is not "dead": stop() is tried, and says the same.
    handle = Handle(shard_id="s1", pid=0, port=1, ref="0" * 64, container_id="0" * 64)
    assert runtime.alive(handle) is True
    with pytest.raises(ShardError, match="cannot reach dockerd"):
        asyncio.run(runtime.stop(handle, grace=1))


def test_launch_without_image_is_refused(tmp_path: Path) -> None:
    launch = Launch(shard_id="s1", argv=("x",), port=1, log_path=tmp_path / "s1.log")
    with pytest.raises(ShardError, match="shard s1 has no image"):
        asyncio.run(DockerRuntime(base_url=f"unix://{tmp_path}/none.sock").start(launch))
