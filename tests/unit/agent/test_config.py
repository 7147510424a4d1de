"""agent.yaml -> AgentConfig: every refusal names the key and the file."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest

from llmgw.agent import config as agent_config
from llmgw.agent.config import (
    AgentConfig,
    DiscoveryConfig,
    DockerConfig,
    EnginesConfig,
    FabricConfig,
    TLSConfig,
    load_agent_config,
    node_id_problem,
    parse_agent_config,
)
from llmgw.contracts.ports import PortRange
from llmgw.errors import ConfigError
from llmgw.listener import ListenerLimits


@pytest.fixture(autouse=True)
def hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default node id is the host name; pin it so tests do not depend on the machine.
    monkeypatch.setattr(agent_config.socket, "gethostname", lambda: "Test-Host")


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def refused(path: Path, **kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_agent_config(path, **kwargs)  # type: ignore[arg-type]
    return info.value


LONG_LABEL = "a" * 64
LONG_NAME = ".".join(["abcdefghij"] * 24)  # 263 characters

INVALID = [
    # unknown keys, with a suggestion
    ("sever: cp1\n", "sever", "unknown key 'sever'; did you mean 'server'?"),
    ("server: cp1\nnodeid: pc-1\n", "nodeid", "accepted keys: advertise, cache_root"),
    # server / servers
    ("node_id: pc-1\n", "server", "is required"),
    ("server: cp1\nservers: [cp2]\n", "servers", "'server' and 'servers' are both set"),
    ("servers: []\n", "servers", "must not be an empty list"),
    ("servers: cp1\n", "servers", "must be a list of strings, got string"),
    ("servers: [cp1, 7443]\n", "servers[1]", "must be a list of strings, got int"),
    ("servers: [cp1, 'cp1:7443']\n", "servers[1]", "cp1:7443 is listed twice"),
    ("server: 7443\n", "server", "must be a string host:port, got int"),
    ("server:\n", "server", "got null"),
    ("server: 'cp1:70000'\n", "server", "must be a number from 1 to 65535"),
    ("server: 'cp1:0'\n", "server", "must be a number from 1 to 65535"),
    ("server: 'cp1:http'\n", "server", "must be a number from 1 to 65535"),
    ("server: '::1'\n", "server", "an IPv6 address needs brackets, e.g. [::1]:7443"),
    ("server: '[cp1]:7443'\n", "server", "is not an IPv6 address"),
    ("server: '[::1]7443'\n", "server", "expected ':port' after ']'"),
    ("server: 'cp 1:7443'\n", "server", "is not a valid host name or IP address"),
    ("server: '10.0.0.300:7443'\n", "server", "is not a valid IPv4 address"),
    # tls
    ("server: cp1\ntls: /etc/llmgw/tls\n", "tls", "must be a mapping, got string"),
    ("server: cp1\ntls: {cert: 5}\n", "tls.cert", "must be a path (a string), got int"),
    ("server: cp1\ntls: {key: ''}\n", "tls.key", "must not be an empty path"),
    ("server: cp1\ntls: {certt: a.crt}\n", "tls.certt", "did you mean 'cert'?"),
    ("server: cp1\ntls: {1: a.crt}\n", "tls", "keys must be strings, got int"),
    # node_id
    ("server: cp1\nnode_id: PC-1\n", "node_id", "lowercase letters, digits, '-' and '.'"),
    ("server: cp1\nnode_id: pc_1\n", "node_id", "'pc_1' is not a valid node id"),
    ("server: cp1\nnode_id: -pc\n", "node_id", "do not start or end with '-'"),
    ("server: cp1\nnode_id: a..b\n", "node_id", "labels of 1-63 characters"),
    (f"server: cp1\nnode_id: {LONG_LABEL}\n", "node_id", "labels of 1-63 characters"),
    (f"server: cp1\nnode_id: {LONG_NAME}\n", "node_id", "at most 253 characters"),
    ("server: cp1\nnode_id: llmgw-gw\n", "node_id", "reserved"),
    ("server: cp1\nnode_id: 42\n", "node_id", "must be a string, got int"),
    # listen / advertise
    ("server: cp1\nlisten: ':9443'\n", "listen", "has no host"),
    ("server: cp1\nlisten: '0.0.0.0:99999'\n", "listen", "from 0 to 65535 (0: pick a free port)"),
    ("server: cp1\nlisten: [a]\n", "listen", "must be a string host:port, got list"),
    ("server: cp1\nadvertise: '0.0.0.0:9443'\n", "advertise", "not an address the control"),
    ("server: cp1\nadvertise: '[::]'\n", "advertise", "not an address the control"),
    ("server: cp1\nadvertise: 'fe80::1:9443'\n", "advertise", "needs brackets"),
    # management address
    ("server: cp1\nmgmt_addr: 10.0.0.300\n", "mgmt_addr", "is not an IP address"),
    ("server: cp1\nmgmt_addr: 10\n", "mgmt_addr", "must be a string IP address, got int"),
    ("server: cp1\nmgmt_interface: ''\n", "mgmt_interface", "must not be empty"),
    ("server: cp1\nmgmt_interface: enp1s0f0np0abcde\n", "mgmt_interface", "at most 15"),
    ("server: cp1\nmgmt_interface: 'eth 0'\n", "mgmt_interface", "not an interface name"),
    (
        "server: cp1\nmgmt_addr: 10.0.0.5\nmgmt_interface: eth0\n",
        "mgmt_interface",
        "'mgmt_addr' and 'mgmt_interface' are both set",
    ),
    # fabrics
    ("server: cp1\nfabrics: {name: ib-a}\n", "fabrics", "must be a list, got mapping"),
    ("server: cp1\nfabrics: [ib-a]\n", "fabrics[0]", "must be a mapping, got string"),
    ("server: cp1\nfabrics: [{hcas: [mlx5_0]}]\n", "fabrics[0].name", "is required"),
    ("server: cp1\nfabrics: [{name: ib-a}]\n", "fabrics[0].hcas", "is required"),
    (
        "server: cp1\nfabrics: [{name: IB A, hcas: [mlx5_0]}]\n",
        "fabrics[0].name",
        "is not a fabric name",
    ),
    ("server: cp1\nfabrics: [{name: ib-a, hcas: []}]\n", "fabrics[0].hcas", "empty list"),
    ("server: cp1\nfabrics: [{name: ib-a, hcas: mlx5_0}]\n", "fabrics[0].hcas", "got string"),
    (
        "server: cp1\nfabrics: [{name: ib-a, hcas: [mlx5_0, 3]}]\n",
        "fabrics[0].hcas[1]",
        "must be a list of strings, got int",
    ),
    (
        "server: cp1\nfabrics: [{name: ib-a, hcas: ['mlx5/0']}]\n",
        "fabrics[0].hcas[0]",
        "is not an adapter name",
    ),
    (
        "server: cp1\nfabrics: [{name: ib-a, hcas: [mlx5_0]}, {name: ib-a, hcas: [mlx5_1]}]\n",
        "fabrics[1].name",
        "fabric ib-a is defined twice",
    ),
    (
        """\
        server: cp1
        fabrics:
          - name: ib-a
            hcas: [mlx5_0, mlx5_1]
          - name: ib-b
            hcas: [mlx5_1, mlx5_2]
        """,
        "fabrics[1].hcas[0]",
        "adapter mlx5_1 is listed under fabrics ib-a and ib-b; an adapter belongs to one fabric",
    ),
    (
        "server: cp1\nfabrics: [{name: ib-a, hcas: [mlx5_0, mlx5_0]}]\n",
        "fabrics[0].hcas[1]",
        "adapter mlx5_0 is listed twice under fabric ib-a",
    ),
    (
        "server: cp1\nfabrics: [{name: ib-a, hca: [mlx5_0]}]\n",
        "fabrics[0].hca",
        "did you mean 'hcas'?",
    ),
    # discovery
    ("server: cp1\ndiscovery: [x]\n", "discovery", "must be a mapping, got list"),
    ("server: cp1\ndiscovery: {nvidia-smi: x}\n", "discovery.nvidia-smi", "'nvidia_smi'?"),
    ("server: cp1\ndiscovery: {ib_root: 5}\n", "discovery.ib_root", "got int"),
    ("server: cp1\ndiscovery: {nvidia_smi: true}\n", "discovery.nvidia_smi", "got bool"),
    # engines
    ("server: cp1\nengines: [vllm]\n", "engines", "must be a mapping, got list"),
    ("server: cp1\nengines: {vlm: {bin: vllm}}\n", "engines.vlm", "did you mean 'vllm'?"),
    ("server: cp1\nengines: {trtllm: {bin: x}}\n", "engines.trtllm", "unknown engine"),
    ("server: cp1\nengines: {sim: {}}\n", "engines.sim", "built in"),
    ("server: cp1\nengines: {vllm: {python: x}}\n", "engines.vllm.python", "under engines.vllm"),
    ("server: cp1\nengines: {llamacpp: llama-server}\n", "engines.llamacpp", "got string"),
    ("server: cp1\nengines: {sglang: {python: ''}}\n", "engines.sglang.python", "empty"),
    # roots and flags
    ("server: cp1\nmodels_root: [a]\n", "models_root", "must be a path (a string), got list"),
    ("server: cp1\ncache_root: ''\n", "cache_root", "must not be an empty path"),
    ("server: cp1\nstate_dir: 1\n", "state_dir", "got int"),
    ("server: cp1\nstop_shards_on_exit: 1\n", "stop_shards_on_exit", "true or false, got int"),
    ("server: cp1\nstop_shards_on_exit: 'no'\n", "stop_shards_on_exit", "got string"),
    ("server: cp1\nsandbox: false\n", "sandbox", "must be a string, got bool"),
    ("server: cp1\nsandbox: maybe\n", "sandbox", "must be required (the default"),
    ("server: cp1\nmax_request_body: 8MB\n", "max_request_body", "ambiguous; use binary units"),
    ("server: cp1\nmax_request_body: 100\n", "max_request_body", "at least 1 KiB"),
    ("server: cp1\nmax_request_body: lots\n", "max_request_body", "a size like 8MiB"),
    (
        "server: cp1\nmax_inflight_body_bytes: 4MiB\n",
        "max_inflight_body_bytes",
        "is 4 MiB, less than max_request_body (8 MiB)",
    ),
    ("server: cp1\nmax_response_body: 1.5B\n", "max_response_body", "not a whole number"),
    ("server: cp1\nupstream_idle_timeout: 0\n", "upstream_idle_timeout", "must be from 1 s to 1 d"),
    ("server: cp1\nupstream_idle_timeout: 2d\n", "upstream_idle_timeout", "from 1 s to 1 d"),
    (
        "server: cp1\nupstream_idle_timeout: soon\n",
        "upstream_idle_timeout",
        "or a duration like 500ms",
    ),
    # runtime
    (
        "server: cp1\nruntime: dokcer\n",
        "runtime",
        "unknown runtime 'dokcer'; did you mean 'docker'?",
    ),
    ("server: cp1\nruntime: podman\n", "runtime", "(accepted runtimes: docker, process)"),
    ("server: cp1\nruntime: 1\n", "runtime", "must be a string, got int"),
    ("server: cp1\nruntime: ''\n", "runtime", "must not be empty"),
    # docker
    ("server: cp1\nruntime: docker\n", "docker.images", "is required when runtime is docker"),
    ("server: cp1\nruntime: docker\ndocker: {images: {}}\n", "docker.images", "is required"),
    ("server: cp1\ndocker: [x]\n", "docker", "must be a mapping, got list"),
    ("server: cp1\ndocker: {image: x}\n", "docker.image", "did you mean 'images'?"),
    ("server: cp1\ndocker: {images: [sim]}\n", "docker.images", "mapping of engine to image"),
    ("server: cp1\ndocker: {images: {vlm: v:1}}\n", "docker.images.vlm", "did you mean 'vllm'?"),
    ("server: cp1\ndocker: {images: {trtllm: t}}\n", "docker.images.trtllm", "unknown engine"),
    ("server: cp1\ndocker: {images: {sim: 5}}\n", "docker.images.sim", "must be a string, got int"),
    ("server: cp1\ndocker: {images: {sim: ''}}\n", "docker.images.sim", "must not be empty"),
    (
        "server: cp1\ndocker: {images: {sim: 'llmgw sim'}}\n",
        "docker.images.sim",
        "'llmgw sim' is not an image reference",
    ),
    ("server: cp1\ndocker: {images: {vllm: Vllm:1}}\n", "docker.images.vllm", "in lowercase"),
    ("server: cp1\ndocker: {network: host}\n", "docker.network", "'host' cannot be used"),
    ("server: cp1\ndocker: {network: none}\n", "docker.network", "needs a bridge network"),
    ("server: cp1\ndocker: {network: 5}\n", "docker.network", "must be a string, got int"),
    ("server: cp1\ndocker: {network: 'my net'}\n", "docker.network", "not a Docker network"),
    ("server: cp1\ndocker: {gpus: all}\n", "docker.gpus", "'all' is not a GPU mode"),
    ("server: cp1\ninstall_sources: http://x/\n", "install_sources", "must be a list of strings"),
    (
        "server: cp1\ninstall_sources: ['ftp://mirror/']\n",
        "install_sources[0]",
        "only https://, http:// and file:// URLs are allowed",
    ),
    # listeners (the data plane's slow-client limits)
    ("server: cp1\nlisteners: 5\n", "listeners", "must be a mapping, got int"),
    ("server: cp1\nlisteners: {header_timeout: 0}\n", "listeners.header_timeout", "from 0.1"),
    (
        "server: cp1\nlisteners: {handshake_timeout: x}\n",
        "listeners.handshake_timeout",
        "must be seconds, or a duration like 500ms",
    ),
    (
        "server: cp1\nlisteners: {enroll_connections_per_source: 5}\n",
        "listeners.enroll_connections_per_source",
        "unknown key",
    ),
    ("server: cp1\ndocker: {host: 'tcp://1.2.3.4:2375'}\n", "docker.host", "not a unix socket URL"),
    ("server: cp1\ndocker: {host: /run/x.sock}\n", "docker.host", "give unix:///PATH"),
    # multinode_ports: one "A-B" range of unprivileged ports, without the data plane's port
    (
        "server: cp1\nmultinode_ports: 29500\n",
        "multinode_ports",
        "must be a string 'A-B' of two port numbers (e.g. \"29500-29999\", quoted), got int",
    ),
    ("server: cp1\nmultinode_ports: [29500, 29999]\n", "multinode_ports", "got list"),
    (
        "server: cp1\nmultinode_ports: '29500:29999'\n",
        "multinode_ports",
        "'29500:29999' is not a port range; write two port numbers joined by '-', e.g. "
        "29500-29999 (one port: 29500-29500)",
    ),
    ("server: cp1\nmultinode_ports: '29500-'\n", "multinode_ports", "is not a port range"),
    ("server: cp1\nmultinode_ports: 'a-b'\n", "multinode_ports", "is not a port range"),
    ("server: cp1\nmultinode_ports: '1-2-3'\n", "multinode_ports", "is not a port range"),
    (
        "server: cp1\nmultinode_ports: 29999-29500\n",
        "multinode_ports",
        "29999-29500 is reversed: it starts above where it ends; write the lower port first "
        "(29500-29999)",
    ),
    (
        "server: cp1\nmultinode_ports: 80-8000\n",
        "multinode_ports",
        "80-8000: port 80 is outside 1024-65535; give a range of unprivileged ports",
    ),
    ("server: cp1\nmultinode_ports: 60000-65536\n", "multinode_ports", "port 65536 is outside"),
    # prefetch: a read rate of 1 MiB/s or more, an interval from 1m to 1d
    ("server: cp1\nprefetch_rate: 1KiB\n", "prefetch_rate", "must be at least 1 MiB"),
    ("server: cp1\nprefetch_rate: fast\n", "prefetch_rate", "a size like 8MiB"),
    ("server: cp1\nprefetch_interval: 10s\n", "prefetch_interval", "must be from 1m to 1d"),
    ("server: cp1\nprefetch_interval: soon\n", "prefetch_interval", "a duration like"),
    (
        "server: cp1\nmultinode_ports: 9000-9999\n",
        "multinode_ports",
        "9000-9999 holds 9443, the data plane's own port (listen); give a range without it, "
        "e.g. 29500-29999, or move listen",
    ),
    (
        "server: cp1\nlisten: 0.0.0.0:29600\n",
        "multinode_ports",
        "is not set, and its default 29500-29999 holds 29600, the data plane's own port "
        "(listen); move listen, or set multinode_ports to a range without it",
    ),
]


@pytest.mark.parametrize(("text", "key", "fragment"), INVALID)
def test_invalid_agent_yaml_is_refused_naming_key_and_file(
    tmp_path: Path, text: str, key: str, fragment: str
) -> None:
    path = write(tmp_path, text)
    error = refused(path)
    message = str(error)
    assert message.startswith(f"{path}: {key}: "), message
    assert fragment in message
    assert error.key == key
    assert error.file == str(path)
    assert error.exit_code == 2


def test_table_covers_every_top_level_key() -> None:
    keys = {key.split(".")[0].split("[")[0] for _, key, _ in INVALID}
    accepted = {field.name for field in dataclasses.fields(AgentConfig)} - {"source"}
    assert accepted - {"servers"} <= keys | {"server"}


def test_listener_limits_default_and_configured(tmp_path: Path) -> None:
    assert load_agent_config(write(tmp_path, "server: cp1\n")).listeners == ListenerLimits()
    path = write(tmp_path, "server: cp1\nlisteners: {header_timeout: 3, handshake_timeout: 2.5}\n")
    assert load_agent_config(path).listeners == ListenerLimits(
        header_timeout=3.0, handshake_timeout=2.5
    )


def test_docker_runtime_with_images_and_network(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        server: cp1
        runtime: docker
        docker:
          images:
            sim: llmgw-sim:0.1
            vllm: registry.example.com:5000/llmgw/vllm:0.6@sha256:%s
          network: llmgw-engines
        """
        % ("ab" * 32),
    )
    config = load_agent_config(path)
    assert config.runtime == "docker"
    assert config.docker == DockerConfig(
        images={
            "sim": "llmgw-sim:0.1",
            "vllm": "registry.example.com:5000/llmgw/vllm:0.6@sha256:" + "ab" * 32,
        },
        network="llmgw-engines",
    )


def test_docker_section_is_accepted_with_the_process_runtime(tmp_path: Path) -> None:
    # Prepared ahead of switching runtimes: kept, but the process runtime does not use it.
    config = load_agent_config(write(tmp_path, "server: cp1\ndocker: {images: {sim: s:1}}\n"))
    assert config.runtime == "process"
    assert config.docker.images == {"sim": "s:1"}
    assert config.docker.network is None
    assert config.docker.gpus == "request"


def test_docker_host_points_at_the_proxy(tmp_path: Path) -> None:
    text = "server: cp1\ndocker: {host: 'unix:///run/llmgw-docker-proxy/docker.sock'}\n"
    config = load_agent_config(write(tmp_path, text))
    assert config.docker.host == "unix:///run/llmgw-docker-proxy/docker.sock"
    assert load_agent_config(write(tmp_path, "server: cp1\n")).docker.host is None


def test_docker_gpus_env_mode(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, "server: cp1\ndocker: {gpus: env}\n"))
    assert config.docker.gpus == "env"


# --- file-level refusals -------------------------------------------------------------------


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing here\n")
    error = refused(path)
    assert str(error).startswith(f"{path}: is empty")
    assert "server" in str(error)


@pytest.mark.parametrize("text", ["- server: cp1\n", "cp1:7443\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    assert "must be a mapping of keys" in str(refused(path))


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\nfabrics:\n  - name: ib-a\n   hcas: [mlx5_0\n")
    error = refused(path)
    assert str(error).startswith(f"{path}: line 4")
    assert "invalid YAML" in str(error)
    assert error.file == str(path)


def test_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\nnode_id: a\nnode_id: b\n")
    message = str(refused(path))
    assert message.startswith(f"{path}: line 3, column 1: ")
    assert "found key 'node_id' twice" in message


def test_missing_file_says_how_to_make_one(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert str(refused(path)) == (
        f"{path}: no such file; create it from agent.example.yaml or pass --config"
    )


def test_unreadable_file_says_permission_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "server: cp1\n")
    if os.geteuid() == 0:  # root reads any file; make the read fail as it would for others

        def deny(self: Path, *args: object, **kwargs: object) -> str:
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "read_text", deny)
    path.chmod(0)
    try:
        message = str(refused(path))
    finally:
        path.chmod(0o600)
    assert message.startswith(f"{path}: permission denied")


def test_directory_is_refused(tmp_path: Path) -> None:
    assert "is a directory" in str(refused(tmp_path))


def test_default_node_id_that_is_no_dns_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_config.socket, "gethostname", lambda: "My_Box")
    message = str(refused(write(tmp_path, "server: cp1\n")))
    assert "node_id: is not set and the host name is no node id" in message
    assert "'my_box'" in message


# --- happy paths ---------------------------------------------------------------------------


def test_minimal_file_takes_every_default(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\n")
    state = Path("/var/lib/llmgw-agent")
    assert load_agent_config(path) == AgentConfig(
        servers=("cp1:7443",),
        tls=TLSConfig(cert=state / "node.crt", key=state / "node.key", ca=state / "ca.crt"),
        node_id="test-host",
        listen="0.0.0.0:9443",
        advertise=None,
        mgmt_addr=None,
        mgmt_interface=None,
        fabrics=(),
        discovery=DiscoveryConfig(nvidia_smi=None, ib_root=Path("/sys/class/infiniband")),
        engines=EnginesConfig(),
        models_root=Path("/srv/llmgw/models"),
        cache_root=Path("/srv/llmgw/cache"),
        state_dir=state,
        stop_shards_on_exit=False,
        source=path,
    )


def test_full_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        servers:
          - cp1.example.com:7443
          - "[fd00::2]:7444"
          - 10.0.0.3
        tls:
          cert: /etc/llmgw/tls/node.crt
          key: /etc/llmgw/tls/node.key
          ca: /etc/llmgw/tls/ca.crt
        node_id: gpu-07.rack-3
        listen: 10.0.0.7:9443
        advertise: gpu-07.example.com
        mgmt_interface: eno1
        fabrics:
          - name: ib-a
            hcas: [mlx5_0, mlx5_1]
          - name: roce_b
            hcas: [mlx5_2]
        discovery:
          nvidia_smi: /usr/bin/nvidia-smi
          ib_root: /sys/class/infiniband
        engines:
          llamacpp: {bin: /opt/llama.cpp/llama-server}
          vllm: {bin: vllm}
          sglang: {python: /opt/sglang/bin/python}
        models_root: /data/models
        cache_root: /data/cache
        state_dir: /var/lib/llmgw-agent
        stop_shards_on_exit: true
        """,
    )
    config = load_agent_config(str(path))
    assert config.servers == ("cp1.example.com:7443", "[fd00::2]:7444", "10.0.0.3:7443")
    assert config.tls == TLSConfig(
        cert=Path("/etc/llmgw/tls/node.crt"),
        key=Path("/etc/llmgw/tls/node.key"),
        ca=Path("/etc/llmgw/tls/ca.crt"),
    )
    assert config.node_id == "gpu-07.rack-3"
    assert config.listen == "10.0.0.7:9443"
    assert config.advertise == "gpu-07.example.com:9443"
    assert config.mgmt_addr is None
    assert config.mgmt_interface == "eno1"
    assert config.fabrics == (
        FabricConfig(name="ib-a", hcas=("mlx5_0", "mlx5_1")),
        FabricConfig(name="roce_b", hcas=("mlx5_2",)),
    )
    assert config.discovery == DiscoveryConfig(
        nvidia_smi=Path("/usr/bin/nvidia-smi"), ib_root=Path("/sys/class/infiniband")
    )
    assert config.engines == EnginesConfig(
        llamacpp_bin="/opt/llama.cpp/llama-server",
        vllm_bin="vllm",
        sglang_python="/opt/sglang/bin/python",
    )
    assert config.models_root == Path("/data/models")
    assert config.cache_root == Path("/data/cache")
    assert config.state_dir == Path("/var/lib/llmgw-agent")
    assert config.stop_shards_on_exit is True
    assert config.source == path


def test_each_engine_program_by_its_registry_setting() -> None:
    engines = EnginesConfig(llamacpp_bin="/opt/llama-server", sglang_python="/opt/py")
    assert {name: engines.program(name) for name in ("sim", "vllm", "sglang", "llamacpp")} == {
        "sim": None,
        "vllm": None,
        "sglang": "/opt/py",
        "llamacpp": "/opt/llama-server",
    }


def test_relative_paths_resolve_against_the_file_directory(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = write(
        tmp_path,
        """\
        server: cp1
        tls: {cert: pki/node.crt, ca: ../ca.crt}
        state_dir: state
        models_root: models
        cache_root: ./cache
        discovery: {nvidia_smi: bin/nvidia-smi, ib_root: sys/ib}
        engines: {llamacpp: {bin: bin/llama-server}, vllm: {bin: vllm}}
        """,
        name="sub/agent.yaml",
    )
    base = tmp_path / "sub"
    config = load_agent_config(path)
    assert config.state_dir == base / "state"
    assert config.tls.cert == base / "pki/node.crt"
    assert config.tls.key == base / "state/node.key"  # default follows the resolved state_dir
    assert config.tls.ca == base / "../ca.crt"
    assert config.models_root == base / "models"
    assert config.cache_root == base / "cache"
    assert config.discovery.nvidia_smi == base / "bin/nvidia-smi"
    assert config.discovery.ib_root == base / "sys/ib"
    assert config.engines.llamacpp_bin == str(base / "bin/llama-server")
    assert config.engines.vllm_bin == "vllm"  # a bare name is looked up in PATH
    for p in (config.state_dir, config.models_root, config.tls.cert):
        assert p.is_absolute()


def test_relative_config_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "server: cp1\nstate_dir: st\n")
    monkeypatch.chdir(tmp_path)
    config = load_agent_config("agent.yaml")
    assert config.source == tmp_path / "agent.yaml"
    assert config.state_dir == tmp_path / "st"


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\nnode_id: pc-1\ntls: {ca: ca.pem}\n")
    config = load_agent_config(
        path,
        overrides={
            "node_id": "pc-2",
            "tls.cert": "/p/node.crt",
            "discovery.ib_root": "/fake/ib",
            "stop_shards_on_exit": True,
        },
    )
    assert config.node_id == "pc-2"
    assert config.tls.cert == Path("/p/node.crt")
    assert config.tls.ca == tmp_path / "ca.pem"  # kept from the file
    assert config.discovery.ib_root == Path("/fake/ib")
    assert config.stop_shards_on_exit is True


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\n")
    error = refused(path, overrides={"node_id": "Bad Name"})
    assert error.key == "node_id"
    error = refused(path, overrides={"tls.crt": "/x"})
    assert error.key == "tls.crt"
    assert "did you mean 'cert'?" in str(error)


def test_override_through_a_scalar_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "server: cp1\n")
    error = refused(path, overrides={"server.port": 1})
    assert error.key == "server"
    assert "not a mapping" in str(error)


def test_override_can_replace_server_with_servers(tmp_path: Path) -> None:
    path = write(tmp_path, "servers: [cp1]\n")
    config = load_agent_config(path, overrides={"servers": ["cp2", "cp3:7000"]})
    assert config.servers == ("cp2:7443", "cp3:7000")


def test_null_values_mean_default(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "server: cp1\ntls:\nfabrics:\ndiscovery:\nengines:\n  vllm:\nlisten:\nnode_id:\n",
    )
    config = load_agent_config(path)
    assert config.tls.cert == Path("/var/lib/llmgw-agent/node.crt")
    assert config.fabrics == ()
    assert config.engines == EnginesConfig()
    assert config.listen == "0.0.0.0:9443"
    assert config.node_id == "test-host"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("", PortRange(29500, 29999)),  # the default: PyTorch's 29500 upwards
        ("multinode_ports:\n", PortRange(29500, 29999)),
        ("multinode_ports: 40000-40099\n", PortRange(40000, 40099)),  # YAML reads it as text
        ("multinode_ports: ' 30000-30000 '\n", PortRange(30000, 30000)),  # one port
        ("multinode_ports: '1024-65535'\nlisten: 0.0.0.0:0\n", PortRange(1024, 65535)),
        ("multinode_ports: 9444-9500\n", PortRange(9444, 9500)),  # next to listen's 9443
        ("multinode_ports: 9000-9999\nlisten: 0.0.0.0:8443\n", PortRange(9000, 9999)),
    ],
)
def test_multinode_ports_default_and_configured(
    tmp_path: Path, line: str, expected: PortRange
) -> None:
    config = load_agent_config(write(tmp_path, "server: cp1\n" + line))
    assert config.multinode_ports == expected


def test_addresses_are_normalized(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "server: '[::1]'\nlisten: '[::]:9555'\nadvertise: 10.1.2.3\nmgmt_addr: 'FD00::0005'\n",
    )
    config = load_agent_config(path)
    assert config.servers == ("[::1]:7443",)
    assert config.listen == "[::]:9555"
    assert config.advertise == "10.1.2.3:9555"  # a bare host takes the listen port
    assert config.mgmt_addr == "fd00::5"


def test_parse_agent_config_names_its_source() -> None:
    config = parse_agent_config({"server": "cp1", "node_id": "pc-1"})
    assert config.servers == ("cp1:7443",)
    assert config.source is None
    with pytest.raises(ConfigError) as info:
        parse_agent_config({"server": "cp1", "node_id": "pc-1", "x": 1}, source="<test>")
    assert str(info.value).startswith("<test>: x: unknown key 'x'")
    with pytest.raises(ConfigError, match=r"^<agent\.yaml>: is empty"):
        parse_agent_config(None)


@pytest.mark.parametrize(
    ("value", "seconds"), [(90, 90.0), (2.5, 2.5), ("90", 90.0), ("1500ms", 1.5), ("5m", 300.0)]
)
def test_upstream_idle_timeout_is_a_duration(value: object, seconds: float) -> None:
    """The one duration syntax (llmgw.durations), as in server.yaml: agent.yaml took only a
    number of seconds before."""
    config = parse_agent_config(
        {"server": "cp1", "node_id": "pc-1", "upstream_idle_timeout": value}
    )
    assert config.upstream_idle_timeout == seconds


def test_parse_does_not_change_its_input(tmp_path: Path) -> None:
    data: dict[str, object] = {"server": "cp1", "tls": {"cert": "a"}}
    parse_agent_config(data)
    assert data == {"server": "cp1", "tls": {"cert": "a"}}


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, "server: cp1\n"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.node_id = "other"  # type: ignore[misc]
    assert isinstance(config.fabrics, tuple)


def test_node_id_problem() -> None:
    assert node_id_problem("gpu-01") is None
    assert node_id_problem("gpu-01.rack-2.dc") is None
    assert node_id_problem("llmgw-x") is not None
    assert node_id_problem("GPU") is not None
    assert node_id_problem("") is not None


def test_the_sandbox_is_required_unless_said_otherwise(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("server: cp1\n")
    assert load_agent_config(plain).sandbox == "required"
    relaxed = tmp_path / "relaxed.yaml"
    relaxed.write_text("server: cp1\nsandbox: if-available\n")
    assert load_agent_config(relaxed).sandbox == "if-available"


def test_prefetch_settings_and_their_defaults() -> None:
    cfg = parse_agent_config({"server": "cp1"})
    assert (cfg.prefetch_rate, cfg.prefetch_interval) == (256 * 1024**2, 600.0)
    cfg = parse_agent_config({"server": "cp1", "prefetch_rate": "64MiB", "prefetch_interval": "1h"})
    assert (cfg.prefetch_rate, cfg.prefetch_interval) == (64 * 1024**2, 3600.0)
