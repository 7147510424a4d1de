"""``llmgw ctl cert`` through click's test runner: exact user-visible text and exit codes."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from llmgw import pki
from llmgw.cli import main
from llmgw.cli.ctl.cert import cert
from llmgw.cli.ctl.context import Ctl


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cert, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_init_ca_prints_directory_and_hash(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    code, out, err = run("init-ca", "--dir", str(d))
    assert (code, err) == (0, "")
    ca_hash = pki.load_ca(d).ca_hash()
    assert out == f"created CA in {d}\nca-hash: {ca_hash}\n"
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600


def test_init_ca_dir_from_environment(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    code, out, _ = run("init-ca", env={"LLMGW_PKI_DIR": str(d)})
    assert code == 0
    assert (d / "ca.crt").exists()
    assert out.startswith(f"created CA in {d}\n")


def test_init_ca_refuses_to_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    ca = pki.init_ca(d)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}
    code, out, err = run("init-ca", "--dir", str(d))
    assert code == 1
    assert out == ""
    assert err == (
        f"error: a CA already exists in {d} (ca-hash {ca.ca_hash()}); refusing to overwrite it\n"
    )
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()} == before


def test_issue_client_without_ca(tmp_path: Path) -> None:
    d = tmp_path / "nothing"
    code, out, err = run("issue-client", "gpu1", "--dir", str(d), "--out", str(tmp_path / "o"))
    assert code == 2
    assert out == ""
    assert err == f"error: no authority in {d}; run 'llmgw ctl cert init-ca' first\n"
    assert not (tmp_path / "o").exists()


def test_issue_client(tmp_path: Path) -> None:
    d, o = tmp_path / "pki", tmp_path / "agent"
    ca = pki.init_ca(d)
    code, out, err = run("issue-client", "gpu1", "--dir", str(d), "--out", str(o))
    assert (code, err) == (0, "")
    cert = pki.load_cert(o / "node.crt")
    assert pki.cert_common_name(cert) == "gpu1"
    cert.verify_directly_issued_by(ca.cert)
    assert out == (
        f"certificate: {o / 'node.crt'}\n"
        f"key:         {o / 'node.key'}\n"
        f"ca:          {o / 'ca.crt'}\n"
        f"fingerprint: {pki.fingerprint(cert.public_key())}\n"
    )
    assert stat.S_IMODE(os.stat(o / "node.key").st_mode) == 0o600
    assert (o / "ca.crt").read_bytes() == (d / "ca.crt").read_bytes()


def test_issue_client_invalid_node_id(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    pki.init_ca(d)
    for bad in ("GPU_1", "llmgw-control-plane"):
        code, out, err = run("issue-client", bad, "--dir", str(d), "--out", str(tmp_path / "o"))
        assert code == 2
        assert out == ""
        assert err.startswith(f"error: node_id: invalid node id {bad!r}: ")
        assert "a node id must be a DNS name" in err
    assert not (tmp_path / "o").exists()


def test_issue_client_refuses_a_name_of_the_control_plane(tmp_path: Path) -> None:
    """In a control plane's own PKI directory, its names (server.crt's SANs) are not node ids."""
    d = tmp_path / "pki"
    pki.ensure_server_identity(d, hosts=["cp-1.example"])
    code, out, err = run(
        "issue-client", "cp-1.example", "--dir", str(d), "--out", str(tmp_path / "o")
    )
    assert (code, out) == (2, "")
    assert err.startswith(
        "error: node_id: invalid node id 'cp-1.example': the control plane answers to that name"
    )
    assert not (tmp_path / "o").exists()
    code, _, err = run("issue-client", "gpu-1", "--dir", str(d), "--out", str(tmp_path / "o"))
    assert (code, err) == (0, "")


def test_dir_is_required_and_help_names_env_var() -> None:
    result = CliRunner().invoke(cert, ["init-ca"], env={"LLMGW_PKI_DIR": ""})
    assert result.exit_code == 2
    assert "--dir" in result.stderr
    for command in ("init-ca", "issue-client"):
        result = CliRunner().invoke(cert, [command, "--help"])
        assert result.exit_code == 0
        assert "LLMGW_PKI_DIR" in result.output


# --------------------------------------------------------------------------- through the admin API

NEW = "sha256:" + "1" * 64
OLD = "sha256:" + "0" * 64
DROP_AT = 2_000_000_000


def rotating(left: list[str]) -> dict[str, Any]:
    return {
        "current": {"ca_hash": NEW, "subject": "CN=llmgw cluster CA", "not_after": 2_100_000_000},
        "previous": {"ca_hash": OLD, "drop_at": DROP_AT},
        "rotation": {"previous": OLD, "current": NEW, "started": 1, "drop_at": DROP_AT},
        "nodes_on_previous": left,
    }


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """The admin API as a stand-in: records each call, answers a rotation in progress."""
    seen: list[tuple[str, str, Any]] = []
    answers: dict[str, Any] = {
        "/api/ca": rotating(["gpu-2"]),
        "/api/ca/rotate": rotating(["gpu-1", "gpu-2"]),
        "/api/ca/finish": {**rotating([]), "previous": None},
    }

    def call(self: Ctl, method: str, path: str, body: Any = None, **_: Any) -> Any:
        seen.append((method, path, body))
        return answers[path]

    monkeypatch.setattr(Ctl, "call", call)
    return seen


def ctl(*args: str) -> Result:
    return CliRunner().invoke(main, ["ctl", "--server", "http://127.0.0.1:9", *args])


def test_cert_alone_shows_both_cas_and_who_is_left(api: list[tuple[str, str, Any]]) -> None:
    out = ctl("cert")
    assert out.exit_code == 0, out.output
    assert api == [("GET", "/api/ca", None)]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"CA:          {NEW}  (valid until 2036-")
    assert lines[1].startswith(f"old CA:      {OLD}  (trusted too; dropped 2033-05-18 03:33 UTC")
    assert lines[2] == "still on the old CA: gpu-2 (they renew when they connect)"


def test_rotate_ca_sends_the_overlap_and_says_what_follows(
    api: list[tuple[str, str, Any]],
) -> None:
    out = ctl("cert", "rotate-ca", "--overlap", "2d")
    assert out.exit_code == 0, out.output
    assert api == [("POST", "/api/ca/rotate", {"overlap": 172800.0})]
    assert f"rotated: the new CA is {NEW}" in out.stdout
    assert f"the old CA {OLD} is dropped 2033-05-18 03:33 UTC" in out.stdout
    assert f"'install-agent.sh upgrade --ca-hash {NEW}'" in out.stdout
    assert ctl("cert", "rotate-ca").exit_code == 0
    assert api[-1][2] == {"overlap": 7 * 86400.0}  # the default: 7 days


@pytest.mark.parametrize("overlap", ["30s", "1x", "-1d"])
def test_rotate_ca_refuses_a_bad_overlap_before_any_call(
    api: list[tuple[str, str, Any]], overlap: str
) -> None:
    out = ctl("cert", "rotate-ca", "--overlap", overlap)
    assert out.exit_code == 2
    assert "Invalid value for '--overlap'" in out.stderr
    assert api == []


def test_finish_rotation_forwards_force(api: list[tuple[str, str, Any]]) -> None:
    out = ctl("cert", "finish-rotation")
    assert out.exit_code == 0, out.output
    assert out.stdout == f"dropped the old CA; only {NEW} is trusted now\n"
    assert ctl("cert", "finish-rotation", "--force").exit_code == 0
    assert [c[2] for c in api] == [{"force": False}, {"force": True}]
