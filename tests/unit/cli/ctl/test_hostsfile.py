"""The hosts file of ``ctl onboard --hosts``: both shapes, per-host options, and each refusal
naming its line (nothing is onboarded from a file with one bad entry)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.cli.ctl.hostsfile import HostEntry, parse_hosts, read_hosts
from llmgw.errors import ConfigError


def test_lines() -> None:
    entries = parse_hosts(
        "# rack 7\n\ngpu-01 root@10.0.0.11\ngpu-02 ops@10.0.0.12:2222  # the odd one\n"
        "gpu-03 [fd00::13]:22\n"
    )
    assert entries == [
        HostEntry("gpu-01", "root", "10.0.0.11", None, 3, {}),
        HostEntry("gpu-02", "ops", "10.0.0.12", 2222, 4, {}),
        HostEntry("gpu-03", None, "fd00::13", 22, 5, {}),
    ]


def test_yaml_with_per_host_options() -> None:
    entries = parse_hosts(
        "# rack 7\n"
        "- node: gpu-01\n"
        "  ssh: root@10.0.0.11\n"
        "  fabric: ib0:mlx5_0\n"
        "- node: gpu-02\n"
        "  ssh: ops@10.0.0.12\n"
        "  port: 2222\n"
        "  sudo: true\n"
        "  identity: ~/.ssh/rack7\n"
        "  ssh_option: [ProxyJump=bastion]\n"
        "  engine: [vllm=/opt/vllm/bin/vllm]\n"
        "  models_root: /srv/models\n"
    )
    assert entries[0] == HostEntry(
        "gpu-01", "root", "10.0.0.11", None, 2, {"fabric": ("ib0:mlx5_0",)}
    )
    assert entries[1] == HostEntry(
        "gpu-02",
        "ops",
        "10.0.0.12",
        2222,
        5,
        {
            "sudo": True,
            "identity": "~/.ssh/rack7",
            "ssh_option": ("ProxyJump=bastion",),
            "engine": ("vllm=/opt/vllm/bin/vllm",),
            "models_root": "/srv/models",
        },
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "lists no host"),
        ("# only a comment\n", "lists no host"),
        ("gpu-01\n", "line 1: 'gpu-01' is not 'NODE [USER@]HOST[:PORT]' (two words)"),
        ("gpu-01 root@h extra\n", "per-host options need the YAML form"),
        ("gpu-01 h\nGPU 02 h2\n", "line 2: "),
        ("gpu-01 h\nbad_id h2\n", "line 2: "),
        ("gpu-01 h\ngpu-01 h2\n", "line 2: node gpu-01 is listed already (line 1)"),
        ("gpu-01 root@h:0\n", "line 1: "),
        ("- node: gpu-01\n", "line 1: the entry has no ssh (a string)"),
        ("- node: a\n  ssh: h\n- just text\n", "line 3: each entry is a mapping"),
        ("- node: a\n  ssh: h\n  colour: red\n", "line 1: unknown key 'colour'"),
        ("- node: a\n  ssh: h\n  sudo: yes please\n", "sudo takes a bool"),
        ("- node: a\n  ssh: h\n  port: 70000\n", "port 70000 is not from 1 to 65535"),
        ("- node: a\n  ssh: h:22\n  port: 2222\n", "the port is given twice"),
        ("- node: a\n  ssh: h\n  nvidia_smi: [a, b]\n", "nvidia_smi takes one string"),
        ("- node: a\n  ssh: h\n  fabric: [1]\n", "fabric takes strings"),
        ("- node: a\n  ssh: [h\n", "is not valid YAML"),
    ],
)
def test_refusals(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_hosts(text, name="hosts.txt")
    assert str(caught.value).startswith("hosts.txt: ")
    assert says in str(caught.value)


def test_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the hosts file: No such file"):
        read_hosts(tmp_path / "missing")
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_hosts(tmp_path / "bin")
