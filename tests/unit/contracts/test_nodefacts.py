"""Node facts: the one parser of --fabric NAME:HCA[,HCA...], --engine NAME=PATH, the paths and the
CIDRs that join-command, the control plane and 'llmgw agent join' accept; what it accepts
agent.yaml takes (checked against the agent's own parser)."""

from __future__ import annotations

import pytest
import yaml

from llmgw.agent.config import parse_agent_config
from llmgw.contracts.nodefacts import (
    AGENT_FACTS,
    FabricFact,
    NodeFacts,
    check_cidr,
    check_path,
    parse_engine,
    parse_fabric,
)
from llmgw.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "fact"),
    [
        ("none", FabricFact("none")),
        ("ib-b", FabricFact("ib-b")),
        ("ib-b:mlx5_2,mlx5_3", FabricFact("ib-b", ("mlx5_2", "mlx5_3"))),
        ("roce.0:eth_1", FabricFact("roce.0", ("eth_1",))),
    ],
)
def test_fabric_syntax(text: str, fact: FabricFact) -> None:
    assert parse_fabric(text) == fact
    assert str(fact) == text


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ("IB-A:mlx5_0", "does not start with a fabric name"),
        ("ib a", "does not start with a fabric name"),
        ("", "must be 1-4096 characters"),
        ("ib-a:", "names adapter '', which is not an adapter name"),
        ("ib-a:mlx5_0,,mlx5_1", "names adapter ''"),
        ("ib-a:mlx5 0", "names adapter 'mlx5 0'"),
        ("ib-a:mlx5_0;reboot", "names adapter 'mlx5_0;reboot'"),
        ("ib-a:mlx5_0,mlx5_0", "lists adapter mlx5_0 twice"),
        ("ib-a\nfabrics:", "does not start with a fabric name"),
    ],
)
def test_fabric_refusals_name_the_option_and_the_fix(text: str, piece: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fabric(text)
    assert str(info.value).startswith("--fabric: ")
    assert piece in str(info.value)


def test_paths_are_absolute_and_safe_for_yaml_units_and_shells() -> None:
    assert check_path("/usr/bin/nvidia-smi", "--nvidia-smi") == "/usr/bin/nvidia-smi"
    assert check_path("/srv/models/", "--models-root") == "/srv/models"
    for bad, piece in (
        ("bin/nvidia-smi", "is not an absolute path"),
        ("/opt/my dir", "other than letters, digits and _ . / + -"),
        ("/opt/a\nb", "other than letters"),
        ("/opt/'a'", "other than letters"),
        ('/opt/"a"', "other than letters"),
        ("/opt/$HOME", "other than letters"),
        ("/opt/`id`", "other than letters"),
        ("/opt/a\\b", "other than letters"),
        ("/opt/a:b", "other than letters"),
        ("/opt/a#b", "other than letters"),
        ("/opt/../etc", "'.' or '..' components"),
        ("/opt/./x", "'.' or '..' components"),
        (7, "must be a string"),
    ):
        with pytest.raises(ConfigError) as info:
            check_path(bad, "--ib-root")
        assert str(info.value).startswith("--ib-root: ") and piece in str(info.value)


def test_engines_name_one_that_takes_a_program() -> None:
    assert parse_engine("vllm=/opt/vllm/bin/vllm") == ("vllm", "/opt/vllm/bin/vllm")
    assert parse_engine("sglang=/opt/sg/bin/python") == ("sglang", "/opt/sg/bin/python")
    assert parse_engine("llamacpp=/usr/local/bin/llama-server")[0] == "llamacpp"
    assert parse_engine("none") == ("none", "")
    for bad, piece in (
        ("vllm", "is not NAME=PATH"),
        ("tgi=/opt/tgi", "names no engine llmgw knows; give one of llamacpp, sglang, vllm"),
        ("sim=/usr/bin/llmgw", "built in and takes no program"),
        ("vllm=vllm", "--engine vllm: 'vllm' is not an absolute path"),
    ):
        with pytest.raises(ConfigError, match=piece):
            parse_engine(bad)


def test_cidrs() -> None:
    for good in ("10.0.0.5", "10.0.0.0/24", "10.0.0.5/24", "fd00::/64", "fd00::1"):
        assert check_cidr(good, "--fabric-peers") == good
    bad_ones = ("10.0.0.0/33", "10.0.0", "host.example", "10.0.0.0/24 ", "fd00::/129")
    for bad in (*bad_ones, "10.0.0.0/255.255.255.0", "fe80::1%eth0", "10.0.0.0/+8"):
        with pytest.raises(ConfigError, match="is not an IP address or CIDR"):
            check_cidr(bad, "--fabric-peers")


def test_facts_checked_together() -> None:
    with pytest.raises(ConfigError, match="fabric ib-a is given twice"):
        NodeFacts.parse(fabrics=["ib-a:mlx5_0", "ib-a:mlx5_1"])
    with pytest.raises(ConfigError, match="adapter mlx5_0 is on fabrics ib-a and ib-b"):
        NodeFacts.parse(fabrics=["ib-a:mlx5_0", "ib-b:mlx5_0,mlx5_1"])
    with pytest.raises(ConfigError, match="--fabric none clears the fabrics: give it alone"):
        NodeFacts.parse(fabrics=["ib-a:mlx5_0", "none"])
    with pytest.raises(ConfigError, match="--engine none clears the engine programs"):
        NodeFacts.parse(engines=["none", "vllm=/a/vllm"])
    with pytest.raises(ConfigError, match="engine vllm is given twice"):
        NodeFacts.parse(engines=["vllm=/a/vllm", "vllm=/b/vllm"])
    # Repeated CIDRs count once; none alone is kept, to be passed on.
    facts = NodeFacts.parse(
        fabrics=["none"], engines=["none"], firewall_from=["10.0.0.0/24", "10.0.0.0/24"]
    )
    assert facts.firewall_from == ("10.0.0.0/24",)
    assert facts.args() == [
        "--fabric", "none", "--engine", "none", "--firewall-from", "10.0.0.0/24"
    ]  # fmt: skip


def test_a_bare_fabric_name_takes_the_active_adapters_found_on_the_node() -> None:
    facts = NodeFacts.parse(fabrics=["ib-b"])
    assert facts.fabrics[0].bare and facts.args() == ["--fabric", "ib-b"]
    found = facts.with_active_adapters(["mlx5_0", "mlx5_1"], "/sys/class/infiniband")
    assert found.fabrics == (FabricFact("ib-b", ("mlx5_0", "mlx5_1")),)
    assert found.agent_config() == {"fabrics": [{"name": "ib-b", "hcas": ["mlx5_0", "mlx5_1"]}]}
    # Beside a listed fabric it takes what that one does not list.
    both = NodeFacts.parse(fabrics=["ib-a:mlx5_0", "ib-b"])
    assert both.with_active_adapters(["mlx5_0", "mlx5_1"], "/ib").fabrics[1].hcas == ("mlx5_1",)
    with pytest.raises(ConfigError) as info:
        both.with_active_adapters(["mlx5_0"], "/ib")
    assert str(info.value) == (
        "--fabric: ib-b names no adapters, so it takes this node's active InfiniBand adapters, "
        "and /ib has none not listed under another fabric; bring their links up (ibstat), or "
        "list the adapters: --fabric ib-b:HCA,HCA"
    )
    with pytest.raises(ConfigError, match="fabrics ib-a and ib-b both name no adapters"):
        NodeFacts.parse(fabrics=["ib-a", "ib-b"])
    # Never written unfilled: agent.yaml would get a fabric without adapters.
    with pytest.raises(ConfigError, match="ib-b names no adapters and none were found"):
        facts.agent_config()
    # A fact without a bare name is left as it is.
    listed = NodeFacts.parse(fabrics=["ib-a:mlx5_0"])
    assert listed.with_active_adapters([], "/ib") is listed


def test_the_nodes_address_or_its_interface() -> None:
    by_address = NodeFacts.from_json({"node_address": "FD00::0005"})
    assert by_address.node_address == "fd00::5"
    assert by_address.as_json() == {"node_address": "fd00::5"}
    assert by_address.args(AGENT_FACTS) == ["--node-address", "fd00::5"]
    assert by_address.agent_config() == {"mgmt_addr": "fd00::5"}
    by_interface = NodeFacts.parse(mgmt_interface="enp1s0f0np0")
    assert by_interface.args() == ["--mgmt-interface", "enp1s0f0np0"]
    assert by_interface.agent_config() == {"mgmt_interface": "enp1s0f0np0"}
    config = {"server": "cp:7443", "node_id": "gpu-01"}
    assert parse_agent_config({**config, **by_address.agent_config()}).mgmt_addr == "fd00::5"
    for bad, piece in (
        ({"node_address": "10.0.0.300"}, "--node-address: '10.0.0.300' is not an IP address"),
        ({"node_address": "10.0.0.0/24"}, "is not an IP address; give e.g. 10.0.0.5"),
        ({"node_address": "gpu-01.example"}, "is not an IP address"),
        ({"mgmt_interface": "eth 1"}, "--mgmt-interface: 'eth 1' is not a network interface"),
        ({"mgmt_interface": "enp1s0f0np0abcde"}, "at most 15 letters"),
        ({"mgmt_interface": "eth1;reboot"}, "is not a network interface name"),
        (
            {"node_address": "10.0.0.5", "mgmt_interface": "eth1"},
            "--node-address and --mgmt-interface both say where the node is reached; give one",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            NodeFacts.from_json(bad)
        assert piece in str(info.value)


FULL = {
    "fabrics": ["ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_2"],
    "nvidia_smi": "/usr/bin/nvidia-smi",
    "ib_root": "/sys/class/infiniband",
    "engines": ["vllm=/opt/vllm/bin/vllm", "llamacpp=/opt/llama/llama-server"],
    "models_root": "/data/models",
    "cache_root": "/data/cache",
    "firewall_from": ["10.0.0.1"],
    "fabric_peers": ["192.168.50.0/24", "fd00::/64"],
}


def test_json_round_trip_and_installer_arguments() -> None:
    facts = NodeFacts.from_json(FULL)
    assert facts.as_json() == FULL
    assert NodeFacts.from_json(facts.as_json()) == facts
    assert NodeFacts.from_json(None) == NodeFacts() and NodeFacts().as_json() == {}
    assert facts.args() == [
        "--fabric", "ib-a:mlx5_0,mlx5_1", "--fabric", "ib-b:mlx5_2",
        "--nvidia-smi", "/usr/bin/nvidia-smi",
        "--ib-root", "/sys/class/infiniband",
        "--engine", "vllm=/opt/vllm/bin/vllm", "--engine", "llamacpp=/opt/llama/llama-server",
        "--models-root", "/data/models",
        "--cache-root", "/data/cache",
        "--firewall-from", "10.0.0.1",
        "--fabric-peers", "192.168.50.0/24", "--fabric-peers", "fd00::/64",
    ]  # fmt: skip
    assert facts.args(AGENT_FACTS)[-2:] == ["--engine", "llamacpp=/opt/llama/llama-server"]
    assert facts.given(AGENT_FACTS) == ["--fabric", "--nvidia-smi", "--ib-root", "--engine"]


@pytest.mark.parametrize(
    ("data", "piece"),
    [
        ([], "facts: must be an object of node facts"),
        ({"gpus": 8}, "unknown fact(s) gpus; the facts are fabrics, nvidia_smi"),
        ({"fabrics": "ib-a"}, "--fabric: must be a list of strings"),
        ({"engines": [7]}, "--engine: must be a string, got int"),
        ({"nvidia_smi": "nvidia-smi"}, "--nvidia-smi: 'nvidia-smi' is not an absolute path"),
        ({"firewall_from": ["everyone"]}, "--firewall-from: 'everyone' is not an IP address"),
    ],
)
def test_json_refusals(data: object, piece: str) -> None:
    with pytest.raises(ConfigError) as info:
        NodeFacts.from_json(data)
    assert piece in str(info.value)


def test_what_is_accepted_here_agent_yaml_takes() -> None:
    facts = NodeFacts.from_json(FULL)
    config = {
        "server": "cp:7443",
        "node_id": "gpu-01",
        "fabrics": [{"name": f.name, "hcas": list(f.hcas)} for f in facts.fabrics],
        "discovery": {"nvidia_smi": facts.nvidia_smi, "ib_root": facts.ib_root},
        "engines": {"vllm": {"bin": "/opt/vllm/bin/vllm"}, "llamacpp": {"bin": "/opt/l/ls"}},
        "models_root": facts.models_root,
        "cache_root": facts.cache_root,
    }
    parsed = parse_agent_config(yaml.safe_load(yaml.safe_dump(config)))
    assert [f.name for f in parsed.fabrics] == ["ib-a", "ib-b"]
    assert str(parsed.discovery.nvidia_smi) == "/usr/bin/nvidia-smi"
