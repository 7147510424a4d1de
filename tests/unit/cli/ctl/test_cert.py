"""``llmgw ctl cert`` through click's test runner: exact user-visible text and exit codes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from click.testing import CliRunner

from llmgw import pki
from llmgw.cli.ctl.cert import cert


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
