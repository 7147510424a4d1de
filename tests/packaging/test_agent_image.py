"""The agent as a container, for real (README "The agent as a container"): the image
scripts/agent-image.sh builds from dist/llmgw-linux-x64 (what `make image` does), run as
packaging/compose/compose.yaml describes it (composefile.py turns a service into its `docker
run`), against a control plane on this host. The node joins from inside its container into
its state volume, an operator approves it, and a ``sim`` replica serves through the gateway
from the engine's bubblewrap sandbox inside the container, everything as uid 17443; `docker
restart` ends the engines with the container and they serve again; without the shipped
seccomp profile the agent refuses the sandbox and says what to give it, and without
``systempaths=unconfined`` the sandbox is weakened and the agent says so. With
``runtime: docker`` the engine is a container of the host's dockerd, reached through the
docker proxy of the compose file's ``docker`` profile, and it outlives a `docker restart` of
the agent's.

The tests run in file order on one module-wide control plane and node: each takes the node
as the one before left it. What the tests change from the compose file: the names of volumes,
host folders (models, cache, agent.yaml under the test's temporary directory), no GPU request
(there is none here), and no ulimits where this machine cannot raise them (a VM whose
bounding set lacks CAP_SYS_RESOURCE, so runc cannot set memlock or nofile above dockerd's).
Nothing on the host is touched but the containers and volumes labelled ``LABEL``, removed
afterwards, the engine containers of this run's node, and the image ``IMAGE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from llmgw.contracts.paths import DEFAULT_AGENT_STATE_DIR
from tests.ci import require_tools, unavailable
from tests.integration.harness import LLMGW, Server, alive, free_port, start_server, wait_for

from .composefile import COMPOSE, Overrides, load, run_argv
from .distcheck import Dist, version
from .pkgcheck import ROOT

IMAGE = "llmgw-test-agent:local"
LABEL = "llmgw.test-agent-image"
AGENT_UID = "17443"
STALE_AFTER_S = 3 * 3600
MODEL = "boxed"
SIZE_LIMIT = 160_000_000  # the image is about 127 MB: the binary (47 MB) on Debian minbase
CAP_SYS_RESOURCE = 24
WAIT_S = 90.0

# A fresh machine also debootstraps the image's rootfs (about 40 s); then about a minute.
pytestmark = pytest.mark.timeout(600)


def docker(*args: str, check: bool = True, timeout: float = 120, **env: str) -> str:
    result = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    return result.stdout


def can_raise_limits() -> bool:
    """Whether runc can set ulimits above dockerd's own (CAP_SYS_RESOURCE in the bounding set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def remove_stale() -> None:
    """Containers and volumes of killed runs (their names carry their start time)."""
    for kind in ("container", "volume"):
        listing = ["ps", "-a"] if kind == "container" else ["volume", "ls"]
        names = docker(
            *listing,
            "--filter",
            f"label={LABEL}",
            "--format",
            "{{.Names}}" if kind == "container" else "{{.Name}}",
            check=False,
        ).split()
        for name in names:
            started = name.split("-")[2] if name.count("-") >= 3 else ""
            if started.isdigit() and int(started) < time.time() - STALE_AFTER_S:
                docker(kind, "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def image(dist_x64: Dist) -> str:
    require_tools("docker")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        unavailable("dockerd is not reachable; start it: dockerd >/var/log/dockerd.log 2>&1 &")
    remove_stale()
    built = subprocess.run(
        [
            str(ROOT / "scripts" / "agent-image.sh"),
            "--tag",
            IMAGE,
            "--binary",
            str(dist_x64.onefile),
        ],
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert built.returncode == 0, f"scripts/agent-image.sh failed:\n{built.stderr[-3000:]}"
    return IMAGE


@dataclass
class Box:
    """The control plane on this host and the containers of one node."""

    server: Server
    tmp: Path
    image: str
    run: str = field(default_factory=lambda: f"{int(time.time())}-{uuid.uuid4().hex[:6]}")
    volumes: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)

    def name(self, what: str) -> str:
        return f"llmgw-ai-{self.run}-{what}"

    def volume(self, what: str) -> str:
        name = self.name(what)
        docker("volume", "create", "--label", f"{LABEL}={self.run}", name)
        self.volumes.append(name)
        return name

    def folder(self, what: str, owner: int = int(AGENT_UID)) -> Path:
        path = self.tmp / what
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, owner, owner)
        return path

    def agent_yaml(self, node: str, **keys: Any) -> Path:
        """The compose folder's example agent.yaml, pointed at this control plane: root's,
        group 17443, 0640, as the README says."""
        cfg = yaml.safe_load((COMPOSE.parent / "agent.yaml").read_text())
        cfg.update(server=f"127.0.0.1:{self.server.grpc_port}", node_id=node)
        cfg.update(listen=f"127.0.0.1:{free_port()}", **keys)
        path = self.tmp / f"{node}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        os.chown(path, 0, int(AGENT_UID))
        path.chmod(0o640)
        return path

    def overrides(self, node: str, config: Path, state: str, **more: Any) -> Overrides:
        models = self.folder("models", owner=0)
        proxy = self.name(f"{node}-proxy")
        if proxy not in self.volumes:
            self.volume(f"{node}-proxy")
        over = Overrides(
            volumes={"state": state, "docker-proxy": proxy},
            binds={
                "./agent.yaml": str(config),
                "/srv/llmgw/models": str(models),
                "/srv/llmgw/cache": str(self.folder("cache")),
            },
            gpus=False,
            ulimits=can_raise_limits(),
            labels={LABEL: self.run},
            **more,
        )
        over.env.setdefault("LLMGW_AGENT_IMAGE", self.image)  # compose's own variable
        return over

    def start(self, service: str, name: str, over: Overrides) -> str:
        docker(*run_argv(service, name=name, overrides=over)[1:])
        self.containers.append(name)
        return name

    def join(self, node: str, over: Overrides) -> str:
        """`docker compose run --rm agent llmgw agent join ...`, the token from the
        environment, never argv."""
        made = self.ctl("--json", "join-command", "--node", node)
        over.command = [
            "llmgw", "agent", "join", "--node-id", node,
            "--enroll-url", made["enroll_url"], "--ca-hash", made["ca_hash"],
        ]  # fmt: skip
        over.environment = {"LLMGW_JOIN_TOKEN": None}
        argv = run_argv("agent", name=self.name(f"{node}-join"), overrides=over, oneoff=True)
        over.command, over.environment = None, {}
        return docker(*argv[1:], LLMGW_JOIN_TOKEN=made["token"])

    def ctl(self, *args: str) -> Any:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(
            LLMGW_SERVER=self.server.url,
            LLMGW_TOKEN=self.server.admin_token,
            XDG_CONFIG_HOME=str(self.tmp / "xdg"),
        )
        out = subprocess.run(
            [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def logs(self, name: str) -> str:
        result = subprocess.run(
            ["docker", "logs", name], capture_output=True, text=True, check=False
        )
        return result.stdout + result.stderr

    def processes(self, name: str) -> list[tuple[int, str, str]]:
        """(host pid, user, command line) of every process in the container."""
        out = docker("top", name, "-eo", "pid,user,args")
        rows = []
        for line in out.splitlines()[1:]:
            pid, user, args = line.split(None, 2)
            rows.append((int(pid), user, args))
        return rows

    def ready(self, model: str, node: str, *, not_port: int | None = None) -> dict[str, Any]:
        """The model's replica on ``node`` once routable (on another port than ``not_port``:
        a new engine; pids inside a container are reused by the next one)."""

        def routable() -> dict[str, Any] | None:
            for row in self.server.replicas(model):
                if row["node"] == node and row["routable"] and row["port"] != not_port:
                    return row
            return None

        try:
            return wait_for(routable, timeout=WAIT_S, interval=0.2, what=f"{model} ready on {node}")  # type: ignore[no-any-return]
        except AssertionError:
            raise AssertionError(
                f"replicas: {self.server.replicas(model)}\nagent:\n"
                + "\n".join(self.logs(c)[-4000:] for c in self.containers[-2:])
            ) from None

    def chat(self, model: str) -> str:
        client = openai.OpenAI(
            base_url=self.server.url + "/v1", api_key=self.server.api_key(), max_retries=2
        )
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        return out.choices[0].message.content or ""

    def remove(self) -> None:
        for name in reversed(self.containers):
            docker("rm", "-f", "-v", name, check=False)
        for node in self.nodes:
            for cid in docker(
                "ps", "-aq", "--filter", f"label=llmgw.node={node}", check=False
            ).split():
                docker("rm", "-f", cid, check=False)
        for name in self.volumes:
            docker("volume", "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def box(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("agent-image")
    tmp.chmod(0o755)  # the container's uid reads agent.yaml and the folders below
    server = start_server(tmp)
    lab = Box(server, tmp, image)
    try:
        yield lab
    finally:
        lab.remove()
        server.proc.terminate()
        server.proc.wait(timeout=30)


@dataclass
class Node:
    id: str
    config: Path
    state: str
    container: str


@pytest.fixture(scope="module")
def node(box: Box) -> Node:
    """A node joined from its container, approved, its agent started as compose says."""
    node_id = "box-1"
    box.nodes.append(node_id)
    config = box.agent_yaml(node_id)
    state = box.volume("state")
    over = box.overrides(node_id, config, state)
    joined = box.join(node_id, over)
    assert (
        f"node {node_id} joined" in joined
        and "key:         /var/lib/llmgw-agent/node.key" in joined
    )
    assert joined.endswith("then start the agent's container: docker compose up -d\n"), joined
    name = box.start("agent", box.name(node_id), over)
    box.server.approve(node_id)
    return Node(node_id, config, state, name)


def test_the_image_is_small_and_has_what_the_agent_needs(image: str, dist_x64: Dist) -> None:
    info = json.loads(docker("image", "inspect", image))[0]
    assert info["Config"]["User"] == f"{AGENT_UID}:{AGENT_UID}"
    assert info["Config"]["Cmd"] == ["llmgw", "agent"] and not info["Config"]["Entrypoint"]
    assert info["Config"]["Labels"]["org.opencontainers.image.version"] == version()
    assert info["Size"] < SIZE_LIMIT, f"{info['Size'] / 1e6:.0f} MB"
    said = docker(
        "run", "--rm", "--network", "none", image, "sh", "-c",
        "llmgw --version; id -un; command -v bwrap; test -s /etc/ssl/certs/ca-certificates.crt"
        " && echo ca; find / -xdev -perm /6000 -type f 2>/dev/null; stat -c '%a %u' /var/lib/llmgw-agent",
    ).split("\n")  # fmt: skip
    assert said[:-1] == [
        f"llmgw {version()}",
        "llmgw-agent",
        "/usr/bin/bwrap",
        "ca",
        f"700 {AGENT_UID}",  # no set-id program, then the state folder a new volume copies
    ], said


def test_a_node_in_a_container_serves_a_sim_replica_from_its_sandbox(box: Box, node: Node) -> None:
    box.server.api("POST", "/api/models", {"name": MODEL, "engine": "sim", "replicas": 1})
    box.ready(MODEL, node.id)
    assert box.chat(MODEL)
    assert json.loads(docker("inspect", node.container))[0]["Config"]["Image"] == box.image
    processes = box.processes(node.container)
    assert {user for _, user, _ in processes} == {AGENT_UID}, processes
    # PID 1 reaps and forwards signals (init: true); the engine runs in bubblewrap with a
    # /proc of its own and no user namespaces of its own making.
    assert processes[0][2].startswith("/sbin/docker-init -- llmgw agent"), processes
    bwrap = [args for _, _, args in processes if args.startswith("/usr/bin/bwrap ")]
    assert bwrap and all("--proc /proc" in a and "--disable-userns" in a for a in bwrap), processes
    assert any("llmgw engine sim" in args for _, _, args in processes), processes
    log = box.logs(node.container)
    assert "engine sandbox weakened" not in log and "level=error" not in log, log[-3000:]
    # The identity went into the state volume, the agent's alone.
    seen = docker(
        "run", "--rm", "-v", f"{node.state}:{DEFAULT_AGENT_STATE_DIR}", "--network", "none",
        box.image, "stat", "-c", "%n %a %u", f"{DEFAULT_AGENT_STATE_DIR}/node.key",
    )  # fmt: skip
    assert seen.split() == [f"{DEFAULT_AGENT_STATE_DIR}/node.key", "600", AGENT_UID]


def test_docker_restart_ends_the_engines_and_they_serve_again(box: Box, node: Node) -> None:
    before = box.ready(MODEL, node.id)
    engines = [pid for pid, _, args in box.processes(node.container) if "llmgw engine sim" in args]
    started = time.monotonic()
    docker("restart", node.container)
    # Well inside the grace period: the agent drained, stopped its engines and exited.
    assert time.monotonic() - started < 45
    assert not any(alive(pid) for pid in engines), "an engine outlived its container"
    log = box.logs(node.container)
    assert "shard stopping" in log, log[-3000:]  # stop_shards_on_exit: the example's
    after = box.ready(MODEL, node.id, not_port=before["port"])
    assert after["replica"] == before["replica"] and box.chat(MODEL)
    # The same identity, no new join: the node is still the approved one.
    assert [n["state"] for n in box.server.nodes() if n["id"] == node.id] == ["approved"]


def test_without_systempaths_the_sandbox_is_weakened_and_the_agent_says_so(
    box: Box, node: Node
) -> None:
    before = box.ready(MODEL, node.id)
    security = load()["services"]["agent"]["security_opt"]
    over = box.overrides(
        node.id, node.config, node.state,
        security_opt=[o for o in security if o != "systempaths=unconfined"],
    )  # fmt: skip
    docker("rm", "-f", node.container)
    box.start("agent", node.container, over)
    box.ready(MODEL, node.id, not_port=before["port"])
    assert box.chat(MODEL)
    log = box.logs(node.container)
    assert "engine sandbox weakened" in log and "systempaths=unconfined" in log, log[-3000:]
    bwrap = [a for _, _, a in box.processes(node.container) if a.startswith("/usr/bin/bwrap ")]
    assert bwrap and all("--ro-bind /proc /proc" in a for a in bwrap), bwrap


def test_dockers_default_profile_refuses_the_sandbox_and_names_the_shipped_one(
    box: Box, node: Node
) -> None:
    security = load()["services"]["agent"]["security_opt"]
    over = box.overrides(
        node.id, node.config, node.state,
        security_opt=[o for o in security if not o.startswith("seccomp=")],
    )  # fmt: skip
    docker("rm", "-f", node.container)
    box.start("agent", node.container, over)

    def refused() -> str | None:
        # Not the first failure, which is the engine the removed container took with it.
        rows = [r for r in box.server.replicas(MODEL) if r["node"] == node.id]
        return next((r["reason"] for r in rows if "namespaces" in r["reason"]), None)

    reason = wait_for(refused, timeout=WAIT_S, interval=0.2, what="the sandbox refused")
    assert "bubblewrap sandbox, which needs unprivileged user namespaces" in reason, reason
    assert "seccomp-agent.json" in reason, reason
    assert not any("llmgw engine" in a for _, _, a in box.processes(node.container))
    docker("rm", "-f", node.container)
    box.server.api("DELETE", f"/api/models/{MODEL}")


def test_docker_engines_through_the_proxy_outlive_the_agents_container(box: Box) -> None:
    node_id = "box-docker"
    box.nodes.append(node_id)
    config = box.agent_yaml(
        node_id,
        runtime="docker",
        docker={"host": "unix:///run/llmgw-docker-proxy/docker.sock", "images": {"sim": box.image}},
        stop_shards_on_exit=False,
    )
    docker_gid = str(os.stat("/var/run/docker.sock").st_gid)
    over = box.overrides(
        node_id, config, box.volume("state-docker"), env={"LLMGW_DOCKER_GID": docker_gid}
    )
    box.start("docker-proxy", box.name(f"{node_id}-proxy"), over)
    box.join(node_id, over)
    agent = box.start("agent", box.name(node_id), over)
    box.server.approve(node_id)
    mounts = json.loads(docker("inspect", agent))[0]["Mounts"]
    assert not any("docker.sock" in m["Source"] for m in mounts), mounts
    model = "boxed-docker"
    box.server.api("POST", "/api/models", {"name": model, "engine": "sim", "replicas": 1})
    before = box.ready(model, node_id)
    assert box.chat(model)
    engines = docker("ps", "-q", "--no-trunc", "--filter", f"label=llmgw.node={node_id}").split()
    assert len(engines) == 1, engines
    docker("restart", agent)
    assert (
        docker("ps", "-q", "--no-trunc", "--filter", f"label=llmgw.node={node_id}").split()
        == engines
    )
    wait_for(lambda: "adopted=1" in box.logs(agent), timeout=WAIT_S, what="the engine adopted")
    after = box.ready(model, node_id)
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]
    assert box.chat(model)
