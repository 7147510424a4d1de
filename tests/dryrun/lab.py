"""The dry run's laboratory: a labelled Docker network, a control plane on the host that
containers on it reach (and that reaches their agents' :9443), agent bundles built from the
frozen binaries in dist/ with this tree's installer, and systemd containers on the network.
The control plane is the frozen N+1 build (dist/vN+1), one release ahead of the agents it
first installs (N), as the upgrade order wants: control plane first, then agents.

Nothing on the host is touched but what carries the label ``llmgw.test-dryrun`` (the
network, the containers), the test's temporary directory and the control plane, a child
process of the test. Missing Docker or binaries skip, except under ``CI=true``, where they
fail (``pkgcheck.unavailable``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.ci import require_tools, unavailable
from tests.integration.harness import LLMGW, Server, free_port, stop_process, wait_for
from tests.packaging.pkgcheck import ROOT, Container

LABEL = "llmgw.test-dryrun"
MOUNT = "/lab"  # where a container sees the lab directory (read-only)
SPOOL = "/var/lib/llmgw-agent/update"  # the agent's update spool, the root helper's input
STALE_AFTER_S = 3 * 3600
ONEFILE = ROOT / "dist" / "llmgw-linux-x64"
ONEDIR = ROOT / "dist" / "llmgw-onedir-x64"
# Where serve_repo serves the signed package repository, on a node's loopback.
REPO_URL = "http://127.0.0.1:8000"


def read_version() -> str:
    text = (ROOT / "llmgw" / "__init__.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__ = "):
            return line.split('"')[1]
    raise AssertionError("no __version__ in llmgw/__init__.py")


def next_version(version: str) -> str:
    """N+1: the last numeric part of N, plus one."""
    parts = version.split(".")
    digits = "".join(c for c in parts[-1] if c.isdigit())
    parts[-1] = str(int(digits or "0") + 1)
    return ".".join(parts)


def docker_ready() -> None:
    require_tools("docker")
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        unavailable("dockerd is not reachable; start it: dockerd >/var/log/dockerd.log 2>&1 &")
    remove_stale()


def remove_stale() -> None:
    """Containers and networks of dry runs that were killed (their names carry the time)."""
    for kind in ("ps -a", "network ls"):
        listed = subprocess.run(
            ["docker", *kind.split(), "--filter", f"label={LABEL}", "--format", "{{.Names}}"]
            if kind == "ps -a"
            else ["docker", "network", "ls", "--filter", f"label={LABEL}", "--format", "{{.Name}}"],
            capture_output=True,
            text=True,
            check=False,
        )
        for name in listed.stdout.split():
            parts = name.split("-")
            started = parts[2] if len(parts) > 2 else ""
            if started.isdigit() and int(started) < time.time() - STALE_AFTER_S:
                rm = (
                    ["docker", "rm", "-f", name]
                    if kind == "ps -a"
                    else ["docker", "network", "rm", name]
                )
                subprocess.run(rm, capture_output=True, check=False)


def run(*args: str | Path, timeout: float = 900, **env: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, (
        f"{' '.join(str(a) for a in args)} exited {result.returncode}\n"
        f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    )
    return result


@dataclass
class Node:
    """A systemd container on the lab's network: one node of the fleet."""

    container: Container
    node_id: str
    ip: str

    def sh(
        self, script: str, *, check: bool = True, timeout: float = 270
    ) -> subprocess.CompletedProcess[str]:
        """``script`` as root on the node; past ``timeout`` (below pytest's 300 s, so that the
        failure is this one) it fails, saying what the script had printed and what systemd
        was doing."""
        return self.container.sh(script, check=check, timeout=timeout)

    def out(self, script: str) -> str:
        return self.container.out(script)

    def version(self) -> str:
        return self.out("TMPDIR=/root /usr/local/lib/llmgw-agent/llmgw --version")

    def unit(self, prop: str) -> str:
        return self.out(f"systemctl show -p {prop} --value llmgw-agent.service")

    def listening(self) -> bool:
        return bool(self.sh("ss -ltnH '( sport = :9443 )'", check=False).stdout.strip())

    def journal(self, unit: str = "llmgw-agent.service", lines: int = 40) -> str:
        return self.sh(f"journalctl -u {unit} -n {lines} --no-pager", check=False).stdout

    def unit_findings(self) -> list[str]:
        """What ``systemd-analyze verify`` says of the agent's units as installed here
        (ExecStart rewritten, the drop-in): nothing, when all is well."""
        verified = self.sh(
            "systemd-analyze verify /etc/systemd/system/llmgw-agent.service "
            "/etc/systemd/system/llmgw-agent-update.service "
            "/etc/systemd/system/llmgw-agent-update.path",
            check=False,
        )
        # systemd 247 in a container with a private cgroup namespace says this of its own
        # helper processes, whatever the units: not a finding about them.
        return [
            line
            for line in (verified.stdout + verified.stderr).splitlines()
            if "to compat systemd cgroup" not in line
        ]

    def helper_status(self, *, interval: float) -> dict[str, Any]:
        """Once the root update helper has taken the request spooled in SPOOL (the caller
        spooled it after removing the old status): the status.json it wrote."""
        wait_for(
            lambda: (
                self.sh(
                    f"test -s {SPOOL}/status.json && ! test -e {SPOOL}/request", check=False
                ).returncode
                == 0
            ),
            what="the helper's status.json",
            timeout=120,
            interval=interval,
        )
        return json.loads(self.out(f"cat {SPOOL}/status.json"))  # type: ignore[no-any-return]


class Lab:
    """The network, the control plane, the bundles; nodes are booted on demand."""

    def __init__(self, tmp: Path, *, next_build: Path) -> None:
        self.tmp = tmp
        self.dir = tmp / "lab"  # mounted at MOUNT in every container
        self.dir.mkdir()
        self.network = f"llmgw-dryrun-{int(time.time())}-{uuid.uuid4().hex[:6]}"
        self.nodes: list[Node] = []
        self.server: Server | None = None
        self.gateway = ""
        self.version = read_version()
        # The N+1 build (scripts/dist.sh --version): its binary is the control plane's, its
        # bundle the agents' upgrade.
        self.version_next = next_version(self.version)
        self.server_binary = next_build / "llmgw-linux-x64"
        self.bundle_next = next_build / f"llmgw-agent-{self.version_next}-linux-x64.tar.gz"

    # -- set-up and tear-down -------------------------------------------------------------------

    def start(self) -> None:
        run("docker", "network", "create", "--label", LABEL, self.network)
        inspect = run("docker", "network", "inspect", self.network).stdout
        config = json.loads(inspect)[0]["IPAM"]["Config"][0]
        self.gateway = config["Gateway"]
        self.bundle_dir = self.dir / "bundles"
        self.bundle_dir.mkdir()
        self.bundle_n = self.make_bundle(ONEFILE, self.dir / "n")
        shutil.copy(self.bundle_n, self.bundle_dir / self.bundle_n.name)
        self.server = self.start_server()

    def stop(self) -> None:
        for node in self.nodes:
            node.container.remove()
        if self.server is not None:
            stop_process(self.server.proc)
        subprocess.run(["docker", "network", "rm", self.network], capture_output=True, check=False)

    def start_server(self) -> Server:
        """``llmgw server`` of the N+1 build on every address (the containers reach it
        through the network's gateway, which its certificate names), state under
        tmp/server."""
        state = self.tmp / "server"
        http_port, grpc_port, enroll_port = free_port(), free_port(), free_port()
        self.enroll_port = enroll_port
        cfg = self.tmp / "server.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "state_dir": str(state),
                    "http_listen": f"0.0.0.0:{http_port}",
                    "grpc_listen": f"0.0.0.0:{grpc_port}",
                    "enroll_listen": f"0.0.0.0:{enroll_port}",
                    "advertise": [self.gateway],
                    "bundle_dir": str(self.bundle_dir),
                    "heartbeat_interval": 1.0,
                    "loss_timeout": 60.0,
                    "replica_wait": 10,
                }
            )
        )
        log_path = self.tmp / "server.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [str(self.server_binary), "server", "--config", str(cfg)], stdout=out, stderr=out
            )
        server = Server(state, http_port, grpc_port, proc, log_path)

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                server.api("GET", "/api/nodes")
            except OSError:
                return False
            return True

        wait_for(healthy, what="control plane", timeout=60)
        status = server.api("GET", "/api/status")
        assert status["version"] == self.version_next, status
        return server

    # -- bundles --------------------------------------------------------------------------------

    def make_bundle(self, binary: Path, out: Path, version: str | None = None) -> Path:
        """A bundle of ``binary`` with this tree's installer and units (packaging/bundle.py)."""
        out.mkdir(parents=True, exist_ok=True)
        args: list[str | Path] = [
            sys.executable,
            ROOT / "packaging" / "bundle.py",
            "build",
            "--binary",
            binary,
            "--arch",
            "x64",
            "--out",
            out,
        ]
        if version:
            args += ["--version", version]
        result = run(*args)
        (path,) = [Path(line) for line in result.stdout.split() if line.endswith(".tar.gz")]
        return path

    def unpack(self, bundle: Path, name: str) -> str:
        """Unpack ``bundle`` under the lab directory; its folder as a container sees it."""
        dest = self.dir / name
        dest.mkdir()
        with tarfile.open(bundle) as tar:
            tar.extractall(dest, filter="tar")
        (top,) = list(dest.iterdir())
        return f"{MOUNT}/{name}/{top.name}"

    def package_repo(self) -> str:
        """The signed apt repository of the one-folder build (scripts/packages.sh, then
        scripts/repo.sh with a throwaway key), made once for the package's modules under the
        lab directory; its folder as a container sees it. :meth:`serve_repo` serves it."""
        repo = self.dir / "repo"
        if (repo / "apt" / "InRelease").is_file():
            return f"{MOUNT}/repo"
        require_tools("dpkg-deb", "apt-ftparchive", "gpg")
        if not (ONEDIR / "llmgw").is_file():
            unavailable(f"no {ONEDIR}; build it first: make dist")
        from tests.packaging.pkgcheck import nfpm_path

        packages = self.tmp / "packages"
        # The bundles package with the x64 bundle alone: the lab's nodes are x64, and the
        # arm64 build may still be running (.ci/run).
        run(
            ROOT / "scripts" / "packages.sh",
            "--binary",
            ONEDIR,
            "--out",
            packages,
            "--bundle-archs",
            "x64",
            NFPM=nfpm_path(),
        )
        run(
            ROOT / "scripts" / "repo.sh",
            "--packages",
            packages,
            "--out",
            repo,
            "--url",
            REPO_URL,
            LLMGW_THROWAWAY_KEY=str(self.tmp / "release-key" / "throwaway.asc"),
        )
        return f"{MOUNT}/repo"

    def serve_repo(self, node: Node) -> tuple[str, str]:
        """The repository served on the node's own loopback (REPO_URL, as an operator's
        mirror would be): its URL and its key file there, for 'install-agent.sh package'."""
        folder = self.package_repo()
        if node.sh(f"curl -fsS {REPO_URL}/apt/llmgw.list >/dev/null", check=False).returncode:
            node.sh(
                f"setsid python3 -m http.server --bind 127.0.0.1 --directory {folder} 8000 "
                ">/dev/null 2>&1 < /dev/null &"
            )
            node.container.wait_for(
                f"curl -fsS {REPO_URL}/apt/llmgw.list >/dev/null", "the repository"
            )
        return REPO_URL, f"{folder}/apt/llmgw.gpg"

    # -- the control plane ----------------------------------------------------------------------

    def ctl(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        assert self.server is not None
        return run(
            *LLMGW,
            "ctl",
            *args,
            LLMGW_SERVER=self.server.url,
            LLMGW_TOKEN=self.server.admin_token,
            LLMGW_CTL_CONFIG="/dev/null",
            **env,
        )

    def join_command(self, node_id: str, *, rekey: bool = False) -> dict[str, Any]:
        flag = ["--rekey", node_id] if rekey else ["--node", node_id]
        return json.loads(self.ctl("--json", "join-command", *flag).stdout)  # type: ignore[no-any-return]

    def node_state(self, node_id: str) -> dict[str, Any] | None:
        assert self.server is not None
        for node in self.server.nodes():
            if node["id"] == node_id:
                return node  # type: ignore[no-any-return]
        return None

    def approve(self, node_id: str) -> None:
        node = wait_for(
            lambda: (n := self.node_state(node_id)) and n["connected"] and n,
            what=f"{node_id} connected",
            timeout=60,
        )
        if node["state"] != "approved":
            self.ctl("approve", node_id, "--fingerprint", node["fingerprint"])

    # -- nodes ----------------------------------------------------------------------------------

    def boot(self, image: str, node_id: str) -> Node:
        """A systemd container on the lab's network, its hostname the node id."""
        container = Container.boot(
            image,
            self.dir,
            mount_at=MOUNT,
            prefix="llmgw-dryrun",
            label=LABEL,
            network=self.network,
            hostname=node_id,
        )
        ip = run(
            "docker",
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            container.name,
        ).stdout.strip()
        node = Node(container, node_id, ip)
        self.nodes.append(node)
        return node

    def module_mark(self) -> tuple[int, frozenset[str]]:
        """Where a test module starts: the nodes booted and the models deployed so far (for
        :meth:`end_module`)."""
        models = (
            frozenset(m["name"] for m in self.server.api("GET", "/api/models"))
            if (self.server is not None)
            else frozenset()
        )
        return len(self.nodes), models

    def end_module(self, mark: tuple[int, frozenset[str]]) -> None:
        """A test module is over: the models it deployed are undeployed and the nodes it booted
        removed. Left up, every module's systemd containers (with their agents and engines)
        ran to the end of the package: about fifteen of them, whose inotify instances (one
        budget for every container's root) ran out, and whose load slowed every later step."""
        booted, models = mark
        if self.server is not None:
            for model in self.server.api("GET", "/api/models"):
                if model["name"] not in models:
                    try:
                        self.server.api("DELETE", f"/api/models/{model['name']}")
                    except OSError:
                        pass  # gone meanwhile, or the server is what failed: said elsewhere
        for node in self.nodes[booted:]:
            node.container.remove()
        del self.nodes[booted:]

    def set_aside_others(self, node_id: str) -> list[str]:
        """Drain (without waiting) every other approved, connected node that still takes
        replicas, so that placement can choose only ``node_id``: the lab is shared by the
        package's modules, and one that ran before may have left a node up. Their ids, to
        ``uncordon`` after."""
        assert self.server is not None
        others = [
            n["id"]
            for n in self.server.nodes()
            if n["id"] != node_id
            and n["state"] == "approved"
            and n["connected"]
            and not n["draining"]
        ]
        for other in others:
            self.ctl("drain", other, "--no-wait")
        return others

    def deploy(self, model: str) -> None:
        assert self.server is not None
        self.server.api("POST", "/api/models", {"name": model, "engine": "sim", "replicas": 1})

    def wait_routable(self, model: str, node_id: str, timeout: float = 120) -> None:
        """A routable replica of ``model`` on ``node_id``; a timeout says what the control plane
        saw instead (the model's replicas, the node, the node's and the model's last events),
        so that a slow machine's failure names the step that did not come."""
        assert self.server is not None
        server = self.server
        try:
            wait_for(
                lambda: any(r["node"] == node_id and r["routable"] for r in server.replicas(model)),
                what=f"a routable replica of {model} on {node_id}",
                timeout=timeout,
                interval=0.5,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.placement_report(model, node_id)}") from None

    def placement_report(self, model: str, node_id: str) -> str:
        """What the control plane says of ``model`` and ``node_id``: for a failure message."""
        assert self.server is not None
        lines = []
        for what, path in (
            ("replicas", f"/api/replicas?model={model}"),
            ("nodes", "/api/nodes"),
            (f"last events of {node_id}", f"/api/events?limit=12&subject={node_id}"),
            (f"last events of {model}", f"/api/events?limit=12&subject={model}"),
        ):
            try:
                found = self.server.api("GET", path)
            except OSError as exc:  # the control plane itself may be what is wrong
                lines.append(f"{what}: {path} failed: {exc}")
                continue
            if what == "nodes":
                found = [n for n in found if n.get("id") == node_id]
            lines.append(f"{what}: {json.dumps(found, default=str)}")
        return "\n".join(lines)

    def complete(self, model: str, key: str) -> str:
        """One completion through the gateway, with the official openai client."""
        import openai

        assert self.server is not None
        client = openai.OpenAI(
            base_url=self.server.url + "/v1", api_key=key, max_retries=2, timeout=60
        )
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "say hello"}], max_tokens=8
        )
        text = answer.choices[0].message.content
        assert text, answer
        return text


class OrderedSteps:
    """What a module's steps (tests run in file order, on one node) share, and which one
    failed first: the ``in_order`` fixture (conftest.py) fails the later ones at once, naming
    it. A module subclasses it for what else its steps hand on."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.failed: str | None = None
        self.node: Node | None = None
        self.join: dict[str, Any] = {}


def node_of(steps: OrderedSteps) -> Node:
    """The node an earlier step started."""
    assert steps.node is not None
    return steps.node


# -- a node with a Docker engine of its own (test_docker_engine.py) ---------------------------

DOCKER_NODE_IMAGE_ENV = "LLMGW_TEST_SYSTEMD_DOCKER_IMAGE"
DOCKER_NODE_IMAGE = "llmgw-test-systemd-docker:local"


def systemd_image(env: str, name: str, flag: str) -> str:
    """A variant of the Debian 12 systemd test image (``scripts/systemd-test-image.sh FLAG``):
    the one ``$ENV`` names, else ``name`` built here (debootstrap once)."""
    given = os.environ.get(env)
    if given:
        inspect = ["docker", "image", "inspect", given]
        if subprocess.run(inspect, capture_output=True, check=False).returncode != 0:
            unavailable(f"${env} names {given}, which is not on this machine")
        return given
    build = subprocess.run(
        [str(ROOT / "scripts" / "systemd-test-image.sh"), flag, name],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if build.returncode != 0:
        unavailable(f"could not build {name}: {build.stderr.strip()[-600:]}")
    return name


def docker_node_image() -> str:
    """The Debian 12 systemd image whose node also runs dockerd (nested in the test container;
    ``scripts/systemd-test-image.sh --docker`` says what that takes and why it is test-only)."""
    return systemd_image(DOCKER_NODE_IMAGE_ENV, DOCKER_NODE_IMAGE, "--docker")


CLOUD_INIT_IMAGE_ENV = "LLMGW_TEST_SYSTEMD_CLOUDINIT_IMAGE"
CLOUD_INIT_IMAGE = "llmgw-test-systemd-cloudinit:local"


def cloud_init_image() -> str:
    """The Debian 12 systemd image with cloud-init (NoCloud; ``scripts/systemd-test-image.sh
    --cloud-init`` says how it is set up)."""
    return systemd_image(CLOUD_INIT_IMAGE_ENV, CLOUD_INIT_IMAGE, "--cloud-init")


def engine_image() -> str:
    """The image of the ``sim`` engine for ``runtime: docker`` (llmgw installed in Debian 12),
    the one the docker runtime's integration tests use: ``$LLMGW_TEST_DOCKER_IMAGE`` (.ci/run
    builds it), else built here with ``scripts/docker-test-image.sh``."""
    from tests.integration.docker_engine import DEFAULT_IMAGE, IMAGE_ENV

    name = os.environ.get(IMAGE_ENV)
    if name:
        inspect = ["docker", "image", "inspect", name]
        if subprocess.run(inspect, capture_output=True, check=False).returncode != 0:
            unavailable(f"${IMAGE_ENV} names {name}, which is not on this machine")
        return name
    build = subprocess.run(
        [str(ROOT / "scripts" / "docker-test-image.sh"), DEFAULT_IMAGE],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)},
    )
    if build.returncode != 0:
        unavailable(f"could not build the engine image: {build.stderr.strip()[-600:]}")
    return DEFAULT_IMAGE


def load_image(node: Node, image: str) -> None:
    """Copy ``image`` from the host's dockerd into the node's own (``docker save | docker
    load``; the node has no registry to pull from, like an air-gapped GPU node)."""
    with subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE) as save:
        loaded = subprocess.run(
            ["docker", "exec", "-i", node.container.name, "docker", "load", "-q"],
            stdin=save.stdout,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert save.returncode == 0, f"docker save {image} exited {save.returncode}"
    assert loaded.returncode == 0, f"docker load in {node.node_id} failed: {loaded.stderr}"
