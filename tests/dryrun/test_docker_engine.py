"""``runtime: docker`` on a Debian 12 node under systemd, for real: the node runs a Docker
engine of its own, the agent is installed from the bundle with ``install-agent.sh install
--docker`` (the hardened unit, reaching dockerd only through llmgw-docker-proxy, never in the
docker group), ``agent.yaml`` says ``runtime: docker``, and a ``sim`` replica runs as a
container in the node's dockerd and serves through the gateway. Code running as the agent user
is refused the daemon's socket, and through the proxy a privileged container and exec into the
engine's; a restart of the agent adopts the container (engines outlive the agent) and it serves
again; a re-run of the install keeps ``runtime: docker``; ``uninstall`` leaves the engine's
container running and the model and cache folders in place (README: "keeps agent.yaml,
identity, models"), says so, and an install on the kept identity adopts the container again;
undeploy removes the container and leaves the engine's output in the shard's log; ``uninstall
--purge`` too leaves a running engine's container and the models, and names the command that
removes the container.

The node's dockerd is nested in the test container (no ``--privileged`` here): the image
``scripts/systemd-test-image.sh --docker`` builds gives it a tmpfs for /var/lib/docker and
remounts the cgroup v1 hierarchies read-write in the container's own mount and cgroup
namespaces before containerd starts. Those two are TEST-IMAGE-ONLY arrangements; everything
llmgw installs and runs on the node is as on a real one. The engine image (the one the docker
runtime's integration tests use) is copied into the node's dockerd with ``docker save | docker
load``, as onto an air-gapped node.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from tests.integration.harness import wait_for

from .lab import Lab, Node, docker_node_image, engine_image, load_image

NODE = "dry-dockerd"
MODEL = "drydocker"
PROXY = "llmgw-docker-proxy.service"
PROXY_SOCKET = "/run/llmgw-docker-proxy/docker.sock"

# About 60 s once the images exist; unless .ci/run made it, the first run on a machine also
# builds the node's image (debootstrap with docker.io, about 100 s).
pytestmark = pytest.mark.timeout(600)


def containers(node: Node, label: str = "llmgw.shard") -> list[dict[str, Any]]:
    """The containers of the node's own dockerd that carry ``label`` (all of llmgw's)."""
    listed = node.out(f"docker ps -a --filter label={label} --format '{{{{json .}}}}'")
    return [json.loads(line) for line in listed.splitlines()]


def engine_of(lab: Lab, node: Node) -> dict[str, Any]:
    """The container of MODEL's shard on the node (the failure says where it went instead)."""
    assert lab.server is not None
    mine = [r for r in lab.server.replicas(MODEL) if r["node"] == NODE]
    found = containers(node, f"llmgw.shard={mine[0]['shard']}") if len(mine) == 1 else []
    assert len(found) == 1, (
        f"{MODEL}'s shard on {NODE}: {mine}; its containers: {found}; all of llmgw's in "
        f"{NODE}'s dockerd: {containers(node)}\nagent:\n{node.journal(lines=60)}"
    )
    return found[0]


def test_a_docker_replica_serves_from_the_installed_hardened_unit(lab: Lab) -> None:
    assert lab.server is not None
    image = engine_image()
    node = lab.boot(docker_node_image(), NODE)
    node.container.wait_for("docker info >/dev/null 2>&1", "the node's dockerd", timeout=60)
    load_image(node, image)

    # 1. install --docker from the bundle, joined with a token, as the one-liner would
    folder = lab.unpack(lab.bundle_n, "docker-engine-unpacked")
    join = lab.join_command(NODE)
    install = (
        f"LLMGW_JOIN_TOKEN={shlex.quote(join['token'])} sh {folder}/install-agent.sh install "
        f"--node-id {NODE} --enroll-url {shlex.quote(join['enroll_url'])} "
        f"--ca-hash {shlex.quote(join['ca_hash'])} --docker"
    )
    installed = node.sh(install)
    assert f"docker: {PROXY} serves {PROXY_SOCKET} to llmgw-agent" in installed.stderr
    assert node.listening(), node.journal()

    # 2. runtime: docker, as an operator sets it (at the top of agent.yaml, above the lines
    # the installer manages), and a restart
    node.sh(
        "f=/etc/llmgw/agent.yaml; { printf 'runtime: docker\\ndocker:\\n  images: {sim: %s}\\n' "
        f"{shlex.quote(image)}; cat $f; }} >/tmp/agent.yaml && cat /tmp/agent.yaml >$f "
        "&& systemctl restart llmgw-agent"
    )
    wait_for(node.listening, what=f"{NODE} listening after the restart", timeout=60)
    lab.approve(NODE)
    # Placement may choose only this node: other modules' nodes are drained meanwhile.
    others = lab.set_aside_others(NODE)
    try:
        serve_restart_undeploy(lab, node, image, install, folder)
        purge_leaves_the_engine_and_the_models(lab, node, folder)
    finally:
        for other in others:
            lab.ctl("uncordon", other)


def serve_restart_undeploy(lab: Lab, node: Node, image: str, install: str, folder: str) -> None:
    assert lab.server is not None
    # 3. the replica: a container of the node's dockerd, serving through the gateway
    lab.deploy(MODEL)
    key = lab.server.api_key("dryrun-docker")
    try:
        lab.wait_routable(MODEL, NODE)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nreplicas: {lab.server.replicas(MODEL)}\n"
            f"agent:\n{node.journal(lines=60)}\nproxy:\n{node.journal(PROXY)}"
        ) from None
    assert lab.complete(MODEL, key)
    shard = engine_of(lab, node)
    assert shard["State"] == "running", shard
    assert shard["Image"] == image
    labels = dict(kv.split("=", 1) for kv in shard["Labels"].split(","))
    assert labels["llmgw.node"] == NODE
    # Published on the node's loopback only (the agent's data plane relays to it).
    assert shard["Ports"].startswith("127.0.0.1:") and "0.0.0.0" not in shard["Ports"], shard

    # 4. it was the hardened unit that started it, and only through the proxy: the agent runs
    # as llmgw-agent, outside the docker group (dockerd's socket is root:docker 0660), with
    # DOCKER_HOST at the proxy's socket.
    assert node.unit("User") == "llmgw-agent"
    assert node.unit("NoNewPrivileges") == "yes"
    assert node.unit("ProtectSystem") == "strict"
    pid = node.unit("MainPID")
    assert node.out(f"ps -o user= -p {pid}") == "llmgw-agent"
    assert "docker" not in node.out("id -nG llmgw-agent").split()
    assert node.out("stat -L -c '%U:%G %a' /var/run/docker.sock") == "root:docker 660"
    assert f"DOCKER_HOST=unix://{PROXY_SOCKET}" in node.unit("Environment")
    assert node.out(f"systemctl is-active {PROXY}") == "active"

    # 5. what code running as llmgw-agent (an engine, a model's code) could try against the
    # real dockerd, refused: the daemon's own socket; through the proxy, a privileged container
    # that mounts / (root on the node), and exec into the engine's container.
    def as_agent(args: str) -> tuple[int, str]:
        done = node.sh(
            "HOME=/tmp setpriv --reuid llmgw-agent --regid llmgw-agent --init-groups "
            f"docker {args}",
            check=False,
        )
        return done.returncode, done.stdout + done.stderr

    before = [c["ID"] for c in containers(node)]
    code, said = as_agent("-H unix:///var/run/docker.sock ps")
    assert code != 0 and "permission denied" in said, said
    code, said = as_agent(
        f"-H unix://{PROXY_SOCKET} run --rm --privileged --label llmgw.shard=evil "
        f"-v /:/host {shlex.quote(image)} chroot /host id"
    )
    assert code != 0 and "container create refused" in said, said
    code, said = as_agent(f"-H unix://{PROXY_SOCKET} exec {shard['ID']} id")
    assert code != 0 and "is not a call llmgw's docker runtime makes" in said, said
    assert [c["ID"] for c in containers(node)] == before

    # 6. engines outlive the agent: a restart adopts the same container, which serves again
    node.sh("systemctl restart llmgw-agent")
    wait_for(node.listening, what=f"{NODE} listening after the restart", timeout=60)
    lab.wait_routable(MODEL, NODE)
    assert lab.complete(MODEL, key)
    after = engine_of(lab, node)
    assert (after["ID"], after["State"]) == (shard["ID"], "running"), (shard, after)
    assert "shards after restart" in node.journal(lines=200)
    shard_started = started_at(node, shard["ID"])
    for kept in MODEL_FILES:
        node.sh(f"echo weights >{kept}")

    # 7. the same install again keeps the operator's runtime lines and restarts nothing
    again = node.sh(install)
    assert "nothing changed; not restarted" in again.stderr, again.stderr
    config = node.out("cat /etc/llmgw/agent.yaml")
    assert "runtime: docker" in config and f"sim: {image}" in config, config

    uninstall_keeps_the_engine_and_an_install_adopts_it(
        lab, node, install, folder, key, after, shard_started
    )

    # 8. undeployed: the container is stopped and removed; what the engine wrote is in the
    # shard's log under the agent's state directory
    lab.ctl("undeploy", MODEL)
    node.container.wait_for(
        f'test -z "$(docker ps -aq --filter id={shard["ID"]})"',
        "the engine's container removed after undeploy",
        timeout=60,
    )
    shard_id = dict(kv.split("=", 1) for kv in after["Labels"].split(","))["llmgw.shard"]
    logs = node.out(f"cat /var/lib/llmgw-agent/logs/{shard_id}.log")
    assert "sim engine listening on 0.0.0.0:8000" in logs, logs[-2000:]


def uninstall_keeps_the_engine_and_an_install_adopts_it(
    lab: Lab,
    node: Node,
    install: str,
    folder: str,
    key: str,
    engine: dict[str, Any],
    engine_started: str,
) -> None:
    # 7b. uninstall: the agent, its units and its proxy go; the engine's container (dockerd's)
    # runs on, named, and the model and cache folders stay
    uninstalled = node.sh(f"sh {folder}/install-agent.sh uninstall")
    assert (
        "uninstall: these Docker engine containers keep running (they are dockerd's, not the "
        f"agent's): {engine['Names']}; an install on this node's identity adopts them"
    ) in uninstalled.stderr, uninstalled.stderr
    # The very container, never restarted.
    assert engine_state(node, engine["ID"]) == ("running", engine_started)
    for kept in MODEL_FILES:
        assert node.out(f"cat {kept}") == "weights", kept
    assert node.sh("systemctl cat llmgw-agent.service", check=False).returncode != 0
    assert node.sh(f"systemctl cat {PROXY}", check=False).returncode != 0
    assert node.out("systemctl is-active docker") == "active"  # Docker itself is not the agent's
    assert not node.listening()

    # 7c. an install on the identity uninstall kept adopts the same container, which serves
    node.sh(install)
    wait_for(node.listening, what=f"{NODE} listening after the reinstall", timeout=60)
    lab.wait_routable(MODEL, NODE)
    assert lab.complete(MODEL, key)
    adopted = engine_of(lab, node)
    assert (adopted["ID"], adopted["State"]) == (engine["ID"], "running"), (engine, adopted)


MODEL_FILES = ("/srv/llmgw/models/keep.bin", "/srv/llmgw/cache/keep.bin")


def started_at(node: Node, container: str) -> str:
    return node.out(f"docker inspect -f '{{{{.State.StartedAt}}}}' {container}")


def engine_state(node: Node, container: str) -> tuple[str, str]:
    """(status, started at) of a container of the node's dockerd."""
    status, started = node.out(
        f"docker inspect -f '{{{{.State.Status}}}} {{{{.State.StartedAt}}}}' {container}"
    ).split()
    return status, started


def purge_leaves_the_engine_and_the_models(lab: Lab, node: Node, folder: str) -> None:
    """9. deployed again, then 'uninstall --purge': the identity, configuration and user go;
    the engine's container runs on (nothing adopts it now: the installer says so and how to
    remove it) and the model and cache folders stay."""
    lab.deploy(MODEL)
    try:
        lab.wait_routable(MODEL, NODE)
        engine = engine_of(lab, node)
        purged = node.sh(f"sh {folder}/install-agent.sh uninstall --purge")
        said = (
            "uninstall: these Docker engine containers keep running, and without this node's "
            f"identity no agent adopts them: {engine['Names']}; remove them: docker rm -f "
            "$(docker ps -aq --filter label=llmgw.shard)"
        )
        assert said in purged.stderr, purged.stderr
        assert engine_state(node, engine["ID"])[0] == "running"
        for kept in MODEL_FILES:
            assert node.out(f"cat {kept}") == "weights", kept
        assert node.sh("test -e /var/lib/llmgw-agent/node.key", check=False).returncode != 0
        assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
        # The command it printed removes exactly llmgw's containers.
        node.sh("docker rm -f $(docker ps -aq --filter label=llmgw.shard)")
        assert containers(node) == []
    finally:
        lab.ctl("undeploy", MODEL)
