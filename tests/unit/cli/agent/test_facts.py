"""``llmgw agent render-facts``: the agent.yaml keys install-agent.sh writes for node facts,
parsed by the one parser of node facts, and what the agent then reads back."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from llmgw.agent.config import parse_agent_config
from llmgw.cli import main


def render(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["agent", "render-facts", *args])
    return result.exit_code, result.output


def test_the_keys_are_what_agent_yaml_takes() -> None:
    code, out = render(
        "--fabric", "ib-b:mlx5_2,mlx5_3", "--fabric", "ib-a:mlx5_0",
        "--nvidia-smi", "/opt/nv/bin/nvidia-smi", "--ib-root", "/host/sys/class/infiniband",
        "--engine", "sglang=/opt/sglang/bin/python", "--engine", "vllm=/opt/vllm/bin/vllm",
    )  # fmt: skip
    assert code == 0, out
    data = yaml.safe_load(out)
    assert data == {
        "fabrics": [
            {"name": "ib-b", "hcas": ["mlx5_2", "mlx5_3"]},
            {"name": "ib-a", "hcas": ["mlx5_0"]},
        ],
        "discovery": {
            "nvidia_smi": "/opt/nv/bin/nvidia-smi",
            "ib_root": "/host/sys/class/infiniband",
        },
        # Each engine's own program setting: SGLang's is its Python.
        "engines": {
            "sglang": {"python": "/opt/sglang/bin/python"},
            "vllm": {"bin": "/opt/vllm/bin/vllm"},
        },
    }
    # Block style, so that the installer finds each top-level key at a line's start.
    assert [line for line in out.splitlines() if not line.startswith((" ", "-"))] == [
        "fabrics:",
        "discovery:",
        "engines:",
    ]
    config = parse_agent_config({"server": "cp:7443", "node_id": "n1", **data})
    assert [f.name for f in config.fabrics] == ["ib-b", "ib-a"]


def test_nothing_given_and_none_print_nothing() -> None:
    assert render() == (0, "")
    assert render("--fabric", "none", "--engine", "none") == (0, "")


def test_refusals_say_which_fact_and_why() -> None:
    cases = {
        ("--fabric", "ib-b", "--ib-root", "/nonexistent"): (
            "--fabric: ib-b names no adapters, so it takes this node's active InfiniBand "
            "adapters, and /nonexistent has none"
        ),
        ("--fabric", "ib-a", "--fabric", "ib-b"): "both name no adapters",
        ("--fabric", "IB:mlx5_0"): "does not start with a fabric name",
        ("--fabric", "ib-a:mlx5_0", "--fabric", "ib-b:mlx5_0"): "adapter mlx5_0 is on fabrics",
        ("--fabric", "none", "--fabric", "ib-a:mlx5_0"): "give it alone",
        ("--engine", "sim=/x"): "built in and takes no program",
        ("--engine", "tgi=/x"): "names no engine llmgw knows",
        ("--engine", "vllm=bin/vllm"): "is not an absolute path",
        ("--nvidia-smi", "/a b"): "holds a character other than",
    }
    for args, piece in cases.items():
        code, out = render(*args)
        assert code == 2, (args, out)
        assert piece in out, (args, out)


def sysfs_port(root: Path, adapter: str, state: str, link_layer: str = "InfiniBand") -> None:
    port = root / adapter / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(f"{state}\n")
    (port / "link_layer").write_text(f"{link_layer}\n")


def test_a_bare_fabric_name_takes_the_active_infiniband_adapters(tmp_path: Path) -> None:
    """The guide's '--fabric ib-b': the adapters with an ACTIVE InfiniBand port in ib_root,
    not one that is down, nor a RoCE one (an Ethernet link layer), nor one another fabric
    lists."""
    sysfs_port(tmp_path, "mlx5_0", "4: ACTIVE")
    sysfs_port(tmp_path, "mlx5_1", "1: DOWN")
    sysfs_port(tmp_path, "mlx5_2", "4: ACTIVE", "Ethernet")
    sysfs_port(tmp_path, "mlx5_10", "4: ACTIVE")
    sysfs_port(tmp_path, "mlx5_3", "4: ACTIVE")
    code, out = render("--fabric", "ib-b", "--ib-root", str(tmp_path))
    assert code == 0, out
    assert yaml.safe_load(out)["fabrics"] == [
        {"name": "ib-b", "hcas": ["mlx5_0", "mlx5_3", "mlx5_10"]}
    ]
    # What the installer records and shows: the fabrics as found.
    code, out = render(
        "--fabric", "ib-a:mlx5_3", "--fabric", "ib-b", "--ib-root", str(tmp_path),
        "--resolved-fabrics",
    )  # fmt: skip
    assert (code, out) == (0, "ib-a:mlx5_3\nib-b:mlx5_0,mlx5_10\n")
