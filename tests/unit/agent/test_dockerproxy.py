"""The Docker socket proxy: its policy (every refusal, and what the docker runtime sends) and
its relay against a stand-in dockerd on a unix socket."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import docker
import pytest

from llmgw.agent.dockerproxy import policy as pol
from llmgw.agent.dockerproxy.policy import Policy, Refused, check_create, check_list, route
from llmgw.agent.dockerproxy.relay import serve
from llmgw.agent.runtimes import containers
from tests.ci import unavailable

LABELS = {"llmgw.node": "n1", "llmgw.shard": "s1", "llmgw.replica": "r1"}


def runtime_body(**host: Any) -> dict[str, Any]:
    """A create body as the docker SDK builds it for the docker runtime."""
    api = docker.APIClient(version="1.41")
    host_config = api.create_host_config(
        port_bindings={"8000/tcp": ("127.0.0.1", 41000)},
        restart_policy={"Name": "no"},
        device_requests=[docker.types.DeviceRequest(device_ids=["0"], capabilities=[["gpu"]])],
        network_mode=None,
    )
    host_config.update(host)
    return {
        "Image": "llmgw-sim:0.1",
        "Cmd": ["llmgw", "engine", "sim"],
        "Labels": dict(LABELS),
        "Env": ["A=1"],
        "ExposedPorts": {"8000/tcp": {}},
        "HostConfig": host_config,
        "NetworkingConfig": None,
    }


def refused(body: dict[str, Any], policy: Policy | None = None) -> str:
    with pytest.raises(Refused) as info:
        check_create(body, policy or Policy())
    return info.value.message


# ------------------------------------------------------------------------------ routes


def test_labels_agree_with_the_runtime() -> None:
    assert (pol.LABEL_NODE, pol.LABEL_SHARD) == (containers.LABEL_NODE, containers.LABEL_SHARD)


@pytest.mark.parametrize(
    ("method", "target", "kind", "operation"),
    [
        ("GET", "/version", "pass", ""),
        ("HEAD", "/_ping", "pass", ""),
        ("GET", "/v1.41/_ping", "pass", ""),
        ("POST", "/v1.45/containers/create?name=llmgw-n1-s1", "create", ""),
        ("GET", "/v1.41/containers/json?all=1", "list", ""),
        ("GET", "/v1.41/containers/abc123/json", "container", "json"),
        ("GET", "/v1.41/containers/llmgw-n1-s1/logs?follow=1", "container", "logs"),
        ("POST", "/v1.41/containers/abc/start", "container", "start"),
        ("POST", "/v1.41/containers/abc/stop?t=10", "container", "stop"),
        ("POST", "/v1.41/containers/abc/kill", "container", "kill"),
        ("POST", "/v1.41/containers/abc/wait", "container", "wait"),
        ("DELETE", "/v1.41/containers/abc?force=True", "container", "remove"),
    ],
)
def test_the_runtime_s_calls_are_routed(
    method: str, target: str, kind: str, operation: str
) -> None:
    r = route(method, target)
    assert (r.kind, r.operation) == (kind, operation)
    if kind == "container":
        assert r.container in ("abc123", "llmgw-n1-s1", "abc")


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("POST", "/v1.41/containers/abc/exec"),
        ("POST", "/v1.41/exec/abc/start"),
        ("POST", "/v1.41/build"),
        ("POST", "/build?t=x"),
        ("POST", "/v1.41/volumes/create"),
        ("POST", "/v1.41/swarm/init"),
        ("POST", "/v1.41/services/create"),
        ("GET", "/v1.41/containers/abc/archive?path=/etc"),
        ("PUT", "/v1.41/containers/abc/archive?path=/"),
        ("HEAD", "/v1.41/containers/abc/archive"),
        ("POST", "/v1.41/containers/abc/attach"),
        ("GET", "/v1.41/containers/abc/export"),
        ("POST", "/v1.41/containers/abc/update"),
        ("POST", "/v1.41/containers/abc/rename?name=x"),
        ("POST", "/v1.41/containers/abc/restart"),
        ("POST", "/v1.41/containers/abc/pause"),
        ("POST", "/v1.41/containers/prune"),
        ("POST", "/v1.41/images/create?fromImage=alpine"),
        ("POST", "/v1.41/images/load"),
        ("GET", "/v1.41/images/json"),
        ("POST", "/v1.41/networks/create"),
        ("POST", "/v1.41/plugins/pull"),
        ("GET", "/v1.41/info"),
        ("GET", "/v1.41/events"),
        ("POST", "/v1.41/session"),
        ("POST", "/v1.41/containers/abc/../create"),
        ("POST", "/v1.41/containers%2fcreate"),
        ("POST", "/v1.41//containers/create"),
        ("DELETE", "/v1.41/containers/abc/json"),
        ("GET", "/v1.41/containers/abc/top"),
        # Parameters the runtime never sends: a checkpoint restored from a host directory.
        ("POST", "/v1.41/containers/abc/start?checkpoint=c&checkpoint-dir=/etc"),
        ("POST", "/v1.41/containers/create?name=x&hostconfig=y"),
        ("GET", "/version?x=1"),
    ],
)
def test_everything_else_is_refused(method: str, target: str) -> None:
    with pytest.raises(Refused) as info:
        route(method, target)
    assert target.split("?")[0] in info.value.message


LABEL_FILTER = quote(json.dumps({"label": ["llmgw.shard"]}, separators=(",", ":")))


def test_container_list_needs_llmgw_s_label_filter() -> None:
    ok = json.dumps({"label": ["llmgw.node=n1", "llmgw.shard"]})
    check_list(f"/v1.41/containers/json?all=1&filters={ok}")
    check_list("/containers/json?filters=" + json.dumps({"label": ["llmgw.shard=s1"]}))
    check_list("/containers/json?filters=" + json.dumps({"label": {"llmgw.shard": True}}))
    for target in (
        "/v1.41/containers/json?all=1",
        "/containers/json?filters=" + json.dumps({"label": ["llmgw.node=n1"]}),
        "/containers/json?filters=" + json.dumps({"label": ["llmgw.shardx"]}),
        "/containers/json?filters=not-json",
        # dockerd reads only the first of two: the label filter must not hide in the second.
        "/containers/json?filters="
        + json.dumps({"status": ["running"]})
        + "&filters="
        + json.dumps({"label": ["llmgw.shard"]}),
        # A blank first one: parse_qs dropped it and read the second, dockerd reads the blank.
        "/containers/json?filters=&filters=" + json.dumps({"label": ["llmgw.shard"]}),
    ):
        with pytest.raises(Refused, match=r"label filter on llmgw\.shard"):
            check_list(target)


@pytest.mark.parametrize(
    "target",
    [
        "/v1.41/containers/json?filters=&filters=" + LABEL_FILTER,
        "/v1.41/containers/json?all=1&all=0&filters=" + LABEL_FILTER,
        "/v1.41/containers/json?filters=" + LABEL_FILTER + "&filters",
        "/v1.41/containers/abc/logs?stdout=1&stdout=0",
    ],
)
def test_a_repeated_parameter_is_refused(target: str) -> None:
    with pytest.raises(Refused, match=r"given more than once; give each once"):
        route("GET", target)


def test_a_semicolon_in_the_query_is_refused() -> None:
    with pytest.raises(Refused, match="a ';' in the query is refused"):
        route("GET", "/v1.41/containers/json?filters=" + LABEL_FILTER + ";all=1")


# ------------------------------------------------------------------------------ create


def test_what_the_runtime_creates_is_accepted() -> None:
    check_create(runtime_body(), Policy())
    # Multi-node: the host's network, nothing published, no raw sockets or low ports.
    check_create(
        runtime_body(
            NetworkMode="host",
            PortBindings=None,
            DeviceRequests=None,
            CapDrop=["NET_RAW", "NET_BIND_SERVICE"],
        ),
        Policy(),
    )
    # A bridge network of the operator's, with its endpoint.
    body = runtime_body(NetworkMode="llmgw")
    body["NetworkingConfig"] = {"EndpointsConfig": {"llmgw": {}}}
    check_create(body, Policy())


def test_the_docker_cli_s_zero_values_are_accepted() -> None:
    # `docker create` sends every HostConfig key, most of them empty.
    host = {
        "Binds": None, "ContainerIDFile": "", "LogConfig": {"Type": "", "Config": {}},
        "NetworkMode": "default", "PortBindings": {}, "RestartPolicy": {"Name": "no"},
        "AutoRemove": False, "VolumeDriver": "", "VolumesFrom": None, "CapAdd": None,
        "CapDrop": None, "CgroupnsMode": "", "Dns": [], "DnsOptions": [], "DnsSearch": [],
        "ExtraHosts": None, "GroupAdd": None, "IpcMode": "", "Cgroup": "", "Links": None,
        "OomScoreAdj": 0, "PidMode": "", "Privileged": False, "PublishAllPorts": False,
        "ReadonlyRootfs": False, "SecurityOpt": None, "UTSMode": "", "UsernsMode": "",
        "ShmSize": 0, "Isolation": "", "CpuShares": 0, "Memory": 0, "CgroupParent": "",
        "Devices": [], "DeviceCgroupRules": None, "DeviceRequests": None, "Mounts": None,
        "Ulimits": None, "MaskedPaths": None, "ReadonlyPaths": None, "Init": None,
        "ConsoleSize": [0, 0],
    }  # fmt: skip
    check_create({"Image": "x", "Labels": LABELS, "HostConfig": host}, Policy())


@pytest.mark.parametrize(
    ("host", "words"),
    [
        ({"Privileged": True}, "Privileged: a privileged container is root on the host"),
        ({"CapAdd": ["SYS_ADMIN"]}, "CapAdd"),
        ({"Devices": [{"PathOnHost": "/dev/sda"}]}, "Devices"),
        ({"DeviceCgroupRules": ["b 8:* rmw"]}, "DeviceCgroupRules"),
        ({"DeviceRequests": [{"Capabilities": [["tpu"]]}]}, "only GPUs"),
        ({"DeviceRequests": [{"Capabilities": []}]}, "only GPUs"),
        ({"DeviceRequests": [{"Capabilities": [["gpu"]], "Driver": "cdi"}]}, "driver"),
        ({"DeviceRequests": [{"Capabilities": [["gpu"]], "Options": {"x": "y"}}]}, "options"),
        ({"PidMode": "host"}, "PidMode"),
        ({"PidMode": "container:abc"}, "PidMode"),
        ({"IpcMode": "host"}, "IpcMode"),
        ({"UTSMode": "host"}, "UTSMode"),
        ({"UsernsMode": "host"}, "UsernsMode"),
        ({"CgroupnsMode": "host"}, "CgroupnsMode"),
        ({"NetworkMode": "container:abc"}, "another container's"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "1"}]}}, "0.0.0.0"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "", "HostPort": "1"}]}}, "every address"),
        ({"PortBindings": {"8000/tcp": [{"HostPort": "1"}]}}, "only 127.0.0.1"),
        ({"PublishAllPorts": True}, "PublishAllPorts"),
        ({"Binds": ["/:/h"]}, "bind mounts are not allowed on this node"),
        ({"Mounts": [{"Type": "bind", "Source": "/", "Target": "/h"}]}, "Mounts"),
        ({"VolumesFrom": ["other"]}, "VolumesFrom"),
        ({"VolumeDriver": "local"}, "VolumeDriver"),
        ({"Links": ["other:o"]}, "Links"),
        ({"SecurityOpt": ["seccomp=unconfined"]}, "seccomp=unconfined"),
        ({"SecurityOpt": ["apparmor=unconfined"]}, "apparmor"),
        ({"SecurityOpt": ["label=disable"]}, "label=disable"),
        ({"SecurityOpt": "seccomp=unconfined"}, "must be a list"),
        ({"Sysctls": {"kernel.core_pattern": "|/x"}}, "Sysctls"),
        ({"CgroupParent": "/system.slice"}, "CgroupParent"),
        ({"Runtime": "kata"}, "Runtime"),
        ({"LogConfig": {"Type": "syslog", "Config": {}}}, "log driver"),
        ({"MaskedPaths": []}, "MaskedPaths"),
        ({"ReadonlyPaths": []}, "ReadonlyPaths"),
        ({"OomScoreAdj": -1000}, "OomScoreAdj"),
        ({"GroupAdd": ["disk"]}, "GroupAdd"),
        ({"RestartPolicy": {"Name": "always"}}, "RestartPolicy"),
        ({"Annotations": {"io.x": "y"}}, "Annotations"),
        ({"SomethingNew": {"x": 1}}, "SomethingNew is not allowed"),
        ({"NetworkMode": "host"}, "'host' goes without published ports"),
        ({"NetworkMode": "host", "PortBindings": None}, "'host' needs CapDrop"),
        (
            {"NetworkMode": "host", "PortBindings": None, "CapDrop": ["NET_RAW"]},
            "'host' needs CapDrop",
        ),
        ({"NetworkMode": "ab12"}, "could be a network id"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "80"}]}}, "1024"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}}, "(any)"),
    ],
)
def test_host_config_refusals(host: dict[str, Any], words: str) -> None:
    message = refused(runtime_body(**host))
    assert message.startswith("container create refused: HostConfig.")
    assert words in message


def test_host_network_can_be_refused_on_a_node() -> None:
    body = runtime_body(NetworkMode="host", PortBindings=None, CapDrop=["ALL"])
    check_create(body, Policy())
    assert "--no-host-network" in refused(body, Policy(host_network=False))
    body = runtime_body()
    body["NetworkingConfig"] = {"EndpointsConfig": {"host": {}}}
    assert "EndpointsConfig" in refused({**body, "HostConfig": {}}, Policy(host_network=False))


def test_containers_without_llmgw_s_labels_are_refused() -> None:
    for labels in ({}, {"llmgw.node": "n1"}, {"llmgw.shard": "s1"}, {"llmgw.shard": ""}, None):
        body = {**runtime_body(), "Labels": labels}
        assert "needs llmgw's labels" in refused(body)
    assert "not a JSON object" in refused([])  # type: ignore[arg-type]
    assert "HostConfig is not a JSON object" in refused({**runtime_body(), "HostConfig": [1]})


@pytest.mark.parametrize(
    "host",
    [
        {"Runtime": ["runc"]},
        {"IpcMode": {"host": 1}},
        {"CgroupnsMode": ["host"]},
        {"DeviceRequests": [{"Capabilities": [["gpu", ["x"]]]}]},
    ],
)
def test_values_of_the_wrong_type_are_refused_not_a_crash(host: dict[str, Any]) -> None:
    # An unhashable value in a set lookup raised TypeError: a traceback, not a 403.
    assert "HostConfig." in refused({"Image": "x", "Labels": LABELS, "HostConfig": host})


def test_unknown_top_level_keys_are_refused() -> None:
    assert "Foo is not allowed" in refused({**runtime_body(), "Foo": "bar"})


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # dockerd reads JSON keys case-insensitively, the last spelling winning.
        ({"hostconfig": {"Privileged": True}}, "hostconfig is not allowed"),
        ({"Hostconfig": None}, "Hostconfig is not allowed"),
        ({"HostConfig": {"readonlypaths": []}}, "HostConfig.readonlypaths is not allowed"),
        ({"HostConfig": {"privileged": False}}, "HostConfig.privileged is not allowed"),
        (
            {"HostConfig": {"PortBindings": {"8000/tcp": [
                {"HostIp": "127.0.0.1", "HostPort": "41000", "hostip": "0.0.0.0"}
            ]}}},
            "HostConfig.PortBindings.hostip is not allowed",
        ),
        (
            {"HostConfig": {"DeviceRequests": [{"Capabilities": [["gpu"]], "driver": "cdi"}]}},
            "HostConfig.DeviceRequests.driver is not allowed",
        ),
        ({"HostConfig": {"RestartPolicy": {"Name": "no", "name": "always"}}}, "RestartPolicy.name"),
        ({"HostConfig": {"LogConfig": {"Type": "", "type": "syslog"}}}, "LogConfig.type"),
        ({"NetworkingConfig": {"endpointsconfig": {"host": {}}}}, "NetworkingConfig.endpointsconfig"),
    ],
)  # fmt: skip
def test_other_spellings_of_checked_keys_are_refused(change: dict[str, Any], words: str) -> None:
    body = {"Image": "x", "Labels": LABELS, **change}
    assert words in refused(body)


# ------------------------------------------------------------------------------ binds


def test_bind_checks(tmp_path: Path) -> None:
    # A root-owned tree (the tests run as root) and an agent-like, writable one below it.
    if os.geteuid() != 0:
        unavailable("the bind checks compare owners with root's: run the tests as root")
    root = tmp_path / "models"
    (root / "llama").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    writable = root / "shared"
    writable.mkdir()
    writable.chmod(0o777)
    (writable / "inner").mkdir()
    (root / "link").symlink_to("/")
    roots = (root,)
    # tmp_path's parents are root's (pytest's are 0700; /tmp is sticky).
    assert pol.bind_problem(f"{root}:/m:ro", roots) is None
    assert pol.bind_problem(f"{root / 'llama'}:/m:ro", roots) is None
    assert pol.bind_problem(f"{writable}:/m:ro", roots) is None  # the directory itself
    assert "can be changed by another user" in str(
        pol.bind_problem(f"{writable / 'inner'}:/m:ro", roots)
    )
    assert "symbolic link" in str(pol.bind_problem(f"{root / 'link'}:/m:ro", roots))
    assert "read-only" in str(pol.bind_problem(f"{root / 'llama'}:/m", roots))
    assert "read-only" in str(pol.bind_problem(f"{root / 'llama'}:/m:rw", roots))
    assert "no 'rw'" in str(pol.bind_problem(f"{root / 'llama'}:/m:ro,rw", roots))
    assert "not under" in str(pol.bind_problem("/etc:/m:ro", roots))
    assert "not under" in str(pol.bind_problem("/:/h:ro", roots))
    assert "normalised" in str(pol.bind_problem(f"{root}/../../etc:/m:ro", roots))
    assert "named volumes" in str(pol.bind_problem("vol:/m:ro", roots))
    assert "no --bind-root" in str(pol.bind_problem(f"{root}:/m:ro", ()))
    assert "cannot check" in str(pol.bind_problem(f"{root / 'missing'}:/m:ro", roots))
    # A sticky, world-writable directory: root's entries in it are safe, others' are not.
    sticky = root / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "mine").mkdir()
    (sticky / "theirs").mkdir()
    os.chown(sticky / "theirs", 65534, 65534)
    (sticky / "theirs" / "x").mkdir()
    os.chown(sticky / "theirs" / "x", 0, 0)
    assert pol.bind_problem(f"{sticky / 'mine'}:/m:ro", (sticky,)) is None
    assert "changed by another user" in str(
        pol.bind_problem(f"{sticky / 'theirs'}:/m:ro", (sticky,))
    )
    assert "changed by another user" in str(
        pol.bind_problem(f"{sticky / 'theirs' / 'x'}:/m:ro", (sticky,))
    )
    # Through check_create, with the policy's roots.
    check_create(runtime_body(Binds=[f"{root / 'llama'}:/models:ro"]), Policy(bind_roots=roots))
    message = refused(runtime_body(Binds=["/:/h:ro"]), Policy(bind_roots=roots))
    assert "HostConfig.Binds" in message and "not under" in message


# ------------------------------------------------------------------------------ the relay


class StandInDockerd:
    """A unix-socket HTTP server answering as dockerd would, recording what it was asked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[str, str, bytes]] = []
        self.garbled = False  # answer with a chunk size that is not hex
        self.containers = {
            "a" * 64: {"Id": "a" * 64, "Config": {"Labels": LABELS}},
            "b" * 64: {"Id": "b" * 64, "Config": {"Labels": {"other": "x"}}},
        }
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, target, _ = lines[0].split(" ")
            length = next(
                (int(v) for k, v in (x.split(": ", 1) for x in lines[1:]) if k == "Content-Length"),
                0,
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.seen.append((method, target, body))
            if self.garbled:
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                return
            path = target.split("?")[0]
            ref = path.split("/")[3] if path.count("/") >= 3 else ""
            found = next((c for i, c in self.containers.items() if i.startswith(ref)), None)
            if path.endswith("/logs"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for word in (b"one\n", b"two\n"):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(word), word))
                conn.sendall(b"0\r\n\r\n")
                return
            if (
                path.endswith("/json")
                and "/containers/" in path
                and path != "/v1.41/containers/json"
            ):
                if found is None:
                    answer, status = {"message": f"No such container: {ref}"}, 404
                else:  # dockerd sends an inspect chunked
                    payload = json.dumps(found).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for part in (payload[:10], payload[10:]):
                        conn.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                    conn.sendall(b"0\r\n\r\n")
                    return
            elif path == "/version":
                answer, status = {"ApiVersion": "1.41", "Version": "stand-in"}, 200
            elif path.endswith("/containers/create"):
                answer, status = {"Id": "c" * 64, "Warnings": []}, 201
            else:
                answer, status = {"ok": True}, 200
            payload = json.dumps(answer).encode()
            conn.sendall(
                b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (status, len(payload), payload)
            )

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[Path, StandInDockerd]]:
    dockerd = StandInDockerd(tmp_path / "dockerd.sock")
    listen = tmp_path / "proxy.sock"
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()

    def run() -> None:
        loop.run_until_complete(
            serve(listen, dockerd.path, Policy(), group=None, on_ready=ready.set, stop=stop)
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield listen, dockerd
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        dockerd.close()


def ask(listen: Path, raw: bytes) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(listen))
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def get(target: str, method: str = "GET", body: bytes = b"") -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_relay_socket_mode_and_refusals(proxied: tuple[Path, StandInDockerd]) -> None:
    listen, dockerd = proxied
    assert oct(listen.stat().st_mode & 0o777) == "0o660"
    status, body = ask(listen, get("/v1.41/containers/abc/exec", "POST"))
    assert status == 403
    assert "not a call llmgw's docker runtime makes" in json.loads(body)["message"]
    privileged = json.dumps(runtime_body(Privileged=True)).encode()
    status, body = ask(listen, get("/v1.41/containers/create", "POST", privileged))
    assert status == 403 and "Privileged" in json.loads(body)["message"]
    assert dockerd.seen == []  # nothing refused reached dockerd


def test_relay_refuses_a_blank_filters_before_the_label_filter(
    proxied: tuple[Path, StandInDockerd],
) -> None:
    """?filters=&filters={label}: the check read the label filter (parse_qs dropped the
    blank), dockerd reads the blank one and lists every container on the host."""
    listen, dockerd = proxied
    status, body = ask(listen, get("/v1.41/containers/json?filters=&filters=" + LABEL_FILTER))
    assert status == 403
    assert "filters are given more than once" in json.loads(body)["message"]
    assert dockerd.seen == []
    status, _ = ask(listen, get("/v1.41/containers/json?all=1&filters=" + LABEL_FILTER))
    assert status == 200 and len(dockerd.seen) == 1  # the runtime's own list goes through


def test_relay_refuses_a_key_twice_in_one_object(proxied: tuple[Path, StandInDockerd]) -> None:
    # Python keeps the last "HostConfig" ({}), Go's encoding/json merges the second into the
    # first: dockerd would create a privileged container with the host's / bound.
    listen, dockerd = proxied
    body = json.dumps(runtime_body())[:-1].encode()
    body += b', "HostConfig": {"Privileged": true, "Binds": ["/:/host"]}, "HostConfig": {}}'
    assert isinstance(json.loads(body), dict)  # what the proxy read before: it passed
    status, answer = ask(listen, get("/v1.41/containers/create", "POST", body))
    assert status == 403 and "appears twice" in json.loads(answer)["message"]
    nested = (
        json.dumps(runtime_body(Privileged=False))
        .encode()
        .replace(b'"Privileged": false', b'"Privileged": true, "privileged": false')
    )
    assert b'"privileged": false' in nested
    status, answer = ask(listen, get("/v1.41/containers/create", "POST", nested))
    assert status == 403 and "appears twice" in json.loads(answer)["message"]
    assert dockerd.seen == []


def test_relay_refuses_a_bare_lf_in_a_header(proxied: tuple[Path, StandInDockerd]) -> None:
    # Go reads "X-A: 1" and "Transfer-Encoding: chunked" as two headers; the proxy saw one.
    listen, dockerd = proxied
    raw = (
        b"GET /v1.41/version HTTP/1.1\r\nHost: docker\r\n"
        b"X-A: 1\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    assert ask(listen, raw)[0] == 400
    assert dockerd.seen == []


def test_relay_checks_the_label_and_names_the_full_id(
    proxied: tuple[Path, StandInDockerd],
) -> None:
    listen, dockerd = proxied
    # Not llmgw's: inspected, then refused; the stop never reaches dockerd.
    status, body = ask(listen, get("/v1.41/containers/bbbb/stop", "POST"))
    assert status == 403 and "is not llmgw's" in json.loads(body)["message"]
    assert [(m, t) for m, t, _ in dockerd.seen] == [("GET", "/v1.41/containers/bbbb/json")]
    dockerd.seen.clear()
    # llmgw's, by a prefix: sent on by its full id, the query kept.
    status, _ = ask(listen, get("/v1.41/containers/aaaa/stop?t=3", "POST"))
    assert status == 200
    assert [(m, t) for m, t, _ in dockerd.seen] == [
        ("GET", "/v1.41/containers/aaaa/json"),
        ("POST", f"/v1.41/containers/{'a' * 64}/stop?t=3"),
    ]
    # A container dockerd does not know: its 404 passes through (the SDK's NotFound).
    status, body = ask(listen, get("/v1.41/containers/cccc/json"))
    assert status == 404 and "No such container" in json.loads(body)["message"]
    # A body where none belongs.
    status, body = ask(listen, get(f"/v1.41/containers/{'a' * 64}/start", "POST", b"{}"))
    assert status == 403 and "takes no body" in json.loads(body)["message"]


def test_relay_streams_chunked_logs(proxied: tuple[Path, StandInDockerd]) -> None:
    listen, _ = proxied
    status, body = ask(listen, get("/v1.41/containers/aaaa/logs?follow=1"))
    assert status == 200
    assert body == b"4\r\none\n\r\n4\r\ntwo\n\r\n0\r\n\r\n"


def test_relay_answers_bad_requests_400(proxied: tuple[Path, StandInDockerd]) -> None:
    listen, dockerd = proxied
    smuggled = (
        b"POST /v1.41/containers/create HTTP/1.1\r\nHost: d\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    assert ask(listen, smuggled)[0] == 400
    assert ask(listen, b"GARBAGE\r\n\r\n")[0] == 400
    assert dockerd.seen == []


def test_relay_keeps_the_connection_for_the_sdk(proxied: tuple[Path, StandInDockerd]) -> None:
    listen, dockerd = proxied
    client = docker.APIClient(base_url=f"unix://{listen}", version="1.41")
    try:
        assert client.version(api_version=False)["ApiVersion"] == "1.41"
        with pytest.raises(docker.errors.APIError) as info:
            client.create_container("img", labels={"x": "y"})
        assert info.value.status_code == 403
        assert "needs llmgw's labels" in str(info.value.explanation)
        created = client.create_container(
            "img", labels=LABELS, host_config=client.create_host_config(privileged=False)
        )
        assert created["Id"] == "c" * 64
        with pytest.raises(docker.errors.NotFound):
            client.inspect_container("cccc")
    finally:
        client.close()
    creates = [json.loads(b) for m, t, b in dockerd.seen if t.endswith("/containers/create")]
    assert [c["Labels"] for c in creates] == [LABELS]


def test_the_runtime_s_own_creates_pass_the_proxy(
    proxied: tuple[Path, StandInDockerd], tmp_path: Path
) -> None:
    """What DockerRuntime really sends (single-node, GPUs, a network, multi-node in the host's
    network) is what the proxy accepts: a change to either that parts them fails here."""
    from llmgw.agent.runtimes.base import Launch
    from llmgw.agent.runtimes.docker import DockerRuntime

    listen, dockerd = proxied
    common = {"argv": ("llmgw", "engine", "sim"), "log_path": tmp_path / "x.log", "image": "i"}
    launches = [
        Launch(shard_id="s1", port=41001, labels={"llmgw.node": "n1"}, container_port=8000, **common),
        Launch(
            shard_id="s2", port=41002, labels={"llmgw.node": "n1"}, gpus=("0", "GPU-1"),
            container_port=8000, **common,
        ),
        Launch(
            shard_id="s3", port=41003, labels={"llmgw.node": "n1"}, host_network=True,
            container_port=41003, **common,
        ),
    ]  # fmt: skip
    for network in (None, "llmgw-engines"):
        runtime = DockerRuntime(base_url=f"unix://{listen}", network=network)
        try:
            for launch in launches:
                assert asyncio.run(runtime.create(launch)) == "c" * 64
        finally:
            runtime.close()
    creates = [json.loads(b) for m, t, b in dockerd.seen if "/containers/create" in t]
    assert len(creates) == 6
    assert {c["HostConfig"].get("NetworkMode") for c in creates} == {
        "default",
        "host",
        "llmgw-engines",
    }


def test_a_garbled_dockerd_answer_ends_one_request_not_the_proxy(
    proxied: tuple[Path, StandInDockerd],
) -> None:
    listen, dockerd = proxied
    dockerd.garbled = True
    # The proxy's own check cannot read the inspect: 502, saying so.
    status, body = ask(listen, get("/v1.41/containers/aaaa/stop", "POST"))
    assert status == 502 and "could not be read" in json.loads(body)["message"]
    # A relayed answer breaks off: the connection ends after the head.
    status, body = ask(listen, get("/version"))
    assert status == 200 and body == b""
    dockerd.garbled = False
    status, body = ask(listen, get("/version"))
    assert status == 200 and json.loads(body)["ApiVersion"] == "1.41"
