"""``llmgw ctl cert`` through click's test runner: exact user-visible text and exit codes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from llmgw import caexport, pki
from llmgw.cli import main, prompts
from llmgw.cli.ctl.cert import cert
from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import SERVER, FakeAPI


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
def api() -> FakeAPI:
    """The admin API as a stand-in: records each call, answers a rotation in progress."""
    answers: dict[str, Any] = {
        "/api/ca": rotating(["gpu-2"]),
        "/api/ca/rotate": rotating(["gpu-1", "gpu-2"]),
        "/api/ca/finish": {**rotating([]), "previous": None},
    }
    return FakeAPI(lambda method, path, body: answers[path])


def test_cert_alone_shows_both_cas_and_who_is_left(api: FakeAPI) -> None:
    out = api.ctl("cert")
    assert out.exit_code == 0, out.output
    assert api.calls == [("GET", "/api/ca", None)]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"CA:          {NEW}  (valid until 2036-")
    assert lines[1].startswith(f"old CA:      {OLD}  (trusted too; dropped 2033-05-18 03:33 UTC")
    assert lines[2] == "still on the old CA: gpu-2 (they renew when they connect)"


def test_rotate_ca_sends_the_overlap_and_says_what_follows(
    api: FakeAPI,
) -> None:
    out = api.ctl("cert", "rotate-ca", "--overlap", "2d")
    assert out.exit_code == 0, out.output
    assert api.calls == [("POST", "/api/ca/rotate", {"overlap": 172800.0})]
    assert f"rotated: the new CA is {NEW}" in out.stdout
    assert f"the old CA {OLD} is dropped 2033-05-18 03:33 UTC" in out.stdout
    assert f"'install-agent.sh upgrade --ca-hash {NEW}'" in out.stdout
    assert api.ctl("cert", "rotate-ca").exit_code == 0
    assert api.calls[-1][2] == {"overlap": 7 * 86400.0}  # the default: 7 days


@pytest.mark.parametrize("overlap", ["30s", "1x", "-1d"])
def test_rotate_ca_refuses_a_bad_overlap_before_any_call(api: FakeAPI, overlap: str) -> None:
    out = api.ctl("cert", "rotate-ca", "--overlap", overlap)
    assert out.exit_code == 2
    assert "Invalid value for '--overlap'" in out.stderr
    assert api.calls == []


def test_finish_rotation_forwards_force(api: FakeAPI) -> None:
    out = api.ctl("cert", "finish-rotation")
    assert out.exit_code == 0, out.output
    assert out.stdout == f"dropped the old CA; only {NEW} is trusted now\n"
    assert api.ctl("cert", "finish-rotation", "--force").exit_code == 0
    assert [c[2] for c in api.calls] == [{"force": False}, {"force": True}]


# --------------------------------------------------------------------------- export-ca

PASSWORD = "the-admin-password"
PASSPHRASE = "a long passphrase"
NO_SECRETS: dict[str, str | None] = {"LLMGW_ADMIN_PASSWORD": None, "LLMGW_CA_PASSPHRASE": None}
SECRETS = {"LLMGW_ADMIN_PASSWORD": PASSWORD, "LLMGW_CA_PASSPHRASE": PASSPHRASE}


class ExportAPI(FakeAPI):
    """``POST /api/ca/export`` as a stand-in: a real export file of a real CA, or an error."""

    def __init__(self, sealed: bytes, ca_hash: str) -> None:
        super().__init__(self.export)
        self.sealed, self.ca_hash = sealed, ca_hash
        self.error: APIError | None = None
        self.answer: dict[str, Any] | None = None

    def export(self, method: str, path: str, body: Any) -> Any:
        if self.error is not None:
            raise self.error
        return self.answer or {
            "ca_hash": self.ca_hash,
            "cluster_id": "c-9",
            "rotation": None,
            "file": self.sealed.decode(),
        }


@pytest.fixture
def export_api(tmp_path: Path) -> ExportAPI:
    ca = pki.init_ca(tmp_path / "cp-pki")
    export = caexport.collect(tmp_path / "cp-pki", ca, cluster_id="c-9", admin_token="tok")
    sealed = caexport.seal(export, PASSPHRASE, kdf=caexport.KDF(n=2**14))
    return ExportAPI(sealed, ca.ca_hash())


def export_ca(
    api: ExportAPI, *args: str, env: dict[str, str | None] | None = None, server: str = SERVER
) -> Result:
    return api.ctl(
        "cert",
        "export-ca",
        *args,
        env={**NO_SECRETS, **(env if env is not None else SECRETS)},
        server=server,
    )


def test_export_ca_writes_the_file_0600_and_says_what_next(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    out = tmp_path / "ca.llmgw"
    result = export_ca(export_api, "--out", str(out))
    assert (result.exit_code, result.stderr) == (0, "")
    assert export_api.calls == [
        (
            "POST",
            "/api/ca/export",
            {"password": PASSWORD, "passphrase": PASSPHRASE},
        )
    ]
    assert out.read_bytes() == export_api.sealed
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert result.stdout == (
        f"exported CA {export_api.ca_hash} of cluster c-9 to {out}\n"
        "the passphrase alone protects the CA key in it. On the new instance: 'llmgw server "
        "--config /etc/llmgw/server.yaml --import-ca ca.llmgw', then delete the file on both "
        "machines\n"
    )


def test_export_ca_keeps_the_admin_password_off_plain_http_to_another_host(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    out = tmp_path / "ca.llmgw"
    result = export_ca(export_api, "--out", str(out), server="http://cp.example.net:8080")
    assert result.exit_code == 1
    assert "refusing to send the admin password in clear over plain HTTP" in result.stderr
    assert export_api.calls == [] and not out.exists()


def test_export_ca_json_and_a_rotation_under_way(export_api: ExportAPI, tmp_path: Path) -> None:
    rotation = {"previous": OLD, "current": export_api.ca_hash, "started": 1.0}
    rotation |= {"drop_at": DROP_AT, "dropped": None}
    export_api.answer = {
        "ca_hash": export_api.ca_hash,
        "cluster_id": "c-9",
        "rotation": rotation,
        "file": export_api.sealed.decode(),
    }
    result = export_ca(export_api, "--out", str(tmp_path / "a"))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].startswith(
        f"with the CA rotation under way: the old CA {OLD} is trusted until 2033-05-18 03:33 UTC"
    )
    args = ["--json", "cert", "export-ca", "--out", str(tmp_path / "b")]
    result = export_api.ctl(*args, env={**NO_SECRETS, **SECRETS})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "ca_hash": export_api.ca_hash,
        "cluster_id": "c-9",
        "rotation": rotation,
        "out": str(tmp_path / "b"),
    }


def test_export_ca_refuses_an_existing_file_before_asking_anything(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    out = tmp_path / "ca.llmgw"
    out.write_text("keep me")
    result = export_ca(export_api, "--out", str(out))
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: {out} exists; nothing was exported. Choose another --out, or pass --force to "
        "replace it\n"
    )
    assert export_api.calls == [] and out.read_text() == "keep me"
    result = export_ca(export_api, "--out", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == export_api.sealed
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_export_ca_refuses_a_directory_or_a_missing_one(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    result = export_ca(export_api, "--out", str(tmp_path / "nope" / "ca.llmgw"))
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: {tmp_path / 'nope'} does not exist; nothing was exported. Create it, or give "
        "--out a file in an existing directory\n"
    )
    result = export_ca(export_api, "--out", str(tmp_path), "--force")
    assert result.exit_code == 2  # click: --out is a file
    assert "is a directory" in result.stderr
    assert export_api.calls == []


def test_export_ca_refuses_a_short_passphrase_before_the_call(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    out = tmp_path / "ca.llmgw"
    result = export_ca(
        export_api, "--out", str(out), env={**SECRETS, "LLMGW_CA_PASSPHRASE": "x" * 11}
    )
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        "error: the passphrase of a CA export must have at least 12 characters (it alone "
        "protects the CA key in the file); nothing was exported. Choose a longer one\n"
    )
    assert export_api.calls == [] and not out.exists()


def test_export_ca_asks_for_both_secrets_in_a_terminal_and_the_passphrase_twice(
    export_api: ExportAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    answers = [PASSWORD, PASSPHRASE, PASSPHRASE + "?"]

    def getpass(prompt: str) -> str:
        asked.append(prompt)
        return answers.pop(0)

    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(prompts.getpass, "getpass", getpass)
    out = tmp_path / "ca.llmgw"
    result = export_ca(export_api, "--out", str(out), env={})
    assert result.exit_code == 2
    assert result.stderr == (
        "error: the two passphrases differ; nothing was done. Run it again and type the same "
        "passphrase twice\n"
    )
    assert asked == [
        "admin password (not echoed): ",
        "passphrase for the export (not echoed): ",
        "passphrase again: ",
    ]
    assert export_api.calls == [] and not out.exists()
    answers[:] = [PASSWORD, PASSPHRASE, PASSPHRASE]
    assert export_ca(export_api, "--out", str(out), env={}).exit_code == 0
    assert export_api.calls[0][2] == {"password": PASSWORD, "passphrase": PASSPHRASE}


def test_export_ca_without_a_terminal_names_the_variables(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    result = export_ca(export_api, "--out", str(tmp_path / "f"), env={})
    assert result.exit_code == 2
    assert result.stderr == (
        "error: no admin password: set LLMGW_ADMIN_PASSWORD or run in a terminal to be "
        "prompted; never pass it as an argument\n"
    )
    result = export_ca(
        export_api, "--out", str(tmp_path / "f"), env={"LLMGW_ADMIN_PASSWORD": PASSWORD}
    )
    assert result.stderr == (
        "error: no passphrase: set LLMGW_CA_PASSPHRASE or run in a terminal to be prompted; "
        "never pass it as an argument\n"
    )
    assert export_api.calls == [] and not (tmp_path / "f").exists()


def test_export_ca_with_a_wrong_admin_password_writes_nothing(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    message = "wrong admin password; nothing was exported. It was made at the first start"
    export_api.error = APIError(message, status=403, code="wrong_password")
    out = tmp_path / "ca.llmgw"
    result = export_ca(export_api, "--out", str(out))
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")
    assert not out.exists()


def test_export_ca_checks_the_answer_before_writing_it(
    export_api: ExportAPI, tmp_path: Path
) -> None:
    out = tmp_path / "ca.llmgw"
    export_api.answer = {"ca_hash": NEW, "file": export_api.sealed.decode()}
    result = export_ca(export_api, "--out", str(out))
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: the control plane answered an export of CA {export_api.ca_hash} for CA {NEW}; "
        "nothing was written. Try again\n"
    )
    export_api.answer = {"ca_hash": NEW, "file": "<html>proxy error</html>"}
    result = export_ca(export_api, "--out", str(out))
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "error: the control plane's export is not a readable CA export (it is not JSON)"
    )
    assert not out.exists()


def test_export_ca_help_names_the_variables() -> None:
    result = CliRunner().invoke(main, ["ctl", "cert", "export-ca", "--help"])
    assert result.exit_code == 0
    assert "LLMGW_ADMIN_PASSWORD" in result.output and "LLMGW_CA_PASSPHRASE" in result.output
